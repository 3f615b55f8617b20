"""`parallelize_model`: turn a full `megatron_composer.model.Transformer` into this rank's shard.

The plan (torchtitan-style, but on our own layers) swaps the model's linear layers for tensor-parallel ones
holding slices of the full weights, installs the expert-parallel dispatcher and the context-parallel attention
core through the model's hooks (`attention.core`, `MoE.dispatch`, `mtp_shifted_ids`), slices the routed
experts, labels every parameter with a `ShardSpec`, and wraps activation checkpointing. Attention splits by
heads: the model reads head counts from tensor shapes.

Inputs: call the result with this rank's batch from `shard_batch` (data-parallel slice of the batch,
head-tail context-parallel slice of the sequence, with position ids, which context parallelism needs).
Outputs: logits [B_local, S_local, V/tp] -- vocab-sharded, for the vocab-parallel losses.

Sequence parallelism (tp > 1): the residual stream, norms and router work on S/tp of the sequence; attention and
the MLPs all-gather their input at entry and reduce-scatter at their row-parallel exit. Inside, column layers
all-reduce their input gradients as without SP (simple, and right for MLA's replicated down-projections);
Megatron's reduce-scatter at the first column layer would move half those bytes in backward.
"""

from __future__ import annotations

import functools
from typing import Literal, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from megatron_composer.parallel import collectives as C
from megatron_composer.parallel.context_parallel import (
    ContextParallelAttention,
    ContextParallelShiftedIds,
    shard_sequence,
)
from megatron_composer.parallel.dims import ParallelGroups
from megatron_composer.parallel.expert_parallel import AllToAllDispatcher
from megatron_composer.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    set_spec,
    spec_of,
)


def validate_layout(groups_or_dims, cfg, seq_len: Optional[int] = None, batch_size: Optional[int] = None,
                    section: str = "parallel") -> None:
    """Check a model config against a layout before anything is built (raises a one-line ConfigError naming
    `section`'s setting to change: parallel.tp for the trainer, rollout.tp for a rollout engine)."""
    dims = getattr(groups_or_dims, "dims", groups_or_dims)
    kv = (cfg.num_kv_heads or cfg.num_heads) if cfg.attention == "gqa" else None
    ffn = [cfg.intermediate_size]
    if cfg.num_experts and cfg.num_shared_experts:
        ffn.append(cfg.moe_intermediate_size * cfg.num_shared_experts)
    dims.validate_model(num_heads=cfg.num_heads, num_kv_heads=kv, vocab_size=cfg.vocab_size,
                        num_experts=cfg.num_experts, ffn_sizes=tuple(ffn), seq_len=seq_len, batch_size=batch_size,
                        section=section)


def shard_batch(groups: ParallelGroups, *tensors_BS: Optional[torch.Tensor], seq_dim: int = 1,
                batch_dim: int = 0) -> list[Optional[torch.Tensor]]:
    """This rank's slice of global-batch tensors [B, S, ...]: B over dp, S head-tail over cp (None passes)."""
    dims = groups.dims
    out = []
    for t in tensors_BS:
        if t is None:
            out.append(None)
            continue
        t = t.chunk(dims.dp, dim=batch_dim)[groups.dp_rank] if dims.dp > 1 else t
        out.append(shard_sequence(t, seq_dim, dims.cp, groups.cp_rank).contiguous())
    return out


def _label(module: nn.Module, kind: str) -> None:
    for p in module.parameters(recurse=False):
        if spec_of(p).kind not in ("tp_sharded", "expert"):
            set_spec(p, ShardSpec(kind))


def _gather_seq_pre_hook(tp_group, dim: int):
    """SP entry: the sub-layer sees the whole (cp-local) sequence; its input gradient is already complete."""
    def hook(module, args, kwargs):
        return (C.gather_from_parallel(args[0], dim, tp_group, grad_is_partial=False), *args[1:]), kwargs
    return hook


def _moe_sp_hooks(moe: nn.Module, tp_group):
    """Under SP the MoE sees S/tp tokens: slice a replayed routing to match, gather the chosen experts back."""
    def pre(module, args, kwargs):
        if len(args) > 1 and args[1] is not None:
            args = (args[0], C.split(args[1], 1, tp_group), *args[2:])
        return args, kwargs

    def post(module, args, kwargs, output):
        out, indices, aux = output
        return out, C.all_gather(indices, 1, tp_group), aux

    moe.register_forward_pre_hook(pre, with_kwargs=True)
    moe.register_forward_hook(post, with_kwargs=True)


def _mla_expand_kv(orig, tp_group, cp_core: Optional[ContextParallelAttention]):
    """MLA's K/V up-projection under TP/CP: gather the latent over cp (1/heads of the K/V bytes); the rope key
    is shared by all heads, so with heads split over tp its gradient is partial and must be all-reduced."""
    def expand_kv(c_kv_BSC, k_rope_BSR):
        if cp_core is not None:
            c_kv_BSC, k_rope_BSR = cp_core.gather_kv(c_kv_BSC, 1), cp_core.gather_kv(k_rope_BSR, 1)
        return orig(c_kv_BSC, C.copy_to_parallel(k_rope_BSR, tp_group))
    return expand_kv


def _checkpointed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


