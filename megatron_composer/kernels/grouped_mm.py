"""Grouped matmuls over tokens sorted by group (the mixture of experts), with the reference next to them.

    mm_rows(a [T, K], b [G, K, N], offs [G]) -> [T, N]:     rows of group g times b[g]
    mm_outer(a [T, M], b [T, N], offs [G]) -> [G, M, N]:    per group, a[rows]^T b[rows] (weight gradients)

offs are cumulative row counts (group g holds rows offs[g-1]:offs[g]). Where torch has `_grouped_mm` for the
device it is used; on CPU the C++ kernel (kernels/cpu: csrc/grouped_mm.cpp) runs the groups as parallel tasks, each
matmul on one thread, instead of one small matmul after another split across threads; the loops below are
its reference and the fallback when it cannot be built or a torch function mode must see every matmul.

The experts' other entry points, which the model calls whatever the device:
    swiglu_experts: the C++ SwiGLU pass over rows sorted by expert on the CPU (the few-rows inference kernel at
        decode sizes, else kernels/cpu's GroupedSwiGLU); None elsewhere, where the model's own grouped matmuls
        (torch._grouped_mm) run its reference, GroupedExperts.reference_forward.
    pair_swiglu: the CPU inference kernel over the chosen (token, expert) pairs at decode sizes; None elsewhere.
    dispatch_sorted: gather the tokens' rows in expert order, run the experts, combine them weighted per token:
        kernels/cpu's GatherRows / CombineRows on the CPU (no scatter), index_select / reference_combine
        elsewhere.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from .cpu.grouped_mm import CombineRows, GatherRows, GroupedSwiGLU, autograd_kernel, few_rows_kernel, matmul_kernel

_GROUPED_MM_REJECTED: set = set()  # operand signatures torch._grouped_mm refused once: not tried again


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> Optional[torch.Tensor]:
    """torch._grouped_mm(a, b, offs) where torch has it for these operands (CUDA, bfloat16, Hopper or newer,
    16-byte aligned rows), else None (the caller runs the C++ kernel or the loops). Decided per call from the
    operands: an import-time probe on CPU tensors cannot say what the GPU supports."""
    if not (a.is_cuda and a.dtype == b.dtype == torch.bfloat16) or is_fake(a):
        return None
    key = (a.device.index, a.dim(), b.dim(), a.stride(), b.stride())
    if key in _GROUPED_MM_REJECTED or torch.cuda.get_device_capability(a.device) < (9, 0):
        return None
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except RuntimeError as e:  # alignment or layout torch does not take: per-group matmuls instead, said once
        _GROUPED_MM_REJECTED.add(key)
        import warnings
        warnings.warn(f"torch._grouped_mm refused operands {tuple(a.shape)} x {tuple(b.shape)} "
                      f"({str(e).splitlines()[0]}); using per-group matmuls for them")
        return None


def reference_mm_rows(a_TK: torch.Tensor, b_GKN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group matmul over the non-empty groups only."""
    out = a_TK.new_empty(a_TK.shape[0], b_GKN.shape[-1])
    if is_fake(offs):  # a dry run (training/dry_run.py): no group sizes to read; the result's shape is what counts
        return out
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    start = 0
    for g, c in enumerate(counts):
        if c:
            torch.matmul(a_TK[start:start + c], b_GKN[g], out=out[start:start + c])
            start += c
    return out


