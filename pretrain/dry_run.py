"""Dry run of one pretraining step at full size on one CPU: one rank of a world of N, measured, not estimated.

`simulate(...)` joins torch's fake process group (backend "fake": every collective returns at once) as one
rank of `world_size`, builds the model through the training core (megatron_composer.training.core:
TrainingCore -> build_model -> the layout's parallelisation, exactly what a trainer rank builds) under
FakeTensorMode, so every tensor has its real shape and dtype and none holds memory, and runs one optimizer step
(forward and backward of one micro-batch of the LM + MTP loss, the gradient reduction and clipping, the
optimizer step) under torch's memory tracker (torch.distributed._tools.MemTracker, or FSDPMemTracker when the
layout shards parameters with FSDP). It returns the rank's peak bytes by kind (parameters, gradients,
optimizer state, activations, temporaries) and the assumptions the run had to make, because a tensor without
values cannot decide anything that depends on data:

- routing is balanced (AllToAllDispatcher.balanced_routing: each expert receives an equal share of the rows);
- host reads of device booleans answer False: rows are single documents (no packing), which is how
  `document_ids` decides; a lone integer (the initialisation seed) reads 0; any other read of a device value
  stops the run with its name;
- the step is taken (loss and gradient norm finite: the core's guard reads them, here nothing is read);
- the Python paths of the kernels run (MEGATRON_COMPOSER_CPP=0), which are the ones a GPU takes; a CPU-only
  C++ kernel (attention without context parallelism, RMSNorm, RoPE, grouped experts) is not what a GPU runs;
- a first step on a short sequence creates the gradients and the optimizer state before the measured step,
  so the measured step is a steady-state one.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from megatron_composer.config import ConfigError

KINDS = ("params", "grads", "optimizer", "activations", "temporaries")


@dataclass
class DryRunResult:
    peak_bytes: int  # total at the rank's peak
    by_kind: dict[str, int]  # KINDS (+ "other") at that moment
    assumptions: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tracker_kinds: dict[str, int] = field(default_factory=dict)  # the tracker's own categories at the peak
    units: dict[str, tuple[int, int]] = field(default_factory=dict)  # fsdp_unit_numels of the built model


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Answers host reads of device values, which fake tensors do not have: booleans read False, a lone integer
    (a 0-dim tensor of its own, e.g. the initialisation seed) reads 0 (see the module docstring); anything else,
    an element of a larger tensor included, is an error naming the read."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            t = args[0]
            if t.dtype == torch.bool:
                return False
            if not t.is_floating_point() and t.untyped_storage().nbytes() == t.element_size():
                return 0  # a lone integer (the model's initialisation seed), not an element of a tensor
            raise RuntimeError(f"the dry run cannot read a {args[0].dtype} value from a device tensor (it has no "
                               "values); the code path needs a balanced/assumed value there")
        return func(*args, **(kwargs or {}))


def _peak_tracker(fsdp: bool):
    """torch's tracker, keeping only the rank's overall peak: its per-module peaks cost a pass over every module
    at every op, minutes for a 61-layer model, and are not reported here."""
    from torch.distributed._tools import FSDPMemTracker, MemTracker

    base = FSDPMemTracker if fsdp else MemTracker

    class PeakTracker(base):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        if fsdp:
            def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
                tracked = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

                def run(*args, **kwargs):
                    group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                    if group is not None and not all(hasattr(p, "_unsharded_param") for p in group.fsdp_params):
                        return orig(*args, **kwargs)  # a unit that never ran (an untrained MTP depth): nothing to attribute
                    return tracked(*args, **kwargs)

                return run

    return PeakTracker


# the tracker's categories (MemTracker and FSDPMemTracker) -> the planner's kinds
_KIND_OF = {
    "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "unsharded_params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "unsharded_grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "All Gather": "unsharded_params", "Reduce Scatter": "unsharded_grads",
    "Buffer": "params",
}


def _batch(mc, layout, seq_len: int, micro_batch: int, device) -> dict[str, torch.Tensor]:
    full = {"tokens": torch.randint(0, mc.vocab_size, (micro_batch, seq_len), device=device),
            "labels": torch.randint(0, mc.vocab_size, (micro_batch, seq_len), device=device),
            "loss_mask": torch.ones(micro_batch, seq_len, device=device),
            "position_ids": torch.arange(seq_len, device=device).expand(micro_batch, seq_len).contiguous()}
    return layout.shard(full)


def simulate(mc, pcfg, world_size: int, seq_len: int, *, micro_batch: int = 1, mtp_weight: float = 0.2,
             precision: str = "bf16", rank: int = 0, seed: int = 0) -> DryRunResult:
    """Measured peak memory of `rank` in one training step of `mc` laid out by `pcfg` over `world_size` ranks
    (module docstring). Raises ConfigError (one line) for a layout that does not divide."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.expert_parallel import assume_balanced_routing
    from megatron_composer.training.core import TrainingCore, finish_gradients
    from megatron_composer.training.layout import Layout
    from megatron_composer.training.optim import OptimizerConfig
    from pretrain.losses import MTPLossConfig, token_counts
    from pretrain.trainer import _autocast, _forward_stats

    if dist.is_initialized():
        raise RuntimeError("simulate() runs its own fake process group; call it outside torch.distributed")
    if not getattr(pcfg, "fsdp", False) and world_size > 1:
        # build_model materialises plain (non-DTensor) meta parameters with Module.to_empty, whose tensor swap
        # FakeTensorMode refuses (it holds a weak reference to every tensor it converts)
        raise ConfigError("the dry run simulates FSDP layouts; set parallel.fsdp=true (planner: --fsdp)")
    t0 = time.perf_counter()
    assumptions = [
        "routing balanced: every expert receives an equal share of the (token, expert) rows",
        "rows are single documents (no packing): device booleans read back as False; the initialisation seed as 0",
        "the step is taken (loss and gradient norm finite)",
        "kernels: the Python paths a GPU takes (MEGATRON_COMPOSER_CPP=0)",
        "the RL learner's loss is the pretraining LM + MTP loss here (same model, layout and optimizer)",
        f"precision {precision} autocast, FP8 recipe off (FP8 GEMMs keep quantised copies: not measured here)",
        "exact tensor bytes: no CUDA allocator rounding or fragmentation, no NCCL or cuBLAS workspaces",
        f"one micro-batch of {micro_batch} sequence(s) per step: with accumulation every gradient shard exists "
        "throughout backward (the planner's --micro-batches counts them)",
    ]
    old_cpp = os.environ.get("MEGATRON_COMPOSER_CPP")
    os.environ["MEGATRON_COMPOSER_CPP"] = "0"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        layout = Layout(pcfg)
        layout.validate(mc, seq_len)
        device = torch.device("cpu")
        mtp = MTPLossConfig(weight=mtp_weight)
        depths = mc.num_mtp_layers if mtp_weight > 0 else 0
        autocast = _autocast(precision, device)
        fsdp = bool(getattr(pcfg, "fsdp", False))
        with FakeTensorMode(allow_non_fake_inputs=True), _ScalarReads():
            core = TrainingCore(mc, {}, layout, device, optim=OptimizerConfig(), fp8=FP8Config(), seed=seed)
            if mc.num_experts:
                assume_balanced_routing(core.model)

            def one_step(batch):
                counts = layout.all_reduce_sum(token_counts(batch, depths, layout.shift_left))

                def loss_fn(b):
                    (loss, stats), _ = _forward_stats(core.model, b, mtp, counts, autocast, False, layout)
                    return loss, stats

                core.accumulate(loss_fn, [batch])
                finish_gradients(core.model, core.optimizer, 1.0)
                core.optimizer.step()
                core.optimizer.zero_grad()

            short = 2 * pcfg.cp * max(pcfg.tp, 1) * 2  # divides by 2*cp (and by tp for sequence parallelism)
            one_step(_batch(mc, layout, short, micro_batch, device))  # gradients, optimizer state
            units = fsdp_unit_numels(core.model) if fsdp else {}
            tracker = _peak_tracker(fsdp)(*((core.model, core.optimizer) if fsdp else ()))
            externals = [core.model]
            if isinstance(core.optimizer, torch.optim.Optimizer):
                externals.append(core.optimizer)
            else:  # DistributedAdamW: its shards are tracked as externals ("Other") and reported as optimizer
                externals += _distributed_adamw_state(core.optimizer)
            tracker.track_external(*externals)
            batch = _batch(mc, layout, seq_len, micro_batch, device)
            with tracker:
                one_step(batch)
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        dist.destroy_process_group()
        if old_cpp is None:
            os.environ.pop("MEGATRON_COMPOSER_CPP", None)
        else:
            os.environ["MEGATRON_COMPOSER_CPP"] = old_cpp
    raw = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    by_kind = dict.fromkeys(KINDS, 0)
    for k, v in raw.items():
        if k == "Total":
            continue
        kind = _KIND_OF.get(k, "optimizer" if k == "Other" else "other")
        by_kind[kind] = by_kind.get(kind, 0) + v
    return DryRunResult(peak_bytes=raw["Total"], by_kind=by_kind, assumptions=assumptions,
                        seconds=time.perf_counter() - t0, tracker_kinds=raw, units=units)


