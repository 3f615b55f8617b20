"""Grouped matmuls over tokens sorted by group (the mixture of experts), with the reference next to them.

    mm_rows(a [T, K], b [G, K, N], offs [G]) -> [T, N]:     rows of group g times b[g]
    mm_outer(a [T, M], b [T, N], offs [G]) -> [G, M, N]:    per group, a[rows]^T b[rows] (weight gradients)

offs are cumulative row counts (group g holds rows offs[g-1]:offs[g]). Where torch has `_grouped_mm` for the
device it is used; on CPU the C++ kernel (csrc/grouped_mm.cpp) runs the groups as parallel tasks, each
matmul on one thread, instead of one small matmul after another split across threads; the loops below are
its reference and the fallback when it cannot be built or a torch function mode must see every matmul.
"""

from __future__ import annotations

import torch

from . import cpp


def _has_grouped_mm() -> bool:
    try:
        x, w = torch.zeros(2, 2), torch.zeros(1, 2, 2)
        torch._grouped_mm(x, w, offs=torch.tensor([2], dtype=torch.int32))
        return True
    except Exception:
        return False


_GROUPED_MM = _has_grouped_mm()


def _cpu_kernel(*tensors: torch.Tensor):
    # The loops run instead under a torch function mode (batch-invariant numerics, tracing: the mode must see
    # each matmul) and when autograd must record them (the kernel is called from model.moe's autograd Function,
    # whose backward makes the gradient matmuls itself).
    if (any(t.device.type != "cpu" for t in tensors) or torch._C._is_torch_function_mode_enabled()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return None
    return cpp.load("grouped_mm")


def reference_mm_rows(a_TK: torch.Tensor, b_GKN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group matmul over the non-empty groups only."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    out = a_TK.new_empty(a_TK.shape[0], b_GKN.shape[-1])
    start = 0
    for g, c in enumerate(counts):
        if c:
            torch.matmul(a_TK[start:start + c], b_GKN[g], out=out[start:start + c])
            start += c
    return out


def reference_mm_outer(a_TM: torch.Tensor, b_TN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = a_TM.new_zeros(offs.numel(), a_TM.shape[1], b_TN.shape[1])
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    start = 0
    for g, c in enumerate(counts):
        if c:
            torch.matmul(a_TM[start:start + c].t(), b_TN[start:start + c], out=out[g])
            start += c
    return out


def mm_rows(a_TK: torch.Tensor, b_GKN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _GROUPED_MM:
        return torch._grouped_mm(a_TK, b_GKN, offs=offs)
    kernel = _cpu_kernel(a_TK, b_GKN)
    if kernel is not None:
        return kernel.mm_rows(a_TK, b_GKN, offs)
    return reference_mm_rows(a_TK, b_GKN, offs)


def mm_outer(a_TM: torch.Tensor, b_TN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _GROUPED_MM:
        return torch._grouped_mm(a_TM.t(), b_TN, offs=offs)
    kernel = _cpu_kernel(a_TM, b_TN)
    if kernel is not None:
        return kernel.mm_outer(a_TM, b_TN, offs)
    return reference_mm_outer(a_TM, b_TN, offs)


__all__ = ["mm_rows", "mm_outer", "reference_mm_rows", "reference_mm_outer"]
