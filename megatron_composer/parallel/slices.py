"""Which part of each full tensor this rank holds: the one definition, for loaders, initialisation, checkpoints
and tests.

A parameter of a laid-out model is cut twice. First by its `ShardSpec` (layers.py): tensor-parallel slices
along `dim` (in `blocks` interleaved blocks, e.g. a fused gate/up) or routed experts split along dim 0 over
ep. Then, under FSDP2, the resulting tensor becomes a DTensor on an FSDP mesh: `Shard(d)` splits dim d with
torch.chunk semantics (ceil-sized chunks, a short or empty last one; FSDP's padding is not part of
`to_local()`), `Replicate()` (HSDP's outer dim) keeps it whole. A rank's local tensor is therefore a union of
boxes of the full tensor -- one box, or one per interleaved block -- each a `Piece`: where it lies in the
local tensor and where in the full one.

Names are the canonical full-model state-dict names: parallelize_model and fully_shard keep module names,
and activation checkpointing wraps functions, not modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn

from megatron_composer.parallel.layers import ShardSpec, spec_of


@dataclass(frozen=True)
class Piece:
    """A box of the full tensor (`full`) and where it lands in this rank's local tensor (`local`)."""
    local: tuple[slice, ...]
    full: tuple[slice, ...]


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for `p`: the DTensor's local shard under FSDP2, else the tensor itself."""
    p = p.data if isinstance(p, nn.Parameter) else p
    return p.to_local() if _is_dtensor(p) else p


def full_shape(p: torch.Tensor) -> torch.Size:
    """The unsharded shape of the parameter (every cut undone). A DTensor's shape is the tensor after the
    ShardSpec cut (FSDP's mesh knows nothing of tp/ep), as is a plain parameter's."""
    return spec_full_shape(p.shape, spec_of(p))


def spec_full_shape(spec_local_shape: Sequence[int], spec: ShardSpec) -> torch.Size:
    shape = list(spec_local_shape)
    if spec.kind in ("tp_sharded", "expert") and spec.size > 1:
        shape[spec.dim] *= spec.size
    return torch.Size(shape)


def mesh_shards(p: torch.Tensor) -> list[tuple[int, int, int]]:
    """(dim, mesh size, this rank's mesh coordinate) per Shard placement of a DTensor, outermost first ([] for a
    plain tensor; Replicate placements cut nothing)."""
    if not _is_dtensor(p):
        return []
    from torch.distributed.tensor import Replicate, Shard

    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    out = []
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Shard):
            if type(pl) is not Shard:  # _StridedShard and friends: not produced by our layouts
                raise ValueError(f"unsupported DTensor placement {pl!r}")
            out.append((pl.dim, mesh.size(i), coord[i]))
        elif not isinstance(pl, Replicate):
            raise ValueError(f"unsupported DTensor placement {pl!r} (parameters are Shard or Replicate)")
    return out


