"""The training core: what every trainer rank does whatever it trains (pretraining, SFT, RL).

A `TrainingCore` holds this rank's shard of the model in its parallel layout and the optimizer. It builds
the model (`build_model`: the one place a trainer's model is made), starts it from a Hugging Face model or a
training checkpoint (`initial_weights`), resumes and saves checkpoints, and takes optimizer steps:
`step(loss_fn, micro_batches, lr)` runs forward and backward over the micro-batches (gradients accumulate),
then the one gradient path (`finish_gradients`: reduction over replicas and global-norm clipping), the
non-finite guard, the optimizer step at the given learning rate, and counts skipped steps. The phases supply
only their data and their loss: pretrain.trainer (LM + MTP) and rl.learner (the policy-gradient loss).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_composer.checkpoint.dcp import (
    CheckpointError,
    check_meta,
    find_latest,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from megatron_composer.config import ConfigError
from megatron_composer.fp8 import FP8Config, apply_fp8
from megatron_composer.host_memory import tune_host_allocator
from megatron_composer.parallel.data_parallel import DistributedAdamW
from megatron_composer.parallel.fsdp import finish_fsdp_gradients, is_fsdp
from megatron_composer.parallel.layers import to_empty
from megatron_composer.parallel.slices import fill_local, full_shape, named_tensors
from megatron_composer.training.config import architecture
from megatron_composer.training.layout import Layout
from megatron_composer.training.optim import OptimizerConfig, set_lr
from megatron_composer.training.qat import QATConfig, apply_qat


def local_device() -> torch.device:
    """This process's accelerator (torchrun's LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass(frozen=True)
class InitialWeights:
    """Weights a fresh run starts from, with a fresh optimizer and schedule: a training checkpoint (any layout)
    or a Hugging Face model directory (config.json + safetensors)."""
    checkpoint: Path | None = None
    hf: str | None = None

    def __str__(self) -> str:
        return f"Hugging Face checkpoint {self.hf}" if self.hf is not None else str(self.checkpoint)


def resume_point(run_dir: str | Path, meta: dict) -> Path | None:
    """run_dir's latest checkpoint, checked against `meta` before anything in run_dir is touched; None if fresh."""
    latest = find_latest(run_dir)
    if latest is not None:
        check_meta(latest, meta)
    return latest


def starting_checkpoint(run_dir: str | Path, init_from: str) -> Path | None:
    """The training checkpoint a run's weights come from -- run_dir's latest, else `checkpoint.init_from` when it
    is a training checkpoint -- read before the model config is known, for what the weights carry (their rope
    scaling); None for a fresh run or a Hugging Face start."""
    latest = find_latest(run_dir)
    if latest is not None:
        return latest
    if init_from and not (Path(init_from) / "config.json").is_file():
        return resolve_checkpoint(init_from)
    return None


def initial_weights(init_from: str, meta: dict) -> InitialWeights | None:
    """`checkpoint.init_from` resolved (a run dir or checkpoint, checked against `meta`; or a Hugging Face
    directory, checked tensor by tensor when it loads); None when empty."""
    if not init_from:
        return None
    if (Path(init_from) / "config.json").is_file():
        return InitialWeights(hf=init_from)
    path = resolve_checkpoint(init_from)
    check_meta(path, meta)
    return InitialWeights(checkpoint=path)


def init_reader(model) -> Callable[[str, tuple], torch.Tensor]:
    """read(name, box) for fill_local: the box of a tensor as the one-process model initialises it
    (Transformer.init_rule under the model's init_seed; model/init.py draws only the row blocks it touches)."""
    from megatron_composer.model.init import init_box

    shapes = {name: full_shape(t) for name, t in named_tensors(model)}
    return lambda name, box: init_box(model.init_rule(name), shapes[name], model.init_seed, name, box)


