"""A rollout engine and its ranks: the engine a worker drives (`EngineLeader`), the ranks that replay it
(`run_follower`), and the live weights of both from the weight-sync store.

Generation never waits for the trainer: a subscriber fetches and decodes this rank's boxes of each new version
in the background (only the stored chunks overlapping them), and the engine applies the ready update between
two decode steps -- an XOR delta into its own slices --, so one response can hold tokens of versions v and v+1;
each token records the version it was sampled under.

Several threads may generate at once (one per sandbox of a group): each adds its requests and then helps
stepping the engine under one lock until its own requests finish, so concurrent episodes share decode steps.

Tensor and expert parallelism (``rollout.tp`` x ``rollout.ep`` > 1): the engine's model is sharded over a group
of processes. The worker runs on the group's first rank and calls the engine only through
`megatron_composer.inference.Lockstep`, which replays its requests, steps and weight updates on the other ranks
(`run_follower`, built on `inference.follow`). A weight update sends only the version: each follower prepares its
own boxes of the same version from the store itself (prefetched in the background like the leader's). While the
leader waits (for work, weights or sandbox commands) a `LockstepHeartbeat` keeps the followers' wait alive. When
the worker stops, so do they.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from megatron_composer.inference import Engine, Lockstep, follow
from megatron_composer.inference.lockstep import WeightsRefused
from rl.rollout.config import RolloutConfig


def rollout_engine(model: torch.nn.Module, cfg: RolloutConfig, seed: int = 0, dp_rank: Optional[tuple] = None
                   ) -> Engine:
    """The engine of a rollout worker; every rank of a tensor-parallel group builds it identically (the
    scheduler's batches and cache blocks must match). rollout.backend=vllm: a vLLM engine for `model`'s config
    and dtype (`model` then only names the weights the subscriber fetches: rl.model.rollout_model builds it on
    the meta device); dp_rank (vllm_layout=dp_attention): (this process's rank in its engine, the engine's
    index on the node)."""
    if cfg.backend == "vllm":
        from megatron_composer.inference.vllm_engine import DataParallel, VLLMEngine

        dp = None
        if cfg.vllm_layout == "dp_attention":
            if dp_rank is None:  # a lone rank would wait for its peers forever
                raise ValueError("rollout.vllm_layout=dp_attention: this engine process was given no data-parallel "
                                 "rank (its rollout processes are launched with torchrun, one per GPU)")
            rank, engine = dp_rank
            dp = DataParallel(cfg.ep, rank, master_port=cfg.dp_port + engine)
        return VLLMEngine(model.config, dtype=next(model.parameters()).dtype, max_batch_size=cfg.max_batch_size,
                          max_seq_len=cfg.max_seq_len, cache_memory_bytes=cfg.cache_memory_mb << 20, seed=seed,
                          tp=1 if dp else cfg.tp, ep=1 if dp else cfg.ep, dcp=cfg.dcp, dp=dp,
                          quantize_experts=None if cfg.quantize_experts == "none" else cfg.quantize_experts)
    return Engine(model, max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len,
                  cache_memory_bytes=cfg.cache_memory_mb << 20, seed=seed)


class EngineLeader:
    """The rank that drives a rollout engine: the engine, the `Lockstep` through which every call that changes
    it reaches the engine's other ranks (none on a one-rank engine), the lock the generating threads share,
    and this rank's weights from `subscriber` (None: fixed weights). `name` is the worker's, for its log lines.
    engine_group: all of the engine's ranks (default its tensor-parallel group; an expert-parallel engine
    passes its own)."""

    def __init__(self, name: str, cfg: RolloutConfig, model: torch.nn.Module, subscriber, seed: int = 0,
                 poll_seconds: float = 1.0, engine_group=None, dp_rank: Optional[tuple] = None):
        self.name = name
        self.subscriber = subscriber  # a subscriber of this rank's boxes (None: fixed weights)
        self.poll_seconds = poll_seconds  # weight_sync.poll_seconds
        self.engine = rollout_engine(model, cfg, seed, dp_rank)
        if subscriber is not None and hasattr(self.engine, "subscription"):
            # vLLM: its workers subscribe themselves (the given subscriber's store and settings), per worker box
            self.subscriber = self.engine.subscription(subscriber)
        self.drive = Lockstep(self.engine, group=engine_group)
        self.lock = threading.Lock()
        self.applied: list[tuple[int, float]] = []  # (version, seconds the engine paused to apply it)

    # -- weights --------------------------------------------------------------------------------------
    def wait_for_weights(self, stopping: Callable[[], bool], timeout_s: float = 600.0) -> int:
        """Apply the first published version (waiting for one unless `stopping()`), then prefetch the next
        ones in the background."""
        deadline = time.monotonic() + timeout_s
        while (v := self.subscriber.latest_version()) is None:
            if stopping() or time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.name}: no weights were published within {timeout_s:.0f}s")
            time.sleep(self.poll_seconds)
        # the first version: every rank reads only its boxes of it (the followers through `fetch`)
        self._apply(self.subscriber.prepare(v))
        self.subscriber.start(self.poll_seconds)
        return v

    def _apply(self, update) -> None:
        """Apply a prepared BoxUpdate of this rank's boxes (an XOR delta on the held weights, or the values);
        the engine's other ranks apply their own update of the same version (followers fetch it themselves)."""
        t0 = time.perf_counter()
        try:
            self.drive.update_weights(update, update.version, delta=update.delta, broadcast=False)
        except WeightsRefused as e:  # another rank of the engine could not prepare it: no rank applied it
            print(f"worker {self.name}: {e}; the engine keeps v{self.engine.weight_version}", flush=True)
            return
        update.commit()
        dt = time.perf_counter() - t0
        self.applied.append((update.version, dt))
        print(f"worker {self.name}: applied weights v{update.version} in {dt * 1e3:.1f} ms "
              f"({'delta' if update.delta else 'values'}, {update.bytes_read / 2**20:.1f} MiB fetched of "
              f"{update.version_bytes / 2**20:.1f} MiB; running requests continue, their next tokens are "
              f"v{update.version})", flush=True)

    def apply_ready(self) -> None:
        """Apply the newest prefetched version if it is newer than the engine's (call it holding `lock`)."""
        if self.subscriber is None or getattr(self.engine, "dp", None) is not None:
            return  # fixed weights (evaluation), or a data-parallel vLLM engine, whose ranks agree on versions
        ready = self.subscriber.pop_ready()
        if ready is not None and ready.version > self.engine.weight_version:
            self._apply(ready)

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list) -> list:
        """The engine's results of `prompts` (one SamplingParams each), in order; new weights are applied
        between decode steps."""
        with self.lock:
            rids = [self.drive.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[int, object] = {}
        while len(results) < len(rids):
            with self.lock:
                self.apply_ready()  # between decode steps: the only pause new weights cause
                for rid in rids:
                    if rid not in results and (r := self.engine.pop_result(rid)) is not None:
                        results[rid] = r
                if len(results) < len(rids):
                    self.drive.step()
        return [results[r] for r in rids]

    # -- lifetime -------------------------------------------------------------------------------------
    def heartbeat(self) -> Optional["LockstepHeartbeat"]:
        """Start beating to the followers (None on an engine without them)."""
        return LockstepHeartbeat(self.drive) if self.drive.group is not None else None

    def stop(self) -> None:
        """Stop the followers and the subscriber's background prefetch, and close an engine that holds
        process-wide state (vLLM's)."""
        self.drive.stop()
        if self.subscriber is not None:  # None: fixed weights
            self.subscriber.stop()
        if callable(close := getattr(self.engine, "close", None)):
            close()


class LockstepHeartbeat:
    """Between engine steps (waiting for work or weights, running sandbox commands) no broadcast reaches the
    followers; a beat every `every_s` for the whole run keeps their wait within the process group's timeout."""

    def __init__(self, drive: Lockstep, every_s: float = 30.0):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(drive, every_s), name="lockstep-beat", daemon=True)
        self._thread.start()

    def _run(self, drive: Lockstep, every_s: float):
        while not self._stop.wait(every_s):
            drive.heartbeat()

    def stop(self):
        self._stop.set()
        self._thread.join()


