"""A pool that runs up to N sandboxes at once, preparing each task once and forking a copy per sample.

Preparing (materialising the tree, running setup such as Dockerfile RUN lines) happens once per task; every
sample of a group then starts from a fork of that snapshot (a reflink copy locally where the filesystem can,
a committed image for container engines), so setup cost is paid once per group, not once per sample.

The pool knows nothing of task formats: ``prepare(task, backend)`` builds a task's snapshot (for the agentic
environments, ``rl.envs.task.prepare_task``), so the sandbox room imports nothing above it.

An RL run meets thousands of tasks, each a snapshot on the host (a layer folder, or an engine's image): the pool keeps
at most ``keep_prepared`` of them, dropping the least recently used one that no live fork stands on; a task met again
later is prepared again (a cache lookup once its image is built).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

from rl.sandbox.base import Sandbox, SandboxError

T = TypeVar("T")


class SandboxPool:
    """Args:
        backend: creates and forks sandboxes (LocalBackend, a container backend).
        prepare: ``prepare(task, backend) -> snapshot``, run once per task; the snapshot has ``discard()``
            and the backend forks it.
        concurrency: sandboxes alive at once.
        keep_prepared: snapshots kept once no fork stands on them (least recently used dropped first); default
            four per concurrent sandbox, so the groups in flight and those just queued find theirs.
    """

    def __init__(self, backend, prepare: Callable[[Any, Any], Any], concurrency: int = 4,
                 keep_prepared: int | None = None):
        if concurrency < 1:
            raise SandboxError(f"SandboxPool concurrency must be at least 1, got {concurrency}")
        keep_prepared = 4 * concurrency if keep_prepared is None else keep_prepared
        if keep_prepared < 1:
            raise SandboxError(f"SandboxPool keep_prepared must be at least 1, got {keep_prepared}")
        if not callable(prepare):
            raise SandboxError(f"SandboxPool prepare must be a callable (task, backend) -> snapshot, got {prepare!r}")
        self.backend = backend
        self._prepare = prepare
        self.concurrency = concurrency
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox")
        self.keep_prepared = keep_prepared
        self._snapshots: OrderedDict[int, Any] = OrderedDict()  # least recently used first
        self._tasks: dict[int, Any] = {}  # keeps prepared tasks alive so their ids stay unique
        self._users: dict[int, int] = {}  # live forks (and prepares under way) per snapshot: never dropped
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()

    def prepare(self, task) -> Any:
        """Snapshot of the prepared task, built on first use and shared by all later forks."""
        with self._using(task) as snapshot:
            return snapshot

    @contextlib.contextmanager
    def _using(self, task) -> Iterator[Any]:
        key = id(task)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
            self._users[key] = self._users.get(key, 0) + 1
        try:
            with lock:
                with self._lock:
                    snapshot = self._snapshots.get(key)
                if snapshot is None:
                    snapshot = self._prepare(task, self.backend)
                    with self._lock:
                        self._snapshots[key] = snapshot
                        self._tasks[key] = task
            with self._lock:
                self._snapshots.move_to_end(key)
            yield snapshot
        finally:
            with self._lock:
                self._users[key] -= 1
                if not self._users[key]:
                    del self._users[key]
                dropped = self._over_bound()
            for old in dropped:
                old.discard()

    def _over_bound(self) -> list:
        """Snapshots to drop (under self._lock): the least recently used that no fork stands on, beyond the bound."""
        idle = [key for key in self._snapshots if key not in self._users]
        excess = len(self._snapshots) - self.keep_prepared
        dropped = []
        for key in idle[:max(0, excess)]:
            dropped.append(self._snapshots.pop(key))
            self._tasks.pop(key, None)
        return dropped

    @contextlib.contextmanager
    def fork(self, task) -> Iterator[Sandbox]:
        """A fresh fork of the task's snapshot, closed when the block ends; the snapshot stays while it runs."""
        with self._using(task) as snapshot:
            with self.backend.fork(snapshot) as sandbox:
                yield sandbox

    def submit(self, task, fn: Callable[[Sandbox], T]) -> Future:
        """Run fn on a fresh fork of the task in the pool; the sandbox is closed afterwards."""

        def job() -> T:
            with self.fork(task) as sandbox:
                return fn(sandbox)

        return self._executor.submit(job)

    def run_group(self, task, fn: Callable[[Sandbox, int], T], group_size: int) -> list[T]:
        """fn(sandbox, sample_index) for each sample of a group, at most `concurrency` at a time."""
        self.prepare(task)
        futures = [self.submit(task, lambda sbx, i=i: fn(sbx, i)) for i in range(group_size)]
        return [f.result() for f in futures]

    def release(self, task) -> None:
        """Drop a task's snapshot once no more samples of it will run (one a fork stands on is left to the bound)."""
        with self._lock:
            if id(task) in self._users:
                return
            snapshot = self._snapshots.pop(id(task), None)
            self._tasks.pop(id(task), None)
        if snapshot is not None:
            snapshot.discard()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for key in list(self._snapshots):
            self._snapshots.pop(key).discard()
        self._tasks.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
