"""Continued-pretraining / SFT stage: config schema, data and loss over the training core.

One stage = one run directory. `run_stage(cfg)` builds tokenizer and data, and the model and optimizer
through megatron_composer.training.core.TrainingCore (which also takes each optimizer step), resumes from
run.dir/latest when it exists (otherwise initialises from checkpoint.init_from, e.g. the previous stage's
weights, with a fresh optimizer and schedule), then trains train.steps optimizer steps. Each step consumes
exactly train.global_batch_tokens tokens, split over data-parallel ranks and micro-batches; the loss is
normalised by the token count of the whole global batch, so a step's numbers do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from megatron_composer.config import ConfigError, resolve_function, save_config, to_dict
from megatron_composer.data.pretrain_data import DataConfig, build_pretrain_datasets, collate
from megatron_composer.data.sft import build_sft_datasets
from megatron_composer.data.tokenizer import load_tokenizer
from megatron_composer.model import ModelOutput
from megatron_composer.parallel.data_parallel import DistributedAdamW
from megatron_composer.parallel.slices import reshard
from megatron_composer.training.config import (
    CheckpointConfig,
    FP8Config,
    LoggingConfig,
    ModelSection,
    OptimizerConfig,
    ParallelConfig,
    QATConfig,
    RunConfig,
    checkpoint_meta,
    model_config,
)
from megatron_composer.training.core import (
    TrainingCore,
    initial_weights,
    local_device,
    resume_point,
    starting_checkpoint,
)
from megatron_composer.training.flops import peak_flops, training_flops_per_token
from megatron_composer.training.layout import Layout
from megatron_composer.training.metrics import MetricsLogger, memory_gb
from megatron_composer.training.optim import lr_at
from pretrain.losses import MTPLossConfig, fused_head_applies, pretrain_loss, token_counts


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 1234
    global_batch_tokens: int = field(
        default=4096, metadata={"help": "tokens per optimizer step, over all data-parallel ranks"})
    micro_batch_size: int = field(default=4, metadata={"help": "sequences per forward pass per rank"})
    precision: Literal["auto", "bf16", "fp32"] = field(
        default="auto", metadata={"help": "auto: bf16 autocast on CUDA, fp32 on CPU; master weights are fp32"})
    eval_interval: int = field(
        default=50, metadata={"help": "validation loss every N steps (0: only at start and end)"})
    eval_samples: int = field(default=32, metadata={"help": "validation sequences per evaluation"})
    eval_hooks: list[str] = field(default_factory=list, metadata={
        "help": "probes run at every evaluation, as 'package.module:function' paths called fn(model, tokenizer) -> "
                "{name: number}; logged beside the validation loss (e.g. tools.copy_eval:copy_probe). Every rank "
                "calls them with the same inputs, so layouts that shard a sequence or the vocabulary (tp, cp) "
                "cannot run them"})
    expert_bias_update_rate: float = field(
        default=1e-3,
        metadata={"help": "aux-loss-free balancing: bias step toward uniform expert load (0 disables)"})
    peak_flops: float = field(
        default=0.0, metadata={"help": "per-device peak FLOP/s for MFU; "
                                       "0: datasheet for known GPUs, else measured matmul peak"})
    stop_below: dict[str, float] = field(default_factory=dict, metadata={
        "help": "end the stage early, with a checkpoint, at the first evaluation where every named metric (e.g. "
                "copy_pool_second from an eval hook, or val_loss) is below its value"})
    max_skipped_steps: int = field(default=20, metadata={"help": "abort after this many consecutive non-finite steps"})


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
    qat: QATConfig = field(default_factory=QATConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        self.data.validate()
        self.optim.validate()
        self.mtp.validate()
        self.parallel.validate()
        self.fp8.validate()
        self.qat.validate()
        if self.train.steps < 1:
            raise ConfigError(f"train.steps={self.train.steps} must be >= 1")
        if self.train.global_batch_tokens % self.data.seq_length:
            raise ConfigError(f"train.global_batch_tokens={self.train.global_batch_tokens} "
                              f"is not a multiple of data.seq_length={self.data.seq_length}")
        if self.checkpoint.interval < 1:
            raise ConfigError(f"checkpoint.interval={self.checkpoint.interval} must be >= 1")
        if self.train.eval_hooks and (self.parallel.tp > 1 or self.parallel.cp > 1):
            raise ConfigError("train.eval_hooks run the whole model on every rank's same inputs; with parallel.tp="
                              f"{self.parallel.tp} and parallel.cp={self.parallel.cp} they cannot: set both to 1 or "
                              "drop the hooks")
        for path in self.train.eval_hooks:
            try:
                resolve_function(path)
            except ValueError as e:
                raise ConfigError(f"train.eval_hooks: {e}") from None


def autocast_for(precision: str, device: torch.device):
    """The autocast context of train.precision (bf16, or auto: bf16 on CUDA; otherwise none)."""
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


class Batches:
    """Deterministic micro-batches: step s, data-parallel rank r, micro-batch m read fixed sample indices."""

    def __init__(self, dataset, global_seqs: int, micro_batch_size: int, layout: Layout):
        if global_seqs % (micro_batch_size * layout.dp_size):
            raise ConfigError(
                f"global batch of {global_seqs} sequences is not divisible by "
                f"micro_batch_size ({micro_batch_size}) x data-parallel size "
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
        return [collate([self.dataset[base + m * self.mbs + i] for i in range(self.mbs)])
                for m in range(self.accumulation_steps)]


def build_data(cfg: PretrainConfig, tokenizer, layout: Layout):
    global_seqs = cfg.train.global_batch_tokens // cfg.data.seq_length
    eval_samples = cfg.train.eval_samples
    if cfg.data.kind == "sft":
        train, valid = build_sft_datasets(cfg.data, tokenizer, cfg.train.seed)
    else:
        cache = cfg.data.cache_dir or str(Path(cfg.run.dir) / "data_cache")
        train, valid = build_pretrain_datasets(cfg.data, tokenizer, cfg.train.steps * global_seqs, eval_samples,
                                               cfg.train.seed, cache)
    return Batches(train, global_seqs, cfg.train.micro_batch_size, layout), valid


def forward_stats(model, batch, mtp_cfg, counts, autocast, want_routing, layout):
    """One micro-batch through the model and the pretraining loss: ((loss, stats), model output); the dry run
    measures exactly this step."""
    fused = fused_head_applies(model, mtp_cfg, layout.vocab_group)  # no [tokens, vocab] logits are made
    with autocast:
        out = model(batch["tokens"], batch["position_ids"], mtp=mtp_cfg.weight > 0, return_routing=want_routing,
                    logits=not fused)
        if torch.is_tensor(out):  # the model returns bare logits when nothing else was asked for
            out = ModelOutput(logits=out)
        return pretrain_loss(out, batch, mtp_cfg, counts, layout.shift_left, layout.vocab_group,
                             head_weight=model.output.weight if fused else None), out


@torch.no_grad()
def evaluate(model, valid, cfg: PretrainConfig, layout: Layout, device, autocast, tokenizer=None) -> dict[str, float]:
    """Each of train.eval_hooks, then the validation loss (and MTP metrics) over eval_samples sequences."""
    has_valid = valid is not None and cfg.train.eval_samples > 0
    if not cfg.train.eval_hooks and not has_valid:
        return {}
    model.eval()
    metrics = {}
    with autocast:
        for path in cfg.train.eval_hooks:
            metrics.update({k: float(v) for k, v in resolve_function(path)(model, tokenizer).items()})
    if has_valid:
        metrics.update(_validation_loss(model, valid, cfg, layout, device, autocast))
    reshard(model)  # no backward follows: FSDP's root would stay gathered until the next step's forward
    model.train()
    return metrics


def _validation_loss(model, valid, cfg: PretrainConfig, layout: Layout, device, autocast) -> dict[str, float]:
    idx = list(range(layout.dp_rank, min(cfg.train.eval_samples, len(valid)), layout.dp_size))
    mbs = cfg.train.micro_batch_size
    batches = [collate([valid[i] for i in idx[j: j + mbs]]) for j in range(0, len(idx), mbs)]
    batches = [layout.shard({k: v.to(device) for k, v in b.items()}) for b in batches]
    depths = model.config.num_mtp_layers if cfg.mtp.weight > 0 else 0
    counts = layout.all_reduce_sum(sum((token_counts(b, depths, layout.shift_left) for b in batches),
                                       torch.zeros(1 + depths, device=device)))
    totals: dict[str, torch.Tensor] = {}
    for b in batches:
        (_, stats), _ = forward_stats(model, b, cfg.mtp, counts, autocast, False, layout)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v.float()
    keys = sorted(totals)
    vec = layout.all_reduce_sum(torch.stack([totals[k] for k in keys]) if keys else torch.zeros(0))
    return {f"val_{k.replace('lm_loss', 'loss')}": float(v) for k, v in zip(keys, vec) if k != "aux_loss"}


class Stage:
    """One stage on this rank: its tokenizer, data and loss over the training core (megatron_composer.training)."""

    def __init__(self, cfg: PretrainConfig, init_from: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.layout = layout = Layout(cfg.parallel)
        self.is_main = layout.rank == 0
        self.device = device = local_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.tokenizer = tokenizer = load_tokenizer(cfg.data.tokenizer)
        # the rope scaling of the weights the stage resumes or starts from
        # (megatron_composer.model.args.stage_rope_scaling)
        self.mc = mc = model_config(cfg, tokenizer, weights=starting_checkpoint(self.run_dir, init_from or ""))
        layout.validate(mc, cfg.data.seq_length)
        meta = checkpoint_meta(mc, tokenizer)
        latest = resume_point(self.run_dir, meta)  # before anything in run.dir is touched
        init = initial_weights(init_from, meta) if latest is None else None
        self.batches, self.valid = build_data(cfg, tokenizer, layout)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        self.core = TrainingCore(mc, meta, layout, device, optim=cfg.optim, fp8=cfg.fp8, qat=cfg.qat,
                                 seed=cfg.train.seed,
                                 init=init, max_skipped_steps=cfg.train.max_skipped_steps,
                                 async_save=cfg.checkpoint.async_save)
        self.model = self.core.model
        self.logger = MetricsLogger(self.run_dir, cfg.logging, self.is_main, to_dict(cfg))
        self.start_step = 0
        if latest is not None:
            self.start_step = self.core.load(latest)["step"]
            self.logger.truncate_after(self.start_step)
            if self.is_main:
                print(f"resumed from {latest} at step {self.start_step}")
        self.autocast = autocast_for(cfg.train.precision, device)
        self.depths = mc.num_mtp_layers if cfg.mtp.weight > 0 else 0
        self.want_routing = cfg.train.expert_bias_update_rate > 0 and mc.expert_bias and mc.num_experts > 0

    def describe(self) -> None:
        cfg, layout, optimizer = self.cfg, self.layout, self.core.optimizer
        bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and self.device.type == "cuda")
        train_dtype = torch.bfloat16 if bf16 else torch.float32
        self.flops_per_token = training_flops_per_token(self.mc, cfg.data.seq_length, include_mtp=cfg.mtp.weight > 0)
        self.peak, peak_source = peak_flops(self.device, train_dtype, cfg.train.peak_flops)
        if not self.is_main:
            return
        print(
            f"stage {self.run_dir}: {cfg.train.steps} steps x {cfg.train.global_batch_tokens} tokens, "
            f"seq {cfg.data.seq_length}, "
            f"dp={layout.dp_size} accum={self.batches.accumulation_steps} mbs={cfg.train.micro_batch_size}, "
            f"{self.flops_per_token / 1e6:.1f} MFLOP/token, peak {self.peak / 1e12:.3f} TFLOP/s/device ({peak_source})"
        )
        if isinstance(optimizer, DistributedAdamW):
            replicas = f"dp x cp {layout.groups.size('dp_cp')}, expert-dp {layout.groups.size('edp')}"
            sharding = "ZeRO-1 sharded" if optimizer.zero1 else "replicated"
            print(f"optimizer: AdamW, {sharding} over {replicas} replicas, "
                  f"{optimizer.state_bytes() / 2**20:.1f} MiB of state on rank 0")

    def train_step(self, step: int) -> dict:
        """Optimizer step `step` (0-based) on its fixed micro-batches: the LM + MTP loss over the core's step,
        then aux-loss-free expert balancing when the step was taken."""
        cfg, layout, device = self.cfg, self.layout, self.device
        t0 = time.perf_counter()
        micro = [layout.shard({k: v.to(device) for k, v in b.items()}) for b in self.batches.step(step)]
        counts = layout.all_reduce_sum(sum((token_counts(b, self.depths, layout.shift_left) for b in micro),
                                           torch.zeros(1 + self.depths, device=device)))
        routed = []

        def loss_fn(batch):
            (loss, stats), out = forward_stats(self.model, batch, cfg.mtp, counts, self.autocast, self.want_routing,
                                               layout)
            if self.want_routing:
                routed.append(out.routed_experts.flatten(1, -1))
            return loss, {k.replace("lm_loss", "loss"): v for k, v in stats.items()}

        metrics = self.core.step(loss_fn, micro, lr_at(step, cfg.train.steps, cfg.optim))
        if not metrics["skipped"]:
            update_expert_bias(self.model, torch.cat(routed, dim=1) if routed else None,
                               cfg.train.expert_bias_update_rate, layout)
        dt = time.perf_counter() - t0
        tokens = cfg.train.global_batch_tokens
        metrics.update(
            step_time=dt, tokens_per_s=tokens / dt, mfu=self.flops_per_token * tokens / dt / (self.peak * layout.world),
            memory_gb=memory_gb(), tokens_seen=(step + 1) * tokens,
        )
        return metrics

    def evaluate(self) -> dict[str, float]:
        metrics = evaluate(self.model, self.valid, self.cfg, self.layout, self.device, self.autocast, self.tokenizer)
        self.logger.console_keys = sorted(k for k in metrics if not k.startswith("val_"))  # the probes' numbers
        return metrics

    def stop_reached(self, metrics: dict) -> bool:
        """Every train.stop_below metric of this evaluation is under its threshold, on every rank (one vote)."""
        below = self.cfg.train.stop_below
        reached = bool(below) and all(k in metrics and metrics[k] < v for k, v in below.items())
        if below and self.layout.world > 1:  # every rank stops at the same step
            votes = self.layout.all_reduce_sum(torch.tensor([float(reached)], device=self.device))
            reached = bool(votes.item() == self.layout.groups.size("dp_cp"))
        return reached

    def run(self) -> Path:
        cfg = self.cfg
        self.describe()
        if self.start_step == 0:
            first = self.evaluate()
            unknown = sorted(set(cfg.train.stop_below) - set(first))
            if unknown:  # before any step is spent
                raise ConfigError(f"train.stop_below names {unknown}, which no evaluation reports; it reports "
                                  f"{sorted(first)} (train.eval_hooks add probes)")
            self.logger.log(0, first, console=True)
        self.model.train()
        for step in range(self.start_step, cfg.train.steps):
            metrics = self.train_step(step)
            done = step + 1
            reached = False
            if (cfg.train.eval_interval and done % cfg.train.eval_interval == 0) or done == cfg.train.steps:
                metrics.update(self.evaluate())
                reached = self.stop_reached(metrics)
            console = (done % cfg.logging.interval == 0 or done == cfg.train.steps or metrics["skipped"]
                       or "val_loss" in metrics)
            if reached:
                metrics["stopped_early"] = 1.0
            self.logger.log(done, metrics, console=console)
            if done % cfg.checkpoint.interval == 0 or done == cfg.train.steps or reached:
                state = {"step": done, "consumed_samples": done * self.batches.global_seqs, "lr": metrics["lr"]}
                self.core.save(self.run_dir, done, state, cfg.checkpoint.keep_last)
            if reached:
                if self.is_main:
                    print(f"stopping at step {done}: " + ", ".join(
                        f"{k} {metrics[k]:.4g} < {v:g}" for k, v in cfg.train.stop_below.items()))
                break
        self.core.finish_save()
        self.logger.close()
        return self.run_dir


def run_stage(cfg: PretrainConfig, init_from: str | None = None) -> Path:
    """Train one stage to completion (resuming if run.dir has a checkpoint). Returns run.dir."""
    return Stage(cfg, init_from).run()
