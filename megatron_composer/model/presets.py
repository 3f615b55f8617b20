"""Named model shapes: the real checkpoints this project targets, and tiny CPU versions of each family."""

from __future__ import annotations

from .args import ModelConfig, ModelConfigError, RopeScaling


def _kimi_k25() -> ModelConfig:
    # Text backbone of Kimi K2.5 (= Kimi K2 shape, DeepSeek-V3 architecture).
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, num_layers=61, rms_norm_eps=1e-6,
        attention="mla", num_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=50000.0, max_position_embeddings=262144,
        rope_scaling=RopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        intermediate_size=18432, num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048,
        num_shared_experts=1, first_k_dense_replace=1, score_func="sigmoid", n_group=1, topk_group=1,
        expert_bias=True, norm_topk_prob=True, routed_scaling_factor=2.827,
    )


def _deepseek_v3() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, num_layers=61, rms_norm_eps=1e-6,
        attention="mla", num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        intermediate_size=18432, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        num_shared_experts=1, first_k_dense_replace=3, score_func="sigmoid", n_group=8, topk_group=4,
        expert_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=1,
    )


def _qwen3_30b_a3b() -> ModelConfig:
    return ModelConfig(
        vocab_size=151936, hidden_size=2048, num_layers=48, rms_norm_eps=1e-6,
        attention="gqa", num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
        rope_theta=1_000_000.0, rope_interleave=False, max_position_embeddings=40960,
        intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        score_func="softmax", norm_topk_prob=True,
    )


def _tiny_deepseek_v3() -> ModelConfig:
    # Every DeepSeek-V3 feature at CPU size: compressed q, group-limited sigmoid routing with bias,
    # a shared expert, a dense first layer, and one MTP depth. The latent plus rope (256 + 64 = 320) is the
    # smallest MLA head vLLM serves (its MLA kernels take 320, 512 or 576), so the tiny model runs on vLLM too.
    return ModelConfig(
        vocab_size=4096, hidden_size=128, num_layers=4, attention="mla", num_heads=4,
        q_lora_rank=64, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        rope_theta=10000.0, max_position_embeddings=4096,
        intermediate_size=384, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        num_shared_experts=1, first_k_dense_replace=1, score_func="sigmoid", n_group=4, topk_group=2,
        expert_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=1,
    )


def _tiny_kimi_k25() -> ModelConfig:
    return _tiny_deepseek_v3().replace(
        n_group=1, topk_group=1, q_lora_rank=64, routed_scaling_factor=2.827, rope_theta=50000.0,
        max_position_embeddings=8192,
        rope_scaling=RopeScaling(factor=2.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
    )


def _tiny_qwen3_moe() -> ModelConfig:
    return ModelConfig(
        vocab_size=4096, hidden_size=128, num_layers=4, attention="gqa", num_heads=4, num_kv_heads=2,
        head_dim=32, qk_norm=True, rope_theta=1_000_000.0, rope_interleave=False, max_position_embeddings=4096,
        intermediate_size=384, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        score_func="softmax", norm_topk_prob=True,
    )


PRESETS = {
    "kimi-k2.5": _kimi_k25,
    "deepseek-v3": _deepseek_v3,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    "tiny-deepseek-v3": _tiny_deepseek_v3,
    "tiny-kimi-k2.5": _tiny_kimi_k25,
    "tiny-qwen3-moe": _tiny_qwen3_moe,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset '{name}'; choose one of {sorted(PRESETS)}")
    return PRESETS[name]().validate()


def count_parameters(cfg: ModelConfig, include_mtp: bool = False) -> dict[str, int]:
    """Analytic parameter counts. `active` = parameters one token's forward pass touches: everything
    except the routed experts it was not sent to (embedding and head included, as DeepSeek counts)."""
    D, H = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        q = D * H * cfg.qk_head_dim if cfg.q_lora_rank is None else (
            D * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * cfg.qk_head_dim)
        attn = (q + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
                + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)
    else:
        Dh, KV = cfg.gqa_head_dim, cfg.num_kv_heads or H
        attn = D * H * Dh + 2 * D * KV * Dh + H * Dh * D + (2 * Dh if cfg.qk_norm else 0)
    norms = 2 * D
    dense_ffn = 3 * D * cfg.intermediate_size
    expert = 3 * D * cfg.moe_intermediate_size
    moe_fixed = D * cfg.num_experts + expert * cfg.num_shared_experts

    def block(layer_id: int) -> tuple[int, int]:
        if cfg.is_moe_layer(layer_id):
            return (attn + norms + moe_fixed + expert * cfg.num_experts,
                    attn + norms + moe_fixed + expert * cfg.num_experts_per_tok)
        return attn + norms + dense_ffn, attn + norms + dense_ffn

    embed = cfg.vocab_size * D
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * D
    total = active = embed + head + D
    for i in range(cfg.num_layers):
        t, a = block(i)
        total, active = total + t, active + a
    if include_mtp:
        for k in range(cfg.num_mtp_layers):
            t, a = block(cfg.num_layers + k)
            extra = 3 * D + 2 * D * D
            total, active = total + t + extra, active + a + extra
    return {"total": total, "active": active}
