"""examples/tiny/rl_agent.yaml, shortened: asynchronous RL on generated agent tasks in sandboxes. The episodes
are real multi-turn ones (tool observations between turns, summaries at the trigger), the shaped rewards of a
group differ, so advantages and gradients are non-zero, and the held-out pass@1 / pass@K are logged.

The tiny model is random except for its output head, which leans to <tool_call> and to <|im_end|>: its turns open
tool calls (malformed: the agent loop answers with an error and the episode goes on) and end at varied lengths,
as a model that has not yet learnt the format does."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_composer.config import load_config

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples/tiny/rl_agent.yaml"


def _setup(rl_assets, root: Path) -> list[str]:
    """Generated tasks, the leaning initial checkpoint; the overrides of examples/tiny/rl_agent.yaml that use them."""
    from megatron_composer.checkpoint.dcp import save_checkpoint
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.config import RLConfig
    from rl.model import full_model
    from rl.sandbox import LocalBackend, SandboxError
    from tools.task_family import generate_splits

    try:
        LocalBackend()
    except SandboxError as e:
        pytest.skip(f"no isolated sandbox on this host: {e}")
    generate_splits(root / "tasks", {"train": 4, "heldout": 2}, seed=5)
    overrides = {
        "run.dir": root / "run", "data.tokenizer": rl_assets / "tok", "data.tasks": root / "tasks/train",
        "eval.tasks": root / "tasks/heldout", "eval.interval": 2, "eval.samples": 2, "eval.at_start": True,
        "model.overrides": "{num_layers: 2, num_mtp_layers: 0}", "data.seq_length": 2048,
        "train.steps": 2, "train.groups_per_step": 2, "train.micro_batch_size": 4,
        "rollout.group_size": 3, "rollout.max_seq_len": 2048, "rollout.cache_memory_mb": 64,
        "rollout.agent_max_turns": 3, "rollout.agent_max_new_tokens": 10, "rollout.summary_max_new_tokens": 8,
        # this tokenizer (~2 bytes a token) makes a first context of ~300-350 tokens with the compact profile: a
        # summary after the first turns
        "rollout.summary_trigger_tokens": 400, "rollout.sandbox_concurrency": 3, "rollout.group_timeout_s": 300,
        "optim.lr": 1e-3, "optim.min_lr": 1e-3, "checkpoint.init_from": root / "init", "checkpoint.keep_last": 0,
    }
    overrides = [f"{k}={v}" for k, v in overrides.items()]
    cfg = load_config(RLConfig, str(CONFIG), overrides)
    tok = load_tokenizer(cfg.data.tokenizer)
    torch.manual_seed(0)
    model, meta = full_model(cfg, tok)
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] += 50.0  # a residual direction present at every position
        d = model.config.hidden_size
        model.output.weight[tok.token_to_id("<tool_call>"), 0] = 6.0 / d ** 0.5
        model.output.weight[tok.token_to_id("<|im_end|>"), 0] = 4.0 / d ** 0.5
    save_checkpoint(root / "init", 0, model, None, {"step": 0}, meta)
    return overrides


def _inject_faults(patch: pytest.MonkeyPatch) -> None:
    """One fault of each kind among the training episodes (#57): the first fork fails, as a host's would; the second
    episode's verifier phase meets a folder the agent left where the phase's machinery writes (class 9 of #57)."""
    from rl.sandbox import SandboxError
    from rl.sandbox.pool import SandboxPool

    fork, lock, forks = SandboxPool.fork, threading.Lock(), []

    @contextlib.contextmanager
    def faulty_fork(self, task):
        if "heldout" in str(task.source):  # held-out evaluation: untouched
            with fork(self, task) as sandbox:
                yield sandbox
            return
        with lock:
            forks.append(task.name)
            n = len(forks)
        if n == 1:
            raise SandboxError("injected: cannot fork the task's snapshot (the host's fault)")
        with fork(self, task) as sandbox:
            if n == 2:
                def enter_verifier(services: bool = True):
                    raise SandboxError("cannot make the verifier's directories: [Errno 17] File exists: "
                                       "'/var/log/entrypoint.log' (injected: the episode's doing)")
                sandbox.enter_verifier = enter_verifier
            yield sandbox

    patch.setattr(SandboxPool, "fork", faulty_fork)


@pytest.fixture(scope="module")
def run(rl_assets, tmp_path_factory):
    from rl.config import RLConfig
    from rl.launch import run_rl

    root = tmp_path_factory.mktemp("agent_rl")
    console = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(console):
        _inject_faults(patch)
        run_rl(load_config(RLConfig, str(CONFIG), _setup(rl_assets, root)))
    print(console.getvalue())
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return rows, console.getvalue()


def test_sigterm_in_the_middle_of_episodes_leaves_nothing_behind(rl_assets, tmp_path, sandbox_parent):
    """rl_composer.py stopped by SIGTERM (as SLURM and torchrun stop jobs) while its sandboxes run episodes: no
    folder, mount or cgroup of it is left."""
    from tests.sandbox_assets import NOTHING, left_by

    overrides = _setup(rl_assets, tmp_path) + ["train.steps=50"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "rl_composer.py"), "--config", str(CONFIG), *overrides],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(sandbox_parent), "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not any(n.startswith("mc-sandbox-") for n in left_by(sandbox_parent, proc.pid)["folders"]):
            assert proc.poll() is None and time.monotonic() < deadline, "the run made no sandbox"
            time.sleep(0.05)
        time.sleep(1.0)  # episodes under way: commands running, snapshots taken
        assert left_by(sandbox_parent, proc.pid)["folders"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == -signal.SIGTERM and "SIGTERM: released" in err, err[-3000:]
    assert left_by(sandbox_parent, proc.pid) == NOTHING


def test_agent_rl_trains_multi_turn_episodes_with_nonzero_gradients(run):
    run, _ = run
    assert [r["step"] for r in run] == [0, 1, 2]  # step 0: the held-out evaluation of the initial weights
    start, run = run[0], run[1:]
    assert {"eval_pass@1", "eval_pass@2"} <= set(start) and "loss" not in start
    for r in run:
        # 2 groups of 3, never the evaluation's groups (2 tasks x 2 samples)
        assert r["episodes"] == 6 and r["turns"] > r["episodes"]  # more than one turn per episode on average
        assert r["advantage_abs_mean"] > 0 and r["grad_norm"] > 0 and r["loss"] != 0 and r["train_tokens"] > 0
        assert r["length_penalty_mean"] < 0 and r["malformed_tool_calls_mean"] < 0  # the shaping terms are on
        # dynamic sampling (rl.refill_groups of the config) runs and is counted
        assert {"refilled_groups", "equal_reward_groups_replaced"} <= set(r)
        assert r["refilled_groups"] >= r["equal_reward_groups_replaced"] >= 0
    assert sum(r["summaries"] for r in run) > 0 and max(r["segments_per_episode"] for r in run) > 1
    assert {"eval_pass@1", "eval_pass@2"} <= set(run[-1]) and 0 <= run[-1]["eval_pass@1"] <= run[-1]["eval_pass@2"] <= 1
    assert "eval_tool_calls_per_episode" in start and any(k.startswith("eval_tier") for k in start)  # per tier
    assert start["eval_tasks"] == 2 and start["eval_pass@1_se"] >= 0  # its sampling error, per tier too
    assert sum(v for k, v in start.items() if k.startswith("eval_tier") and k.endswith("_tasks")) == 2
    for r in (start, run[-1]):  # run by the embedded rollout worker's engine on the version just published
        assert r["eval_workers"] == ["embedded0"] and r["eval_token_versions"] == [r["eval_weight_version"]]
    assert start["eval_weight_version"] == 0 and run[-1]["eval_weight_version"] == run[-1]["weight_version"]


def test_infrastructure_faults_are_retried_and_policy_errors_scored_in_one_run(run):
    """The injected faults (`_inject_faults`): the host's was retried, the episode's own scored 0 and was kept; no
    group was dropped or re-queued (every step trained on its 2 groups of 3), and the console line names both."""
    rows, console = run
    steps = rows[1:]
    assert sum(r["infra_faults"] for r in steps) == 1
    assert sum(r["policy_errors"] for r in steps) >= 1  # the injected one (a tiny model's episodes may add more)
    assert all(r["episodes"] == 6 for r in steps)
    assert "infrastructure fault (1/3): injected: cannot fork" in console
    for r in steps:  # the trainer's console line of each step
        line = next(x for x in console.splitlines() if x.startswith(f"step {r['step']} |"))
        assert f"infra_faults {r['infra_faults']:.4g}" in line and f"policy_errors {r['policy_errors']:.4g}" in line \
            and "reward_mean" in line, line
