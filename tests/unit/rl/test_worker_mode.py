"""rl/rollout/launch.py's table of the ways a rollout worker runs, row by row, through `worker_mode`."""

from __future__ import annotations

import pytest

from rl.config import RLConfig
from rl.rollout.launch import WorkerMode, worker_mode

T, N, P, L, F = WorkerMode.THREADS, WorkerMode.NONE, WorkerMode.PROCESS, WorkerMode.LEADER, WorkerMode.FOLLOWER


def _cfg(role: str, trainer_ranks: int = 1, tp: int = 1, backend: str = "engine") -> RLConfig:
    cfg = RLConfig()
    cfg.role, cfg.trainer_ranks = role, trainer_ranks
    cfg.rollout.tp, cfg.rollout.backend = tp, backend
    return cfg


@pytest.mark.parametrize("cfg, world, modes", [
    (_cfg("auto"), 1, [T]),                                   # 1: one process, worker threads in it
    (_cfg("auto", trainer_ranks=2), 2, [T, N]),               # 1: every process trains; rank 0 has the threads
    (_cfg("trainer", trainer_ranks=2), 2, [N, N]),            # the workers are launched apart
    (_cfg("auto", trainer_ranks=1), 3, [N, P, P]),            # 2: rollout ranks
    (_cfg("auto", trainer_ranks=1, tp=2), 5, [N, L, F, L, F]),  # 3: engines of 2 ranks after the trainer's
    (_cfg("auto", trainer_ranks=2, tp=2, backend="vllm"), 4, [N, N, P, P]),  # vLLM: one process per engine
    (_cfg("rollout"), 2, [P, P]),                             # 4: a separate launch of workers
    (_cfg("rollout", tp=2), 4, [L, F, L, F]),                 # 4: ... of engines of 2 ranks
])
def test_worker_mode_follows_the_table(cfg, world, modes):
    cfg.check_runnable(world)
    assert [worker_mode(cfg, rank, world) for rank in range(world)] == modes
    assert [m.rollout_process for m in modes] == [m in (P, L, F) for m in modes]