def simulate_scaled(mc, pcfg, world_size: int, seq_len: int, *, layers: int, **kw) -> DryRunResult:
    """`simulate` of the model with `layers` and `layers + 1` transformer layers (the dense ones first, as in
    the model), extrapolated linearly to its own number: with full recompute a rank's peak is affine in the
    number of identical MoE blocks (their parameters, gradients and optimizer state, and one saved input
    each), so two depths fix it -- when the peak sits in the same place at both depths. tests/test_dry_run.py
    checks equal increments at 3, 4 and 5 layers on the tiny preset; for Kimi K2.5 in EP 8 x CP 8 at 131k and
    256k both depths peak in the last layer's attention backward and the increment is the estimate's (0.80 GiB
    at 256k: one layer's shards and saved input), while at 32k the peak moves from the last to the second-last
    layer's MoE backward between 3 and 4 layers (its reduce-scatter buffer outweighs one saved input), and the
    3->4 and 4->5 increments differ by 55 MB (about 3 GiB over 61 layers). For
    models whose full simulation takes too long here: 3 + 4 layers of Kimi K2.5 take about 75 CPU-seconds at
    131k-256k tokens (about 10 s per layer), so its 61 layers would take about 10 CPU-minutes."""
    # both depths need two MoE blocks: the peak (inside the last block's backward, the one before it prefetched)
    # then has the same shape in both, and their difference is one more block's state and saved input only
    if not mc.first_k_dense_replace + 2 <= layers < mc.num_layers:
        raise ConfigError(f"--sim-layers {layers} must be at least the {mc.first_k_dense_replace} dense layers + 2 "
                          f"and below the model's {mc.num_layers} layers")
    a = simulate(mc.replace(num_layers=layers), pcfg, world_size, seq_len, **kw)
    b = simulate(mc.replace(num_layers=layers + 1), pcfg, world_size, seq_len, **kw)
    n = mc.num_layers - layers

    def ext(x, y):
        return int(x + n * (y - x))

    kinds = sorted(set(a.by_kind) | set(b.by_kind))
    return DryRunResult(
        peak_bytes=ext(a.peak_bytes, b.peak_bytes),
        by_kind={k: ext(a.by_kind.get(k, 0), b.by_kind.get(k, 0)) for k in kinds},
        assumptions=a.assumptions + [f"extrapolated linearly from {layers}- and {layers + 1}-layer runs to "
                                     f"{mc.num_layers} layers (+{(b.peak_bytes - a.peak_bytes) / 2**30:.3f} GiB per "
                                     "layer; exact when both depths peak in the same block, see simulate_scaled)"],
        seconds=a.seconds + b.seconds,
        tracker_kinds={k: ext(a.tracker_kinds.get(k, 0), b.tracker_kinds.get(k, 0)) for k in a.tracker_kinds})


def fsdp_unit_numels(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """The FSDP units the built model really has (parallel/fsdp.py:apply_fsdp), named as the planner's
    megatron_composer.parallel.cost.fsdp_units names them -> (dense, routed-expert) elements of this rank's
    tp/ep-local tensors before FSDP sharding. A block's routed-experts unit is counted with its block, as the
    planner counts it; the model's own unit is "root"."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, list[int]] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        experts = name.endswith(".feed_forward.experts")
        unit = name.removesuffix(".feed_forward.experts") if experts else (name or "root")
        n = sum(math.prod(fp._orig_size) for fp in group.fsdp_params)
        out.setdefault(unit, [0, 0])[1 if experts else 0] += n
    return {k: (v[0], v[1]) for k, v in out.items()}


def _distributed_adamw_state(opt) -> list[torch.Tensor]:
    out = []
    for _, b in opt._all_buckets():
        out += [t for t in (b.exp_avg, b.exp_avg_sq, b.master) if t is not None]
    return out


__all__ = ["DryRunResult", "KINDS", "fsdp_unit_numels", "simulate", "simulate_scaled"]
