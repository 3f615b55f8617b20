"""Data parallelism: bucketed gradient reduction, ZeRO-1 AdamW and global gradient-norm clipping.

Gradients are summed (not averaged) across replicas: the training loss on each rank is its tokens' loss sum
divided by the global token count, so the sum of the ranks' gradients is the gradient of the global mean.

Parameters fall into two families by who holds copies of them (see `ShardSpec`):
  dense  -- replicas are the dp x cp ranks with the same tp coordinate;
  expert -- replicas are the expert-data-parallel ranks (same ep coordinate).
Each family's gradients are flattened into buckets of about `bucket_mb` and reduced with one collective per
bucket: all-reduce, or with ZeRO-1 a reduce-scatter so each replica keeps 1/n of the reduced gradient and
1/n of the AdamW moments, updates its slice of the parameters and all-gathers the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from megatron_composer.parallel import collectives as C
from megatron_composer.parallel.dims import ParallelGroups
from megatron_composer.parallel.layers import spec_of


def default_decay_filter(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices only (not norms, biases or the router bias)."""
    return p.ndim >= 2


@dataclass
class _Bucket:
    params: list  # (name, param)
    numel: int  # unpadded
    padded: int  # multiple of the replica count
    decay_mask: torch.Tensor  # [padded] 1.0 where weight decay applies
    count_mask: torch.Tensor  # [padded] 1.0 where this rank's copy counts towards the global grad norm
    # ZeRO-1 state for this rank's slice [lo, hi) of the bucket
    lo: int = 0
    hi: int = 0
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    master: Optional[torch.Tensor] = None  # fp32 copy of the slice when params are low precision
    grad_shard: Optional[torch.Tensor] = None


