"""Rotary position embedding, plain and with YaRN scaling (the DeepSeek-V3 / Kimi K2 long-context recipe).

YaRN (Peng et al., 2023) blends interpolated and extrapolated inverse frequencies with a linear ramp over
the dimensions whose wavelength lies between `beta_fast` and `beta_slow` rotations in the original context,
and scales cos/sin by an attention factor. DeepSeek additionally multiplies the softmax scale by
mscale(factor, mscale_all_dim)^2 (see `softmax_scale`).
"""

from __future__ import annotations

import math

import torch

from ..kernels.rope import RopeTail, kernel_for
from .args import ModelConfig, RopeScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(s: RopeScaling, dim: int, base: float) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

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


def apply_rope(x_BSHD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of x by position. `interleaved` pairs (x0,x1),(x2,x3)... (DeepSeek weights) and
    returns the rotated pairs de-interleaved into halves; both q and k get the same layout, so q.k is exact."""
    cos, sin = cos_BSd.unsqueeze(2), sin_BSd.unsqueeze(2)
    if interleaved:
        x1, x2 = x_BSHD[..., 0::2], x_BSHD[..., 1::2]
    else:
        half = x_BSHD.shape[-1] // 2
        x1, x2 = x_BSHD[..., :half], x_BSHD[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope_tail(x_BSHD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor, interleaved: bool,
                    rope_dim: int) -> torch.Tensor:
    """apply_rope on the last `rope_dim` dims of each head, the others passed through: one C++ pass each way
    (kernels/rope.py) where it applies, else the reference below (equal bit for bit in float32)."""
    lead = x_BSHD.shape[:-2]
    if cos_BSd.shape[:-1] != lead:  # broadcast positions (one row of ids for the batch)
        cos_BSd, sin_BSd = cos_BSd.expand(*lead, -1), sin_BSd.expand(*lead, -1)
    kernel = kernel_for(x_BSHD, cos_BSd, sin_BSd)
    if kernel is not None:
        if not torch.is_grad_enabled():  # inference: the kernel alone, no autograd node
            return kernel.rotate(x_BSHD, cos_BSd, sin_BSd, rope_dim, interleaved, False)
        return RopeTail.apply(kernel, x_BSHD, cos_BSd, sin_BSd, rope_dim, interleaved)
    if rope_dim == x_BSHD.shape[-1]:
        return apply_rope(x_BSHD, cos_BSd, sin_BSd, interleaved)
    x_pass, x_rot = x_BSHD.split([x_BSHD.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([x_pass, apply_rope(x_rot, cos_BSd, sin_BSd, interleaved)], dim=-1)
