"""Rotary embedding of the heads, device-neutral: `apply_rope_tail` runs the C++ pass (kernels/cpu/rope.py) on the
CPU where it applies and its reference (apply_rope on the tail, the rest copied through) everywhere else; the two
are equal bit for bit in float32. The frequencies and YaRN are the model's (model/rope.py)."""

from __future__ import annotations

import torch

from .cpu.rope import RopeTail, kernel_for


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
    where it applies, else the reference below (equal bit for bit in float32)."""
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


__all__ = ["apply_rope", "apply_rope_tail"]
