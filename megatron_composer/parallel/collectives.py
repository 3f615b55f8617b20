"""Collectives that autograd can differentiate through.

Each forward collective has a known adjoint: all-reduce <-> identity, split <-> all-gather,
reduce-scatter <-> all-gather, all-to-all <-> all-to-all with the splits swapped. The group is always an
explicit argument. A group of size 1 makes every function the identity, so unsharded code pays nothing.

Collectives are looked up on `torch.distributed` at call time, so a benchmark can wrap them to count bytes.
The single-tensor all-gather and reduce-scatter are `all_gather_single` / `reduce_scatter_single` where torch
has them (2.13 deprecates, with a warning on every call, the `all_gather_into_tensor` / `reduce_scatter_tensor`
names older releases only have); `ALL_GATHER` / `REDUCE_SCATTER` name the ones in use.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# -- raw collectives (no autograd) ------------------------------------------------------------------------

def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x_front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x_front.shape[0],) + tuple(x_front.shape[1:]), dtype=x.dtype, device=x.device)
    getattr(dist, ALL_GATHER)(out, x_front, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    x_front = x.movedim(dim, 0).contiguous()
    out = torch.empty((x_front.shape[0] // n,) + tuple(x_front.shape[1:]), dtype=x.dtype, device=x.device)
    getattr(dist, REDUCE_SCATTER)(out, x_front, group=group)
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group) -> torch.Tensor:
    """Exchange rows of x: input_splits[i] rows go to rank i, output_splits[i] rows come from rank i."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(output_splits), input_split_sizes=list(input_splits),
                           group=group)
    return out


def ring_exchange_start(tensors: list[torch.Tensor], group):
    """Start sending each tensor to the next rank of the group's ring and receiving the previous rank's."""
    n, r = group_size(group), group_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in recv]
    return dist.batch_isend_irecv(ops), recv


def ring_exchange_finish(pending) -> list[torch.Tensor]:
    reqs, recv = pending
    for req in reqs:
        req.wait()
    return recv


# -- autograd functions ------------------------------------------------------------------------------------

class _CopyToParallel(torch.autograd.Function):
    """Forward identity, backward all-reduce: entering a tensor-parallel region from replicated input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """Forward all-reduce, backward identity: leaving a tensor-parallel region with partial sums."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToParallel(torch.autograd.Function):
    """Forward keeps this rank's chunk of a replicated tensor, backward all-gathers the chunks."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _GatherFromParallel(torch.autograd.Function):
    """Forward all-gather; backward either keeps this rank's chunk (downstream is replicated, so the
    gradient is already complete) or reduce-scatters (downstream is sharded, gradients are partial)."""

    @staticmethod
    def forward(ctx, x, dim, group, grad_is_partial):
        ctx.dim, ctx.group, ctx.partial = dim, group, grad_is_partial
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            return reduce_scatter(g, ctx.dim, ctx.group), None, None, None
        return split(g, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward reduce-scatter along dim, backward all-gather (sequence-parallel exit of a TP region)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        return all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_s, in_s = ctx.splits
        return all_to_all(g, in_s, out_s, ctx.group), None, None, None


def copy_to_parallel(x, group):
    return x if group_size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group):
    return x if group_size(group) == 1 else _ReduceFromParallel.apply(x, group)


def scatter_to_parallel(x, dim, group):
    return x if group_size(group) == 1 else _ScatterToParallel.apply(x, dim, group)


def gather_from_parallel(x, dim, group, grad_is_partial: bool = False):
    return x if group_size(group) == 1 else _GatherFromParallel.apply(x, dim, group, grad_is_partial)


def reduce_scatter_to_parallel(x, dim, group):
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, dim, group)


def all_to_all_autograd(x, output_splits, input_splits, group):
    return x if group_size(group) == 1 else _AllToAll.apply(x, output_splits, input_splits, group)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Non-differentiable max all-reduce (used for numerically stable softmax over sharded vocab)."""
    return all_reduce(x.clone(), group, op=dist.ReduceOp.MAX)


def exchange_splits(input_splits: torch.Tensor, group) -> torch.Tensor:
    """Given how many rows this rank sends to each peer, return how many each peer sends here."""
    n = group_size(group)
    if n == 1:
        return input_splits
    out = torch.empty_like(input_splits)
    dist.all_to_all_single(out, input_splits.contiguous(), group=group)
    return out


__all__ = [
    "group_size", "group_rank", "all_reduce", "all_gather", "reduce_scatter",
    "split", "all_to_all", "copy_to_parallel", "reduce_from_parallel", "scatter_to_parallel",
    "gather_from_parallel", "reduce_scatter_to_parallel", "all_to_all_autograd", "all_reduce_max",
    "exchange_splits", "ring_exchange_start", "ring_exchange_finish",
]
