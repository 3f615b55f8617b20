"""Tensor-parallel layers (Megatron-style) with optional sequence parallelism, and parameter sharding specs.

Activations are [batch, seq, hidden]; with sequence parallelism the seq dimension (dim 1) is sharded over
the tensor-parallel group outside the column/row pair, and gathered/reduce-scattered at its edges.

Every parameter of a parallelised model carries a `ShardSpec` (attribute `_mc_spec`) saying how it relates
to the full tensor and how its gradient must be synchronised. Optimisers, gradient clipping, checkpoints and
the equality tests read it; nothing else is needed to know a parameter's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_composer.parallel import collectives as C

SyncKind = Literal["replicated", "tp_partial", "tp_sharded", "expert"]


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter maps to the full one, and which ranks share its gradient.

    kind: replicated  -- same value on every rank, gradient identical across tp (sum over dp x cp)
          tp_partial  -- same value on every rank, gradient partial across tp (sequence-sharded inputs)
          tp_sharded  -- dim `dim` split over tp in `blocks` interleaved blocks (e.g. fused gate/up)
          expert      -- dim 0 (experts) split over ep, replicated over expert-data-parallel ranks
    """

    kind: SyncKind = "replicated"
    dim: int = 0
    blocks: int = 1
    rank: int = 0
    size: int = 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor."""
        if self.kind in ("replicated", "tp_partial") or self.size == 1:
            return full
        pieces = full.chunk(self.blocks, dim=self.dim)
        return torch.cat([p.chunk(self.size, dim=self.dim)[self.rank] for p in pieces], dim=self.dim)


def spec_of(p: torch.Tensor) -> ShardSpec:
    return getattr(p, "_mc_spec", ShardSpec())


def set_spec(p: torch.Tensor, spec: ShardSpec) -> None:
    p._mc_spec = spec


def _sharded_param(full: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    p = nn.Parameter(spec.take(full.detach()).clone().contiguous())
    set_spec(p, spec)
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over tp. Input replicated (or sequence-sharded with SP)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], tp_group, *,
                 sequence_parallel: bool = False, gather_output: bool = False, blocks: int = 1,
                 seq_dim: int = 1):
        super().__init__()
        self.group, self.sp, self.gather_output, self.seq_dim = tp_group, sequence_parallel, gather_output, seq_dim
        spec = ShardSpec("tp_sharded", dim=0, blocks=blocks, rank=C.group_rank(tp_group), size=C.group_size(tp_group))
        if weight.shape[0] % (spec.size * blocks) != 0:
            raise ValueError(f"ColumnParallelLinear: {weight.shape[0]} output features do not split into "
                             f"{blocks} block(s) x tp={spec.size}; change parallel.tp")
        self.weight = _sharded_param(weight, spec)
        self.bias = _sharded_param(bias, spec) if bias is not None else None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0] // spec.size
        self.linear_fn = F.linear  # replaceable local matmul (FP8 swaps it in)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group, **kw) -> "ColumnParallelLinear":
        return cls(linear.weight, linear.bias, tp_group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:
            x = C.gather_from_parallel(x, self.seq_dim, self.group, grad_is_partial=True)
        else:
            x = C.copy_to_parallel(x, self.group)
        y = self.linear_fn(x, self.weight, self.bias)
        if self.gather_output:
            y = C.gather_from_parallel(y, y.dim() - 1, self.group)
        return y


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over tp; input is the tp-sharded output of a column layer.
    The partial products are all-reduced, or reduce-scattered along the sequence under SP."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], tp_group, *,
                 sequence_parallel: bool = False, seq_dim: int = 1):
        super().__init__()
        self.group, self.sp, self.seq_dim = tp_group, sequence_parallel, seq_dim
        spec = ShardSpec("tp_sharded", dim=1, rank=C.group_rank(tp_group), size=C.group_size(tp_group))
        if weight.shape[1] % spec.size != 0:
            raise ValueError(f"RowParallelLinear: {weight.shape[1]} input features do not split over "
                             f"tp={spec.size}; change parallel.tp")
        self.weight = _sharded_param(weight, spec)
        self.bias = None
        if bias is not None:  # added once, after the reduction
            self.bias = nn.Parameter(bias.detach().clone())
            set_spec(self.bias, ShardSpec("tp_partial" if sequence_parallel else "replicated"))
        self.in_features, self.out_features = weight.shape[1] // spec.size, weight.shape[0]
        self.linear_fn = F.linear  # replaceable local matmul (FP8 swaps it in)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp_group, **kw) -> "RowParallelLinear":
        return cls(linear.weight, linear.bias, tp_group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fn(x, self.weight, None)
        if self.sp:
            y = C.reduce_scatter_to_parallel(y, self.seq_dim, self.group)
        else:
            y = C.reduce_from_parallel(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over tp; each rank looks up the ids it owns and the partial rows are summed
    (all-reduce, or reduce-scatter along the sequence under SP)."""

    def __init__(self, weight: torch.Tensor, tp_group, *, sequence_parallel: bool = False, seq_dim: int = 1):
        super().__init__()
        self.group, self.sp, self.seq_dim = tp_group, sequence_parallel, seq_dim
        n, r = C.group_size(tp_group), C.group_rank(tp_group)
        if weight.shape[0] % n != 0:
            raise ValueError(f"VocabParallelEmbedding: vocabulary {weight.shape[0]} is not divisible by tp={n}; "
                             f"change parallel.tp or pad the vocabulary")
        self.weight = _sharded_param(weight, ShardSpec("tp_sharded", dim=0, rank=r, size=n))
        self.vocab_start = r * (weight.shape[0] // n)
        self.vocab_end = self.vocab_start + weight.shape[0] // n

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tp_group, **kw) -> "VocabParallelEmbedding":
        return cls(emb.weight, tp_group, **kw)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sp:
            return C.reduce_scatter_to_parallel(out, self.seq_dim, self.group)
        return C.reduce_from_parallel(out, self.group)




def _gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(local, DTensor):  # FSDP shard: first the (tp/ep-local) tensor over the FSDP mesh
        local = local.full_tensor()
    if spec.kind in ("replicated", "tp_partial") or spec.size == 1:
        return local
    pieces = C.all_gather(local.detach().contiguous(), spec.dim, group).chunk(spec.size, dim=spec.dim)
    # each rank's piece holds its slice of every block; regroup block-major
    per_block = [p.chunk(spec.blocks, dim=spec.dim) for p in pieces]
    return torch.cat([per_block[r][b] for b in range(spec.blocks) for r in range(spec.size)], dim=spec.dim)


def iter_full_state_dict(model: nn.Module, groups):
    """Collective: (name, unsharded tensor) one entry at a time, on every rank: FSDP shards gathered over their
    mesh, then tensor-parallel pieces over tp, experts over ep. A rank holds one gathered tensor at a time unless the caller keeps them."""
    params = dict(model.named_parameters())
    for name, t in model.state_dict().items():
        if groups is None:
            yield name, t
            continue
        spec = spec_of(params[name]) if name in params else ShardSpec()
        yield name, _gather_full(t, spec, groups.group("ep") if spec.kind == "expert" else groups.group("tp"))


def full_state_dict(model: nn.Module, groups) -> dict[str, torch.Tensor]:
    """The unsharded state dict (every rank gets it). Feeds single-file checkpoints, conversion to Hugging Face
    format and loading under another layout (slices.load_full_state_dict)."""
    return dict(iter_full_state_dict(model, groups))


__all__ = ["ShardSpec", "spec_of", "set_spec", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "iter_full_state_dict", "full_state_dict"]
