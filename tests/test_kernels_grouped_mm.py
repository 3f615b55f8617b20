"""The C++ grouped matmuls (kernels/csrc/grouped_mm.cpp) against their Python loops: rows and outer
products, empty and uneven groups, transposed operands as the experts pass them, 1 and 2 threads."""

import pytest
import torch

from megatron_composer.kernels import cpp, grouped_mm as gm


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
