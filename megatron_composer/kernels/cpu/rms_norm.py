"""RMSNorm on CPU in one pass per row each way (csrc/rms_norm.cpp), as an autograd Function.

Its reference, which it follows operation by operation (float32 statistics, the same roundings to the input
dtype), is `RMSNormFunction` in kernels/rms_norm.py (the entry point `rms_norm`); that runs instead on other
devices and dtypes, under a torch function mode (which must see each op), or where the C++ module cannot be
built.
"""

from __future__ import annotations

import torch

from . import cpp


def kernel_for(x: torch.Tensor, weight: torch.Tensor):
    """The C++ module when it applies to (x, weight): CPU, both float32 or both bfloat16, no function mode."""
    if (not x.is_cpu or not weight.is_cpu or x.dtype != weight.dtype
            or x.dtype not in (torch.float32, torch.bfloat16) or torch._C._is_torch_function_mode_enabled()):
        return None
    return cpp.load("rms_norm")


class RMSNormCpp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, x, weight, eps):
        y, rstd = kernel.rms_norm(x, weight, eps)
        ctx.kernel = kernel
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        dx, dweight = ctx.kernel.rms_norm_backward(dy, x, rstd, weight, ctx.needs_input_grad[1],
                                                   ctx.needs_input_grad[2])
        return None, dx, dweight, None


__all__ = ["RMSNormCpp", "kernel_for"]
