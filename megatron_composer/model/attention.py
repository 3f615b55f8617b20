"""Attention: Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2) and grouped-query attention with q/k norm
(Qwen3).

Head counts are read from tensor shapes at run time, so tensor parallelism shards the projections by heads
without touching this file. The attention core is the module attribute `core` (default `sdpa_attention`),
so context parallelism and batch-invariant inference can swap it.

Packed sequences: `doc_ids_BS` (see `document_ids`) labels the document of each token; attention is causal
and never crosses documents.

Inference: given an `inference_context` (inference/context.py: the paged KV cache, slots and positions of new
tokens) the same modules cache what they attend to and attend over the cache. MLA caches the normed latent
and the rotated rope key per token and, outside batch-invariant mode, attends in the latent space (DeepSeek's
absorbed decoding form: scores q_nope W_uk . c_kv + q_rope . k_rope, output (p . c_kv) W_uv, with W_uk and
W_uv read as views of wkv_b: no second copy of any weight). `layer_id` (set by the block) names the module's
cache layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.causal_attention import sdpa_attention
from .args import ModelConfig
from .norms import RMSNorm
from .rope import apply_rope_tail, softmax_scale


def document_ids(position_ids_BS: torch.Tensor) -> Optional[torch.Tensor]:
    """Document index per token for packed rows (a new document starts wherever the position does not
    increase), or None when every row is a single document (the fast causal path)."""
    restart = position_ids_BS[:, 1:] <= position_ids_BS[:, :-1]
    if not bool(restart.any()):
        return None
    return F.pad(restart.long(), (1, 0)).cumsum(-1)


class MLAttention(nn.Module):
    """Multi-head Latent Attention. K/V come from a low-rank latent c_kv (kv_lora_rank) plus one shared rope
    key per token; queries optionally from a low-rank latent c_q (q_lora_rank)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.rope_interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.hidden_size, H * cfg.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.core = sdpa_attention
        self.layer_id = 0

    def project_q(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries [B, S, H, qk_nope + qk_rope] with rope applied."""
        B, S, _ = x_BSD.shape
        # not hasattr: a miss raises inside Module.__getattr__
        q = self.wq(x_BSD) if "wq" in self._modules else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_BSHD = q.view(B, S, -1, self.qk_nope_head_dim + self.qk_rope_head_dim)
        return apply_rope_tail(q_BSHD, cos, sin, self.rope_interleave, self.qk_rope_head_dim)

    def compress_kv(self, x_BSD: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token cache content: normed latent [B, S, kv_lora_rank] and rotated rope key [B, S, rope]."""
        c_kv, k_rope = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope_tail(k_rope.unsqueeze(2), cos, sin, self.rope_interleave, self.qk_rope_head_dim).squeeze(2)
        return self.kv_norm(c_kv), k_rope

    def expand_kv(self, c_kv_BSC: torch.Tensor, k_rope_BSR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent -> per-head keys [B, S, H, qk_head_dim] and values [B, S, H, v_head_dim]."""
        B, S, _ = c_kv_BSC.shape
        kv = self.wkv_b(c_kv_BSC).view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_rope_BSR.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids_BS: Optional[torch.Tensor], inference_context=None) -> torch.Tensor:
        if inference_context is not None:
            return self.forward_cached(x_BSD, cos, sin, inference_context)
        B, S, _ = x_BSD.shape
        q = self.project_q(x_BSD, cos, sin)
        k, v = self.expand_kv(*self.compress_kv(x_BSD, cos, sin))
        o_BHSD = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale, doc_ids_BS)
        return self.wo(o_BHSD.transpose(1, 2).reshape(B, S, -1))

    def forward_cached(self, x_BND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """New tokens [B, N] over the cache: their latent rows are written, then attended with the cached ones."""
        B, N, _ = x_BND.shape
        Dn, C = self.qk_nope_head_dim, self.kv_lora_rank
        q = self.project_q(x_BND, cos, sin)  # [B, N, H, Dn + R]
        c_kv, k_rope = self.compress_kv(x_BND, cos, sin)
        kv_new = torch.cat([c_kv, k_rope], dim=-1)
        if not ctx.absorbed:  # keys and values expanded from the cached latent, as the training forward makes them
            ctx.write(self.layer_id, kv_new)
            kv_BLX = ctx.gather(self.layer_id, x_BND.dtype)[0]
            k, v = self.expand_kv(*kv_BLX.split([C, self.qk_rope_head_dim], dim=-1))
            return self.wo(ctx.attend(q, k, v, self.scale).reshape(B, N, -1))
        # attention in the latent space: W_uk and W_uv are views of wkv_b (this rank's heads)
        w_kv = self.wkv_b.weight.view(q.shape[2], Dn + self.v_head_dim, C)
        return self.wo(ctx.attend_absorbed(self.layer_id, q, kv_new, w_kv, Dn, self.scale))


class GQAttention(nn.Module):
    """Grouped-query attention with optional per-head RMSNorm on q and k (Qwen3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, KV, Dh = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, cfg.gqa_head_dim
        self.head_dim = Dh
        self.scale = softmax_scale(cfg)
        self.rope_interleave = False
        self.wq = nn.Linear(cfg.hidden_size, H * Dh, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.hidden_size, KV * Dh, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.hidden_size, KV * Dh, bias=cfg.attention_bias)
        self.wo = nn.Linear(H * Dh, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.core = sdpa_attention
        self.layer_id = 0

    def project_qkv(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B,S,H,Dh], k and v [B,S,KV,Dh], rope applied to q and k."""
        B, S, _ = x_BSD.shape
        q = self.q_norm(self.wq(x_BSD).view(B, S, -1, self.head_dim))
        k = self.k_norm(self.wk(x_BSD).view(B, S, -1, self.head_dim))
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        return (apply_rope_tail(q, cos, sin, False, self.head_dim), apply_rope_tail(k, cos, sin, False, self.head_dim),
                v)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids_BS: Optional[torch.Tensor], inference_context=None) -> torch.Tensor:
        if inference_context is not None:
            return self.forward_cached(x_BSD, cos, sin, inference_context)
        B, S, _ = x_BSD.shape
        q, k, v = self.project_qkv(x_BSD, cos, sin)
        o_BHSD = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale, doc_ids_BS)
        return self.wo(o_BHSD.transpose(1, 2).reshape(B, S, -1))


    def forward_cached(self, x_BND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """New tokens [B, N] over the cache: this rank's kv heads are written, then attended with the cached ones."""
        B, N, _ = x_BND.shape
        q, k, v = self.project_qkv(x_BND, cos, sin)
        ctx.write(self.layer_id, k, v)
        k_BLKD, v_BLKD = ctx.gather(self.layer_id, x_BND.dtype)
        return self.wo(ctx.attend(q, k_BLKD, v_BLKD, self.scale).reshape(B, N, -1))


def build_attention(cfg: ModelConfig) -> nn.Module:
    return MLAttention(cfg) if cfg.attention == "mla" else GQAttention(cfg)
