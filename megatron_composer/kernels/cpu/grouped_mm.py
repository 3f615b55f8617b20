"""The experts' C++ CPU kernels (csrc/grouped_mm.cpp, and csrc/decode.cpp's inference leaves) and the autograd
Functions around them. Their references and the device-neutral entry points are in kernels/grouped_mm.py.

    GroupedSwiGLU: a whole SwiGLU expert pass, (silu(x w1^T) * x w3^T) w2^T per group, reading w1 and w3 in
        place (no concatenated copy of the weights) and doing the elementwise work per group while its rows
        are in cache; its reference is GroupedExperts.reference_forward (model/moe.py).
    GatherRows / CombineRows: the permutations around the experts, tokens -> (token, slot) rows sorted by
        expert and back, weighted; summed per token with no scatter (reference: kernels/grouped_mm.py
        reference_combine).
"""

from __future__ import annotations

import torch

from . import cpp


def matmul_kernel(*tensors: torch.Tensor):
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
    """The CPU inference leaf kernels (csrc/decode.cpp) where they apply: no gradient, float32 CPU
    tensors, AVX2, no torch function mode (batch-invariant numerics must see every op)."""
    if torch.is_grad_enabled() or torch._C._is_torch_function_mode_enabled():
        return None
    for t in tensors:  # a loop, not any(<generator>): called by every MoE layer of every decode step
        if t.dtype != torch.float32 or not t.is_cpu:
            return None
    kernel = cpp.load("decode")
    return kernel if kernel is not None and kernel.has_avx2() else None


def few_rows_kernel(x_SD: torch.Tensor, w1_EFD: torch.Tensor, rows: int):
    """inference_kernel where the experts see few rows (at most 16 per expert on average: decoding, not prefill):
    its `swiglu_rows` (rows sorted by expert; reference GroupedExperts.reference_forward) and `pair_swiglu`
    (chosen (token, expert) pairs; reference GroupedExperts.forward_pairs in model/moe.py)."""
    return inference_kernel(x_SD, w1_EFD) if rows <= 16 * w1_EFD.shape[0] else None


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


__all__ = ["CombineRows", "GatherRows", "GroupedSwiGLU", "autograd_kernel", "few_rows_kernel", "inference_kernel",
           "matmul_kernel"]
