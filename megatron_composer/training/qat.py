"""Quantisation-aware training (`qat.experts=int4`): the routed experts train on the INT4 grid they are served on.

Kimi K2.5 is released, and served, with its routed experts in INT4 (compressed-tensors pack-quantized, 4-bit
symmetric groups of 32: checkpoint/int4.py). With `qat.experts=int4` every GroupedExperts computes with its
weights fake-quantised to that grid -- the same quantiser `save_hf_checkpoint(quantize="int4-experts")` writes
with -- and passes the gradient straight through to the float masters, so the model trained is the model an INT4
server runs: its export's logits are the trained model's. The transform runs inside the experts' own forward, on
whatever weights the layout gives it there (a rank's experts under expert parallelism, the gathered unit under
FSDP), before any FP8 recipe quantises the grouped GEMM's operands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from megatron_composer.checkpoint import int4
from megatron_composer.config import ConfigError
from megatron_composer.model.moe import GroupedExperts


@dataclass
class QATConfig:
    experts: Literal["none", "int4"] = field(
        default="none", metadata={"help": "int4: routed experts train on Kimi K2.5's INT4 grid (4-bit symmetric, "
                                          "groups of 32) with straight-through gradients"})

    def validate(self) -> "QATConfig":
        if self.experts not in ("none", "int4"):
            raise ConfigError(f"qat.experts={self.experts!r}; choose none or int4")
        return self


def int4_straight_through(w: torch.Tensor) -> torch.Tensor:
    """w's INT4 grid values in the forward, w's gradient unchanged in the backward."""
    return w + (int4.fake_quantize(w.detach()) - w).detach()


def apply_qat(model: nn.Module, cfg: QATConfig) -> nn.Module:
    """Give every routed-experts module the INT4 weight transform (qat.experts=int4); in place."""
    if cfg.experts == "none":
        return model
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for w in (module.w1, module.w2, module.w3):
                if w.shape[-1] % int4.GROUP:
                    raise ConfigError(f"qat.experts=int4: the input dimension {w.shape[-1]} of '{name}' is not a "
                                      f"multiple of the INT4 group size {int4.GROUP}")
            module.weight_transform = int4_straight_through
    return model


__all__ = ["QATConfig", "apply_qat", "int4_straight_through"]
