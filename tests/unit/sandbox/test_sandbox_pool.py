"""SandboxPool's bound on prepared snapshots (rl/sandbox/pool.py): an RL run over thousands of tasks keeps at most
keep_prepared of them on the host, never drops one a live fork stands on, and prepares a dropped task again."""

from __future__ import annotations

import threading

import pytest

from rl.sandbox.base import SandboxError
from rl.sandbox.pool import SandboxPool


class _Snapshot:
    def __init__(self, name: str):
        self.name = name
        self.discarded = False

    def discard(self):
        assert not self.discarded, f"{self.name} discarded twice"
        self.discarded = True


class _Sandbox:
    def __init__(self, snapshot: _Snapshot):
        assert not snapshot.discarded, f"forked the discarded snapshot {snapshot.name}"
        self.snapshot = snapshot
        self.closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


class _Backend:
    def fork(self, snapshot):
        return _Sandbox(snapshot)


class _Task:
    def __init__(self, name: str):
        self.name = name


def _pool(keep: int, concurrency: int = 2):
    prepared: list[_Snapshot] = []

    def prepare(task, backend):
        prepared.append(_Snapshot(task.name))
        return prepared[-1]

    return SandboxPool(_Backend(), prepare, concurrency=concurrency, keep_prepared=keep), prepared


def test_idle_snapshots_beyond_the_bound_go_least_recently_used_first():
    pool, prepared = _pool(keep=2)
    a, b, c = _Task("a"), _Task("b"), _Task("c")
    with pool:
        for task in (a, b, a, c):  # a is used again after b: b is the least recently used when c comes
            with pool.fork(task) as sandbox:
                assert sandbox.snapshot.name == task.name
        assert [s.name for s in prepared] == ["a", "b", "c"]
        assert [s.discarded for s in prepared] == [False, True, False]
        with pool.fork(b):  # b again: prepared anew, and a (now the least recently used) goes
            pass
        assert [s.name for s in prepared] == ["a", "b", "c", "b"]
        assert prepared[0].discarded and not prepared[2].discarded and not prepared[3].discarded
    assert all(s.discarded for s in prepared)  # close drops the rest, each once


def test_a_snapshot_a_fork_stands_on_is_never_dropped():
    pool, prepared = _pool(keep=1)
    a, b, c = _Task("a"), _Task("b"), _Task("c")
    with pool:
        with pool.fork(a) as on_a, pool.fork(b) as on_b:  # two live forks over a bound of one
            with pool.fork(c):
                pass
            assert not on_a.snapshot.discarded and not on_b.snapshot.discarded
        # the block closed both forks: the bound holds again
        assert sum(not s.discarded for s in prepared) == 1
        assert on_a.closed and on_b.closed


def test_concurrent_samples_of_one_task_prepare_it_once():
    pool, prepared = _pool(keep=1, concurrency=4)
    task = _Task("a")
    barrier = threading.Barrier(4, timeout=30)

    def sample(sandbox, i):
        barrier.wait()  # all four forks live at once
        return sandbox.snapshot.name

    with pool:
        assert pool.run_group(task, sample, group_size=4) == ["a"] * 4
        assert len(prepared) == 1


def test_release_leaves_a_snapshot_in_use():
    pool, prepared = _pool(keep=4)
    a = _Task("a")
    with pool:
        with pool.fork(a):
            pool.release(a)
            assert not prepared[0].discarded
        pool.release(a)
        assert prepared[0].discarded


def test_a_bound_below_one_is_refused():
    with pytest.raises(SandboxError, match="keep_prepared must be at least 1"):
        SandboxPool(_Backend(), lambda task, backend: None, keep_prepared=0)