class _PrefetchedVersions:
    """A follower's weights: its own subscriber prepares new versions of its boxes in the background (as the
    leader's does); `fetch(version)` hands over the one the leader applied, or prepares it if it is not there
    (or was prepared on another version than the one now held)."""

    def __init__(self, subscriber, keep: int = 2):
        self.subscriber, self.keep = subscriber, keep
        self._states: dict[int, dict] = {}
        self._applied = -1
        self._lock = threading.Lock()

    def on_ready(self, _version: int) -> None:
        ready = self.subscriber.pop_ready()
        with self._lock:
            if ready is not None and ready.version > self._applied:
                self._states[ready.version] = ready
                for v in sorted(self._states)[:-self.keep]:
                    del self._states[v]

    def fetch(self, version: int) -> dict:
        with self._lock:
            state = self._states.pop(version, None)
            self._applied = max(self._applied, version)
            for v in [v for v in self._states if v < version]:
                del self._states[v]  # the leader never goes back
        if state is not None and state.delta and state.base_id != self.subscriber.held_id:
            state = None  # a delta on a version this rank no longer holds
        return state if state is not None else self.subscriber.prepare(version)


class _Replica:
    """A follower's engine as `follow` drives it, logging each weight version it applies."""

    def __init__(self, engine: Engine, name: str):
        self.engine, self.tp_group, self.name = engine, engine.tp_group, name

    def add_request(self, prompt, params) -> int:
        return self.engine.add_request(prompt, params)

    def step(self):
        return self.engine.step()

    def pop_result(self, rid: int):
        return self.engine.pop_result(rid)

    def update_weights(self, weights, version: int, **kw) -> None:
        if hasattr(weights, "commit"):  # this rank's own BoxUpdate: values or an XOR delta, as it was prepared
            kw["delta"] = weights.delta
        self.engine.update_weights(weights, version, **kw)
        if hasattr(weights, "commit"):
            weights.commit()
        print(f"{self.name}: applied weights v{version}", flush=True)


def run_follower(name: str, cfg: RolloutConfig, model: torch.nn.Module, subscriber, poll_seconds: float = 1.0,
                 engine_group=None) -> None:
    """A rank of an engine other than its first: replay the leader's engine calls, with this rank's boxes of
    each weight version read from the store by its own subscriber, until the worker stops. engine_group: as
    EngineLeader's."""
    engine = rollout_engine(model, cfg)
    versions = _PrefetchedVersions(subscriber)
    subscriber.start(poll_seconds, on_ready=versions.on_ready)
    try:
        follow(_Replica(engine, name), versions.fetch, group=engine_group)
    finally:
        subscriber.stop()