def load_hf_weights(model, path: str) -> None:
    """Fill this rank's pieces of a laid-out model (any layout, FSDP included; allocated, not yet filled) from a
    Hugging Face checkpoint, reading only the slices it holds. The checkpoint's architecture must be the
    configured one; MTP depths the checkpoint lacks (e.g. Qwen3, Kimi K2 exports) get the fresh seeded
    initialisation and are learned by self-distillation; every other weight must be present with the same
    shape (every name and shape checked before any weight is read)."""
    from megatron_composer.checkpoint.hf import HFReader, load_hf_shards

    reader = HFReader(path)
    mine, theirs = architecture(model.config), architecture(reader.config)
    diffs = [f"{k}: checkpoint {theirs.get(k)!r} vs config {mine.get(k)!r}" for k in sorted(mine)
             if k not in ("num_mtp_layers", "rope_scaling") and mine.get(k) != theirs.get(k)]
    if diffs or reader.config.num_mtp_layers > model.config.num_mtp_layers:
        diffs = diffs or [f"num_mtp_layers: checkpoint {reader.config.num_mtp_layers} vs config "
                          f"{model.config.num_mtp_layers}"]
        raise CheckpointError(f"Hugging Face checkpoint '{path}' does not match the configured model "
                              f"({'; '.join(diffs[:3])}); set model.preset / model.overrides to match it")
    load_hf_shards(model, reader, progress=False, init=init_reader(model))


def build_model(mc, layout: Layout, device: torch.device, fp8: FP8Config, *, seed: int,
                init: InitialWeights | None = None, meta: dict | None = None,
                qat: QATConfig | None = None) -> torch.nn.Module:
    """This rank's shard of the model, laid out by `layout`, on `device`, with the FP8 recipe of `fp8` and the
    quantisation-aware training of `qat` (training/qat.py).

    Built on the meta device, laid out there (TP/SP/EP/CP, then FP8, then FSDP when parallel.fsdp), and only
    then allocated: a rank allocates only its own pieces (parallel/slices.py) and fills them, with the `init`
    weights when given (`meta` is the checkpoint meta they are checked against), else with the seeded
    layout-independent initialisation: the assembled model equals torch.manual_seed(seed); Transformer(mc)."""
    from megatron_composer.model import Transformer

    tune_host_allocator()  # every trainer and tool builds its model here: see megatron_composer/host_memory.py
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(mc)  # draws model.init_seed from the seeded generator, allocates nothing
    model = layout.parallelize(model)
    apply_qat(model, qat or QATConfig())
    try:
        # after parallelize: FP8 GEMMs for the replicated linears and the (possibly expert-sharded) grouped
        # experts; before FSDP, which quantises nothing itself: the FP8 layers see the gathered weight
        model = apply_fp8(model, fp8)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model = layout.shard_parameters(model)
    to_empty(model, device)  # keeps the ShardSpecs
    if init is not None and init.hf is not None:
        load_hf_weights(model, init.hf)
    else:
        fill_local(model, init_reader(model))
    model.reset_buffers()
    if init is not None and init.checkpoint is not None:
        load_checkpoint(init.checkpoint, model, None, meta, restore_rng=False, groups=layout.groups)
    return model


