"""One device mesh for every kind of parallelism, and the process groups cut from it.

Dense layers see the world as dp x cp x tp (tp fastest, so a tensor-parallel group sits on neighbouring
ranks, i.e. inside one node). Experts see the same ranks folded differently, as edp x ep (ep fastest), the
"MoE parallel folding" of Megatron-Core: the expert-parallel size need not divide or equal any dense size,
only the world size. Every rank holds distinct tokens at the MoE layer (tensor-parallel ranks take disjoint
slices of the token set there), so any group of ranks can exchange tokens.

Groups are created explicitly by `ParallelDims.build()` and handed to layers; nothing lives at module level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch.distributed as dist

from megatron_composer.config import ConfigError


@dataclass
class ParallelConfig:
    """The `parallel:` section of a training config. dp = -1 means "whatever is left of the world"."""

    tp: int = field(default=1, metadata={"help": "tensor-parallel size (splits heads, FFN width, vocab)"})
    cp: int = field(default=1, metadata={"help": "context-parallel size (splits each sequence into 2*cp chunks)"})
    ep: int = field(default=1, metadata={"help": "expert-parallel size (splits the routed experts)"})
    dp: int = field(default=-1, metadata={"help": "data-parallel size; -1 infers world // (tp*cp)"})
    sequence_parallel: bool = field(default=False, metadata={"help": "shard norms/residual along sequence over tp"})
    zero1: bool = field(default=True, metadata={"help": "shard AdamW states across data-parallel ranks (fsdp=false)"})
    fsdp: bool = field(default=False, metadata={
        "help": "FSDP2: shard parameters, gradients and AdamW states over dp x cp (experts: over world/ep)"})
    dp_replicate: int = field(default=1, metadata={
        "help": "HSDP (fsdp=true): replicate over this many groups, shard within each"})
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={
        "help": "FSDP all-gather and compute dtype (auto: bfloat16 on GPU, float32 on CPU); reduction in float32"})
    grad_bucket_mb: float = field(default=25.0, metadata={"help": "gradient all-reduce bucket size"})
    cp_attention: Literal["allgather", "ring"] = field(
        default="allgather", metadata={"help": "context-parallel K/V exchange: all-gather (MLA: the latent) or ring"})
    moe_capacity_factor: Optional[float] = field(
        default=None, metadata={"help": "expert capacity per rank as a multiple of the mean load; null = dropless"})
    activation_checkpointing: Literal["none", "full", "selective"] = field(
        default="none", metadata={"help": "recompute whole layers (full) or attention core + experts (selective)"})

    def validate(self) -> None:
        for name in ("tp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} is {getattr(self, name)}; it must be >= 1")
        if self.dp == 0 or self.dp < -1:
            raise ConfigError(f"parallel.dp is {self.dp}; give a positive size or -1 to infer it")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ConfigError(f"parallel.moe_capacity_factor is {self.moe_capacity_factor}; give a value > 0 or null")
        if self.dp_replicate < 1:
            raise ConfigError(f"parallel.dp_replicate is {self.dp_replicate}; it must be >= 1")
        if self.dp_replicate > 1 and not self.fsdp:
            raise ConfigError(f"parallel.dp_replicate = {self.dp_replicate} is HSDP and needs parallel.fsdp=true "
                              "(or set parallel.dp_replicate=1)")
        if self.grad_bucket_mb <= 0:
            raise ConfigError(f"parallel.grad_bucket_mb is {self.grad_bucket_mb}; it must be > 0")


def _check_divisible(value: int, value_name: str, by: int, by_name: str) -> None:
    if by > 0 and value % by != 0:
        raise ConfigError(
            f"{value_name} = {value} is not divisible by {by_name} = {by}; change {by_name} to a divisor of "
            f"{value} (or change {value_name})")


@dataclass
class ParallelDims:
    """Sizes of the mesh. `build()` creates the process groups for this rank."""

    world_size: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = -1
    sequence_parallel: bool = False
    dp_replicate: int = 1  # HSDP replicas (FSDP only): divides dp*cp and world/ep

    def __post_init__(self):
        for name in ("world_size", "tp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} is {getattr(self, name)}; it must be >= 1")
        if self.sequence_parallel and self.tp == 1:
            self.sequence_parallel = False  # nothing to shard over; keeps one code path
        dense = self.tp * self.cp
        if self.dp == -1:
            if self.world_size % dense != 0:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by tp*cp = {self.tp}*{self.cp} = {dense}; "
                    f"change parallel.tp or parallel.cp (or the number of processes)")
            self.dp = self.world_size // dense
        elif self.dp * dense != self.world_size:
            raise ConfigError(
                f"dp*cp*tp = {self.dp}*{self.cp}*{self.tp} = {self.dp * dense} but the world size is "
                f"{self.world_size}; change parallel.dp (or set it to -1 to infer it)")
        if self.world_size % self.ep != 0:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by parallel.ep = {self.ep}; change parallel.ep "
                f"to a divisor of {self.world_size}")
        if self.dp_replicate < 1:
            raise ConfigError(f"parallel.dp_replicate is {self.dp_replicate}; it must be >= 1")
        for n, what in ((self.dp * self.cp, "dp*cp"), (self.world_size // self.ep, "world/ep")):
            if n % self.dp_replicate:
                raise ConfigError(f"parallel.dp_replicate = {self.dp_replicate} does not divide {what} = {n} (HSDP "
                                  f"replicates over dp_replicate groups of the FSDP ranks); choose a divisor of {n}")

    @classmethod
    def from_config(cls, pcfg: ParallelConfig, world_size: int) -> "ParallelDims":
        return cls(world_size=world_size, tp=pcfg.tp, cp=pcfg.cp, ep=pcfg.ep, dp=pcfg.dp,
                   sequence_parallel=pcfg.sequence_parallel, dp_replicate=pcfg.dp_replicate if pcfg.fsdp else 1)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: how many ranks hold the same experts."""
        return self.world_size // self.ep

    # -- coordinates -------------------------------------------------------------------------------
    def coords(self, rank: int) -> dict:
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = rank // (self.tp * self.cp)
        return dict(tp=tp_rank, cp=cp_rank, dp=dp_rank, ep=rank % self.ep, edp=rank // self.ep)

    def dense_groups(self, kind: str) -> list[list[int]]:
        """All rank lists of one dense group kind: tp, cp, dp, dp_cp (gradient replicas), cp_tp, world."""
        ranks = range(self.world_size)
        key = {
            "tp": lambda r: (r // self.tp,),
            "cp": lambda r: (r % self.tp, r // (self.tp * self.cp)),
            "dp": lambda r: (r % (self.tp * self.cp),),
            "dp_cp": lambda r: (r % self.tp,),
            "cp_tp": lambda r: (r // (self.tp * self.cp),),  # every shard of one sequence (SP and CP)
            "world": lambda r: (),
        }[kind]
        return _partition(ranks, key)

    def expert_groups(self, kind: str) -> list[list[int]]:
        ranks = range(self.world_size)
        key = {"ep": lambda r: (r // self.ep,), "edp": lambda r: (r % self.ep,)}[kind]
        return _partition(ranks, key)

    # -- model checks ------------------------------------------------------------------------------
    def validate_model(self, *, num_heads: int, num_kv_heads: Optional[int] = None, vocab_size: int,
                       num_experts: int = 0, ffn_sizes: tuple[int, ...] = (), seq_len: Optional[int] = None,
                       batch_size: Optional[int] = None, section: str = "parallel") -> None:
        """Raise ConfigError (one line, naming the size to change: `section`.tp etc., e.g. rollout.tp for a
        rollout engine's layout) before any model is built."""
        tp, ep, cp, dp = (f"{section}.{k}" for k in ("tp", "ep", "cp", "dp"))
        _check_divisible(num_heads, "the number of attention heads", self.tp, tp)
        if num_kv_heads is not None:
            _check_divisible(num_kv_heads, "the number of key/value heads", self.tp, tp)
        _check_divisible(vocab_size, "the vocabulary size", self.tp, tp)
        for f in ffn_sizes:
            _check_divisible(f, "the FFN hidden size", self.tp, tp)
        if num_experts:
            _check_divisible(num_experts, "the number of routed experts", self.ep, ep)
        if seq_len is not None:
            _check_divisible(seq_len, "the sequence length", 2 * self.cp, f"2*{cp}")
            if self.sequence_parallel:
                _check_divisible(seq_len // self.cp, "the per-rank sequence length (seq/cp)", self.tp, tp)
        if batch_size is not None:
            _check_divisible(batch_size, "the global batch size (sequences)", self.dp, dp)

    # -- groups ------------------------------------------------------------------------------------
    def build(self, rank: Optional[int] = None) -> "ParallelGroups":
        """Create every process group (all ranks must call this together) and return this rank's."""
        if rank is None:
            rank = dist.get_rank()
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"ParallelDims was sized for {self.world_size} ranks but torch.distributed has "
                              f"{dist.get_world_size()}; launch with --nproc-per-node {self.world_size}")
        mine = {}
        for kind in ("tp", "cp", "dp", "dp_cp", "cp_tp", "world"):
            mine[kind] = _new_groups(self.dense_groups(kind), rank)
        for kind in ("ep", "edp"):
            mine[kind] = _new_groups(self.expert_groups(kind), rank)
        return ParallelGroups(dims=self, rank=rank, coords=self.coords(rank), **mine)


def _partition(ranks, key) -> list[list[int]]:
    out: dict = {}
    for r in ranks:
        out.setdefault(key(r), []).append(r)
    return [sorted(v) for _, v in sorted(out.items())]


def _new_groups(rank_lists: list[list[int]], rank: int):
    """new_group must be called by every rank for every group, in the same order."""
    mine = None
    for ranks in rank_lists:
        if len(ranks) == dist.get_world_size():
            g = dist.group.WORLD
        else:
            g = dist.new_group(ranks)
        if rank in ranks:
            mine = (g, ranks)
    return mine


@dataclass
class ParallelGroups:
    """This rank's process groups and coordinates. Pass it (not globals) to parallel layers."""

    dims: ParallelDims
    rank: int
    coords: dict
    tp: tuple
    cp: tuple
    dp: tuple
    dp_cp: tuple
    cp_tp: tuple
    world: tuple
    ep: tuple
    edp: tuple

    def group(self, kind: str):
        return getattr(self, kind)[0]

    def ranks(self, kind: str) -> list[int]:
        return getattr(self, kind)[1]

    def size(self, kind: str) -> int:
        return len(getattr(self, kind)[1])

    def local_rank(self, kind: str) -> int:
        return getattr(self, kind)[1].index(self.rank)

    @property
    def tp_group(self):
        return self.tp[0]

    @property
    def cp_group(self):
        return self.cp[0]

    @property
    def ep_group(self):
        return self.ep[0]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def ep_rank(self) -> int:
        return self.coords["ep"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def sequence_parallel(self) -> bool:
        return self.dims.sequence_parallel


__all__ = ["ParallelConfig", "ParallelDims", "ParallelGroups"]