def _parallelize_attention(attn: nn.Module, groups: ParallelGroups, sp: bool) -> None:
    tp = groups.tp_group
    if hasattr(attn, "wkv_b"):  # MLA: split heads; the low-rank down-projections stay replicated
        if hasattr(attn, "wq"):
            attn.wq = ColumnParallelLinear.from_linear(attn.wq, tp)
        else:
            attn.wq_b = ColumnParallelLinear.from_linear(attn.wq_b, tp)
        attn.wkv_b = ColumnParallelLinear.from_linear(attn.wkv_b, tp)
    else:  # GQA: q and kv heads split; q/k norms are per-head-dim weights shared by heads on every rank
        attn.wq = ColumnParallelLinear.from_linear(attn.wq, tp)
        attn.wk = ColumnParallelLinear.from_linear(attn.wk, tp)
        attn.wv = ColumnParallelLinear.from_linear(attn.wv, tp)
        for norm in (attn.q_norm, attn.k_norm):
            _label(norm, "tp_partial")
    attn.wo = RowParallelLinear.from_linear(attn.wo, tp, sequence_parallel=sp)
    if sp:
        attn.register_forward_pre_hook(_gather_seq_pre_hook(tp, 1), with_kwargs=True)


def _parallelize_mlp(mlp: nn.Module, groups: ParallelGroups, sp: bool, seq_dim: int) -> None:
    tp = groups.tp_group
    mlp.w1 = ColumnParallelLinear.from_linear(mlp.w1, tp)
    mlp.w3 = ColumnParallelLinear.from_linear(mlp.w3, tp)
    mlp.w2 = RowParallelLinear.from_linear(mlp.w2, tp, sequence_parallel=sp, seq_dim=seq_dim)
    if sp:
        mlp.register_forward_pre_hook(_gather_seq_pre_hook(tp, seq_dim), with_kwargs=True)


def _shard_experts(experts: nn.Module, groups: ParallelGroups) -> None:
    ep, r = groups.dims.ep, groups.ep_rank
    spec = ShardSpec("expert", dim=0, rank=r, size=ep)
    for name in ("w1", "w2", "w3"):
        full = getattr(experts, name)
        p = nn.Parameter(spec.take(full.detach()).clone())
        set_spec(p, spec)
        setattr(experts, name, p)
    experts.expert_offset = r * (full.shape[0] // ep)


def _blocks(model) -> list[nn.Module]:
    return list(model.layers) + [m.block for m in model.mtp]


def parallelize_model(model: nn.Module, groups: ParallelGroups,
                      activation_checkpointing: Literal["none", "full", "selective"] = "none",
                      capacity_factor: Optional[float] = None,
                      cp_attention: Literal["allgather", "ring"] = "allgather") -> nn.Module:
    """Shard `model` (a full Transformer, modified in place and returned) for this rank's coordinates."""
    cfg, dims = model.config, groups.dims
    validate_layout(dims, cfg)
    tp, sp = groups.tp_group, dims.sequence_parallel
    if dims.tp > 1:
        if cfg.tie_word_embeddings:
            raise ValueError("tensor parallelism with tie_word_embeddings is not supported; set parallel.tp=1")
        model.tok_embeddings = VocabParallelEmbedding.from_embedding(model.tok_embeddings, tp, sequence_parallel=sp)
        model.output = ColumnParallelLinear.from_linear(model.output, tp, sequence_parallel=sp)
        seq_partial = "tp_partial" if sp else "replicated"
        _label(model.norm, seq_partial)
        for m in model.mtp:  # MTP's norms and fusing projection run on the residual stream
            for sub in (m.enorm, m.hnorm, m.norm, m.eh_proj):
                _label(sub, seq_partial)
        for block in _blocks(model):
            _label(block.attention_norm, seq_partial)
            _label(block.ffn_norm, seq_partial)
            _parallelize_attention(block.attention, groups, sp)
            ff = block.feed_forward
            if getattr(block, "is_moe", False):
                _label(ff.router, seq_partial)
                if ff.shared_experts is not None:  # works on flattened tokens [T, D]
                    _parallelize_mlp(ff.shared_experts, groups, sp, seq_dim=0)
                if sp:
                    _moe_sp_hooks(ff, tp)
            else:
                _parallelize_mlp(ff, groups, sp, seq_dim=1)

    cp_core = None
    if dims.cp > 1:
        cp_core = ContextParallelAttention(groups.cp_group, kv_exchange=cp_attention)
        model.mtp_shifted_ids = ContextParallelShiftedIds(groups.cp_group, model.mtp_shifted_ids)

        def set_positions(module, args, kwargs):
            pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
            if pos is None:
                raise ValueError("context parallelism needs position_ids: pass the sharded position ids "
                                 "(shard_batch) to the model")
            cp_core.set_positions(pos)

        model.register_forward_pre_hook(set_positions, with_kwargs=True)

    for block in _blocks(model):
        attn = block.attention
        if cp_core is not None:
            attn.core = cp_core
        if hasattr(attn, "wkv_b") and (dims.tp > 1 or cp_core is not None):
            latent_gather = cp_core if cp_core is not None and cp_attention == "allgather" else None
            attn.expand_kv = _mla_expand_kv(attn.expand_kv, tp, latent_gather)
        if getattr(block, "is_moe", False):
            ff = block.feed_forward
            _shard_experts(ff.experts, groups)
            if dims.ep > 1 or dims.tp > 1 or capacity_factor is not None:
                ff.dispatch = AllToAllDispatcher(groups.ep_group, ff.num_experts, tp_group=tp,
                                                 slice_tokens_over_tp=not sp, capacity_factor=capacity_factor)
        if activation_checkpointing == "full":
            block.forward = _checkpointed(block.forward)
        elif activation_checkpointing == "selective":  # the memory-heavy, compute-light parts
            attn.core = _checkpointed(attn.core)
            if getattr(block, "is_moe", False):
                block.feed_forward.experts.forward = _checkpointed(block.feed_forward.experts.forward)
        elif activation_checkpointing != "none":
            raise ValueError(f"activation_checkpointing is {activation_checkpointing!r}; use none, full or selective")
    return model


__all__ = ["parallelize_model", "shard_batch", "validate_layout"]
