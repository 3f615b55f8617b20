"""Rope on the last dims of each head (kernels/cpu/csrc/rope.cpp via model.rope.apply_rope_tail) against its
reference (torch.cat of the passed-through dims and apply_rope): equal bit for bit, values and gradients,
float32 and bfloat16, interleaved or halves, 1 and 2 threads; the reference under torch function modes."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_composer.kernels.cpu import cpp
from megatron_composer.kernels.cpu.rope import kernel_for
from megatron_composer.model.rope import apply_rope, apply_rope_tail


@pytest.fixture
def kernel():
    k = cpp.load("rope")
    if k is None:
        pytest.skip("no C++ compiler: the Python reference runs instead")
    return k


def _reference(x, cos, sin, interleaved, rope_dim):
    x_pass, x_rot = x.split([x.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([x_pass, apply_rope(x_rot, cos, sin, interleaved)], dim=-1)


def _value_and_grad(fn, x, dy):
    x.grad = None
    y = fn()
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,passed,rope_dim", [(4, 6, 8), (1, 0, 8), (3, 0, 12)])
def test_rope_tail_equals_reference(kernel, threads, dtype, interleaved, heads, passed, rope_dim):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(heads + rope_dim)
        B, S = 2, 37
        x = torch.randn(B, S, heads, passed + rope_dim, generator=g).to(dtype).requires_grad_()
        angle = torch.arange(S)[None, :, None].float() * torch.rand(rope_dim // 2, generator=g)
        cos, sin = (1.2 * angle.cos()).to(dtype), (1.2 * angle.sin()).to(dtype)  # [1, S, R/2]: broadcast rows
        dy = torch.randn(x.shape, generator=g).to(dtype)
        assert kernel_for(x, cos, sin) is kernel
        got = _value_and_grad(lambda: apply_rope_tail(x, cos, sin, interleaved, rope_dim), x, dy)
        want = _value_and_grad(lambda: _reference(x, cos.expand(B, -1, -1), sin.expand(B, -1, -1), interleaved,
                                                  rope_dim), x, dy)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        torch.set_num_threads(n)


def test_rope_tail_reference_paths_and_bad_input(kernel):
    x = torch.randn(1, 5, 2, 8)
    cos, sin = torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    assert kernel_for(x.double(), cos.double(), sin.double()) is None
    assert kernel_for(x, cos.requires_grad_(), sin) is None  # gradients for cos/sin: the reference
    cos = cos.detach()

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        y = apply_rope_tail(x, cos, sin, True, 4)
    assert "cat" in mode.funcs
    assert torch.equal(y, apply_rope_tail(x, cos, sin, True, 4))
    with pytest.raises(RuntimeError, match="even rope_dim"):
        kernel.rotate(x, cos, sin, 3, True, False)
    with pytest.raises(RuntimeError, match="over x's leading dims"):
        kernel.rotate(x, torch.rand(1, 4, 2), torch.rand(1, 4, 2), 4, True, False)
