"""End to end: `torchrun --nproc-per-node 3 rl_composer.py ... rollout.tp=2` (or rollout.ep=2): rank 0 trains,
ranks 1-2 are one tensor- (expert-) parallel rollout engine (rank 1 runs the worker through Lockstep, rank 2
follows and reads its own boxes of every weight version from the store itself). The run logs rewards, publishes
versions that both rollout ranks apply, trains on tokens of later versions, evaluates the held-out set on that
engine, and every process exits cleanly; a rollout.tp that does not divide the rollout ranks is refused with one
line before any work."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(rl_assets: Path, run_dir: Path, steps: int, **extra) -> list[str]:
    over = {
        "run.dir": run_dir, "data.tokenizer": rl_assets / "tok", "data.tasks": rl_assets / "tasks",
        "model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
        "rollout.tp": 2, "train.steps": steps, "train.groups_per_step": 1,
        "train.micro_batch_size": 4, "train.seed": 3, "rollout.group_size": 4, "rollout.max_new_tokens": 8,
        "rollout.max_inflight_groups": 1, "rollout.max_seq_len": 128, "rollout.cache_memory_mb": 16,
        "rollout.lease_s": 20, "rollout.heartbeat_s": 0.5, "rollout.group_timeout_s": 240,
        # on-policy only: groups trained after the first update must be sampled under it (not timing-dependent)
        "rollout.max_staleness": 0,
        "optim.lr": 1e-3, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-3,
        "rl.loss_constant": 8, "checkpoint.interval": 10, "checkpoint.keep_last": 0, "logging.interval": 1,
        "weight_sync.dtype": "float32", "weight_sync.poll_seconds": 0.1, "checkpoint.init_from": "''",
        "eval.interval": 0, "eval.at_start": "false", **extra,  # rl.yaml's own held-out evaluation off
    }
    return [f"{k}={v}" for k, v in over.items()]


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def _launch(rl_assets: Path, run_dir: Path, nproc: int, steps: int, env: dict | None = None,
            **extra) -> subprocess.CompletedProcess:
    env = env or _env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_port()), str(ROOT / "rl_composer.py"), "--config",
           str(ROOT / "examples/tiny/rl.yaml"), *_overrides(rl_assets, run_dir, steps, **extra)]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"rollout.tp": 2},
                                    pytest.param({"rollout.tp": 1, "rollout.ep": 2}, marks=pytest.mark.e2e)],
                         ids=["tp2", "ep2"])
def test_one_trainer_rank_and_a_tensor_parallel_rollout_group(rl_assets, tmp_path, layout):
    run_dir = tmp_path / "run"
    res = _launch(rl_assets, run_dir, nproc=3, steps=3, **layout, **{
        "eval.tasks": rl_assets / "tasks", "eval.interval": 2, "eval.samples": 2})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # held-out evaluation ran on the sharded engine (its worker is rollout rank 1) on the version just published
    evals = [r for r in rows if "eval_pass@1" in r]
    assert [r["step"] for r in evals] == [2, 3], [sorted(r) for r in rows]
    for r in evals:
        assert r["eval_workers"] == ["rank1"] and r["eval_weight_version"] == r["weight_version"]
        assert r["eval_token_versions"] == [r["eval_weight_version"]] and 0 <= r["eval_pass@1"] <= r["eval_pass@2"] <= 1
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= r["reward_best_of_k"] <= 1.0 and r["train_tokens"] > 0
        assert r["weight_sync_bytes"] > 0 and r["weight_version"] == r["step"]
    # the worker (rollout rank 0 of the group = global rank 1) and its follower (rank 2) applied the same versions
    worker = {int(v) for v in re.findall(r"worker rank1: applied weights v(\d+)", out)}
    follower = {int(v) for v in re.findall(r"rank2 \(rollout engine rank 1\): applied weights v(\d+)", out)}
    assert 0 in worker and max(worker) >= 1, out[-6000:]
    assert worker <= follower, (worker, follower)
    # groups trained after the first update were sampled (partly) under published versions > 0
    assert max(v for r in rows for v in r["token_versions"]) >= 1, [r["token_versions"] for r in rows]


@pytest.mark.dist
def test_rollout_tp_that_does_not_divide_the_rollout_ranks_is_refused(rl_assets, tmp_path):
    res = _launch(rl_assets, tmp_path / "run", nproc=2, steps=1)  # 1 rollout rank, rollout.tp=2
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert lines and ("rollout.tp x rollout.ep = 2 x 1 = 2 processes per engine does not divide the 1 rollout "
                      "rank(s)") in lines[0], res.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.dist
def test_separately_launched_tensor_parallel_rollouts(rl_assets, tmp_path):
    """role=trainer (one process) and `torchrun --nproc-per-node 2 ... role=rollout rollout.tp=2` against the same
    run.dir: the rollout group generates every group, follows the versions, and exits when the trainer is done."""
    run_dir = tmp_path / "run"
    env = _env(RL_WORKER_NAME="tpjob")
    over = ["role=trainer", "rollout.tp=2"]  # the trainer ignores rollout.tp
    trainer = subprocess.Popen(
        [sys.executable, str(ROOT / "rl_composer.py"), "--config", str(ROOT / "examples/tiny/rl.yaml"),
         *_overrides(rl_assets, run_dir, steps=2), *over], env=env, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        res = _launch(rl_assets, run_dir, nproc=2, steps=2, env=env, role="rollout")
    finally:
        trainer_out, _ = trainer.communicate(timeout=300)
    out = res.stdout + res.stderr
    assert trainer.returncode == 0, trainer_out[-6000:]
    assert res.returncode == 0, out[-6000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "worker tpjobx0: applied weights v1" in out, out[-6000:]
    assert "tpjobx1 (rollout engine rank 1): applied weights v1" in out, out[-6000:]
    assert max(v for r in rows for v in r["token_versions"]) >= 1, [r["token_versions"] for r in rows]


def test_rollout_launch_not_a_multiple_of_rollout_tp_is_refused(rl_assets, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "rl_composer.py"), "--config", str(ROOT / "examples/tiny/rl.yaml"),
                          *_overrides(rl_assets, tmp_path / "run", steps=1), "role=rollout"],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith(
        "error: rollout.tp x rollout.ep = 2 x 1 = 2 processes per engine does not divide this launch's 1 rollout "
        "process(es)"), res.stderr[-3000:]


def test_rollout_tp_that_does_not_divide_the_heads_is_refused(rl_assets, tmp_path):
    """Checked on every rank before any process group exists (here: rank 0 of 4, one trainer + a tp 3 group)."""
    res = subprocess.run([sys.executable, str(ROOT / "rl_composer.py"), "--config", str(ROOT / "examples/tiny/rl.yaml"),
                          *_overrides(rl_assets, tmp_path / "run", steps=1), "rollout.tp=3"],
                         env=_env(RANK="0", WORLD_SIZE="4"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert (last.startswith("error: rollout.tp=3 rollout.ep=1:")
            and "rollout.tp" in last[len("error: rollout.tp=3 rollout.ep=1:"):]), res.stderr[-3000:]
