"""End to end: `torchrun --nproc-per-node 3 rl_composer.py ... trainer_ranks=2 parallel.tp=2`: ranks 0-1 train
the tiny MoE model tensor-parallel, rank 2 generates; the run logs rewards every step, publishes every version,
checkpoints, and a second launch with the same run.dir resumes the layout's checkpoint."""

from __future__ import annotations

import json
import os
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


def _launch(rl_assets: Path, run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    over = {
        "run.dir": run_dir, "data.tokenizer": rl_assets / "tok", "data.tasks": rl_assets / "tasks",
        "model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
        "trainer_ranks": 2, "parallel.tp": 2, "train.steps": steps, "train.groups_per_step": 1,
        "train.micro_batch_size": 4, "train.seed": 3, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
        "rollout.max_inflight_groups": 2, "rollout.max_seq_len": 128, "rollout.cache_memory_mb": 16,
        "rollout.lease_s": 20, "rollout.heartbeat_s": 0.5, "rollout.group_timeout_s": 240,
        "optim.lr": 1e-3, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-3,
        "rl.loss_constant": 6, "checkpoint.interval": 2, "checkpoint.keep_last": 0, "logging.interval": 1,
        "weight_sync.dtype": "float32", "weight_sync.poll_seconds": 0.2, "checkpoint.init_from": "''",
        "eval.interval": 0,
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), str(ROOT / "rl_composer.py"), "--config", str(ROOT / "examples/tiny/rl.yaml"),
           *[f"{k}={v}" for k, v in over.items()]]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.dist
@pytest.mark.e2e
def test_three_processes_two_tensor_parallel_trainer_ranks(rl_assets, tmp_path):
    run_dir = tmp_path / "run"
    res = _launch(rl_assets, run_dir, steps=2)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "on 2 trainer rank(s) (tp 2, cp 1, ep 1, dp 1)" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= r["reward_best_of_k"] <= 1.0 and r["train_tokens"] > 0
        assert r["weight_sync_bytes"] > 0 and r["weight_version"] == r["step"]
    manifests = sorted(p.name for p in (run_dir / "weights").rglob("*") if "manifest" in p.name)
    assert len(manifests) >= 3, manifests  # v0 (initial), v1, v2
    assert (run_dir / "latest").read_text().strip() == "checkpoints/step_2"
    # the same command with more steps resumes the tensor-parallel checkpoint and continues the epoch
    res = _launch(rl_assets, run_dir, steps=3)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "resumed from" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert len({p for r in rows for p in r["prompts"]}) == 3
