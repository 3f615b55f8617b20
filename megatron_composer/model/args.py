"""ModelConfig: every architectural number of the DeepSeek-V3 / Kimi-K2.5 / Qwen3-MoE family in one dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional


class ModelConfigError(ValueError):
    """The model configuration is inconsistent; the message names the field and the fix."""


@dataclass
class RopeScaling:
    """YaRN context extension as DeepSeek-V3 / Kimi K2 configure it (fields as in HF `rope_parameters`)."""

    type: Literal["yarn"] = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 2
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_std: float = 0.02

    # Attention. "mla": Multi-head Latent Attention (DeepSeek-V2/V3, Kimi); "gqa": grouped-query (Qwen3).
    attention: Literal["mla", "gqa"] = "mla"
    num_heads: int = 4
    attention_bias: bool = False
    # GQA
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    qk_norm: bool = True
    # MLA; q_lora_rank None means queries are not compressed (DeepSeek-V2-Lite style)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32

    # Rotary embedding. MLA checkpoints store the rope dims interleaved (pairs), Qwen3 in halves.
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 4096

    # Feed-forward
    intermediate_size: int = 256

    # Mixture of experts (num_experts == 0: every layer dense)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    dense_layers: list[int] = field(default_factory=list)
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    expert_bias: bool = False  # aux-loss-free balancing bias (e_score_correction_bias): selects, never weights
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    aux_loss_coef: float = 0.0  # sequence-wise balance loss (DeepSeek-V3 complementary loss); 0 = off

    # Multi-token prediction depth (DeepSeek-V3 MTP modules)
    num_mtp_layers: int = 0

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def gqa_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.gqa_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.num_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id not in self.dense_layers
            and (layer_id + 1) % self.moe_layer_freq == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> "ModelConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ModelConfigError(msg)

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            need(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        if self.attention == "gqa":
            kv = self.num_kv_heads or self.num_heads
            need(self.num_heads % kv == 0,
                 f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads ({kv})")
            need(self.head_dim is not None or self.hidden_size % self.num_heads == 0,
                 f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_heads ({self.num_heads}); "
                 "set model.head_dim explicitly")
            need(self.gqa_head_dim % 2 == 0, f"model.head_dim ({self.gqa_head_dim}) must be even for RoPE")
        else:
            need(self.kv_lora_rank > 0, "model.kv_lora_rank must be positive for MLA")
            need(self.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
            need(self.q_lora_rank is None or self.q_lora_rank > 0,
                 "model.q_lora_rank must be positive, or null for uncompressed queries")
        if self.num_experts > 0:
            need(0 < self.num_experts_per_tok <= self.num_experts,
                 f"model.num_experts_per_tok ({self.num_experts_per_tok}) "
                 f"must be in 1..num_experts ({self.num_experts})")
            need(self.num_experts % self.n_group == 0,
                 f"model.num_experts ({self.num_experts}) must be divisible by model.n_group ({self.n_group})")
            need(1 <= self.topk_group <= self.n_group,
                 f"model.topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
            per_group = self.num_experts // self.n_group
            need(self.n_group == 1 or per_group >= 2,
                 f"model.n_group ({self.n_group}) leaves {per_group} expert per group; group scores use the top 2")
            need(self.num_experts_per_tok <= self.topk_group * per_group,
                 f"model.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in topk_group "
                 f"({self.topk_group}) groups of {per_group}; raise model.topk_group")
            need(self.moe_intermediate_size > 0, "model.moe_intermediate_size must be positive")
            need(self.moe_layer_freq >= 1, "model.moe_layer_freq must be >= 1")
        need(self.num_mtp_layers >= 0, "model.num_mtp_layers must be >= 0")
        if self.rope_scaling is not None:
            need(self.rope_scaling.factor >= 1.0,
                 f"model.rope_scaling.factor must be >= 1, got {self.rope_scaling.factor}")
        return self


def stage_rope_scaling(configured: Optional[RopeScaling], seq_length: int,
                       weights: Optional[RopeScaling]) -> Optional[RopeScaling]:
    """The rope scaling a training stage runs with, given the one its weights were trained with.

    The rope is part of what the weights learned: a stage keeps the YaRN factor and original length of the
    checkpoint it starts from (or resumes) whatever its own sequence length, unless it deliberately extends
    the context, i.e. its configured scaling reaches further than the weights' (seq_length beyond their
    factor x original length) or the weights had none. A later, shorter stage (SFT at 128k after the 256k
    stage, RL) therefore stays at the long stage's factor instead of recomputing a smaller one."""
    if weights is None or configured is None:
        return configured if weights is None else weights
    weights_context = weights.factor * weights.original_max_position_embeddings
    return configured if seq_length > weights_context else weights
