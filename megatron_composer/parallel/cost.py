"""Analytic cost of a parallel layout: per-rank parameter/gradient/optimizer memory and collective traffic
per training step, following exactly what `parallelize_model`, the vocab-parallel losses and
`DistributedAdamW` do. `benchmarks/parallel_comm.py` checks it against wrapped collectives on tiny models;
`tools/plan_parallel.py` applies it to the real presets.

Traffic is counted as collective *payload* bytes per rank: the tensor handed to all-reduce, the full
(gathered) tensor of all-gather and reduce-scatter, and the rows an all-to-all sends to other ranks. A ring
moves about 2(n-1)/n (all-reduce) or (n-1)/n (the others) of the payload over each rank's link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from megatron_composer.parallel.dims import ParallelDims

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass
class StepPlan:
    """A training step to estimate: the layout (dims) and the step's sizes and precisions. (Not
    training.layout.Layout, which is a rank's place in a running job.)"""

    dims: ParallelDims
    seq_len: int  # tokens per sequence (global, before context parallelism)
    micro_batch: int  # sequences per data-parallel rank per micro-batch
    zero1: bool = True
    mtp: bool = True  # MTP heads run (and are trained)
    param_bytes: int = 4  # parameters and gradients (2 for bf16 training, with an fp32 master in the optimizer)
    act_bytes: int = 4
    activation_checkpointing: str = "none"
    packed: bool = False  # rows pack several documents (attention needs an explicit mask)
    cp_attention: str = "allgather"  # or "ring"
    # FSDP (parallel.fsdp): parameters, gradients and optimizer state sharded over the dense replicas (dp x cp)
    # and, for routed experts, over the expert-data-parallel ranks, each divided by dp_replicate (HSDP keeps
    # that many replicas of each shard); blocks are gathered in gather_bytes (2: bf16; 1: FP8 recipes that
    # gather quantised weights) one at a time plus the next one prefetched (parallel/fsdp.py links each block to
    # one neighbour), gradients reduce-scattered in fp32 (fsdp_working_set).
    fsdp: bool = False
    dp_replicate: int = 1
    gather_bytes: float = 2

    @property
    def local_tokens(self) -> int:
        return self.micro_batch * self.seq_len // self.dims.cp


def param_kinds(cfg, dims: ParallelDims) -> dict[str, str]:
    """Each parameter's ShardSpec kind (replicated, tp_partial, tp_sharded, expert) as `parallelize_model` labels it
    in the layout `dims`: read from the model built on the meta device and laid out by parallelize_model as rank 0
    of a fake world of tp x ep ranks (the kinds depend on tp, ep and sequence parallelism, not on dp or cp). With
    tp = 1 nothing is tensor-parallel, so only routed experts are not replicated."""
    key = (repr(cfg), dims.tp, dims.ep, dims.sequence_parallel)
    if key not in _KINDS:
        _KINDS[key] = _read_kinds(cfg, dims.tp, dims.ep, dims.sequence_parallel)
    return dict(_KINDS[key])


_KINDS: dict[tuple, dict[str, str]] = {}  # a planner asks for the same few layouts many times


def _read_kinds(cfg, tp: int, ep: int, sp: bool) -> dict[str, str]:
    from megatron_composer.model import Transformer
    from megatron_composer.parallel.fake_world import fake_rank
    from megatron_composer.parallel.layers import spec_of
    from megatron_composer.parallel.parallelize import parallelize_model

    with fake_rank(tp * ep):
        groups = ParallelDims(tp * ep, tp=tp, ep=ep, sequence_parallel=sp).build()
        with torch.device("meta"):
            model = parallelize_model(Transformer(cfg), groups)
        return {name: spec_of(p).kind for name, p in model.named_parameters()}


