"""The C++ grouped matmuls (kernels/cpu/csrc/grouped_mm.cpp) against their Python loops: rows and outer
products, empty and uneven groups, transposed operands as the experts pass them, 1 and 2 threads."""

import pytest
import torch

from megatron_composer.kernels import grouped_mm as gm
from megatron_composer.kernels.cpu import cpp


@pytest.fixture
def kernel():
    k = cpp.load("grouped_mm")
    if k is None:
        pytest.skip("no C++ compiler: the Python loops run instead")
    return k


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grouped_mm_matches_reference(kernel, threads, dtype):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        counts = torch.tensor([5, 0, 37, 1, 0, 64, 12, 3, 0, 20])
        offs = counts.cumsum(0).to(torch.int32)
        T, K, N = int(counts.sum()), 24, 40
        a = torch.randn(T, K, generator=g).to(dtype)
        w = torch.randn(len(counts), N, K, generator=g).to(dtype)  # experts' [F, D] weights, used transposed
        dy = torch.randn(T, N, generator=g).to(dtype)
        tol = dict(atol=0, rtol=0) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5) \
            if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(kernel.mm_rows(a, w.transpose(1, 2), offs),
                                   gm.reference_mm_rows(a, w.transpose(1, 2), offs), **tol)
        torch.testing.assert_close(kernel.mm_rows(dy, w, offs), gm.reference_mm_rows(dy, w, offs), **tol)
        outer = kernel.mm_outer(dy, a, offs)
        torch.testing.assert_close(outer, gm.reference_mm_outer(dy, a, offs), **tol)
        assert torch.all(outer[counts == 0] == 0)
    finally:
        torch.set_num_threads(n)


def test_grouped_mm_rejects_bad_offsets(kernel):
    with pytest.raises(RuntimeError, match="non-decreasing"):
        kernel.mm_rows(torch.zeros(4, 3), torch.zeros(2, 3, 5), torch.tensor([3, 1]))


# ---- the fused SwiGLU experts and the permutations around them (autograd Functions over the C++ module) ----
def _experts(dtype, E=6, D=24, F=16, seed=0):
    from megatron_composer.model.moe import GroupedExperts

    g = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(E, D, F)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ex.to(dtype)


def _grads(fn, tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype))
    return [out.detach()] + [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F", [16, 8, 20])  # the activation runs 16 columns at a time: whole, only a tail, both
def test_grouped_swiglu_matches_reference_forward(kernel, threads, dtype, F):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ex = _experts(dtype, F=F)
        counts = torch.tensor([9, 0, 30, 1, 0, 17])  # empty experts included
        offs = counts.cumsum(0).to(torch.int32)
        x = torch.randn(int(counts.sum()), 24, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        params = [x, ex.w1, ex.w2, ex.w3]
        got = _grads(lambda: gm.GroupedSwiGLU.apply(kernel, x, ex.w1, ex.w3, ex.w2, offs), params)
        want = _grads(lambda: ex.reference_forward(x, offs), params)
        # same matmuls as the Python path, group by group: equal in float32, within rounding in bfloat16
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        for name, a, b in zip(["y", "dx", "dw1", "dw2", "dw3"], got, want):
            torch.testing.assert_close(a, b, **tol, msg=name)
        for w in (ex.w1, ex.w2, ex.w3):
            assert torch.all(w.grad[1] == 0) and torch.all(w.grad[4] == 0)
        assert got[0].dtype == dtype and got[2].shape == ex.w1.shape and got[2].is_contiguous()
        # frozen experts: no weight gradients computed, the input gradient still is
        for w in (ex.w1, ex.w2, ex.w3):
            w.requires_grad_(False)
            w.grad = None
        x.grad = None
        gm.GroupedSwiGLU.apply(kernel, x, ex.w1, ex.w3, ex.w2, offs).sum().backward()
        assert x.grad is not None and ex.w1.grad is None
    finally:
        torch.set_num_threads(n)


def test_grouped_swiglu_all_experts_empty_and_bad_offsets(kernel):
    ex = _experts(torch.float32)
    x = torch.zeros(0, 24, requires_grad=True)
    y = gm.GroupedSwiGLU.apply(kernel, x, ex.w1, ex.w3, ex.w2, torch.zeros(6, dtype=torch.int32))
    y.sum().backward()
    assert y.shape == (0, 24) and torch.all(ex.w1.grad == 0) and torch.all(ex.w2.grad == 0)
    with pytest.raises(RuntimeError, match="offs must end"):
        kernel.swiglu_forward(torch.zeros(5, 24), ex.w1.detach(), ex.w3.detach(), ex.w2.detach(),
                              torch.tensor([1, 1, 2, 2, 3, 3], dtype=torch.int32))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_combine_match_reference(kernel, threads, dtype):
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        T, K, D = 37, 3, 40
        indices = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(T)])
        order = torch.argsort(indices.reshape(-1), stable=True)
        pos = torch.empty_like(order).index_put_((order,), torch.arange(T * K)).view(T, K)
        x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
        w = torch.rand(T, K, generator=g).requires_grad_()
        scale = torch.randn(T * K, D, generator=g).to(dtype)  # something per row between gather and combine

        def fused():
            rows = gm.GatherRows.apply(kernel, x, order // K, pos)
            return gm.CombineRows.apply(kernel, rows * scale, w, pos)

        def reference():
            return gm.reference_combine(x.index_select(0, order // K) * scale, w, order)

        got, want = _grads(fused, [x, w]), _grads(reference, [x, w])
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        for name, a, b in zip(["out", "dx", "dw"], got, want):
            torch.testing.assert_close(a, b, **tol, msg=name)
        assert got[0].dtype == dtype and got[2].dtype == torch.float32
        with pytest.raises(RuntimeError, match="out of range"):
            kernel.combine(torch.zeros(4, D), torch.tensor([[0, 4]]))
    finally:
        torch.set_num_threads(n)


def test_experts_take_the_reference_under_function_modes_and_replaced_grouped_mm(kernel):
    from torch.overrides import TorchFunctionMode

    from megatron_composer.model import moe

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    ex = _experts(torch.float32)
    x = torch.randn(20, 24)
    indices = torch.randint(0, 6, (10, 2))
    weights = torch.rand(10, 2)
    fused = moe.local_dispatch(ex, x[:10], indices, weights)
    with Seen() as mode:  # a mode (batch-invariant numerics, tracing) must see every op: the Python path
        seen = moe.local_dispatch(ex, x[:10], indices, weights)
    assert {"cat", "silu", "index_add_"} <= mode.funcs
    torch.testing.assert_close(seen, fused, atol=1e-5, rtol=1e-5)

    calls = []

    def replacement(x_TD, w_EFD, offs):  # what FP8 installs: it must receive the concatenated w1|w3 and w2
        calls.append(tuple(w_EFD.shape))
        return moe.grouped_mm(x_TD, w_EFD, offs)

    ex.grouped_mm = replacement
    torch.testing.assert_close(moe.local_dispatch(ex, x[:10], indices, weights), fused, atol=1e-5, rtol=1e-5)
    assert calls == [(6, 32, 24), (6, 24, 16)]


def test_local_dispatch_of_no_tokens(kernel):
    from megatron_composer.model import moe

    ex = _experts(torch.float32)
    x = torch.zeros(0, 24, requires_grad=True)
    weights = torch.zeros(0, 2, requires_grad=True)
    out = moe.local_dispatch(ex, x, torch.zeros(0, 2, dtype=torch.long), weights)
    out.sum().backward()
    assert out.shape == (0, 24) and x.grad.shape == (0, 24) and torch.all(ex.w1.grad == 0)
