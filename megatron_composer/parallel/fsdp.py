"""FSDP2 parameter sharding on top of the tensor/expert/context-parallel layers (`parallel.fsdp`).

`apply_fsdp` runs torch's `fully_shard` over the model after parallelize_model (and FP8): every parameter
becomes a DTensor holding this rank's shard of its (tp/ep-local) tensor, its gradient is reduce-scattered,
and the optimizer (torch AdamW) updates only the shard.

Meshes, cut from the existing process groups:
  dense  -- the dp x cp ranks with this rank's tp coordinate (the gradient replicas, group "dp_cp");
  expert -- the expert-data-parallel ranks (group "edp"), holding the same experts.
With parallel.dp_replicate = r > 1 each mesh is 2-D, (replicate r) x (shard n/r): HSDP, parameters sharded
within a shard group and replicated across the r groups (gradients reduce-scattered, then all-reduced).

Units: one per transformer block (main and MTP), the routed experts of a MoE block as their own unit on the
expert mesh (dim 0 sharded, dim 1 when the shards outnumber the local experts), and the root unit
(embedding, final norm, head, MTP projections and norms). Blocks reshard after forward (the root keeps its
parameters gathered until its backward); each block prefetches
the next one (forward) and the previous one (backward), within the main stack and within the MTP stack.

Gradients are summed over the replicas, as DistributedAdamW does (the loss on each rank is its tokens' sum
divided by the global token count): the divide factor is 1 with sum-only collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_composer.parallel.dims import ParallelGroups
from megatron_composer.parallel.layers import set_spec, spec_of
from megatron_composer.parallel.slices import local_tensor


@dataclass
class FSDPMeshes:
    dense: object  # DeviceMesh
    expert: object
    dp_replicate: int


def _split(ranks: list[int], replicate: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups: contiguous runs of n/r ranks, replicate groups: every (n/r)-th rank) of one group."""
    n = len(ranks)
    width = n // replicate
    shards = [ranks[i * width:(i + 1) * width] for i in range(replicate)]
    replicas = [ranks[j::width] for j in range(width)]
    return shards, replicas


