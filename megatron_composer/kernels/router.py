"""The router's scores and choices in one CPU inference call (kernels/cpu: csrc/decode.cpp `route`), device-neutral:
`route` returns None where the kernel does not apply (gradients, a torch function mode, not float32 on the CPU),
and the caller runs its reference, model/moe.py Router.forward, whose operations the kernel repeats (change
both together)."""

from __future__ import annotations

from typing import Optional

import torch

from .cpu.grouped_mm import inference_kernel


def route(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: Optional[torch.Tensor], sigmoid: bool,
          norm_topk_prob: bool, top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float):
    """(indices [T, K], combine weights [T, K] float32, scores [T, E] float32), or None."""
    kernel = inference_kernel(x_TD, weight_ED)
    if kernel is None:
        return None
    return kernel.route(x_TD, weight_ED, bias_E, sigmoid, norm_topk_prob, top_k, n_group, topk_group,
                        routed_scaling_factor)


__all__ = ["route"]
