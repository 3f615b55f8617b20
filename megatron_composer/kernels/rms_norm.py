"""RMSNorm, device-neutral: `rms_norm(x, weight, eps)` runs the C++ pass (kernels/cpu/rms_norm.py) on the CPU
where it applies and its reference, `RMSNormFunction`, everywhere else.

y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the statistics in float32 (or wider), as the reference
checkpoints were trained.
"""

from __future__ import annotations

import torch

from .cpu.rms_norm import RMSNormCpp, kernel_for


class RMSNormFunction(torch.autograd.Function):
    """The reference. One saved [.., 1] rstd and a hand-written backward instead of the ~8 elementwise nodes
    (and their saved float32 copies) autograd records for the same expression."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        n32 = x.to(rstd.dtype) * rstd
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = (dy * n32.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0, dtype=rstd.dtype).to(weight.dtype)
        dn = (dy * weight).to(rstd.dtype)
        dx = (dn - n32 * (dn * n32).mean(-1, keepdim=True)).mul_(rstd)
        return dx.to(x.dtype), dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernel = kernel_for(x, weight)  # the C++ pass where it applies (CPU, float32/bfloat16, no function mode)
    if kernel is not None:
        if not torch.is_grad_enabled():  # inference: the kernel alone, no autograd node
            return kernel.rms_norm(x, weight, eps)[0]
        return RMSNormCpp.apply(kernel, x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


__all__ = ["RMSNormFunction", "rms_norm"]
