"""RMSNorm's C++ pass (kernels/cpu/csrc/rms_norm.cpp) against its Python reference (_RMSNormFunction): values and
gradients in float32 and bfloat16, 1 and 2 threads, any leading shape, frozen weights, and the reference
under torch function modes."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_composer.kernels.cpu import cpp
from megatron_composer.kernels.cpu.rms_norm import RMSNormCpp, kernel_for
from megatron_composer.model.norms import RMSNorm, _RMSNormFunction


@pytest.fixture
def kernel():
    k = cpp.load("rms_norm")
    if k is None:
        pytest.skip("no C++ compiler: the Python reference runs instead")
    return k


def _run(fn, x, w, dy):
    x.grad = w.grad = None
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 33, 256), (3, 5, 4, 24), (7, 40)])
def test_rms_norm_kernel_matches_reference(kernel, threads, dtype, shape):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(len(shape) + threads)
        x = (torch.randn(shape, generator=g) * 3).to(dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
        dy = torch.randn(shape, generator=g).to(dtype)
        got = _run(lambda a, b: RMSNormCpp.apply(kernel, a, b, 1e-6), x, w, dy)
        want = _run(lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), x, w, dy)
        # float32: within rounding of the row sums' order; bfloat16: the reference's roundings, op by op
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        for name, a, b in zip(["y", "dx", "dweight"], got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            torch.testing.assert_close(a, b, **tol, msg=name)
        # against float64 the kernel is no less accurate than the reference
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        exact = _run(lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), x64, w64, dy.double())
        for a, b, e in zip(got, want, exact):
            assert (a.double() - e).abs().max() <= 2 * (b.double() - e).abs().max() + 1e-6
    finally:
        torch.set_num_threads(n)


def test_rms_norm_non_contiguous_input_and_frozen_weight(kernel):
    x = torch.randn(6, 8, 32).transpose(0, 1).requires_grad_()
    w = torch.randn(32)  # no gradient wanted
    y = RMSNormCpp.apply(kernel, x, w, 1e-5)
    torch.testing.assert_close(y, _RMSNormFunction.apply(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    _RMSNormFunction.apply(ref_x, w, 1e-5).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-5, rtol=1e-5)


def test_rms_norm_module_paths(kernel):
    norm = RMSNorm(16)
    x = torch.randn(4, 16)
    assert kernel_for(x, norm.weight) is kernel
    assert kernel_for(x.double(), norm.weight.double()) is None  # other dtypes: the reference
    assert kernel_for(x.bfloat16(), norm.weight) is None  # mixed dtypes: the reference (it promotes)

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:  # a mode must see the ops: the reference runs
        y = norm(x)
    assert "rsqrt" in mode.funcs
    torch.testing.assert_close(y, norm(x), atol=1e-6, rtol=1e-6)


def test_rms_norm_rejects_bad_input(kernel):
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        kernel.rms_norm(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight \\[D\\]"):
        kernel.rms_norm(torch.zeros(2, 4), torch.zeros(5), 1e-6)
