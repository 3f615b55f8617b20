"""Rotary embedding of the last `rope_dim` dims of each head with the other dims copied through, in one C++
pass each way (csrc/rope.cpp), as an autograd Function.

Its reference is `torch.cat([x[..., :P], apply_rope(x[..., P:], cos, sin, interleaved)], -1)` with
apply_rope from kernels/rope.py (the entry point `apply_rope_tail`): the kernel rounds as those separate
multiplies do, so float32 results are equal bit for bit. The reference runs instead on other devices and
dtypes, when cos/sin need gradients, under a torch function mode (which must see each op), or where the C++
module cannot be built.
"""

from __future__ import annotations

import torch

from . import cpp


def kernel_for(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The C++ module when it applies: CPU, x/cos/sin all float32 or all bfloat16, constant cos/sin."""
    if (not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16) or cos.dtype != x.dtype
            or sin.dtype != x.dtype or cos.requires_grad or sin.requires_grad
            or torch._C._is_torch_function_mode_enabled()):
        return None
    return cpp.load("rope")


class RopeTail(torch.autograd.Function):
    """x [..., H, P + R] -> [x[..., :P] | rope(x[..., P:])] (rotated pairs de-interleaved into halves)."""

    @staticmethod
    def forward(ctx, kernel, x, cos, sin, rope_dim, interleaved):
        ctx.kernel, ctx.rope_dim, ctx.interleaved = kernel, rope_dim, interleaved
        ctx.save_for_backward(cos, sin)
        return kernel.rotate(x, cos, sin, rope_dim, interleaved, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return None, ctx.kernel.rotate(dy, cos, sin, ctx.rope_dim, ctx.interleaved, True), None, None, None, None


__all__ = ["RopeTail", "kernel_for"]