def model_params(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, from the model built on the meta device (no memory)."""
    from megatron_composer.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _local_numel(name, shape, kind, dims: ParallelDims) -> int:
    n = math.prod(shape)
    if kind == "tp_sharded":
        return n // dims.tp
    if kind == "expert":
        return n // dims.ep
    return n


def memory_per_rank(cfg, lay: StepPlan, params: Optional[list] = None) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state (AdamW moments, fp32 master when params are not
    fp32) on one rank."""
    dims = lay.dims
    params = params if params is not None else model_params(cfg)
    kinds = param_kinds(cfg, dims)
    dense = expert = 0
    for name, shape in params:
        kind = kinds[name]
        n = _local_numel(name, shape, kind, dims)
        if kind == "expert":
            expert += n
        else:
            dense += n
    state_per_elem = 8 + (4 if lay.param_bytes != 4 else 0)
    if lay.fsdp:
        dense_shard, expert_shard = fsdp_shards(lay)
        n = math.ceil(dense / dense_shard) + math.ceil(expert / expert_shard)
        return {  # fp32 shards of parameters and gradients, AdamW moments over the same shards
            "params": n * 4, "grads": n * 4, "optimizer": 8 * n,
            "dense_params_local": dense, "expert_params_local": expert,
        }
    dense_share = dims.dp * dims.cp if lay.zero1 else 1
    expert_share = dims.edp if lay.zero1 else 1
    return {
        "params": (dense + expert) * lay.param_bytes,
        "grads": (dense + expert) * lay.param_bytes,
        "optimizer": state_per_elem * (math.ceil(dense / dense_share) + math.ceil(expert / expert_share)),
        "dense_params_local": dense,
        "expert_params_local": expert,
    }


def comm_per_step(cfg, lay: StepPlan, offrank_slots: Optional[float] = None, params: Optional[list] = None,
                  micro_batches: int = 1) -> dict[str, float]:
    """Payload bytes per rank of `micro_batches` micro-batch forward+backward passes plus the optimizer step.

    offrank_slots: (token, expert) pairs per MoE layer this rank sends to other expert-parallel ranks; by
    default the uniform-routing expectation T*K*(ep-1)/ep (T tokens the rank dispatches). The all-to-all
    return trip and the backward pass move the same number of rows.
    """
    d = lay.dims
    tp, cp, ep, sp = d.tp, d.cp, d.ep, d.sequence_parallel
    b, s = lay.micro_batch, lay.seq_len // d.cp
    D, p = cfg.hidden_size, lay.act_bytes
    bsD = b * s * D * p
    vol = dict.fromkeys(OPS, 0.0)
    depths = cfg.num_mtp_layers if lay.mtp else 0
    blocks = [(i, cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    blocks += [(cfg.num_layers + k, cfg.is_moe_layer(cfg.num_layers + k)) for k in range(depths)]

    def row_exit(n_bytes):  # RowParallelLinear output (+ its backward)
        if sp:
            vol["reduce_scatter"] += n_bytes
            vol["all_gather"] += n_bytes
        else:
            vol["all_reduce"] += n_bytes

    if tp > 1:
        # embedding (main + one lookup per MTP depth) and output head (+ per depth), vocab-parallel CE
        for _ in range(1 + depths):
            row_exit(bsD)
            if sp:  # head gathers the sequence; its input gradient is partial -> reduce-scatter
                vol["all_gather"] += bsD
                vol["reduce_scatter"] += bsD
            else:
                vol["all_reduce"] += bsD
            vol["all_reduce"] += 3 * b * s * 4  # max, target logit, sum of exponentials (fp32)
        for _, is_moe in blocks:
            # attention
            if sp:
                vol["all_gather"] += bsD
            if cfg.attention == "mla":
                q_in = D if cfg.q_lora_rank is None else cfg.q_lora_rank
                # column inputs' gradients: q latent, and the kv latent + rope key (cp-gathered first)
                kv_len = cp if lay.cp_attention == "allgather" else 1
                vol["all_reduce"] += b * s * (q_in + kv_len * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)) * p
            else:
                vol["all_reduce"] += 3 * bsD
            row_exit(bsD)
            # feed-forward
            if not is_moe:
                if sp:
                    vol["all_gather"] += bsD
                vol["all_reduce"] += 2 * bsD
                row_exit(bsD)
                continue
            if cfg.num_shared_experts:
                if sp:
                    vol["all_gather"] += b * s * D * p
                vol["all_reduce"] += 2 * b * s * D * p
                row_exit(b * s * D * p)
            if sp:
                vol["all_gather"] += b * s * cfg.num_experts_per_tok * 8  # chosen experts, gathered back
            else:  # token slice per tp rank: output gathered; x and gate-weight gradients gathered back
                T_pad = math.ceil(b * s / tp) * tp
                vol["all_gather"] += T_pad * D * p * 2 + T_pad * cfg.num_experts_per_tok * 4
    if cp > 1:
        vol["all_gather"] += b * s * cp * 8 * (1 + depths)  # position ids once, token ids per MTP depth
        for _ in blocks:
            if lay.cp_attention == "ring":  # K/V shards cp-1 hops forward; with fp32 dK/dV cp-1 (+1 home) back
                if cfg.attention == "mla":
                    width = cfg.num_heads // tp * (cfg.qk_head_dim + cfg.v_head_dim)
                else:
                    width = 2 * (cfg.num_kv_heads or cfg.num_heads) // tp * cfg.gqa_head_dim
                shard, pc = b * s * width, max(p, 4)
                vol["send_recv"] += (cp - 1) * shard * p + (cp - 1) * shard * (p + pc) + shard * pc
                continue
            if cfg.attention == "mla":
                kv = b * s * cp * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * p
            else:
                kv = 2 * b * (cfg.num_kv_heads or cfg.num_heads) // tp * s * cp * cfg.gqa_head_dim * p
            vol["all_gather"] += kv
            vol["reduce_scatter"] += kv
    if ep > 1:
        n_moe = sum(1 for _, m in blocks if m)
        T_disp = b * s // tp if sp else math.ceil(b * s / tp)
        K = cfg.num_experts_per_tok
        slots = offrank_slots if offrank_slots is not None else T_disp * K * (ep - 1) / ep
        vol["all_to_all"] += n_moe * (4 * slots * D * p + (ep - 1) * (cfg.num_experts // ep) * 8)
    vol = {k: v * micro_batches for k, v in vol.items()}
    # gradients and optimizer (once per step)
    params = params if params is not None else model_params(cfg)
    mem = memory_per_rank(cfg, lay, params)
    dense, expert = mem["dense_params_local"], mem["expert_params_local"]
    g = lay.param_bytes if lay.param_bytes == 4 else 4
    if tp > 1:  # tp_partial gradients summed over tp: the whole tensor, or under FSDP this rank's dim-0 shard of it
        kinds = param_kinds(cfg, d)
        # (finish_fsdp_gradients all-reduces the local shard after the reduce-scatter; rank 0 holds the largest)
        dense_shard = fsdp_shards(lay)[0] if lay.fsdp else 1
        vol["all_reduce"] += sum(math.ceil(sh[0] / dense_shard) * math.prod(sh[1:]) for n, sh in params
                                 if kinds[n] == "tp_partial") * g
    if lay.fsdp:
        for op, v in fsdp_comm_per_microbatch(cfg, lay, params).items():
            vol[op] += v * micro_batches
    for n_local, replicas in (() if lay.fsdp else ((dense, d.dp * d.cp), (expert, d.edp))):
        if replicas == 1 or n_local == 0:
            continue
        if lay.zero1:
            vol["reduce_scatter"] += n_local * 4
            vol["all_gather"] += n_local * 4
        else:
            vol["all_reduce"] += n_local * 4
    if d.world_size > 1:
        vol["all_reduce"] += 8  # global gradient norm (fp64 scalar)
    return vol


def fsdp_shards(lay: StepPlan) -> tuple[int, int]:
    """How many ranks share one copy of a dense and of an expert parameter under FSDP: the dense replicas
    (dp x cp) and the expert-data-parallel ranks, each over dp_replicate (HSDP)."""
    d = lay.dims
    return d.dp * d.cp // lay.dp_replicate, d.edp // lay.dp_replicate


def _fsdp_unit_of(name: str) -> str:
    """The FSDP unit parallel/fsdp.py puts a parameter in: its transformer block (main or MTP; a MoE block's
    routed experts, a unit of their own on the expert mesh, are counted with it), or the root (embedding, final
    norm, head, and the MTP projections and norms, which sit outside the MTP blocks)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2])
    if parts[0] == "mtp" and parts[2] == "block":
        return ".".join(parts[:3])
    return "root"


def _local_params(cfg, lay: StepPlan, params: Optional[list] = None):
    """(name, unit, is_expert, elements on this rank after TP/EP, before FSDP) of every parameter."""
    dims = lay.dims
    params = params if params is not None else model_params(cfg)
    kinds = param_kinds(cfg, dims)
    for name, shape in params:
        kind = kinds[name]
        yield name, _fsdp_unit_of(name), kind == "expert", _local_numel(name, shape, kind, dims)


def fsdp_units(cfg, lay: StepPlan, params: Optional[list] = None) -> dict[str, tuple[int, int]]:
    """FSDP units as parallel/fsdp.py makes them (_fsdp_unit_of) -> (dense, expert) elements this rank holds of
    them unsharded (after TP/EP, before FSDP)."""
    units: dict[str, list[int]] = {}
    for _, unit, expert, n in _local_params(cfg, lay, params):
        units.setdefault(unit, [0, 0])[1 if expert else 0] += n
    return {k: (v[0], v[1]) for k, v in units.items()}


def first_backward_units(cfg, lay: StepPlan) -> tuple[str, Optional[str]]:
    """The block unit backward reaches first (the last MTP block when MTP is trained, else the last layer) and
    the one it prefetches (its predecessor in the same stack: parallel/fsdp.py links the stacks separately)."""
    depths = cfg.num_mtp_layers if lay.mtp else 0
    if depths:
        return f"mtp.{depths - 1}.block", (f"mtp.{depths - 2}.block" if depths > 1 else None)
    n = cfg.num_layers
    return f"layers.{n - 1}", (f"layers.{n - 2}" if n > 1 else None)


FSDP_PHASES = ("loss", "ffn", "attention")


def fsdp_working_set(cfg, lay: StepPlan, params: Optional[list] = None, phase: str = "attention") -> dict[str, float]:
    """Bytes of unsharded FSDP state at one moment of the backward of one micro-batch (FSDP_PHASES; zero without
    FSDP): "loss" (the heads and loss through their backward), "ffn" (the start of the feed-forward backward of
    the first block backward reaches) and "attention" (that block's attention core backward). Terms:
      root           the root unit, gathered from the first forward to the end of backward (reshard_after_forward
                     False), in the gather dtype
      root_grads     its unsharded gradients made before the blocks' backward (all but the token embedding's:
                     head, final norm, MTP projections), in the compute dtype, kept until the root's reduce-scatter
      block          the block's dense unit, gathered for its backward
      block_experts  its routed-experts unit, gathered (ffn); after their backward they reshard, and
      reduce_scatter the experts' float32 reduce-scatter input, which FSDP keeps until the next unit's
                     reduce-scatter is issued (attention)
      block_grads    the block's dense gradients made before the attention core's backward: its feed-forward's
                     (shared experts, router, norm) and wo's (attention)
      prefetch       the previous block (dense and experts units) gathered ahead (ffn, attention)"""
    zero = dict.fromkeys(("root", "root_grads", "block", "block_experts", "reduce_scatter", "block_grads",
                          "prefetch"), 0.0)
    if not lay.fsdp:
        return dict(zero, total=0.0)
    if phase not in FSDP_PHASES:
        raise ValueError(f"phase {phase!r}; use one of {FSDP_PHASES}")
    params = params if params is not None else model_params(cfg)
    units = fsdp_units(cfg, lay, params)
    first, prev = first_backward_units(cfg, lay)
    g, c = lay.gather_bytes, lay.act_bytes
    out = dict(zero, root=sum(units.get("root", (0, 0))) * g)
    if phase != "loss":
        dense, experts = units.get(first, (0, 0))
        out["root_grads"] = sum(n for name, unit, _, n in _local_params(cfg, lay, params)
                                if unit == "root" and not name.startswith("tok_embeddings.")) * c
        out["block"] = dense * g
        out["prefetch"] = sum(units.get(prev, (0, 0))) * g if prev else 0.0
        if phase == "ffn":
            out["block_experts"] = experts * g
        else:
            out["reduce_scatter"] = experts * 4
            out["block_grads"] = sum(
                n for name, unit, expert, n in _local_params(cfg, lay, params)
                if unit == first and not expert and (".attention." not in name or ".attention.wo." in name)) * c
    out["total"] = sum(out.values())
    return out


def backward_peak(cfg, lay: StepPlan, acts: dict, params: Optional[list] = None, micro_batches: int = 1) -> dict:
    """Peak bytes of one rank in a step with full-layer recompute: the largest of the backward moments of
    FSDP_PHASES, each the sharded state (parameters, optimizer; gradients: all of them from the second micro-batch
    on, else those reduce-scattered before that moment), fsdp_working_set at that moment and the activations then
    live (activation_bytes(...)["phases"]). Returns {"phase", "total", "terms", "phases": {phase: total}}.
    Checked against the dry run (pretrain/dry_run.py) for Kimi K2.5 in EP 8 x CP 8 x FSDP: the attention moment,
    the peak there at 131k and 256k tokens, matches it to 0.1%. The "ffn" moment counts the recomputed block's
    saved tensors as its backward starts; the dry run's feed-forward moments are higher (~20% at 131k-256k: the
    recomputed MoE's dispatch buffers are live too; inside the routed experts' backward their unsharded weight
    gradients join), which at 32k makes the MoE backward the peak and the dry run 7% above this estimate."""
    params = params if params is not None else model_params(cfg)
    mem = memory_per_rank(cfg, lay, params)
    phases, terms_of = {}, {}
    for phase in FSDP_PHASES:
        work = fsdp_working_set(cfg, lay, params, phase)
        if micro_batches > 1 or not lay.fsdp:
            grads = mem["grads"]
        elif phase == "attention":  # the first block's experts, reduce-scattered before its attention backward
            grads = math.ceil(fsdp_units(cfg, lay, params).get(first_backward_units(cfg, lay)[0], (0, 0))[1]
                              / fsdp_shards(lay)[1]) * 4
        else:
            grads = 0.0
        terms = {"params": mem["params"], "grads": grads, "optimizer": mem["optimizer"]}
        terms.update({f"fsdp {k}": v for k, v in work.items() if k != "total"})
        terms["activations"] = acts["phases"][phase]
        terms_of[phase], phases[phase] = terms, sum(terms.values())
    best = max(phases, key=phases.get)
    return {"phase": best, "total": phases[best], "terms": terms_of[best], "phases": phases}


def fsdp_comm_per_microbatch(cfg, lay: StepPlan, params: Optional[list] = None) -> dict[str, float]:
    """FSDP payload bytes per micro-batch: every unit all-gathered for forward and again for backward (the root
    once: it stays gathered), its gradient reduce-scattered in fp32; with HSDP the fp32 gradient shards are
    all-reduced over the replicas."""
    vol = dict.fromkeys(OPS, 0.0)
    dense_shard, expert_shard = fsdp_shards(lay)
    for unit, (dense, expert) in fsdp_units(cfg, lay, params).items():
        gathers = 1 if unit == "root" else 2
        for n, shard in ((dense, dense_shard), (expert, expert_shard)):
            if shard > 1 and n:
                vol["all_gather"] += gathers * n * lay.gather_bytes
                vol["reduce_scatter"] += n * 4
            if lay.dp_replicate > 1 and n:
                vol["all_reduce"] += math.ceil(n / shard) * 4
    return vol


__all__ = ["StepPlan", "OPS", "param_kinds", "model_params", "memory_per_rank", "comm_per_step", "fsdp_shards",
           "fsdp_units", "first_backward_units", "FSDP_PHASES", "fsdp_working_set", "backward_peak",
           "fsdp_comm_per_microbatch"]


def _norm_bytes(n: int, w: int, p: int) -> float:
    """RMSNorm saves its input and 1/rms (fp32) per row."""
    return n * w * p + 4 * n


def _block_prob_bytes(b: int, heads: int, kv_heads: int, s: int) -> float:
    """fp32 probabilities the CPU attention kernel keeps for backward (rows with no earlier documents),
    or 0 where it recomputes them."""
    from ..kernels import causal_attention as ka

    rep = heads // kv_heads
    rows = ka._rows_per_block(b * kv_heads, rep, s)
    elems = b * heads * sum((min(s, s0 + rows) - s0) * min(s, s0 + rows) for s0 in range(0, s, rows))
    return 4 * elems if elems <= ka._SAVED_PROB_ELEMENTS else 0.0


def activation_bytes(cfg, lay: StepPlan, attention_backend: str = "auto", loss: str = "reference") -> dict[str, float]:
    """Bytes held for backward by one micro-batch on one rank at the end of the forward pass (logits and
    the loss's softmax included), without recompute, and the backward-time peak with full-layer recompute
    (block inputs plus one recomputed block).

    attention_backend (without context parallelism, which always runs the blockwise core): "flash" (GPU SDPA:
    q, k, v, output, log-sum-exp, and the boolean mask of packed rows) or "blocks" (the CPU kernel: q, k, v,
    the output the output projection also reads, log-sum-exp, and the probabilities of short sequences);
    "auto" is "blocks", the CPU rule.

    loss: "reference" (F.cross_entropy on every head's logits, as the tests measure) or "trainer" (the
    pretraining loss the trainer runs: `trainer_loss_bytes`).
    """
    d = lay.dims
    tp, cp, sp, p = d.tp, d.cp, d.sequence_parallel, lay.act_bytes
    b, s = lay.micro_batch, lay.seq_len // cp
    T, D = b * s, cfg.hidden_size
    Tr = T // tp if sp else T  # residual-stream tokens (sequence-parallel regions hold 1/tp)
    Tk = T * cp if lay.cp_attention == "allgather" else T  # keys and values held for a query shard
    H = cfg.num_heads // tp
    depths = cfg.num_mtp_layers if lay.mtp else 0

    def attention() -> float:
        x = _norm_bytes(Tr, D, p) + T * D * p  # attention_norm + the normed input the projections save
        if cfg.attention == "mla":
            qk, vd = cfg.qk_head_dim, cfg.v_head_dim
            if cfg.q_lora_rank is not None:
                # q_norm saves wq_a's output and the normed latent; its output is saved by wq_b
                x += _norm_bytes(T, cfg.q_lora_rank, p) + T * cfg.q_lora_rank * p
            x += T * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * p + 4 * T  # kv_norm: wkv_a's output (a view), 1/rms
            x += Tk * cfg.kv_lora_rank * p  # latent (cp-gathered) saved by wkv_b
            v_saved = Tk * H * (cfg.qk_nope_head_dim + vd) * p  # flash keeps values as views of wkv_b's output
        else:
            qk = vd = cfg.gqa_head_dim
            KV = (cfg.num_kv_heads or cfg.num_heads) // tp
            if cfg.qk_norm:  # per-head norms: input and 1/rms per head
                x += _norm_bytes(T * H, qk, p) + _norm_bytes(T * KV, qk, p)
            v_saved = Tk * H * vd * p
        backend = attention_backend if attention_backend != "auto" else "blocks"
        q_saved, k_saved = T * H * qk * p, Tk * H * qk * p
        if cp > 1:  # blockwise core: contiguous q, k, v (K/V heads unrepeated), fp32 output and lse, wo's copy
            kvh = H if cfg.attention == "mla" else (cfg.num_kv_heads or cfg.num_heads) // tp
            x += q_saved + Tk * kvh * (qk + vd) * p + T * H * vd * max(p, 4) + T * H * 4 + T * H * vd * p
        elif backend == "flash":  # q, k, v, output, log-sum-exp (+ the boolean mask of packed rows)
            x += q_saved + k_saved + v_saved + T * H * vd * p + T * H * 4
            if lay.packed:
                x += T * (Tk // b)
        else:  # blocks: q, k (K/V heads unrepeated) and v as given, output (shared with wo), lse, probabilities
            kvh = H if cfg.attention == "mla" else (cfg.num_kv_heads or cfg.num_heads) // tp
            k_saved = Tk * kvh * qk * p
            v_saved = v_saved if cfg.attention == "mla" else Tk * kvh * vd * p
            x += q_saved + k_saved + v_saved + T * H * vd * p + T * H * 4 + _block_prob_bytes(b, H, kvh, s)
        return x

    def ffn(is_moe: bool) -> float:
        x = _norm_bytes(Tr, D, p)
        if not is_moe:
            F_ = cfg.intermediate_size // tp
            return x + T * D * p + 4 * T * F_ * p
        K, E, Fm = cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size
        Td = Tr if (sp or tp == 1) else math.ceil(T / tp)  # tokens this rank dispatches
        x += Tr * D * p + Tr * E * 4 + Tr * K * (8 + 4 + 4)  # router input, scores, choice and weights
        x += 3 * Td * K * D * p + 4 * Td * K * Fm * p + Td * K * (8 + 8 + 4)  # experts and combine
        x += (E // d.ep) * 2 * Fm * D * p  # the concatenated w1|w3 the grouped gate/up matmul saves
        if cfg.num_shared_experts:
            Fs = Fm * cfg.num_shared_experts // tp
            x += 4 * T * Fs * p + (T * D * p if sp else 0)
        return x

    V = cfg.vocab_size // tp

    def head() -> float:  # final norm, head input, logits and the cross-entropy softmax (fp32)
        if loss == "trainer":
            return _norm_bytes(Tr, D, p) + T * D * p
        return _norm_bytes(Tr, D, p) + T * D * p + T * V * p + T * V * 4

    def attention_backward() -> float:
        """Temporaries of the attention core's backward at its peak, beyond what attention() saved (of which
        wo's input is freed by then and the core output's gradient, the same size, takes its place)."""
        if cfg.attention == "mla":
            kvh, qk, vd = H, cfg.qk_head_dim, cfg.v_head_dim
        else:
            kvh, qk, vd = (cfg.num_kv_heads or cfg.num_heads) // tp, cfg.gqa_head_dim, cfg.gqa_head_dim
        if cp == 1:  # the q, k, v gradients (in the compute dtype) the kernel returns
            return (T * H * qk + Tk * kvh * (qk + vd)) * p
        from .context_parallel import KEY_BLOCK

        # _BlockwiseAttention/_RingAttention.backward (parallel/context_parallel.py): q and the output gradient
        # in float32 (qg, do), dq accumulated in float32, delta [T, H]; per key block the float32 casts of the
        # block's k and v, its mask, and two [T, H, block] float32 blocks (probabilities and their gradient)
        kb = min(KEY_BLOCK, Tk // b)
        x = T * H * qk * 4 * 2 + T * H * vd * 4 + T * H * 4
        x += b * kvh * kb * (qk + vd) * 4 + T * kb + 2 * T * H * kb * 4
        if lay.cp_attention == "allgather":  # dk, dv over the gathered keys, written in the inputs' dtype
            return x + Tk * kvh * (qk + vd) * p
        # ring: one shard's float32 accumulators dk/dv, this step's float32 parts, and the next K/V shard (own
        # dtype) and accumulators arriving
        shard = T * kvh * (qk + vd)
        return x + shard * (4 + 4 + p + 4)

    blocks = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    mtp_blocks = [cfg.is_moe_layer(cfg.num_layers + k) for k in range(depths)]
    block_bytes = [attention() + ffn(m) for m in blocks + mtp_blocks]
    ids_rope = T * 8 + T * cfg.rope_dim * p  # token ids, rope cos/sin (shared by layers)
    rest = ids_rope + head()  # + the main head
    for _ in range(depths):  # enorm, hnorm, the concatenation eh_proj saves, norm + head
        rest += T * 8 + 2 * _norm_bytes(Tr, D, p) + Tr * 2 * D * p + head()
    if loss == "trainer":
        rest += trainer_loss_bytes(cfg, lay)
    none = sum(block_bytes) + rest
    # Full recompute: every block's input is kept; the peak is one of three moments of the backward, in the first
    # block backward reaches (the last MTP block, else the last layer: all inputs still held) or before it.
    inputs = len(block_bytes) * Tr * D * p
    first_moe = (blocks + mtp_blocks)[-1]
    # the attention norm's input is the block input itself (in `inputs`); its 1/rms is the block's own
    att_saved = attention() - _norm_bytes(Tr, D, p) + 4 * Tr
    grad_out = Tr * D * p  # the gradient of the block's output, live through its backward
    phases = {
        "loss": inputs + rest,  # the heads and the loss through their backward (trainer_loss_bytes: its peak)
        # the recomputed block's saved tensors all live as its feed-forward backward starts
        "ffn": inputs + ids_rope + grad_out + att_saved + ffn(first_moe),
        # the feed-forward's are freed; the attention core's backward temporaries join
        "attention": inputs + ids_rope + grad_out + att_saved + attention_backward(),
    }
    full = max(phases.values())
    return {"none": none, "full": full, "per_block_max": max(block_bytes), "phases": phases,
            "first_block_moe": first_moe}


def trainer_loss_bytes(cfg, lay: StepPlan) -> float:
    """Peak bytes of the pretraining loss (pretrain/losses.py) beyond the head's input, at its backward.

    Fused head (one tp rank, no MTP self-distillation: pretrain.losses.fused_head_applies): no [tokens, vocab]
    tensor; the forward keeps dh [T, D] and the fp32 head-weight gradient dW [V, D], the backward makes
    dW * grad (fp32) and its cast to the weight dtype (kernels/linear_cross_entropy.py).
    Otherwise the main logits (saved by the blocked cross-entropy, kernels/cross_entropy.py) and their
    gradient, and per MTP depth the self-distillation's float32 [T, V] tensors: the student logits (saved by
    its cross-entropy), log q (saved by log-softmax) and the teacher's p (saved by the KL product) from the
    forward, and three more in its backward (the product's gradient, the log-softmax backward, the
    cross-entropy gradient)."""
    d = lay.dims
    T, D, p = lay.local_tokens, cfg.hidden_size, lay.act_bytes
    V = cfg.vocab_size // d.tp
    depths = cfg.num_mtp_layers if lay.mtp else 0
    if d.tp == 1 and depths == 0:
        w = lay.gather_bytes if lay.fsdp else lay.param_bytes
        return 2 * T * D * p + 2 * V * D * 4 + V * D * w
    return 2 * T * V * p + depths * 6 * T * V * 4


def saved_tensor_bytes(run, exclude=()) -> int:
    """Bytes of distinct storages autograd saves for backward while `run()` executes (the activation memory
    a backward pass needs), excluding the storages of `exclude` (parameters). Returns (bytes, run's result)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


__all__ += ["activation_bytes", "saved_tensor_bytes", "trainer_loss_bytes"]


# ---- rollout engines -------------------------------------------------------------------------------------

# bytes per parameter of each weight format: (routed experts, other matmul weights); embeddings, head, norms
# and routers stay bf16 in every format (as the released FP8 and INT4 checkpoints keep them)
ROLLOUT_WEIGHT_FORMATS = {
    "bf16": (2.0, 2.0),
    "fp8": (1 + 4 / 128**2, 1 + 4 / 128**2),  # e4m3 with an fp32 scale per 128x128 block (DeepSeek's FP8)
    "int4": (0.5 + 2 / 32, 2.0),  # pack-quantized experts: 4 bits plus a bf16 scale per group of 32 (Kimi K2.5)
}


@dataclass
class RolloutEngine:
    """One inference engine: `gpus` GPUs; attention, dense and vocabulary weights split over `tp` (replicated over
    gpus / tp data-parallel attention groups, each holding its own sequences' cache); routed experts split over
    `ep` (replicated gpus / ep times); each sequence's cache split over `dcp` of its group's tp GPUs (vLLM's
    decode context parallelism, which spares MLA's latent cache its replication over tp). vLLM's
    --enable-expert-parallel is ep = gpus."""

    gpus: int
    tp: int = 1
    ep: int = 0  # 0: all of the engine's GPUs
    weights: str = "bf16"
    kv_bytes: int = 2  # cache dtype: 2 bf16, 1 fp8
    mtp: bool = False  # the MTP layers are loaded (speculative decoding) and cache too
    dcp: int = 1

    def __post_init__(self):
        self.ep = self.ep or self.gpus
        if self.weights not in ROLLOUT_WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.weights!r}: use one of {list(ROLLOUT_WEIGHT_FORMATS)}")
        if self.gpus % self.tp or self.gpus % self.ep:
            raise ValueError(f"tp={self.tp} and ep={self.ep} must divide the engine's {self.gpus} GPUs")
        if self.dcp < 1 or self.tp % self.dcp:
            raise ValueError(f"dcp={self.dcp} must divide tp={self.tp} (it splits a sequence's cache over tp ranks)")

    @property
    def attention_groups(self) -> int:
        return self.gpus // self.tp


def rollout_weight_bytes(cfg, engine: RolloutEngine, params: Optional[list] = None) -> dict[str, float]:
    """Bytes of weights on one GPU of the engine, by kind."""
    params = params if params is not None else model_params(cfg)
    expert_b, dense_b = ROLLOUT_WEIGHT_FORMATS[engine.weights]
    # which matmuls tp splits: the training layout's kinds (they do not depend on tp's size)
    kinds = param_kinds(cfg, ParallelDims(2, tp=2)) if engine.tp > 1 else {}
    out = {"routed experts": 0.0, "dense matmuls": 0.0, "embeddings and head": 0.0, "norms and routers": 0.0}
    for name, shape in params:
        if name.startswith("mtp.") and not engine.mtp:
            continue
        n = math.prod(shape)
        if ".experts." in name and ".shared_experts." not in name:
            out["routed experts"] += n * expert_b / engine.ep
        elif name.split(".")[0] in ("tok_embeddings", "output"):
            out["embeddings and head"] += n * 2 / engine.tp
        elif len(shape) == 1 or "router" in name.split("."):
            out["norms and routers"] += n * 2
        else:
            split = engine.tp > 1 and kinds[name] == "tp_sharded"
            out["dense matmuls"] += n * dense_b / (engine.tp if split else 1)
    return out


def rollout_kv_bytes_per_token(cfg, engine: RolloutEngine) -> float:
    """Cache bytes one token of a sequence takes on each GPU of its attention group (MLA's latent row is
    replicated over tp; GQA's kv heads are split; dcp stores each token on one of dcp ranks), from the engine's
    own cache layout (inference/kv_cache.py)."""
    from megatron_composer.inference.kv_cache import cache_entries_per_token

    tp = engine.tp
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    if cfg.attention == "gqa" and kv_heads % tp and tp % kv_heads == 0:
        tp = kv_heads  # more ranks than kv heads: each head is replicated, one per rank
    per_layer = sum(math.prod(shape) for shape in cache_entries_per_token(cfg, tp))
    layers = cfg.num_layers + (cfg.num_mtp_layers if engine.mtp else 0)
    return per_layer * layers * engine.kv_bytes / engine.dcp


def rollout_plan(cfg, engine: RolloutEngine, seq_len: int, concurrency: int, gpu_mem_bytes: float,
                 utilization: float = 0.9, params: Optional[list] = None) -> dict:
    """Per-GPU memory of an engine holding `concurrency` sequences of `seq_len` tokens: weights, KV cache and
    what is left of `utilization` x the GPU's memory (the rest is the runtime's: activations, CUDA graphs)."""
    weights = rollout_weight_bytes(cfg, engine, params)
    per_token = rollout_kv_bytes_per_token(cfg, engine)
    seqs_per_group = math.ceil(concurrency / engine.attention_groups)
    kv = seqs_per_group * seq_len * per_token
    budget = utilization * gpu_mem_bytes
    free_for_kv = budget - sum(weights.values())
    max_seqs = max(0, int(free_for_kv // (seq_len * per_token))) * engine.attention_groups if free_for_kv > 0 else 0
    return {"weights": weights, "weight_bytes": sum(weights.values()), "kv_per_token": per_token,
            "seqs_per_group": seqs_per_group, "kv_bytes": kv, "total": sum(weights.values()) + kv,
            "budget": budget, "fits": sum(weights.values()) + kv <= budget, "max_concurrency": max_seqs}


def smallest_rollout_engine(cfg, seq_len: int, concurrency: int, gpu_mem_bytes: float, weights: str = "bf16",
                            kv_bytes: int = 2, utilization: float = 0.9, max_gpus: int = 1024,
                            params: Optional[list] = None) -> Optional[tuple[RolloutEngine, dict]]:
    """The engine with the fewest GPUs (powers of two, experts over all of them) whose GPUs hold the weights and
    `concurrency` sequences of `seq_len` tokens; of its tp choices (1..8) the one with the least memory per GPU."""
    params = params if params is not None else model_params(cfg)
    gpus = 1
    while gpus <= max_gpus:
        fits = []
        for tp in (1, 2, 4, 8):
            if gpus % tp == 0:
                try:
                    engine = RolloutEngine(gpus=gpus, tp=tp, weights=weights, kv_bytes=kv_bytes)
                    plan = rollout_plan(cfg, engine, seq_len, concurrency, gpu_mem_bytes, utilization, params)
                except ValueError:  # e.g. kv heads that do not split over tp
                    continue
                if plan["fits"]:
                    fits.append((plan["total"], tp, engine, plan))
        if fits:
            _, _, engine, plan = min(fits, key=lambda f: (f[0], f[1]))
            return engine, plan
        gpus *= 2
    return None


def rollout_update_plan(cfg, engine: RolloutEngine, *, gpus_per_node: int = 8, delta_ratio: float = 0.03,
                        expert_delta_ratio: Optional[float] = None, link_gbps: float = 400.0,
                        base: str = "host", staging: str = "sparse", params: Optional[list] = None) -> dict:
    """What a node of the engine keeps and moves for weight updates (rl/weight_sync + inference/vllm_engine.py).

    Each GPU runs one engine worker; a worker subscribes to its boxes of every version: the non-expert tensors
    whole (the engine's loaders cut them for tp) and its 1/ep of the routed experts, in the served format (the
    trainer publishes INT4 experts as their packed words and scales). Per version it fetches the compressed XOR
    delta of those boxes, `delta_ratio` of their raw bytes (`expert_delta_ratio` for the experts; default the
    same), and stages it until the engine applies it between two steps:
      staging="sparse": the changed elements' positions (4 bytes) and XOR bits, about the delta ratio of the
        elements (measured: bf16 3.0% compressed for 3.0% changed, INT4 0.15% for 0.15%), plus the compressed
        bytes while they are decoded; staging="dense": the decoded bits of every box.
      base="host": the XOR base is a host copy of the boxes (an engine that repacks what it loads, such as
        vLLM's CPU build, cannot serve as one); base="device": the served bytes on the GPU, the XOR applied
        there (kernels/xor_apply.py), and the host holds only the staging.
    The pause is the node's fetched bytes over `link_gbps` (Gbit/s per node) when nothing was prefetched."""
    if base not in ("host", "device") or staging not in ("sparse", "dense"):
        raise ValueError(f"base={base!r}, staging={staging!r}: use host|device and sparse|dense")
    params = params if params is not None else model_params(cfg)
    boxes = rollout_weight_bytes(cfg, replace(engine, tp=1, dcp=1), params)  # whole non-expert tensors
    experts = boxes["routed experts"]
    other = sum(boxes.values()) - experts
    worker = experts + other
    ratio_e = delta_ratio if expert_delta_ratio is None else expert_delta_ratio
    fetched = other * delta_ratio + experts * ratio_e  # per worker and version
    if staging == "dense":
        staged = worker
    else:  # a 4-byte position per changed element: INT4 experts change in 4-byte words, the rest in 2 bytes
        expert_elem = {"int4": 4, "fp8": 1}.get(engine.weights, 2)
        staged = fetched + other * delta_ratio * (1 + 4 / 2) + experts * ratio_e * (1 + 4 / expert_elem)
    workers = min(gpus_per_node, engine.gpus)
    host = {"base": worker * workers if base == "host" else 0.0, "staging": staged * workers}
    node_fetch = fetched * workers
    return {"worker_bytes": worker, "worker_experts": experts, "worker_other": other, "workers": workers,
            "worker_staging": staged, "host": host, "host_total": sum(host.values()),
            "device_base": worker if base == "device" else 0.0, "fetched_per_version": node_fetch,
            "pause_s": node_fetch * 8 / (link_gbps * 1e9), "delta_ratio": delta_ratio, "expert_delta_ratio": ratio_e}


__all__ += ["rollout_update_plan"]