def _chunk_range(start: int, stop: int, n: int, k: int) -> tuple[int, int]:
    """Range of chunk k of torch.chunk(n) applied to [start, stop): ceil-sized chunks, short/empty tail."""
    length = stop - start
    size = -(-length // n) if length else 0
    lo = min(start + k * size, stop)
    return lo, min(lo + size, stop)


def pieces_for(shape: Sequence[int], spec: ShardSpec, shards: Sequence[tuple[int, int, int]] = ()) -> list[Piece]:
    """The boxes a rank holds of a full tensor of `shape` cut by `spec` then by `shards` ((dim, size, coord)
    per FSDP Shard placement, outermost first); local slices index the rank's local tensor. Empty boxes are
    left out (an empty FSDP tail shard holds nothing)."""
    shape = list(shape)
    spec_shape = list(shape)
    cut = spec.kind in ("tp_sharded", "expert") and spec.size > 1
    if cut:
        if shape[spec.dim] % (spec.size * spec.blocks):
            raise ValueError(f"dim {spec.dim} of size {shape[spec.dim]} does not split into {spec.blocks} "
                             f"block(s) x {spec.size} ranks")
        spec_shape[spec.dim] //= spec.size
    # FSDP's range of the spec-local tensor on every dim
    ranges = [(0, n) for n in spec_shape]
    for d, n, k in shards:
        ranges[d] = _chunk_range(*ranges[d], n, k)
    if any(lo >= hi for lo, hi in ranges) and any(n > 0 for n in spec_shape):
        return []
    base = [lo for lo, _ in ranges]
    if not cut:
        return [Piece(local=tuple(slice(0, hi - lo) for lo, hi in ranges),
                      full=tuple(slice(lo, hi) for lo, hi in ranges))]
    d = spec.dim
    blocks = spec.blocks if spec.kind == "tp_sharded" else 1
    full_block = shape[d] // blocks          # one interleaved block of the full tensor
    local_block = full_block // spec.size    # this rank's share of it
    lo, hi = ranges[d]
    out = []
    for j in range(blocks):
        a, b = max(lo, j * local_block), min(hi, (j + 1) * local_block)
        if a >= b:
            continue
        full_start = j * full_block + spec.rank * local_block + (a - j * local_block)
        local = [slice(0, h - l) for l, h in ranges]
        full = [slice(l, h) for l, h in ranges]
        local[d] = slice(a - base[d], b - base[d])
        full[d] = slice(full_start, full_start + (b - a))
        out.append(Piece(local=tuple(local), full=tuple(full)))
    return out


def local_pieces(p: torch.Tensor) -> list[Piece]:
    """Boxes covering local_tensor(p) exactly (FSDP padding excluded), each with its place in the full tensor."""
    return pieces_for(full_shape(p), spec_of(p), mesh_shards(p))


def reshard(model: nn.Module) -> nn.Module:
    """Every FSDP2 unit of `model` back on its shards (a no-op for units already sharded, and without FSDP).

    FSDP2 registers a unit's gathered tensors as its parameters between its forward and its backward, and a
    unit that keeps them after forward (the root, `reshard_after_forward=False`) keeps them after a forward
    with no backward (evaluation). A reader of this rank's pieces must see the sharded DTensors, which carry
    the ShardSpecs and the optimizer state: a checkpoint taken then would store the gathered tp/ep-local
    tensor as the full one, and no AdamW moments."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model


def named_tensors(model: nn.Module):
    """(canonical name, tensor) for every parameter and persistent floating buffer of `model` (its FSDP units
    resharded first: the tensors are this rank's pieces)."""
    reshard(model)
    yield from model.named_parameters()
    non_persistent = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{mod_name}.{b}" if mod_name else b)
    for name, b in model.named_buffers():
        if name not in non_persistent and b.is_floating_point():
            yield name, b


@torch.no_grad()
def fill_local(model: nn.Module, read: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> None:
    """For every parameter and persistent floating buffer (by canonical full-model name), copy read(name, box)
    -- the box `piece.full` of the full tensor -- into its place in the local tensor, cast to the local dtype."""
    for name, t in named_tensors(model):
        local = local_tensor(t)
        for piece in local_pieces(t):
            src = read(name, piece.full)
            dst = local[piece.local]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: read a {tuple(src.shape)} block for box {piece.full}, the local "
                                 f"piece is {tuple(dst.shape)}")
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's pieces of an unsharded state dict into a parallelised model (any layout, FSDP included;
    parallel/slices.py says which pieces)."""
    own = dict(named_tensors(model))
    missing = sorted(set(model.state_dict()) - set(full))
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} entries, e.g. {missing[:3]}; was it saved from this model?")
    for name, t in own.items():
        if tuple(full[name].shape) != tuple(full_shape(t)):
            raise ValueError(f"{name}: checkpoint tensor {tuple(full[name].shape)} does not match the model's "
                             f"{tuple(full_shape(t))}")
    fill_local(model, lambda name, box: full[name][box])


def assemble(shape: Sequence[int], spec: ShardSpec, rank_pieces: Sequence[tuple[list[Piece], torch.Tensor]],
             dtype=None) -> torch.Tensor:
    """The full tensor from every rank's (pieces, local tensor); raises if the pieces do not tile it exactly
    once (a replicated copy must agree with the first). For tests and gathers."""
    full = torch.zeros(tuple(shape), dtype=dtype or rank_pieces[0][1].dtype)
    seen = torch.zeros(tuple(shape), dtype=torch.bool)
    for pieces, local in rank_pieces:
        for pc in pieces:
            if seen[pc.full].all():
                continue
            if seen[pc.full].any():
                raise ValueError(f"piece {pc.full} partly overlaps another")
            full[pc.full] = local[pc.local].to(full.dtype)
            seen[pc.full] = True
    if not bool(seen.all()):
        raise ValueError(f"pieces cover {int(seen.sum())} of {seen.numel()} elements")
    return full


__all__ = ["Piece", "local_tensor", "full_shape", "local_pieces", "fill_local", "reshard", "pieces_for", "mesh_shards",
           "named_tensors", "spec_full_shape", "assemble",
           "load_full_state_dict"]
