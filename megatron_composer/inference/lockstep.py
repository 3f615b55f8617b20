"""Driving a tensor-parallel engine from one rank.

Every rank of a tensor-parallel engine must make the same calls in the same order. When only rank 0 sees
the requests (an HTTP server, a rollout worker talking to sandboxes), `Lockstep` wraps rank 0's engine:
requests it adds are queued and broadcast to the other ranks together with the next step or weight
update, and the other ranks run `follow(engine)`, which replays them. Seeds left to the engine are drawn
on rank 0 and sent along, so every rank samples from identically seeded generators. Without tensor
parallelism `Lockstep` calls the engine directly.

Weight updates carry the full (unsharded) tensors to every rank, or, when the other ranks can read the
same published version themselves (an object store), only the version: `follow(engine, fetch)` then calls
`fetch(version)` on each rank, and the ranks agree before any applies it: if one cannot fetch it (a corrupt
object, an outage) none applies it, the engine keeps its weights, and rank 0's update raises WeightsRefused.
"""

from __future__ import annotations

import random
import threading
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .engine import Engine, GenerationResult
from .sampling import SamplingParams


class WeightsRefused(RuntimeError):
    """A weight version some rank of the engine could not fetch: no rank applied it."""


def _all_ok(ok: bool, group) -> bool:
    """Whether `ok` holds on every rank of `group` (a collective)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class Lockstep:
    """Rank 0's handle on a tensor-parallel engine; thread-safe (calls are serialised)."""

    def __init__(self, engine: Engine, seed: Optional[int] = None, group=None):
        """group: the ranks that make the engine's calls together (default: its tensor-parallel group; an
        expert-parallel engine passes all of its ranks)."""
        self.engine = engine
        self.group = group if group is not None else engine.tp_group
        self.src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._adds: list[tuple[list[int], SamplingParams]] = []
        self._seeds = random.Random(seed)
        # held from an add (or a broadcast) until this rank's engine has it (or has stepped / updated)
        self.lock = threading.RLock()

    def _send(self, command: str, payload=None) -> None:
        if self.group is None:
            return
        box = [(command, self._adds, payload)]
        self._adds = []
        dist.broadcast_object_list(box, src=self.src, group=self.group)

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        own = SamplingParams(**vars(params))
        if own.seed is None and self.group is not None:  # every rank must draw the same numbers
            own.seed = self._seeds.getrandbits(62)
        with self.lock:
            rid = self.engine.add_request(prompt, own)
            if self.group is not None:
                self._adds.append(([int(t) for t in prompt], own))
        return rid

    def step(self) -> list[GenerationResult]:
        with self.lock:
            self._send("step")
            return self.engine.step()

    def update_weights(self, weights: Optional[Mapping[str, torch.Tensor]], version: int, *, delta: bool = False,
                       recompute_cache: bool = False, broadcast: bool = True) -> None:
        """Engine.update_weights on every rank between the same two steps. broadcast=False sends only the
        version: the other ranks' `follow` must have a `fetch` that returns the same tensors (or their own
        slices of them); if any rank's fetch fails, no rank applies the version (WeightsRefused)."""
        if not broadcast and self.group is not None:
            with self.lock:
                self._send("update", (version, delta, recompute_cache, None))
                if not _all_ok(True, self.group):
                    raise WeightsRefused(f"weight version {version} was not applied: another rank of the engine could "
                                         "not fetch it (see its log); every rank keeps its weights")
                self.engine.update_weights(weights, version, delta=delta, recompute_cache=recompute_cache)
            return
        with self.lock:  # rank 0 first: a rejected update is sent nowhere
            self.engine.update_weights(weights, version, delta=delta, recompute_cache=recompute_cache)
            # host copies: a pickled device tensor would be rebuilt on rank 0's device index on the other ranks
            sent = {k: v.detach().cpu() for k, v in weights.items()} if broadcast and weights is not None else None
            self._send("update", (version, delta, recompute_cache, sent))

    def heartbeat(self) -> None:
        """While idle: keeps the other ranks' broadcasts within their collective timeout."""
        with self.lock:
            self._send("beat")

    def stop(self) -> None:
        with self.lock:
            self._send("stop")


def follow(engine: Engine, fetch: Optional[Callable[[int], Mapping[str, torch.Tensor]]] = None, group=None) -> None:
    """Ranks other than 0: replay rank 0's requests, steps and weight updates until it stops. `fetch(version)`
    returns the full tensors of a version, or a reader of this rank's slices of it (Engine.update_weights);
    group: as Lockstep's."""
    group = group if group is not None else engine.tp_group
    src = dist.get_global_rank(group, 0)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        command, adds, payload = box[0]
        for prompt, params in adds:
            engine.add_request(prompt, params)
        if command == "step":
            for result in engine.step():  # only rank 0 reads results: drop them here or they pile up
                engine.pop_result(result.request_id)
        elif command == "update":
            version, delta, recompute, weights = payload
            if weights is None:
                if fetch is None:
                    raise RuntimeError("rank 0 sent a weight version without tensors; call follow(engine, fetch)")
                try:
                    weights = fetch(version)
                except Exception as e:  # every rank keeps its weights: none applies a version one lacks
                    print(f"rank {dist.get_rank()}: weight version {version} not applied, could not fetch it "
                          f"({type(e).__name__}: {e})", flush=True)
                    weights = None
                if not _all_ok(weights is not None, group):
                    continue
            engine.update_weights(weights, version, delta=delta, recompute_cache=recompute)
        elif command == "stop":
            return


__all__ = ["Lockstep", "WeightsRefused", "follow"]