def _mesh_over(existing, rank_lists: list[list[int]], replicate: int, device_type: str, me: int, name: str):
    """A DeviceMesh over this rank's group of `rank_lists` (1-D: the existing group itself; HSDP: new
    replicate and shard groups, created by every rank for every group in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    if replicate == 1:
        return DeviceMesh.from_group(existing, device_type, mesh_dim_names=(f"{name}_shard",))
    mine_shard = mine_rep = grid = None
    for ranks in rank_lists:  # every rank creates every group, in the same order
        shards, replicas = _split(ranks, replicate)
        made_shards = [dist.new_group(r) for r in shards]
        made_reps = [dist.new_group(r) for r in replicas]
        if me in ranks:
            grid = torch.tensor(shards, dtype=torch.int)
            mine_shard = next(g for g, r in zip(made_shards, shards) if me in r)
            mine_rep = next(g for g, r in zip(made_reps, replicas) if me in r)
    return DeviceMesh.from_group([mine_rep, mine_shard], device_type, mesh=grid,
                                 mesh_dim_names=(f"{name}_replicate", f"{name}_shard"))


def build_meshes(groups: ParallelGroups, device_type: Optional[str] = None) -> FSDPMeshes:
    """The dense and expert FSDP meshes, HSDP when groups.dims.dp_replicate > 1 (which ParallelDims checked
    divides both dp*cp and world/ep). Collective: every rank must call it. Made of host integers even under
    FakeTensorMode (the dry run, pretrain/dry_run.py, builds the model there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _build_meshes(groups, device_type)


def _build_meshes(groups: ParallelGroups, device_type: Optional[str]) -> FSDPMeshes:
    dims = groups.dims
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    r = dims.dp_replicate
    dense = _mesh_over(groups.group("dp_cp"), dims.dense_groups("dp_cp"), r, device_type, groups.rank, "dense")
    expert = _mesh_over(groups.group("edp"), dims.expert_groups("edp"), r, device_type, groups.rank, "expert")
    return FSDPMeshes(dense=dense, expert=expert, dp_replicate=r)


def _blocks(model) -> tuple[list[nn.Module], list[nn.Module]]:
    return list(model.layers), [m.block for m in model.mtp]


def _link_prefetch(stack: list[nn.Module]) -> None:
    units = [(b, b.feed_forward.experts if getattr(b, "is_moe", False) else None) for b in stack]
    for i, (block, _) in enumerate(units):
        if i + 1 < len(units):
            nxt, nxt_experts = units[i + 1]
            block.set_modules_to_forward_prefetch([nxt] + ([nxt_experts] if nxt_experts is not None else []))
        if i > 0:
            prev, prev_experts = units[i - 1]
            block.set_modules_to_backward_prefetch([prev] + ([prev_experts] if prev_experts is not None else []))


def apply_fsdp(model: nn.Module, groups: ParallelGroups, *, param_dtype: torch.dtype = torch.float32,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (a parallelised Transformer, on any device including meta) with FSDP2 over the meshes of
    `groups` (HSDP when groups.dims.dp_replicate > 1); in place."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import Shard

    meshes = build_meshes(groups)
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    expert_shards = meshes.expert.size(meshes.expert.ndim - 1)

    def expert_placement(p: nn.Parameter):
        return Shard(0) if p.shape[0] >= expert_shards else Shard(1)

    main, mtp = _blocks(model)
    units = []
    for block in main + mtp:
        if getattr(block, "is_moe", False):
            experts = block.feed_forward.experts
            units.append(fully_shard(experts, mesh=meshes.expert, mp_policy=mp,
                                     reshard_after_forward=reshard_after_forward,
                                     shard_placement_fn=expert_placement))
            # the dispatch without expert parallelism enters the experts through forward_pairs, not forward:
            # it must gather the unit too, whichever kernel it then picks
            register_fsdp_forward_method(experts, "forward_pairs")
        units.append(fully_shard(block, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=reshard_after_forward))
    # the root keeps its parameters gathered from forward to backward: backward needs them at once, and a loss
    # that applies the head itself (pretrain's fused head) reads model.output.weight after the forward
    units.append(fully_shard(model, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=False))
    for unit in units:  # sum over replicas (no averaging), with sum-only collectives (gloo has no PREMUL_SUM)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    _link_prefetch(main)
    _link_prefetch(mtp)
    for name, p in model.named_parameters():  # fully_shard made new Parameters: carry the ShardSpecs over
        set_spec(p, specs[name])
    model._mc_fsdp = meshes
    model._mc_groups = groups  # finish_fsdp_gradients reads tp and the world from them
    return model


def is_fsdp(model: nn.Module) -> bool:
    return getattr(model, "_mc_fsdp", None) is not None


def _counted_once(p: torch.Tensor, tp_rank0: bool) -> bool:
    """Whether this rank's shard of p counts towards the global norm: replicated-over-tp tensors only on tp
    rank 0, HSDP replicas only on replicate coordinate 0 (FSDP shards are disjoint)."""
    from torch.distributed.tensor import DTensor, Replicate

    if spec_of(p).kind not in ("tp_sharded", "expert") and not tp_rank0:
        return False
    if isinstance(p, DTensor):
        coord = p.device_mesh.get_coordinate()
        return all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, Replicate))
    return True


@torch.no_grad()
def finish_fsdp_gradients(model: nn.Module, groups: ParallelGroups, max_norm: float) -> torch.Tensor:
    """After the last backward under FSDP (which has reduce-scattered the gradients over its meshes): all-reduce
    the tp_partial gradient shards over tp, then clip all shards to the global norm max_norm (inf: none).
    Returns the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    tp_group = groups.group("tp")
    if groups.size("tp") > 1:
        for p in params:
            if spec_of(p).kind == "tp_partial":
                dist.all_reduce(local_tensor(p.grad), group=tp_group)
    tp_rank0 = groups.tp_rank == 0
    dev = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for p in params:
        if _counted_once(p, tp_rank0):
            sq += local_tensor(p.grad).double().square().sum()
    dist.all_reduce(sq, group=groups.group("world"))
    norm = sq.sqrt().float()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            local_tensor(p.grad).mul_(coef.to(p.grad.dtype))
    return norm


__all__ = ["FSDPMeshes", "apply_fsdp", "build_meshes", "finish_fsdp_gradients", "is_fsdp"]
