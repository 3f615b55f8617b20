"""Rollout worker: the claim loop. A worker claims a group from the `rl.orchestrator.WorkQueue`, runs its G
episodes (rl/rollout/episodes.py) on its engine (rl/rollout/engines.py: live weights from the weight-sync
store, applied between decode steps) and writes the whole group back; it renews the group's lease while it runs.

Held-out evaluation runs on the same engine and episode code: the worker takes an item of the eval queue
(`WorkQueue.held_out`; ``eval_version`` v, ``samples`` episodes of a held-out task) before training groups, but
only once its engine holds a version >= v, and writes the group back there (never trained on).

A group whose episodes keep meeting faults of the infrastructure (`EpisodeCrash`, after ``rollout.episode_retries``
reruns of an episode) is handed back to the queue; an episode that ended in an error of its own is scored 0 in its
group and never makes the group go back (rl/rollout/episodes.py). When the queue says stop, the worker stops, and
with it the engine's follower ranks. How and where workers run (threads in the trainer, rollout ranks, engines of
several ranks, separate launches) is chosen in one place: rl/rollout/launch.py.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Optional

import torch

from megatron_composer.data.chat_format import ChatFormat
from rl.orchestrator import WorkItem, WorkQueue
from rl.rollout.config import RolloutConfig
from rl.rollout.engines import EngineLeader
from rl.rollout.episodes import EpisodeCrash, EpisodeRunner
from rl.rollout.tasks import RLTask


class RolloutWorker(EpisodeRunner):
    """Episodes (`EpisodeRunner`) on an `EngineLeader`, fed by the queue. ``queue=None``: no claim loop, only
    `run_group` (evaluation, tests); ``subscriber=None``: fixed weights."""

    def __init__(self, name: str, cfg: RolloutConfig, model: torch.nn.Module, tokenizer, tasks: list[RLTask],
                 queue: WorkQueue, subscriber, seed: int = 0, sandbox_backend=None, poll_seconds: float = 1.0,
                 stops_since: Optional[float] = None, objective=None, engine_group=None,
                 eval_tasks: Optional[list[RLTask]] = None, chat_format: Optional[ChatFormat] = None,
                 dp_rank: Optional[tuple] = None):
        leader = EngineLeader(name, cfg, model, subscriber, seed, poll_seconds, engine_group, dp_rank)
        super().__init__(name, cfg, tokenizer, tasks, leader, seed=seed, objective=objective,
                         sandbox_backend=sandbox_backend, eval_tasks=eval_tasks, chat_format=chat_format)
        self.queue = queue
        # the queue of held-out items; None: this worker takes no evaluation items
        self.eval_queue = queue.held_out() if queue is not None and eval_tasks else None
        self.stops_since = stops_since  # ignore stop markers older than this (see WorkQueue.stop_requested)
        # the leader's engine, its Lockstep drive, the generating threads' lock and the versions applied
        self.engine, self.drive, self.applied = leader.engine, leader.drive, leader.applied
        self._drive_lock = leader.lock
        self.error: Optional[BaseException] = None

    def _stopping(self) -> bool:
        return self.queue.stop_requested(self.name, self.stops_since)

    def wait_for_weights(self, timeout_s: float = 600.0) -> int:
        return self.engines.wait_for_weights(self._stopping, timeout_s)

    def apply_ready(self) -> None:
        self.engines.apply_ready()

    def _claim(self) -> tuple[Optional[WorkItem], Optional[WorkQueue]]:
        """The next item and its queue: a held-out evaluation item of a version the engine holds (the trainer
        may be waiting for it), else a training group whose weights the engine holds (`WorkItem.runs_on`)."""
        held = self.engine.weight_version
        if self.eval_queue is not None:
            item = self.eval_queue.claim(self.name, accept=lambda it: it.runs_on(held))
            if item is not None:
                return item, self.eval_queue
        return self.queue.claim(self.name, accept=lambda it: it.runs_on(held)), self.queue

    def run(self) -> None:
        """Claim and run groups until the queue says stop (then the tensor-parallel followers stop too)."""
        followers_beat = self.engines.heartbeat()
        beat = None
        try:
            self.wait_for_weights()
            while not self._stopping():
                with self._drive_lock:
                    self.apply_ready()
                item, queue = self._claim()
                if item is None:
                    time.sleep(0.02)
                    continue
                beat = _LeaseHeartbeat(queue, self.name, item.gid, self.cfg.heartbeat_s)
                try:
                    result = self.run_group(item)
                except EpisodeCrash as e:
                    print(f"worker {self.name}: giving group {item.gid} back to the queue: {e}", flush=True)
                    queue.release(self.name, item)
                    continue
                finally:
                    beat.stop()
                if not queue.complete(self.name, item, result):
                    print(f"worker {self.name}: group {item.gid} was re-issued meanwhile; result dropped", flush=True)
        except BaseException as e:
            self.error = e
            traceback.print_exc()
            raise
        finally:
            for b in (beat, followers_beat):
                if b is not None:
                    b.stop()
            self.engines.stop()
            self.close()


class _LeaseHeartbeat:
    """Renews the lease of the group a worker runs every `every_s`, until stopped or the lease is lost."""

    def __init__(self, queue: WorkQueue, worker: str, gid: int, every_s: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(queue, worker, gid, every_s), daemon=True)
        self._thread.start()

    def _run(self, queue, worker, gid, every_s):
        while not self._stop.wait(every_s):
            if not queue.heartbeat(worker, gid):
                return

    def stop(self):
        self._stop.set()
        self._thread.join()
