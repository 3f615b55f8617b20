"""Rotary position embedding, plain and with YaRN scaling (the DeepSeek-V3 / Kimi K2 long-context recipe).

YaRN (Peng et al., 2023) blends interpolated and extrapolated inverse frequencies with a linear ramp over
the dimensions whose wavelength lies between `beta_fast` and `beta_slow` rotations in the original context,
and scales cos/sin by an attention factor. DeepSeek additionally multiplies the softmax scale by
mscale(factor, mscale_all_dim)^2 (see `softmax_scale`).
"""

from __future__ import annotations

import math

import torch

from ..kernels.rope import apply_rope, apply_rope_tail  # noqa: F401  (the model's rope, kernels/rope.py)
from .args import ModelConfig, RopeScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(s: RopeScaling, dim: int, base: float) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        return ((dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)))
                / (2 * math.log(base)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim / 2] (float32) and the factor applied to cos/sin."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq, 1.0
    inv_freq_interp = inv_freq / s.factor
    low, high = _yarn_correction_range(s, dim, base)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = inv_freq_interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s.factor)
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    if cfg.attention == "gqa":
        return cfg.gqa_head_dim ** -0.5
    scale = cfg.qk_head_dim ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.mscale_all_dim:
        m = yarn_mscale(s.factor, s.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding(torch.nn.Module):
    """Produces (cos, sin) of shape [B, S, rope_dim / 2] for given position ids."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids_BS[..., None].float() * self.inv_freq.float()
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos, sin


