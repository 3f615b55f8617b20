"""A pool that runs up to N sandboxes at once, preparing each task once and forking a copy per sample.

Preparing (materialising the tree, running setup such as Dockerfile RUN lines) happens once per task; every
sample of a group then starts from a fork of that snapshot (a reflink copy locally where the filesystem can,
a committed image for container engines), so setup cost is paid once per group, not once per sample.

The pool knows nothing of task formats: ``prepare(task, backend)`` builds a task's snapshot (for the agentic
environments, ``rl.envs.task.prepare_task``), so the sandbox room imports nothing above it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from rl.sandbox.base import Sandbox, SandboxError

T = TypeVar("T")


class SandboxPool:
    """Args:
        backend: creates and forks sandboxes (LocalBackend, a container backend).
        prepare: ``prepare(task, backend) -> snapshot``, run once per task; the snapshot has ``discard()``
            and the backend forks it.
        concurrency: sandboxes alive at once.
    """

    def __init__(self, backend, prepare: Callable[[Any, Any], Any], concurrency: int = 4):
        if concurrency < 1:
            raise SandboxError(f"SandboxPool concurrency must be at least 1, got {concurrency}")
        if not callable(prepare):
            raise SandboxError(f"SandboxPool prepare must be a callable (task, backend) -> snapshot, got {prepare!r}")
        self.backend = backend
        self._prepare = prepare
        self.concurrency = concurrency
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox")
        self._snapshots: dict[int, Any] = {}
        self._tasks: dict[int, Any] = {}  # keeps prepared tasks alive so their ids stay unique
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()

    def prepare(self, task) -> Any:
        """Snapshot of the prepared task, built on first use and shared by all later forks."""
        key = id(task)
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._snapshots:
                self._snapshots[key] = self._prepare(task, self.backend)
                self._tasks[key] = task
            return self._snapshots[key]

    def fork(self, task) -> Sandbox:
        return self.backend.fork(self.prepare(task))

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
        """Drop a task's snapshot once no more samples of it will run."""
        with self._lock:
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
