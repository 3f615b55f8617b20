"""Grouped matmuls over tokens sorted by group (the mixture of experts), with the reference next to them.

    mm_rows(a [T, K], b [G, K, N], offs [G]) -> [T, N]:     rows of group g times b[g]
    mm_outer(a [T, M], b [T, N], offs [G]) -> [G, M, N]:    per group, a[rows]^T b[rows] (weight gradients)

offs are cumulative row counts (group g holds rows offs[g-1]:offs[g]). Where torch has `_grouped_mm` for the
device it is used; on CPU the C++ kernel (csrc/grouped_mm.cpp) runs the groups as parallel tasks, each
matmul on one thread, instead of one small matmul after another split across threads; the loops below are
its reference and the fallback when it cannot be built or a torch function mode must see every matmul.

The same C++ module also runs, with their own backward passes (the autograd Functions below):
    GroupedSwiGLU: a whole SwiGLU expert pass, (silu(x w1^T) * x w3^T) w2^T per group, reading w1 and w3 in
        place (no concatenated copy of the weights) and doing the elementwise work per group while its rows
        are in cache; its reference is GroupedExperts.reference_forward (model/moe.py).
    GatherRows / CombineRows: the permutations around the experts, tokens -> (token, slot) rows sorted by
        expert and back, weighted; summed per token with no scatter (reference: reference_combine).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

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


def autograd_kernel(*tensors: torch.Tensor):
    """The C++ module for the autograd Functions below (CPU tensors outside torch function modes), or None."""
    if any(t.device.type != "cpu" for t in tensors) or torch._C._is_torch_function_mode_enabled():
        return None
    return cpp.load("grouped_mm")


def inference_kernel(*tensors: torch.Tensor):
    """The CPU inference leaf kernels (kernels/csrc/decode.cpp) where they apply: no gradient, float32 CPU
    tensors, AVX2, no torch function mode (batch-invariant numerics must see every op)."""
    if (torch.is_grad_enabled() or torch._C._is_torch_function_mode_enabled()
            or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors)):
        return None
    kernel = cpp.load("decode")
    return kernel if kernel is not None and kernel.has_avx2() else None


def few_rows_kernel(x_SD: torch.Tensor, w1_EFD: torch.Tensor, rows: int):
    """inference_kernel where the experts see few rows (at most 16 per expert on average: decoding, not prefill):
    its `swiglu_rows` (rows sorted by expert; reference GroupedExperts.reference_forward) and `pair_swiglu`
    (chosen (token, expert) pairs; reference model/moe.py local_dispatch)."""
    return inference_kernel(x_SD, w1_EFD) if rows <= 16 * w1_EFD.shape[0] else None


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


class GroupedSwiGLU(torch.autograd.Function):
    """y = (silu(x w1[g]^T) * x w3[g]^T) w2[g]^T for the rows of each group g (offs: cumulative counts)."""

    @staticmethod
    def forward(ctx, kernel, x_TD, w1_EFD, w3_EFD, w2_EDF, offs):
        y_TD, gate_up_T2F = kernel.swiglu_forward(x_TD, w1_EFD, w3_EFD, w2_EDF, offs)
        ctx.kernel = kernel
        ctx.save_for_backward(x_TD, gate_up_T2F, w1_EFD, w3_EFD, w2_EDF, offs)
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_TD, gate_up_T2F, w1_EFD, w3_EFD, w2_EDF, offs = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[1], any(ctx.needs_input_grad[2:5])
        dx, dw1, dw3, dw2 = ctx.kernel.swiglu_backward(dy_TD.contiguous(), x_TD, gate_up_T2F, w1_EFD, w3_EFD,
                                                       w2_EDF, offs, need_dx, need_dw)
        return None, dx, dw1, dw3, dw2, None


class GatherRows(torch.autograd.Function):
    """x_TD rows in (token, slot) order: x[token_of_slot]; the backward sums each token's K rows via pos_TK
    (row of each (token, slot) pair) instead of scattering."""

    @staticmethod
    def forward(ctx, kernel, x_TD, token_of_slot_S, pos_TK):
        ctx.kernel = kernel
        ctx.save_for_backward(pos_TK)
        return x_TD.index_select(0, token_of_slot_S)

    @staticmethod
    def backward(ctx, dx_SD):
        (pos_TK,) = ctx.saved_tensors
        return None, ctx.kernel.combine(dx_SD.contiguous(), pos_TK), None, None


class CombineRows(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * y[pos[t, k]], summed in float32 (float64 for float64 rows)."""

    @staticmethod
    def forward(ctx, kernel, y_SD, weights_TK, pos_TK):
        ctx.kernel = kernel
        ctx.save_for_backward(y_SD, weights_TK, pos_TK)
        return kernel.combine(y_SD, pos_TK, weights_TK)

    @staticmethod
    def backward(ctx, dout_TD):
        y_SD, weights_TK, pos_TK = ctx.saved_tensors
        dy, dw = ctx.kernel.combine_backward(dout_TD, y_SD, pos_TK, weights_TK, ctx.needs_input_grad[1],
                                             ctx.needs_input_grad[2])
        return None, dy, None if dw is None else dw.to(weights_TK.dtype), None


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


__all__ = ["CombineRows", "GatherRows", "GroupedSwiGLU", "autograd_kernel", "mm_outer", "mm_rows",
           "reference_combine", "reference_mm_outer", "reference_mm_rows"]
