"""A trainer rank's place in the parallel layout, shared by the pretraining and RL trainers.

`Layout` turns the `parallel:` config section into process groups (megatron_composer.parallel.ParallelDims),
parallelises a full model, builds the optimizer (DistributedAdamW with ZeRO-1 on several ranks) and shards
batches and sums metrics over the ranks that hold distinct tokens. The gradient path after backward is
`megatron_composer.training.core.finish_gradients`. The layout's world is torch.distributed's default group:
the RL entrypoint initialises that group over the trainer ranks only, so rollout processes never join it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_composer.parallel.dims import ParallelConfig, ParallelDims
from megatron_composer.training.optim import OptimizerConfig, build_optimizer


def shift_left_local(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """y[:, t] = x[:, t + k] along dim 1, `fill` past the end (the single-shard case of cp_shift_left)."""
    pad = torch.full_like(x.narrow(1, 0, k), fill)
    return torch.cat([x.narrow(1, k, x.shape[1] - k), pad], dim=1)


class Layout:
    """This rank's place in the parallel layout (parallel.tp/cp/ep from config, dp inferred).

    Pure data parallelism keeps the model unchanged. Tensor, context and expert parallelism use
    megatron_composer.parallel.parallelize_model; logits are vocab-sharded under tp and sequence-sharded under
    cp. With more than one rank the optimizer is a DistributedAdamW (see `build_optimizer`): it reduces
    gradients per parameter family (dense over dp x cp replicas, routed experts over expert-data-parallel
    replicas) in buckets of parallel.grad_bucket_mb, counts each distinct element once in the grad norm, and
    with parallel.zero1 shards the AdamW moments over those replicas. One rank has nothing to reduce and uses
    torch's AdamW. Counts and logged sums are reduced over the dp x cp ranks, which hold distinct tokens.

    With parallel.fsdp (under torch.distributed) the parameters themselves are sharded by FSDP2 (`shard_parameters`,
    megatron_composer.parallel.fsdp): gradients are reduce-scattered by FSDP and the optimizer is torch's AdamW
    over the local shards; ZeRO-1 and the bucketed reduction are not used.
    """

    def __init__(self, pcfg: ParallelConfig, distributed: bool | None = None):
        # distributed=False: this process alone, even inside a torchrun launch (single-rank references in tests)
        on = dist.is_initialized() if distributed is None else distributed
        self.world = dist.get_world_size() if on else 1
        self.rank = dist.get_rank() if on else 0
        self.pcfg = pcfg
        self.dims = ParallelDims.from_config(pcfg, self.world)
        self.groups = None
        coords = self.dims.coords(self.rank)
        self.dp_size, self.dp_rank, self.cp_rank = self.dims.dp, coords["dp"], coords["cp"]
        self.cp = pcfg.cp
        self.model_parallel = max(pcfg.tp, pcfg.cp, pcfg.ep) > 1 or pcfg.activation_checkpointing != "none"
        self.fsdp = pcfg.fsdp and on  # a torchrun world (of one rank too: FSDP's gather dtype and hooks)
        if self.model_parallel or self.world > 1 or self.fsdp:
            self.groups = self.dims.build()

    def build_optimizer(self, model: torch.nn.Module, cfg: OptimizerConfig):
        """torch AdamW on one rank and over FSDP shards; DistributedAdamW (bucketed reduction, ZeRO-1 if
        parallel.zero1) on several ranks without FSDP."""
        groups = self.groups if self.world > 1 and not self.fsdp else None
        return build_optimizer(model, cfg, groups, zero1=self.pcfg.zero1, bucket_mb=self.pcfg.grad_bucket_mb)

    def validate(self, mc, seq_length: int) -> None:
        from megatron_composer.parallel import validate_layout

        validate_layout(self.dims, mc, seq_len=seq_length)

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.model_parallel:
            return model
        from megatron_composer.parallel import parallelize_model

        return parallelize_model(model, self.groups, activation_checkpointing=self.pcfg.activation_checkpointing,
                                 capacity_factor=self.pcfg.moe_capacity_factor, cp_attention=self.pcfg.cp_attention)

    def shard_parameters(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 over the parallelised (and FP8-converted) model when parallel.fsdp; else the model unchanged."""
        if not self.fsdp:
            return model
        from megatron_composer.parallel.fsdp import apply_fsdp

        return apply_fsdp(model, self.groups, param_dtype=self.fsdp_param_dtype)

    @property
    def fsdp_param_dtype(self) -> torch.dtype:
        name = self.pcfg.fsdp_param_dtype
        if name == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return getattr(torch, name)

    @property
    def vocab_group(self):
        return self.groups.tp_group if self.groups is not None and self.dims.tp > 1 else None

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's context-parallel slice of each [B, S] tensor (identity without CP)."""
        if self.cp == 1:
            return batch
        from megatron_composer.parallel import shard_sequence

        return {k: shard_sequence(v, 1, self.cp, self.cp_rank).contiguous() for k, v in batch.items()}

    @property
    def shift_left(self):
        if self.cp == 1:
            return shift_left_local
        from megatron_composer.parallel import cp_shift_left

        group = self.groups.cp_group
        return lambda x, k, fill=0: cp_shift_left(x, k, 1, group, fill)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks holding distinct tokens (dp x cp)."""
        if self.world > 1:
            dist.all_reduce(t, group=self.groups.group("dp_cp") if self.groups is not None else None)
        return t