def finish_gradients(model: torch.nn.Module, optimizer, max_norm: float) -> torch.Tensor:
    """After the last backward of a step: reduce gradients over replicas, then clip them to the global norm
    max_norm (<= 0: no clipping). Returns the norm before clipping. Without FSDP on several ranks the
    optimizer is a DistributedAdamW, which does both per parameter family; under FSDP the gradients are
    already reduce-scattered and parallel.fsdp.finish_fsdp_gradients adds the tp reduction of tp_partial
    shards and the global norm; one rank has nothing to reduce."""
    max_norm = max_norm if max_norm > 0 else float("inf")
    if isinstance(optimizer, DistributedAdamW):
        optimizer.finish_grad_sync()
        return optimizer.clip_grad_norm(max_norm)
    if is_fsdp(model):
        return finish_fsdp_gradients(model, model._mc_groups, max_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


LossFn = Callable[[object], "tuple[torch.Tensor | None, dict]"]


class TrainingCore:
    """This trainer rank's model shard and optimizer, checkpoints, and the optimizer step (module docstring)."""

    def __init__(self, mc, meta: dict, layout: Layout, device: torch.device, *, optim: OptimizerConfig,
                 fp8: FP8Config, seed: int, init: InitialWeights | None = None, max_skipped_steps: int = 20,
                 async_save: bool = False, qat: QATConfig | None = None):
        self.mc, self.meta, self.layout, self.device = mc, meta, layout, device
        self.async_save, self._async_group, self._pending = async_save, None, None
        self.grad_clip, self.max_skipped_steps = optim.grad_clip, max_skipped_steps
        self.model = build_model(mc, layout, device, fp8, seed=seed, init=init, meta=meta, qat=qat)
        self.optimizer = layout.build_optimizer(self.model, optim)
        self.skipped_in_a_row = 0
        if init is not None and layout.rank == 0:
            print(f"initialised weights from {init} (fresh optimizer and schedule)", flush=True)

    # -- checkpoints and weights ----------------------------------------------------------------------
    def load(self, ckpt: str | Path) -> dict:
        """Collective: resume model, optimizer and RNG from a checkpoint of this run; returns its state."""
        return load_checkpoint(ckpt, self.model, self.optimizer, self.meta, groups=self.layout.groups)

    def save(self, run_dir: str | Path, step: int, state: dict, keep_last: int) -> Path:
        """Collective: every rank's model and optimizer shards; ``state`` (step, phase state) from rank 0.
        With checkpoint.async_save the shards are written in the background (after a host copy) and the
        checkpoint becomes `latest` at the next save or at `finish_save()`, which the trainers call at the end."""
        self.finish_save()
        if not self.async_save:
            return save_checkpoint(run_dir, step, self.model, self.optimizer, state, self.meta, keep_last,
                                   groups=self.layout.groups)
        if self._async_group is None and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")  # the writer thread's own collectives
        self._pending = save_checkpoint(run_dir, step, self.model, self.optimizer, state, self.meta, keep_last,
                                        groups=self.layout.groups, async_save=True, async_group=self._async_group)
        return self._pending.final

    def finish_save(self) -> Path | None:
        """Collective: wait for an asynchronous save in flight and publish it (no-op when there is none)."""
        pending, self._pending = self._pending, None
        return pending.finish() if pending is not None else None

    # -- one optimizer step ---------------------------------------------------------------------------
    def accumulate(self, loss_fn: LossFn, micro_batches: list) -> dict:
        """Forward and backward over the micro-batches (gradients accumulate); returns the summed ``sums``."""
        totals: dict = {}
        for micro in micro_batches:
            loss, sums = loss_fn(micro)
            if loss is not None:
                loss.backward()
            for k, v in sums.items():
                totals[k] = totals.get(k, 0) + (v.float() if torch.is_tensor(v) else v)
        return totals

    def step(self, loss_fn: LossFn, micro_batches: Iterable, lr: float, *, reduce: bool = True) -> dict:
        """One optimizer step at learning rate `lr` over this rank's micro-batches (collective).

        ``loss_fn(micro_batch)`` returns ``(loss, sums)``: the core runs ``loss.backward()`` (gradients
        accumulate over the micro-batches; a loss_fn that runs its own backward returns None) and adds up the
        ``sums``, then sums them over the ranks holding distinct tokens (``reduce=False``: they are already
        step-level metrics over all ranks). A step whose summed ``loss`` or gradient norm is not finite, or
        that had no micro-batch, leaves the weights unchanged; more than max_skipped_steps non-finite steps in
        a row stop the run. Returns the sums with lr, grad_norm and skipped (0 | 1)."""
        set_lr(self.optimizer, lr)
        micro_batches = list(micro_batches)
        totals = self.accumulate(loss_fn, micro_batches)
        if reduce and totals:
            keys = sorted(totals)
            vec = self.layout.all_reduce_sum(torch.stack([totals[k] for k in keys]).detach())
            metrics = {k: float(v) for k, v in zip(keys, vec)}
        else:
            metrics = dict(totals)
        grad_norm = finish_gradients(self.model, self.optimizer, self.grad_clip)
        finite = math.isfinite(metrics.get("loss", 0.0)) and bool(torch.isfinite(grad_norm))
        if finite and micro_batches:
            self.optimizer.step()
        self.optimizer.zero_grad()  # drops the gradients (torch AdamW: set_to_none) and any ZeRO-1 gradient shards
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        if self.skipped_in_a_row > self.max_skipped_steps:
            raise RuntimeError(f"{self.skipped_in_a_row} consecutive steps had non-finite loss/gradients; lower "
                               "optim.lr or check the data")
        metrics.update(lr=lr, grad_norm=float(grad_norm), skipped=0 if finite else 1)
        return metrics


__all__ = ["InitialWeights", "TrainingCore", "build_model", "finish_gradients", "init_reader",
           "initial_weights", "load_hf_weights", "local_device", "resume_point", "starting_checkpoint"]
