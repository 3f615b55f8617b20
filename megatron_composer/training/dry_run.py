"""What the dry runs of a training step share (pretrain/dry_run.py for a pretraining step, rl/dry_run.py for an
RL trainer step): one rank of a world of N on torch's fake process group (backend "fake": every collective
returns at once) and FakeTensorMode (every tensor has its real shape and dtype, none holds memory), measured by
torch's memory tracker (torch.distributed._tools.MemTracker, or FSDPMemTracker when the layout shards
parameters with FSDP), and the rank's peak bytes by kind.

A tensor without values cannot decide anything that depends on data; `HostReads` answers the host reads a
step makes of device values, and each phase's dry run lists what its answers assume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

from megatron_composer.config import ConfigError

KINDS = ("params", "grads", "optimizer", "activations", "temporaries")


@dataclass
class DryRunResult:
    peak_bytes: int  # total at the rank's peak
    by_kind: dict[str, int]  # KINDS (+ "other", "reference") at that moment
    assumptions: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tracker_kinds: dict[str, int] = field(default_factory=dict)  # the tracker's own categories at the peak
    units: dict[str, tuple[int, int]] = field(default_factory=dict)  # fsdp_unit_numels of the built model
    extra: dict = field(default_factory=dict)  # what a phase's dry run observed besides memory


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Answers host reads of device values, which fake tensors do not have: booleans read False, a lone integer
    (a 0-dim tensor of its own, e.g. the initialisation seed) reads 0. With ``metrics=True`` (the RL step, whose
    loss logs statistics and filters tokens on the host) a floating-point read answers 0.0 and a boolean-mask
    selection ``x[mask]`` selects every element (every position is a valid token), so the selected tensor has
    its largest shape. Any other read, an element of a larger integer tensor included, is an error naming it."""

    def __init__(self, metrics: bool = False):
        super().__init__()
        self.metrics = metrics

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            t = args[0]
            if t.dtype == torch.bool:
                return False
            if not t.is_floating_point() and t.untyped_storage().nbytes() == t.element_size():
                return 0  # a lone integer (the model's initialisation seed), not an element of a tensor
            if self.metrics and t.is_floating_point():
                return 0.0
            raise RuntimeError(f"the dry run cannot read a {args[0].dtype} value from a device tensor (it has no "
                               "values); the code path needs a balanced/assumed value there")
        if (self.metrics and func is torch.ops.aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None
                and args[1][0].dtype == torch.bool and is_fake(args[1][0])):
            x, mask = args[0], args[1][0]
            return x.reshape(-1, *x.shape[mask.dim():]).clone()  # every element selected
        return func(*args, **(kwargs or {}))


def require_fsdp(pcfg, world_size: int) -> None:
    if not getattr(pcfg, "fsdp", False) and world_size > 1:
        # build_model materialises plain (non-DTensor) meta parameters with Module.to_empty, whose tensor swap
        # FakeTensorMode refuses (it holds a weak reference to every tensor it converts)
        raise ConfigError("the dry run simulates FSDP layouts; set parallel.fsdp=true (planner: --fsdp)")


def peak_tracker(fsdp: bool):
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
                        # a unit that never ran (an untrained MTP depth): nothing to attribute
                        return orig(*args, **kwargs)
                    return tracked(*args, **kwargs)

                return run

            def _fsdp_state_pre_forward(self, fsdp_mod, orig):
                tracked = super()._fsdp_state_pre_forward(fsdp_mod, orig)

                def run(*args, **kwargs):
                    # the tracker refuses a second forward of the root in one tracked region (it keeps per-module
                    # statistics of one iteration); the RL step runs several passes of the policy, and only the
                    # overall peak is reported here, so the root's statistics start afresh at each pass
                    fqn = self._mod_tracker.get_known_fqn(fsdp_mod)
                    if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw \
                            and self._mod_tracker.parents - {fqn} == {"Global"}:
                        del self.memory_tracking[fsdp_mod]
                    return tracked(*args, **kwargs)

                return run

    return PeakTracker


# the tracker's categories (MemTracker and FSDPMemTracker) -> the planner's kinds
KIND_OF = {
    "Parameter": "params", "Sharded Param": "params", "Unsharded Param": "unsharded_params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "unsharded_grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "All Gather": "unsharded_params", "Reduce Scatter": "unsharded_grads",
    "Buffer": "params",
}


def measure_peak(model, optimizer, fsdp: bool, run) -> dict[str, int]:
    """The tracker's snapshot (its categories -> bytes, "Total" included) at the peak of `run()`, `model` and
    `optimizer` tracked as such. Tensors that existed before and belong to neither are not in it (the caller
    adds what lives through the whole run, see storage_bytes)."""
    tracker = peak_tracker(fsdp)(*((model, optimizer) if fsdp else ()))
    externals = [model]
    if isinstance(optimizer, torch.optim.Optimizer):
        externals.append(optimizer)
    else:  # DistributedAdamW: its shards are tracked as externals ("Other") and reported as optimizer
        externals += distributed_adamw_state(optimizer)
    tracker.track_external(*externals)
    with tracker:
        run()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def by_kind(raw: dict[str, int], other_kind: str = "optimizer") -> dict[str, int]:
    """The tracker's categories summed into KINDS; "Other" (the externals measure_peak was given) is
    `other_kind`."""
    out = dict.fromkeys(KINDS, 0)
    for k, v in raw.items():
        if k == "Total":
            continue
        kind = KIND_OF.get(k, other_kind if k == "Other" else "other")
        out[kind] = out.get(kind, 0) + v
    return out


def extrapolate(a: DryRunResult, b: DryRunResult, n: int, note: str) -> DryRunResult:
    """`a` (L layers) and `b` (L + 1 layers) extrapolated affinely to L + n layers."""

    def ext(x, y):
        return int(x + n * (y - x))

    kinds = sorted(set(a.by_kind) | set(b.by_kind))
    return DryRunResult(
        peak_bytes=ext(a.peak_bytes, b.peak_bytes),
        by_kind={k: ext(a.by_kind.get(k, 0), b.by_kind.get(k, 0)) for k in kinds},
        assumptions=a.assumptions + [note.format(per_layer=(b.peak_bytes - a.peak_bytes) / 2**30)],
        seconds=a.seconds + b.seconds,
        tracker_kinds={k: ext(a.tracker_kinds.get(k, 0), b.tracker_kinds.get(k, 0)) for k in a.tracker_kinds},
        extra=dict(a.extra))


def check_sim_layers(mc, layers: int) -> None:
    # both depths need two MoE blocks: the peak (inside the last block's backward, the one before it prefetched)
    # then has the same shape in both, and their difference is one more block's state and saved input only
    if not mc.first_k_dense_replace + 2 <= layers < mc.num_layers:
        raise ConfigError(f"--sim-layers {layers} must be at least the {mc.first_k_dense_replace} dense layers + 2 "
                          f"and below the model's {mc.num_layers} layers")


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


def distributed_adamw_state(opt) -> list[torch.Tensor]:
    out = []
    for _, b in opt._all_buckets():
        out += [t for t in (b.exp_avg, b.exp_avg_sq, b.master) if t is not None]
    return out


__all__ = ["DryRunResult", "HostReads", "KINDS", "KIND_OF", "by_kind", "check_sim_layers", "distributed_adamw_state",
           "extrapolate", "fsdp_unit_numels", "measure_peak", "peak_tracker", "require_fsdp",
           "storage_bytes"]
