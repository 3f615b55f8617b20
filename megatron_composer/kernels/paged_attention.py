"""Attention of new tokens over a paged KV cache: the leaf kernels the model's attention modules call in
inference (through the engine's inference context, inference/context.py).

`absorbed_attention` wraps the first with MLA's query absorption and value expansion (the whole attention of
a decode step between the projections, one C++ call on the CPU). Two forms, each a reference in torch (any
device; on CUDA SDPA with the mask) and, on the CPU, a C++ kernel that reads the cache rows where they lie
(kernels/cpu/csrc/decode.cpp) where it applies:
- `latent_attention`: MLA in the latent space (DeepSeek's absorbed decoding form). Query rows [B, M, C + R]
  (latent query q_nope W_uk, then the rotated rope query) score against cache rows [C + R] (normed latent,
  rotated rope key); the output is p . latent [B, M, C], to be expanded by W_uv.
- `grouped_attention`: GQA over gathered keys and values, query heads grouped by their kv head (no repeat).

Masks: query row (b, n) sees cache positions 0..pos_BN[b, n]. Shapes depend on the batch only through B, N and
L (the longest sequence), so a caller can pad them to buckets for CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .cpu import cpp


def causal_bias(pos_BN: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, L] additive mask (0 where cache position l <= pos, -inf after)."""
    visible = torch.arange(L, device=pos_BN.device) <= pos_BN[:, :, None]
    return torch.zeros(visible.shape, dtype=dtype, device=pos_BN.device).masked_fill_(~visible, float("-inf"))


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def latent_attention_reference(q_BMX: torch.Tensor, cache_SX: torch.Tensor, slots_BL: torch.Tensor,
                               bias_BML: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """Gather the rows, one batched matmul for the scores (mask added inside), softmax, one for the values."""
    B, L = slots_BL.shape
    kv_BLX = cache_SX.index_select(0, slots_BL.reshape(-1)).view(B, L, -1).to(q_BMX.dtype)
    scores = torch.baddbmm(bias_BML, q_BMX, kv_BLX.transpose(1, 2), alpha=scale)
    return torch.bmm(_softmax(scores), kv_BLX[..., :latent_dim])


def latent_attention(q_BMX: torch.Tensor, cache_SX: torch.Tensor, slots_BL: torch.Tensor, pos_BN: torch.Tensor,
                     scale: float, latent_dim: int, bias_BML: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MLA latent attention: q rows ordered (position, head), M = N * H; returns [B, M, latent_dim].
    bias_BML (the mask expanded over heads) is made from pos_BN when not given."""
    B, N = pos_BN.shape
    if (q_BMX.device.type == "cpu" and q_BMX.dtype == torch.float32 and cache_SX.dtype == torch.float32
            and N <= 4 and not torch._C._is_torch_function_mode_enabled()):
        kernel = cpp.load("decode")
        if kernel is not None and kernel.has_avx2():
            return kernel.paged_latent_attention(q_BMX.contiguous(), cache_SX, slots_BL, pos_BN, float(scale),
                                                 latent_dim)
    if bias_BML is None:
        bias_BML = expand_bias(causal_bias(pos_BN, slots_BL.shape[1], q_BMX.dtype), q_BMX.shape[1] // N)
    return latent_attention_reference(q_BMX, cache_SX, slots_BL, bias_BML, scale, latent_dim)


def absorbed_attention(q_BNHD: torch.Tensor, w_kv_HDC: torch.Tensor, nope_dim: int, attend_latent) -> torch.Tensor:
    """MLA's absorbed form around a latent attention `attend_latent(q_BMX) -> [B, M, C]`: latent queries
    q_nope W_uk per head (score rows (position, head): [q_lat | q_rope]), and the latent output expanded by W_uv.
    q [B, N, H, Dn + R] (rope applied), w_kv [H, Dn + Dv, C] (a view of wkv_b's weight); returns [B, N, H * Dv].
    The reference of the CPU kernel `absorbed_kernel` returns."""
    B, N, H, _ = q_BNHD.shape
    Dn, C = nope_dim, w_kv_HDC.shape[2]
    q_lat = torch.bmm(q_BNHD[..., :Dn].reshape(B * N, H, Dn).transpose(0, 1), w_kv_HDC[:, :Dn])  # [H, B * N, C]
    q_BMX = torch.cat([q_lat.transpose(0, 1).view(B, N, H, C), q_BNHD[..., Dn:]], dim=-1).view(B, N * H, -1)
    o_lat = attend_latent(q_BMX)  # [B, N * H, C]
    o = torch.bmm(o_lat.view(B * N, H, C).transpose(0, 1), w_kv_HDC[:, Dn:].transpose(1, 2))  # [H, B * N, Dv]
    return o.transpose(0, 1).reshape(B, N, -1)


def absorbed_kernel(q_BNHD: torch.Tensor, cache_SX: torch.Tensor):
    """The C++ module whose `absorbed_attention(q, kv_new, w_kv, cache, write_slots, rows, slots_BL, pos_BN, scale)`
    writes the new rows, then computes absorbed_attention over latent_attention in one call: float32 CPU tensors,
    AVX2, a few new positions per sequence (decoding, verification), no torch function mode; else None."""
    if (not q_BNHD.is_cpu or q_BNHD.dtype != torch.float32 or cache_SX.dtype != torch.float32
            or q_BNHD.shape[1] > 4 or torch._C._is_torch_function_mode_enabled()):
        return None
    kernel = cpp.load("decode")
    return kernel if kernel is not None and kernel.has_avx2() else None


def expand_bias(bias_BNL: torch.Tensor, heads: int) -> torch.Tensor:
    """The mask for score rows ordered (position, head): [B, N * heads, L] ([B, 1, L] broadcasts when N = 1)."""
    B, N, L = bias_BNL.shape
    return bias_BNL if N == 1 else bias_BNL[:, :, None].expand(B, N, heads, L).reshape(B, N * heads, L)


def grouped_attention(q_BNHD: torch.Tensor, k_BLKD: torch.Tensor, v_BLKD: torch.Tensor, bias_BNL: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """GQA of new queries [B, N, H, D] over gathered keys/values [B, L, KV, D]; returns [B, N, H, Dv]."""
    B, N, H, Dh = q_BNHD.shape
    L, KV = k_BLKD.shape[1], k_BLKD.shape[2]
    if q_BNHD.is_cuda:
        o = F.scaled_dot_product_attention(q_BNHD.transpose(1, 2), k_BLKD.transpose(1, 2), v_BLKD.transpose(1, 2),
                                           attn_mask=bias_BNL[:, None], scale=scale, enable_gqa=True)
        return o.transpose(1, 2)
    rep = H // KV
    # query heads grouped by their kv head, rows (head in group, position): [B, KV, rep * N, D]
    q_BKMD = q_BNHD.reshape(B, N, KV, rep, Dh).permute(0, 2, 3, 1, 4).reshape(B, KV, rep * N, Dh)
    bias = bias_BNL[:, None, None].expand(B, 1, rep, N, L).reshape(B, 1, rep * N, L)
    scores = torch.matmul(q_BKMD, k_BLKD.permute(0, 2, 3, 1)) * scale + bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_BNHD.dtype)
    o = torch.matmul(probs, v_BLKD.transpose(1, 2))  # [B, KV, rep * N, Dv]
    return o.view(B, KV, rep, N, -1).permute(0, 3, 1, 2, 4).reshape(B, N, H, -1)


__all__ = ["absorbed_attention", "absorbed_kernel", "causal_bias", "expand_bias", "grouped_attention",
           "latent_attention", "latent_attention_reference"]
