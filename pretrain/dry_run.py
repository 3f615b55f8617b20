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

import time

import torch

from megatron_composer.parallel.fake_world import fake_rank
from megatron_composer.training.dry_run import (
    KINDS,
    DryRunResult,
    HostReads,
    by_kind,
    check_sim_layers,
    extrapolate,
    fsdp_unit_numels,
    measure_peak,
    require_fsdp,
)


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

    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.expert_parallel import assume_balanced_routing
    from megatron_composer.training.core import TrainingCore, finish_gradients
    from megatron_composer.training.layout import Layout
    from megatron_composer.training.optim import OptimizerConfig
    from pretrain.losses import MTPLossConfig, token_counts
    from pretrain.trainer import autocast_for, forward_stats

    require_fsdp(pcfg, world_size)
    t0 = time.perf_counter()
    assumptions = [
        "routing balanced: every expert receives an equal share of the (token, expert) rows",
        "rows are single documents (no packing): device booleans read back as False; the initialisation seed as 0",
        "the step is taken (loss and gradient norm finite)",
        "kernels: the Python paths a GPU takes (MEGATRON_COMPOSER_CPP=0)",
        f"precision {precision} autocast, FP8 recipe off (FP8 GEMMs keep quantised copies: not measured here)",
        "exact tensor bytes: no CUDA allocator rounding or fragmentation, no NCCL or cuBLAS workspaces",
        f"one micro-batch of {micro_batch} sequence(s) per step: with accumulation every gradient shard exists "
        "throughout backward (the planner's --micro-batches counts them)",
    ]
    with fake_rank(world_size, rank):
        layout = Layout(pcfg)
        layout.validate(mc, seq_len)
        device = torch.device("cpu")
        mtp = MTPLossConfig(weight=mtp_weight)
        depths = mc.num_mtp_layers if mtp_weight > 0 else 0
        autocast = autocast_for(precision, device)
        fsdp = bool(getattr(pcfg, "fsdp", False))
        with FakeTensorMode(allow_non_fake_inputs=True), HostReads():
            core = TrainingCore(mc, {}, layout, device, optim=OptimizerConfig(), fp8=FP8Config(), seed=seed)
            if mc.num_experts:
                assume_balanced_routing(core.model)

            def one_step(batch):
                counts = layout.all_reduce_sum(token_counts(batch, depths, layout.shift_left))

                def loss_fn(b):
                    (loss, stats), _ = forward_stats(core.model, b, mtp, counts, autocast, False, layout)
                    return loss, stats

                core.accumulate(loss_fn, [batch])
                finish_gradients(core.model, core.optimizer, 1.0)
                core.optimizer.step()
                core.optimizer.zero_grad()

            short = 2 * pcfg.cp * max(pcfg.tp, 1) * 2  # divides by 2*cp (and by tp for sequence parallelism)
            one_step(_batch(mc, layout, short, micro_batch, device))  # gradients, optimizer state
            units = fsdp_unit_numels(core.model) if fsdp else {}
            batch = _batch(mc, layout, seq_len, micro_batch, device)
            raw = measure_peak(core.model, core.optimizer, fsdp, lambda: one_step(batch))
    return DryRunResult(peak_bytes=raw["Total"], by_kind=by_kind(raw), assumptions=assumptions,
                        seconds=time.perf_counter() - t0, tracker_kinds=raw, units=units)


def simulate_scaled(mc, pcfg, world_size: int, seq_len: int, *, layers: int, **kw) -> DryRunResult:
    """`simulate` of the model with `layers` and `layers + 1` transformer layers (the dense ones first, as in
    the model), extrapolated linearly to its own number: with full recompute a rank's peak is affine in the
    number of identical MoE blocks (their parameters, gradients and optimizer state, and one saved input
    each), so two depths fix it -- when the peak sits in the same place at both depths.
    tests/unit/pretrain/test_dry_run.py checks equal increments at 3, 4 and 5 layers on the tiny preset; for Kimi K2.5
    in EP 8 x CP 8 at 131k and 256k both depths peak in the last layer's attention backward and the increment is the
    estimate's (0.80 GiB at 256k: one layer's shards and saved input), while at 32k the peak moves from the last to the
    second-last layer's MoE backward between 3 and 4 layers (its reduce-scatter buffer outweighs one saved input), and
    the 3->4 and 4->5 increments differ by 55 MB (about 3 GiB over 61 layers). For models whose full simulation takes
    too long here: 3 + 4 layers of Kimi K2.5 take about 75 CPU-seconds at 131k-256k tokens (about 10 s per layer), so
    its 61 layers would take about 10 CPU-minutes."""
    check_sim_layers(mc, layers)
    a = simulate(mc.replace(num_layers=layers), pcfg, world_size, seq_len, **kw)
    b = simulate(mc.replace(num_layers=layers + 1), pcfg, world_size, seq_len, **kw)
    return extrapolate(a, b, mc.num_layers - layers,
                       f"extrapolated linearly from {layers}- and {layers + 1}-layer runs to {mc.num_layers} layers "
                       "(+{per_layer:.3f} GiB per layer; exact when both depths peak in the same block, see "
                       "simulate_scaled)")


__all__ = ["DryRunResult", "KINDS", "fsdp_unit_numels", "simulate", "simulate_scaled"]
