"""Continued-pretraining / SFT stage: config schema and the training loop.

One stage = one run directory. `run_stage(cfg)` builds tokenizer, data, model and optimizer, resumes from
run.dir/latest when it exists (otherwise initialises from checkpoint.init_from, e.g. the previous stage's
weights, with a fresh optimizer and schedule), then trains train.steps optimizer steps. Each step consumes
exactly train.global_batch_tokens tokens, split over data-parallel ranks and micro-batches; the loss is
normalised by the token count of the whole global batch, so a step's numbers do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from megatron_composer.checkpoint.dcp import CheckpointError, find_latest, load_checkpoint, resolve_checkpoint, save_checkpoint, saved_architecture
from megatron_composer.config import ConfigError, save_config, to_dict
from megatron_composer.data.pretrain_data import DataConfig, build_pretrain_datasets, collate
from megatron_composer.data.sft import build_sft_datasets
from megatron_composer.data.tokenizer import load_tokenizer
from megatron_composer.fp8 import FP8Config, apply_fp8
from megatron_composer.model import ModelOutput
from megatron_composer.parallel.data_parallel import DistributedAdamW
from megatron_composer.parallel.dims import ParallelConfig
from megatron_composer.training.flops import peak_flops, training_flops_per_token
from megatron_composer.training.metrics import LoggingConfig, MetricsLogger, memory_gb
from megatron_composer.training.optim import OptimizerConfig, lr_at, set_lr
from pretrain.layout import Layout
from pretrain.losses import MTPLossConfig, fused_head_applies, pretrain_loss, token_counts


@dataclass
class RunConfig:
    dir: str = field(default="runs/default", metadata={"help": "outputs; running again with the same dir resumes from its latest checkpoint"})


@dataclass
class ModelSection:
    preset: str = field(default="tiny-deepseek-v3", metadata={"help": "megatron_composer.model preset name"})
    vocab_size: int = field(default=0, metadata={"help": "0: the tokenizer's vocab size rounded up to a multiple of 64"})
    yarn_original_length: int = field(default=0, metadata={"help": ">0 turns on YaRN with factor data.seq_length / this (the previous stage's context)"})
    overrides: dict = field(default_factory=dict, metadata={"help": "any ModelConfig field, e.g. {num_layers: 2}"})


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 1234
    global_batch_tokens: int = field(default=4096, metadata={"help": "tokens per optimizer step, over all data-parallel ranks"})
    micro_batch_size: int = field(default=4, metadata={"help": "sequences per forward pass per rank"})
    precision: Literal["auto", "bf16", "fp32"] = field(default="auto", metadata={"help": "auto: bf16 autocast on CUDA, fp32 on CPU; master weights are fp32"})
    eval_interval: int = field(default=50, metadata={"help": "validation loss every N steps (0: only at start and end)"})
    eval_samples: int = field(default=32, metadata={"help": "validation sequences per evaluation"})
    expert_bias_update_rate: float = field(default=1e-3, metadata={"help": "aux-loss-free balancing: bias step toward uniform expert load (0 disables)"})
    peak_flops: float = field(default=0.0, metadata={"help": "per-device peak FLOP/s for MFU; 0: datasheet for known GPUs, else measured matmul peak"})
    max_skipped_steps: int = field(default=20, metadata={"help": "abort after this many consecutive non-finite steps"})


@dataclass
class CheckpointConfig:
    interval: int = field(default=100, metadata={"help": "save every N steps (and at the end)"})
    keep_last: int = field(default=3, metadata={"help": "checkpoints kept (0 keeps all)"})
    init_from: str = field(default="", metadata={"help": "fresh runs load model weights from this run dir or checkpoint; 'previous' = the previous stage of a chain"})


@dataclass
class PretrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    mtp: MTPLossConfig = field(default_factory=MTPLossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        self.data.validate()
        self.optim.validate()
        self.mtp.validate()
        self.parallel.validate()
        self.fp8.validate()
        if self.train.steps < 1:
            raise ConfigError(f"train.steps={self.train.steps} must be >= 1")
        if self.train.global_batch_tokens % self.data.seq_length:
            raise ConfigError(f"train.global_batch_tokens={self.train.global_batch_tokens} is not a multiple of data.seq_length={self.data.seq_length}")
        if self.checkpoint.interval < 1:
            raise ConfigError(f"checkpoint.interval={self.checkpoint.interval} must be >= 1")


# Fields that do not change parameter shapes: a stage may change them and still load the previous weights.
# rope_scaling is architecture: what the weights learned (checked on load, inherited by later stages).
_NON_ARCH_FIELDS = {"max_position_embeddings", "init_std", "aux_loss_coef", "rope_theta", "routed_scaling_factor"}


def model_config(cfg: PretrainConfig, tokenizer, weights=None):
    """The stage's ModelConfig; ``weights`` (a checkpoint directory the stage resumes or starts from) gives
    the rope scaling it inherits (megatron_composer.model.args.stage_rope_scaling)."""
    from megatron_composer.model import ModelConfig, RopeScaling, get_preset

    mc = get_preset(cfg.model.preset)
    overrides = dict(cfg.model.overrides)
    if isinstance(overrides.get("rope_scaling"), dict):
        overrides["rope_scaling"] = RopeScaling(**overrides["rope_scaling"])
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"model.overrides has unknown ModelConfig field(s) {sorted(unknown)}")
    vocab = cfg.model.vocab_size or -(-tokenizer.vocab_size // 64) * 64
    mc = dataclasses.replace(mc, vocab_size=vocab, **overrides)
    if cfg.model.yarn_original_length:
        old = cfg.model.yarn_original_length
        base = mc.rope_scaling or RopeScaling()
        mc = dataclasses.replace(
            mc,
            rope_scaling=dataclasses.replace(base, factor=cfg.data.seq_length / old, original_max_position_embeddings=old),
            max_position_embeddings=max(mc.max_position_embeddings, cfg.data.seq_length),
        )
    saved = saved_architecture(weights) if weights is not None else None
    if saved is not None and "rope_scaling" in saved:
        from megatron_composer.model.args import stage_rope_scaling

        rope = RopeScaling(**saved["rope_scaling"]) if saved["rope_scaling"] else None
        mc = dataclasses.replace(mc, rope_scaling=stage_rope_scaling(mc.rope_scaling, cfg.data.seq_length, rope))
    tokenizer.check_fits_model(mc.vocab_size)
    return mc.validate()


def architecture(mc) -> dict:
    return {k: v for k, v in to_dict(mc).items() if k not in _NON_ARCH_FIELDS}


def _autocast(precision: str, device: torch.device):
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def update_expert_bias(model, routed_experts: torch.Tensor | None, rate: float, layout: Layout) -> None:
    """DeepSeek-V3 aux-loss-free balancing: raise the selection bias of under-loaded experts, lower over-loaded."""
    if routed_experts is None or rate <= 0:
        return
    layers = model.moe_layers
    E = model.config.num_experts
    load = torch.stack([torch.bincount(routed_experts[i].flatten(), minlength=E) for i in range(len(layers))]).float()
    layout.all_reduce_sum(load)
    for layer, load_E in zip(layers, load):
        bias = getattr(layer.feed_forward.router, "e_score_correction_bias", None)
        if bias is not None:
            bias.add_(rate * torch.sign(load_E.mean() - load_E))


def load_hf_weights(model, path: str) -> None:
    """Copy a Hugging Face checkpoint's weights into the full (not yet parallelised) model. MTP depths the
    checkpoint lacks (e.g. Qwen3, Kimi K2 exports) keep their fresh initialisation and are learned by
    self-distillation; every other weight must be present with the same shape."""
    from megatron_composer.checkpoint.hf import load_hf_checkpoint

    hf = load_hf_checkpoint(path)
    mine, theirs = architecture(model.config), architecture(hf.config)
    diffs = [f"{k}: checkpoint {theirs.get(k)!r} vs config {mine.get(k)!r}" for k in sorted(mine) if k not in ("num_mtp_layers", "rope_scaling") and mine.get(k) != theirs.get(k)]
    if diffs or hf.config.num_mtp_layers > model.config.num_mtp_layers:
        diffs = diffs or [f"num_mtp_layers: checkpoint {hf.config.num_mtp_layers} vs config {model.config.num_mtp_layers}"]
        raise CheckpointError(f"Hugging Face checkpoint '{path}' does not match the configured model ({'; '.join(diffs[:3])}); set model.preset / model.overrides to match it")
    result = model.load_state_dict(hf.state_dict(), strict=False)
    hf_mtp_layers = hf.config.num_mtp_layers
    fresh_mtp = lambda k: k.startswith("mtp.") and int(k.split(".")[1]) >= hf_mtp_layers  # noqa: E731
    missing = [k for k in result.missing_keys if not fresh_mtp(k)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"Hugging Face checkpoint '{path}' lacks {missing[:3]} / has unexpected {result.unexpected_keys[:3]}")
    del hf


class Batches:
    """Deterministic micro-batches: step s, data-parallel rank r, micro-batch m read fixed sample indices."""

    def __init__(self, dataset, global_seqs: int, micro_batch_size: int, layout: Layout):
        if global_seqs % (micro_batch_size * layout.dp_size):
            raise ConfigError(
                f"global batch of {global_seqs} sequences is not divisible by micro_batch_size ({micro_batch_size}) x data-parallel size "
                f"({layout.dp_size}); change train.global_batch_tokens or train.micro_batch_size"
            )
        self.dataset = dataset
        self.global_seqs = global_seqs
        self.mbs = micro_batch_size
        self.per_rank = global_seqs // layout.dp_size
        self.rank_offset = layout.dp_rank * self.per_rank

    @property
    def accumulation_steps(self) -> int:
        return self.per_rank // self.mbs

    def step(self, step: int) -> list[dict[str, torch.Tensor]]:
        base = step * self.global_seqs + self.rank_offset
        return [collate([self.dataset[base + m * self.mbs + i] for i in range(self.mbs)]) for m in range(self.accumulation_steps)]


def build_data(cfg: PretrainConfig, tokenizer, layout: Layout):
    global_seqs = cfg.train.global_batch_tokens // cfg.data.seq_length
    eval_samples = cfg.train.eval_samples
    if cfg.data.kind == "sft":
        train, valid = build_sft_datasets(cfg.data, tokenizer, cfg.train.seed)
    else:
        cache = cfg.data.cache_dir or str(Path(cfg.run.dir) / "data_cache")
        train, valid = build_pretrain_datasets(cfg.data, tokenizer, cfg.train.steps * global_seqs, eval_samples, cfg.train.seed, cache)
    return Batches(train, global_seqs, cfg.train.micro_batch_size, layout), valid


def _forward_stats(model, batch, mtp_cfg, counts, autocast, want_routing, layout):
    fused = fused_head_applies(model, mtp_cfg, layout.vocab_group)  # no [tokens, vocab] logits are made
    with autocast:
        out = model(batch["tokens"], batch["position_ids"], mtp=mtp_cfg.weight > 0, return_routing=want_routing, logits=not fused)
        if torch.is_tensor(out):  # the model returns bare logits when nothing else was asked for
            out = ModelOutput(logits=out)
        return pretrain_loss(out, batch, mtp_cfg, counts, layout.shift_left, layout.vocab_group,
                             head_weight=model.output.weight if fused else None), out


@torch.no_grad()
def evaluate(model, valid, cfg: PretrainConfig, layout: Layout, device, autocast) -> dict[str, float]:
    if valid is None or cfg.train.eval_samples == 0:
        return {}
    model.eval()
    idx = list(range(layout.dp_rank, min(cfg.train.eval_samples, len(valid)), layout.dp_size))
    batches = [collate([valid[i] for i in idx[j: j + cfg.train.micro_batch_size]]) for j in range(0, len(idx), cfg.train.micro_batch_size)]
    batches = [layout.shard({k: v.to(device) for k, v in b.items()}) for b in batches]
    depths = model.config.num_mtp_layers if cfg.mtp.weight > 0 else 0
    counts = layout.all_reduce_sum(sum((token_counts(b, depths, layout.shift_left) for b in batches), torch.zeros(1 + depths, device=device)))
    totals: dict[str, torch.Tensor] = {}
    for b in batches:
        (_, stats), _ = _forward_stats(model, b, cfg.mtp, counts, autocast, False, layout)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v.float()
    keys = sorted(totals)
    vec = layout.all_reduce_sum(torch.stack([totals[k] for k in keys]) if keys else torch.zeros(0))
    model.train()
    return {f"val_{k.replace('lm_loss', 'loss')}": float(v) for k, v in zip(keys, vec) if k != "aux_loss"}


def run_stage(cfg: PretrainConfig, init_from: str | None = None) -> Path:
    """Train one stage to completion (resuming if run.dir has a checkpoint). Returns run.dir."""
    run_dir = Path(cfg.run.dir)
    layout = Layout(cfg.parallel)
    is_main = layout.rank == 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    latest = find_latest(run_dir)
    init_path = hf_init = None
    if latest is None and init_from:
        if (Path(init_from) / "config.json").is_file():
            hf_init = init_from  # a Hugging Face base model (config.json + safetensors)
        else:
            init_path = resolve_checkpoint(init_from)
    mc = model_config(cfg, tokenizer, weights=latest or init_path)  # the rope of the weights it starts from
    layout.validate(mc, cfg.data.seq_length)
    meta = {"model": architecture(mc), "tokenizer": tokenizer.describe()}
    from megatron_composer.checkpoint.dcp import check_meta

    for ckpt in (latest, init_path):
        if ckpt is not None:
            check_meta(ckpt, meta)  # before anything in run.dir is touched

    batches, valid = build_data(cfg, tokenizer, layout)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    from megatron_composer.model import Transformer

    torch.manual_seed(cfg.train.seed)
    model = Transformer(mc)
    if hf_init is not None:
        load_hf_weights(model, hf_init)
        if is_main:
            print(f"initialised weights from Hugging Face checkpoint {hf_init} (fresh optimizer and schedule)")
    model = layout.parallelize(model).to(device)  # shard on the host: a device holds only its shard
    try:
        # after parallelize: FP8 GEMMs for the replicated linears and the (possibly expert-sharded) grouped experts
        model = apply_fp8(model, cfg.fp8)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    optimizer = layout.build_optimizer(model, cfg.optim)
    distributed_optimizer = isinstance(optimizer, DistributedAdamW)
    logger = MetricsLogger(run_dir, cfg.logging, is_main, to_dict(cfg))

    start_step = 0
    if latest is not None:
        state = load_checkpoint(latest, model, optimizer, meta, groups=layout.groups)
        start_step = state["step"]
        logger.truncate_after(start_step)
        if is_main:
            print(f"resumed from {latest} at step {start_step}")
    elif init_path is not None:
        load_checkpoint(init_path, model, None, meta, restore_rng=False, groups=layout.groups)
        if is_main:
            print(f"initialised weights from {init_path} (fresh optimizer and schedule)")

    autocast = _autocast(cfg.train.precision, device)
    train_dtype = torch.bfloat16 if cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda") else torch.float32
    flops_per_token = training_flops_per_token(mc, cfg.data.seq_length, include_mtp=cfg.mtp.weight > 0)
    peak, peak_source = peak_flops(device, train_dtype, cfg.train.peak_flops)
    depths = mc.num_mtp_layers if cfg.mtp.weight > 0 else 0
    want_routing = cfg.train.expert_bias_update_rate > 0 and mc.expert_bias and mc.num_experts > 0
    if is_main:
        print(
            f"stage {run_dir}: {cfg.train.steps} steps x {cfg.train.global_batch_tokens} tokens, seq {cfg.data.seq_length}, "
            f"dp={layout.dp_size} accum={batches.accumulation_steps} mbs={cfg.train.micro_batch_size}, "
            f"{flops_per_token / 1e6:.1f} MFLOP/token, peak {peak / 1e12:.3f} TFLOP/s/device ({peak_source})"
        )
        if distributed_optimizer:
            replicas = f"dp x cp {layout.groups.size('dp_cp')}, expert-dp {layout.groups.size('edp')}"
            sharding = "ZeRO-1 sharded" if optimizer.zero1 else "replicated"
            print(f"optimizer: AdamW, {sharding} over {replicas} replicas, {optimizer.state_bytes() / 2**20:.1f} MiB of state on rank 0")

    if start_step == 0:
        logger.log(0, evaluate(model, valid, cfg, layout, device, autocast), console=True)

    skipped_in_a_row = 0
    model.train()
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.train.steps, cfg.optim)
        set_lr(optimizer, lr)
        micro = [layout.shard({k: v.to(device) for k, v in b.items()}) for b in batches.step(step)]
        counts = layout.all_reduce_sum(sum((token_counts(b, depths, layout.shift_left) for b in micro), torch.zeros(1 + depths, device=device)))
        totals: dict[str, torch.Tensor] = {}
        routed = []
        for b in micro:
            (loss, stats), out = _forward_stats(model, b, cfg.mtp, counts, autocast, want_routing, layout)
            loss.backward()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0) + v.float()
            if want_routing:
                routed.append(out.routed_experts.flatten(1, -1))
        grad_norm = layout.finish_gradients(model, optimizer, cfg.optim.grad_clip)
        keys = sorted(totals)
        vec = layout.all_reduce_sum(torch.stack([totals[k] for k in keys]).detach())
        metrics = {k.replace("lm_loss", "loss"): float(v) for k, v in zip(keys, vec)}
        finite = math.isfinite(metrics["loss"]) and bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
            update_expert_bias(model, torch.cat(routed, dim=1) if routed else None, cfg.train.expert_bias_update_rate, layout)
            skipped_in_a_row = 0
        else:
            skipped_in_a_row += 1
            if skipped_in_a_row > cfg.train.max_skipped_steps:
                raise RuntimeError(f"{skipped_in_a_row} consecutive steps had non-finite loss/gradients; lower optim.lr or check the data")
        optimizer.zero_grad()  # drops the gradients (torch AdamW: set_to_none) and any ZeRO-1 gradient shards
        dt = time.perf_counter() - t0
        tokens = cfg.train.global_batch_tokens
        metrics.update(
            lr=lr, grad_norm=float(grad_norm), skipped=0 if finite else 1, step_time=dt, tokens_per_s=tokens / dt,
            mfu=flops_per_token * tokens / dt / (peak * layout.world), memory_gb=memory_gb(), tokens_seen=(step + 1) * tokens,
        )
        done = step + 1
        if (cfg.train.eval_interval and done % cfg.train.eval_interval == 0) or done == cfg.train.steps:
            metrics.update(evaluate(model, valid, cfg, layout, device, autocast))
        console = done % cfg.logging.interval == 0 or done == cfg.train.steps or not finite or "val_loss" in metrics
        logger.log(done, metrics, console=console)
        if done % cfg.checkpoint.interval == 0 or done == cfg.train.steps:
            save_checkpoint(run_dir, done, model, optimizer, {"step": done, "consumed_samples": done * batches.global_seqs, "lr": lr}, meta, cfg.checkpoint.keep_last, groups=layout.groups)
    logger.close()
    return run_dir