class DistributedAdamW:
    """AdamW over a parallelised model: call `finish_grad_sync()` after backward, then optionally
    `clip_grad_norm(max_norm)`, then `step()` and `zero_grad()`.

    The update is elementwise identical to torch.optim.AdamW(foreach=False), so a single process with the
    same gradients takes the same step.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], groups: ParallelGroups, *,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, zero1: bool = True, bucket_mb: float = 25.0,
                 decay_filter: Callable[[str, torch.Tensor], bool] = default_decay_filter):
        self.groups, self.zero1 = groups, zero1
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        # One group, for schedules that set param_groups[i]["lr"] as on a torch optimizer.
        self.param_groups = [{"lr": lr, "weight_decay": weight_decay}]
        self.step_count = 0
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in named]
        self.tp_partial = [p for _, p in named if spec_of(p).kind == "tp_partial"]
        families = {"dense": [], "expert": []}
        for n, p in named:
            families["expert" if spec_of(p).kind == "expert" else "dense"].append((n, p))
        self.family_group = {"dense": groups.dp_cp, "expert": groups.edp}
        bucket_bytes = int(bucket_mb * 2**20)
        self.buckets: dict[str, list[_Bucket]] = {}
        for fam, items in families.items():
            self.buckets[fam] = self._make_buckets(fam, items, bucket_bytes, decay_filter)

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    # -- layout --------------------------------------------------------------------------------------
    def _make_buckets(self, fam, items, bucket_bytes, decay_filter) -> list[_Bucket]:
        group, ranks = self.family_group[fam]
        n, me = len(ranks), ranks.index(self.groups.rank)
        tp_rank0 = self.groups.tp_rank == 0
        buckets, cur, cur_bytes = [], [], 0
        for name, p in items:
            cur.append((name, p))
            cur_bytes += p.numel() * 4
            if cur_bytes >= bucket_bytes:
                buckets.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            buckets.append(cur)
        out = []
        for params in buckets:
            numel = sum(p.numel() for _, p in params)
            padded = math.ceil(numel / n) * n
            dev = params[0][1].device
            decay = torch.zeros(padded, device=dev)
            count = torch.zeros(padded, device=dev)
            off = 0
            for name, p in params:
                k = spec_of(p).kind
                decay[off:off + p.numel()] = float(decay_filter(name, p))
                # Count each distinct gradient element once in the world: tp-replicated copies only on tp rank 0;
                # without ZeRO the dp replicas hold full copies, so only replica 0 counts.
                counts = (k in ("tp_sharded", "expert") or tp_rank0) and (self.zero1 or me == 0)
                count[off:off + p.numel()] = float(counts)
                off += p.numel()
            b = _Bucket(params=params, numel=numel, padded=padded, decay_mask=decay, count_mask=count)
            if self.zero1:
                b.lo, b.hi = me * padded // n, (me + 1) * padded // n
                b.count_mask = count[b.lo:b.hi].clone()
                b.decay_mask = decay[b.lo:b.hi].clone()
                b.exp_avg = torch.zeros(b.hi - b.lo, device=dev)
                b.exp_avg_sq = torch.zeros(b.hi - b.lo, device=dev)
            else:
                b.exp_avg = torch.zeros(padded, device=dev)
                b.exp_avg_sq = torch.zeros(padded, device=dev)
            if any(p.dtype != torch.float32 for _, p in params):  # low-precision params: keep an fp32 master
                flat = self._flat_params(b)
                b.master = (flat[b.lo:b.hi] if self.zero1 else flat).clone()
            out.append(b)
        return out

    def _flat_params(self, b: _Bucket) -> torch.Tensor:
        flat = torch.cat([p.detach().reshape(-1).float() for _, p in b.params])
        return torch.nn.functional.pad(flat, (0, b.padded - b.numel))

    def _flat_grads(self, b: _Bucket) -> torch.Tensor:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for _, p in b.params])
        return torch.nn.functional.pad(flat, (0, b.padded - b.numel))

    def _all_buckets(self):
        for fam, buckets in self.buckets.items():
            for b in buckets:
                yield fam, b

    # -- gradient synchronisation --------------------------------------------------------------------
    def finish_grad_sync(self) -> None:
        """Reduce gradients across replicas (all-reduce, or reduce-scatter under ZeRO-1)."""
        tp_group = self.groups.group("tp")
        for p in self.tp_partial:  # sequence-sharded inputs leave partial sums across tp
            if p.grad is not None:
                p.grad = C.all_reduce(p.grad.contiguous(), tp_group)
        for fam, b in self._all_buckets():
            group = self.family_group[fam][0]
            flat = self._flat_grads(b)
            if self.zero1:
                b.grad_shard = C.reduce_scatter(flat, 0, group)
            else:
                flat = C.all_reduce(flat, group)
                off = 0
                for _, p in b.params:
                    g = flat[off:off + p.numel()].view_as(p).to(p.dtype)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    off += p.numel()

    def gather_grads(self) -> None:
        """Under ZeRO-1, all-gather the reduced gradient shards into every p.grad (for inspection and tests)."""
        if not self.zero1:
            return
        for fam, b in self._all_buckets():
            flat = C.all_gather(b.grad_shard, 0, self.family_group[fam][0])
            off = 0
            for _, p in b.params:
                p.grad = flat[off:off + p.numel()].view_as(p).to(p.dtype).clone()
                off += p.numel()

    def _local_grads(self):
        """(bucket, flat reduced gradient this rank holds for it)."""
        for fam, b in self._all_buckets():
            yield b, (b.grad_shard if self.zero1 else self._flat_grads(b))

    def global_grad_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for b, g in self._local_grads():
            sq += (g.double().square() * b.count_mask.double()).sum()
        sq = C.all_reduce(sq, self.groups.group("world"))
        return sq.sqrt().float()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so the global L2 norm is at most max_norm; returns the norm before clipping."""
        norm = self.global_grad_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if self.zero1:
            for b, _ in self._local_grads():
                b.grad_shard.mul_(coef)
        else:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    # -- update --------------------------------------------------------------------------------------
    def _adamw(self, param: torch.Tensor, grad: torch.Tensor, exp_avg, exp_avg_sq, decay_mask) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay:
            param.mul_(1 - self.lr * self.weight_decay * decay_mask)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1 ** self.step_count)
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** self.step_count)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for fam, b in self._all_buckets():
            if self.zero1:
                shard = b.master if b.master is not None else self._flat_params(b)[b.lo:b.hi].clone()
                self._adamw(shard, b.grad_shard, b.exp_avg, b.exp_avg_sq, b.decay_mask)
                flat = C.all_gather(shard, 0, self.family_group[fam][0])
            else:
                flat = b.master if b.master is not None else self._flat_params(b)
                self._adamw(flat, self._flat_grads(b), b.exp_avg, b.exp_avg_sq, b.decay_mask)
            off = 0
            for _, p in b.params:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for _, b in self._all_buckets():
            b.grad_shard = None

    # -- checkpointing and accounting ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step_count, "zero1": self.zero1,
                "buckets": {f"{fam}.{i}": {"exp_avg": b.exp_avg, "exp_avg_sq": b.exp_avg_sq, "master": b.master}
                            for fam, bs in self.buckets.items() for i, b in enumerate(bs)}}

    def load_state_dict(self, sd: dict) -> None:
        if sd["zero1"] != self.zero1:
            raise ValueError("optimizer state was saved with zero1=%s; set parallel.zero1 to match" % sd["zero1"])
        self.step_count = sd["step"]
        for fam, bs in self.buckets.items():
            for i, b in enumerate(bs):
                s = sd["buckets"][f"{fam}.{i}"]
                b.exp_avg.copy_(s["exp_avg"])
                b.exp_avg_sq.copy_(s["exp_avg_sq"])
                if b.master is not None:
                    b.master.copy_(s["master"])

    def named_param_states(self, gather: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {"exp_avg", "exp_avg_sq"}}: each parameter's moments as full tensors of its (local) shape,
        the layout-independent form checkpoints store. Under ZeRO-1 this all-gathers every bucket (collective);
        gather=False returns zeros of the same shapes instead, to be filled and handed to load_named_param_states."""
        out = {}
        for fam, b in self._all_buckets():
            flats = {}
            for key in ("exp_avg", "exp_avg_sq"):
                t = getattr(b, key)
                if not gather:
                    flats[key] = torch.zeros(b.padded, dtype=t.dtype, device=t.device)
                else:
                    flats[key] = C.all_gather(t, 0, self.family_group[fam][0]) if self.zero1 else t
            off = 0
            for name, p in b.params:
                out[name] = {k: f[off:off + p.numel()].view(p.shape).clone() for k, f in flats.items()}
                off += p.numel()
        return out

    @torch.no_grad()
    def load_named_param_states(self, states: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Inverse of named_param_states: keep this rank's slice of each bucket. fp32 masters restart from the
        (just loaded) parameters."""
        self.step_count = int(step)
        for _, b in self._all_buckets():
            for key in ("exp_avg", "exp_avg_sq"):
                flat = torch.cat([states[name][key].reshape(-1).float() for name, _ in b.params])
                flat = torch.nn.functional.pad(flat, (0, b.padded - b.numel))
                getattr(b, key).copy_(flat[b.lo:b.hi] if self.zero1 else flat)
            if b.master is not None:
                flat = self._flat_params(b)
                b.master.copy_(flat[b.lo:b.hi] if self.zero1 else flat)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank."""
        total = 0
        for _, b in self._all_buckets():
            for t in (b.exp_avg, b.exp_avg_sq, b.master):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


__all__ = ["DistributedAdamW", "default_decay_filter"]
