"""FP8 training configuration (the `fp8:` section of a run config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from megatron_composer.config import ConfigError

BLOCKWISE_BLOCK = 128


@dataclass
class FP8Config:
    recipe: Literal["none", "mxfp8", "blockwise"] = field(
        default="none", metadata={"help": "none | mxfp8 (E8M0 scales per block) | blockwise (DeepSeek-V3 FP32 tiles)"})
    block_size: int = field(
        default=32,
        metadata={"help": "MX block length along the reduction dim: 32 (OCP) or 16; blockwise always uses 128"})
    rounding: Literal["rceil", "floor"] = field(
        default="rceil", metadata={"help": "MX scale rounding: rceil (no saturation) or floor (OCP)"})
    pow2_scale: bool = field(default=False, metadata={"help": "blockwise: round FP32 scales up to powers of two"})
    backend: Literal["auto", "emulated", "triton", "scaled_mm", "te"] = field(
        default="auto", metadata={"help": "kernels: auto picks the fastest available and logs it"})
    wgrad_bf16: bool = field(default=False, metadata={"help": "compute weight gradients in high precision"})
    keep_high_precision: list[str] = field(
        default_factory=lambda: ["tok_embeddings", "output", "router", "*norm*"],
        metadata={"help": "fnmatch patterns; a module stays high precision if its name or a dotted part matches"})

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    @property
    def block(self) -> int:
        """Block length along the reduction dimension."""
        return self.block_size if self.recipe == "mxfp8" else BLOCKWISE_BLOCK

    def validate(self) -> "FP8Config":
        if self.recipe == "mxfp8" and self.block_size not in (16, 32):
            raise ConfigError(f"fp8.block_size is {self.block_size}; MX supports 32 (OCP) or 16")
        return self

    def replace(self, **kw) -> "FP8Config":
        return dataclasses.replace(self, **kw).validate()