def reference_mm_outer(a_TM: torch.Tensor, b_TN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = a_TM.new_zeros(offs.numel(), a_TM.shape[1], b_TN.shape[1])
    if is_fake(offs):  # a dry run, as in reference_mm_rows
        return out
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    start = 0
    for g, c in enumerate(counts):
        if c:
            torch.matmul(a_TM[start:start + c].t(), b_TN[start:start + c], out=out[g])
            start += c
    return out


def reference_combine(y_SD: torch.Tensor, weights_TK: torch.Tensor, order_S: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[row of (t, k)], rows of y in `order_S` order of the flattened (token, slot)
    pairs; the Python path of GatherRows + CombineRows (and the numerics they follow)."""
    T, K = weights_TK.shape
    y_SD = y_SD * weights_TK.reshape(-1)[order_S, None].to(y_SD.dtype)
    return y_SD.new_zeros(T, y_SD.shape[1]).index_add_(0, order_S // K, y_SD)


def mm_rows(a_TK: torch.Tensor, b_GKN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if (out := _grouped_mm(a_TK, b_GKN, offs)) is not None:
        return out
    kernel = matmul_kernel(a_TK, b_GKN)
    if kernel is not None:
        return kernel.mm_rows(a_TK, b_GKN, offs)
    return reference_mm_rows(a_TK, b_GKN, offs)


def mm_outer(a_TM: torch.Tensor, b_TN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if (out := _grouped_mm(a_TM.t(), b_TN, offs)) is not None:
        return out
    kernel = matmul_kernel(a_TM, b_TN)
    if kernel is not None:
        return kernel.mm_outer(a_TM, b_TN, offs)
    return reference_mm_outer(a_TM, b_TN, offs)


def swiglu_experts(x_TD: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                   offs: torch.Tensor) -> Optional[torch.Tensor]:
    """The SwiGLU experts over rows sorted by expert with a C++ CPU pass, or None where none applies (not the CPU,
    a torch function mode, mixed dtypes): the caller then runs its reference on torch's grouped matmuls."""
    few = few_rows_kernel(x_TD, w1_EFD, x_TD.shape[0])
    if few is not None:  # inference at decode sizes
        return few.swiglu_rows(x_TD, w1_EFD, w3_EFD, w2_EDF, offs)
    kernel = autograd_kernel(x_TD, w1_EFD)
    if kernel is not None and x_TD.dtype == w1_EFD.dtype == w2_EDF.dtype == w3_EFD.dtype:
        return GroupedSwiGLU.apply(kernel, x_TD, w1_EFD, w3_EFD, w2_EDF, offs)
    return None


def pair_swiglu(x_TD: torch.Tensor, indices_TK: torch.Tensor, weights_TK: torch.Tensor, w1_EFD: torch.Tensor,
                w3_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> Optional[torch.Tensor]:
    """The weighted sum of each token's chosen experts in one CPU inference call at decode sizes, or None
    (the caller's reference: GroupedExperts.forward_pairs's sort, experts and combine in model/moe.py)."""
    few = few_rows_kernel(x_TD, w1_EFD, indices_TK.numel())
    return None if few is None else few.pair_swiglu(x_TD, indices_TK, weights_TK, w1_EFD, w3_EFD, w2_EDF)


def dispatch_sorted(x_TD: torch.Tensor, order_S: torch.Tensor, weights_TK: torch.Tensor,
                    experts: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_k weights[t, k] * experts(rows)[row of (t, k)] where rows are x's token rows in the order `order_S` of
    the flattened (token, slot) pairs (sorted by expert)."""
    T, K = weights_TK.shape
    token_of_slot = order_S // K
    kernel = autograd_kernel(x_TD) if x_TD.dtype in (torch.float32, torch.bfloat16) else None
    if kernel is None:
        y = experts(x_TD.index_select(0, token_of_slot))  # backward: index_add, not index_put
        return reference_combine(y, weights_TK, order_S)
    pos_TK = torch.empty_like(order_S).index_put_((order_S,), torch.arange(order_S.numel(), device=order_S.device))
    pos_TK = pos_TK.view(T, K)  # row of each (token, slot) pair among the sorted rows
    y = experts(GatherRows.apply(kernel, x_TD, token_of_slot, pos_TK))
    return CombineRows.apply(kernel, y, weights_TK, pos_TK)


__all__ = ["dispatch_sorted", "mm_outer", "mm_rows", "pair_swiglu", "reference_combine", "reference_mm_outer",
           "reference_mm_rows", "swiglu_experts"]
