"""The asynchronous RL system: orchestrator queue semantics, an in-process run, a killed rollout worker and a
killed trainer, each ending with every prompt of the epoch trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_composer.config import load_config
from rl.orchestrator import Orchestrator, QueueError, WorkItem, WorkQueue
from tests.rl_assets import write_rl_assets

ROOT = Path(__file__).resolve().parents[3]

# -- orchestrator and queue (no model) ----------------------------------------------------------------------
def _result(item: WorkItem, version: int, rewards=(0.0, 1.0)) -> dict:
    return {"gid": item.gid, "prompt_index": item.prompt_index, "attempt": item.attempt,
            "episodes": [{"reward": r, "segments": []} for r in rewards],
            "version_counts": {version: 4}, "min_weight_version": version}


def test_claims_are_exclusive_and_expired_leases_requeue(tmp_path):
    q = WorkQueue(tmp_path)
    for g in range(3):
        q.put(WorkItem(g, 10 + g))
    a, b = q.claim("wa"), q.claim("wb")
    assert (a.gid, b.gid) == (0, 1)
    assert q.requeue_expired(lease_s=60) == []
    # wa dies: its lease expires, the group goes back with attempt + 1, and wa's late result is refused
    assert sorted(q.requeue_expired(lease_s=0.0, now=time.time() + 1)) == [0, 1]
    again = q.claim("wc")
    assert again.gid == 0 and again.attempt == 1
    assert not q.complete("wa", a, _result(a, 0))
    assert q.complete("wc", again, _result(again, 0))
    assert q.done_ids() == [0]


def test_epoch_with_crashes_stale_groups_and_resume_trains_each_prompt_once(tmp_path):
    q = WorkQueue(tmp_path / "q")
    orch = Orchestrator(q, num_prompts=10, group_size=2, seed=3, max_inflight_groups=3, max_staleness=1, lease_s=0.5)
    trained: list[int] = []
    version = 0

    def work(crash_every: int = 0):
        n = 0
        while (item := q.claim("w")) is not None:
            n += 1
            if crash_every and n % crash_every == 0:
                os.utime(q.root / "claimed" / f"{item.gid}.w.json", (0, 0))  # dead worker: lease long expired
                continue
            # every third group is generated with weights too old to be used
            stale = item.gid % 3 == 0 and item.attempt == 0
            q.complete("w", item, _result(item, version - 5 if stale else version))

    def collect(o: Orchestrator, n: int, crash_every: int = 0) -> list[dict]:
        got: list[dict] = []
        while len(got) < n and not o.exhausted:
            o.fill()
            work(crash_every)
            try:
                got += o.next_groups(1, version, timeout_s=1.0, poll_s=0.01)
            except QueueError:
                pass  # only crashed claims left: their leases expire and they are worked again
        return got

    for _ in range(3):
        trained += [r["prompt_index"] for r in collect(orch, 2, crash_every=2)]
        version += 1
    state = json.loads(json.dumps(orch.state_dict()))  # what the checkpoint stores
    # the trainer dies: a fresh orchestrator resumes from the checkpointed state
    orch2 = Orchestrator(q, num_prompts=10, group_size=2, seed=3, max_inflight_groups=3, max_staleness=1, lease_s=0.5)
    orch2.load_state_dict(state)
    while not orch2.exhausted:
        trained += [r["prompt_index"] for r in collect(orch2, 2)]
        version += 1
    assert sorted(trained) == list(range(10))
    assert orch.stats.requeued_stale >= 1 and orch.stats.requeued_crashed >= 1


def test_orchestrator_drops_results_it_did_not_issue(tmp_path):
    q = WorkQueue(tmp_path)
    orch = Orchestrator(q, num_prompts=2, group_size=2, seed=0, max_inflight_groups=1, max_staleness=0)
    orch.fill()
    item = q.claim("w")
    q.complete("w", item, _result(item, 0))
    ghost = WorkItem(99, 1)
    q.put(ghost)
    q.claim("w")
    q.complete("w", ghost, _result(ghost, 0))
    got = orch.next_groups(1, 0, timeout_s=5)
    orch.fill()
    item = q.claim("w")
    q.complete("w", item, _result(item, 0))
    got += orch.next_groups(1, 0, timeout_s=5)
    assert [r["gid"] for r in got] == [0, 1] and orch.stats.ignored_duplicates == 1
    assert orch.exhausted and q.done_ids() == []


def test_groups_ask_for_weights_no_older_than_the_staleness_bound(tmp_path):
    """Issued at trainer version v, a group asks for weights >= v - max_staleness; a worker holding older ones
    leaves it pending, and a stale group is redone asking for the same bound."""
    q = WorkQueue(tmp_path)
    orch = Orchestrator(q, num_prompts=6, group_size=2, seed=0, max_inflight_groups=2, max_staleness=1)
    orch.fill(version=3)
    items = [WorkItem.from_json(p.read_text()) for p in sorted((q.root / "pending").glob("*.json"))]
    assert [it.min_version for it in items] == [2, 2]
    assert WorkItem.from_json(items[0].to_json()) == items[0]
    assert not items[0].runs_on(1) and items[0].runs_on(2) and WorkItem(0, 0).runs_on(0)
    assert WorkItem(0, 0, eval_version=4).runs_on(4) and not WorkItem(0, 0, eval_version=4).runs_on(3)
    assert q.claim("w", accept=lambda it: it.runs_on(1)) is None  # the engine holds v1: nothing it may run
    a = q.claim("w", accept=lambda it: it.runs_on(2))
    q.complete("w", a, _result(a, 0))  # generated with v0 anyway (an old worker): dropped and redone
    b = q.claim("w")
    q.complete("w", b, _result(b, 3))
    (got,) = orch.next_groups(1, 3, timeout_s=5, poll_s=0.01)
    assert got["gid"] == b.gid and orch.stats.requeued_stale == 1
    redo = WorkItem.from_json((q.root / "pending" / f"{a.gid}.json").read_text())
    assert (redo.attempt, redo.min_version) == (1, 2)


def test_held_out_items_wait_for_the_version_and_never_reach_training(tmp_path):
    """OrchestratorRole.evaluate issues tagged items into the eval queue; a worker whose engine holds an older
    version may not take them; their results come back by task and never as training groups."""
    import threading
    from types import SimpleNamespace

    from rl.orchestrator import OrchestratorRole

    rollout = SimpleNamespace(group_size=2, max_inflight_groups=2, max_staleness=0, lease_s=30, group_timeout_s=20)
    role = OrchestratorRole(tmp_path, num_prompts=4, rollout=rollout, seed=0)
    eval_q = role.queue.held_out()
    held = {"v": 2}

    def worker():
        while True:
            item = eval_q.claim("w", accept=lambda it: it.eval_version <= held["v"])
            if item is None:
                if role.queue.stop_requested("w"):
                    return
                time.sleep(0.01)
                continue
            assert item.eval_version == 3 and item.samples == 3
            eps = [{"reward": 1.0, "verifier_reward": float(i == 0), "segments": []} for i in range(item.samples)]
            eval_q.complete("w", item, {**_result(item, held["v"]), "episodes": eps, "eval_version": item.eval_version})

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    threading.Timer(0.3, lambda: held.update(v=3)).start()  # the engine applies v3 a moment later
    results = role.evaluate(3, num_tasks=2, samples=3)
    role.stop()
    t.join(5)
    assert [r["prompt_index"] for r in results] == [0, 1] and {r["min_weight_version"] for r in results} == {3}
    from rl.metrics import summarize_groups

    tasks = [SimpleNamespace(name=f"t{i}", kind="single_turn") for i in range(2)]
    summary = summarize_groups(tasks, results, samples=3)   # the verifier reward decides, not the shaped one
    assert summary["pass@1"] == pytest.approx(1 / 3) and summary["pass@3"] == 1.0
    # nothing of the evaluation is a training group: the training queue saw none of it
    assert role.queue.done_ids() == [] and not any(eval_q.root.glob("*/*"))


# -- tiny end-to-end runs -------------------------------------------------------------------------------------
PROMPTS = [("Start a function.", r"[\s\S]*def[\s\S]*"), ("Write an import.", r"[\s\S]*import[\s\S]*"),
           ("Return a value.", r"[\s\S]*return[\s\S]*"), ("Say hi.", r"[\s\S]*hi[\s\S]*"),
           ("Name a loop keyword.", r"[\s\S]*(for|while)[\s\S]*"), ("Write a class.", r"[\s\S]*class[\s\S]*"),
           ("Count to three.", r"[\s\S]*3[\s\S]*"), ("Open a file.", r"[\s\S]*open[\s\S]*")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A byte-level BPE tokenizer.json with the chat markers and a task set of 8 single-turn prompts."""
    return write_rl_assets(tmp_path_factory.mktemp("rl_assets"), PROMPTS)


def _overrides(assets: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": run_dir, "data.tokenizer": assets / "tok", "data.tasks": assets / "tasks",
        "model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
        "train.steps": 4, "train.groups_per_step": 2, "train.micro_batch_size": 8, "train.seed": 7,
        "rollout.group_size": 4, "rollout.max_new_tokens": 6, "rollout.max_inflight_groups": 3,
        "rollout.max_staleness": 2, "rollout.max_seq_len": 128, "rollout.cache_memory_mb": 16,
        "rollout.lease_s": 4, "rollout.heartbeat_s": 0.5, "rollout.group_timeout_s": 120,
        "optim.lr": 1e-3, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-3,
        "rl.loss_constant": 6, "checkpoint.interval": 2, "checkpoint.keep_last": 0, "logging.interval": 1,
        "weight_sync.dtype": "float32", "checkpoint.init_from": "''", "eval.interval": 0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _trained_prompts(run_dir: Path) -> list[int]:
    return sorted(p for r in _metrics(run_dir) for p in r.get("prompts", []))  # step 0: evaluation only


def test_in_process_run_logs_metrics_checkpoints_and_consumes_the_epoch(assets, tmp_path):
    from rl.config import RLConfig
    from rl.launch import run_rl

    run_dir = tmp_path / "run"
    cfg = load_config(RLConfig, None, _overrides(assets, run_dir, **{
        "eval.tasks": assets / "tasks", "eval.interval": 2, "eval.samples": 2, "eval.at_start": True}))
    run_rl(cfg)
    start, *rows = _metrics(run_dir)
    evals = [start] + [r for r in rows if "eval_pass@1" in r]
    assert start["step"] == 0 and "loss" not in start and start["eval_weight_version"] == 0  # the initial weights
    assert [r["step"] for r in evals] == [0, 2, 4] and all(
        0 <= r["eval_pass@1"] <= r["eval_pass@2"] <= 1 for r in evals)
    for r in evals:
        # measured by the rollout worker's engine, on exactly the version just published
        assert r["eval_workers"] == ["embedded0"] and r["eval_token_versions"] == [r["eval_weight_version"]]
        assert r["eval_weight_version"] == r.get("weight_version", 0)
    # the evaluation groups (2 samples each, every held-out task) were never trained on
    assert all(r["episodes"] == 2 * 4 for r in rows) and not any((run_dir / "rollouts/eval/done").iterdir())
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "reward_mean", "reward_best_of_k", "advantage_std", "kl", "mismatch_masked_fraction",
                "routing_mismatch_token_fraction", "staleness_hist", "weight_sync_bytes", "weight_sync_seconds",
                "episodes", "turns", "generated_tokens", "infra_faults"):
        assert key in rows[-1], key
    assert all(r["reward_best_of_k"] >= r["reward_mean"] for r in rows)
    assert _trained_prompts(run_dir) == list(range(len(PROMPTS)))
    assert (run_dir / "config.yaml").is_file() and (run_dir / "latest").read_text().strip() == "checkpoints/step_4"
    # off-policy tokens were trained: versions behind the trainer appear in the staleness histogram
    assert any(int(k) >= 1 for r in rows for k in r["staleness_hist"])


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def _wait_for(cond, timeout: float, what: str, details=lambda: ""):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{details()}")
        time.sleep(0.05)


def test_killed_rollout_worker_mid_episode_loses_and_duplicates_nothing(assets, tmp_path):
    run_dir = tmp_path / "run"
    common = _overrides(assets, run_dir, **{"rollout.max_new_tokens": 24})
    cmd = [sys.executable, str(ROOT / "rl_composer.py"), "--config", str(ROOT / "examples/tiny/rl.yaml"), *common]
    trainer = subprocess.Popen(cmd + ["role=trainer"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    victim_log = open(tmp_path / "victim.log", "w")
    victim = subprocess.Popen(cmd + ["role=rollout"], env=dict(_env(), RL_WORKER_NAME="victim"),
                              stdout=victim_log, stderr=subprocess.STDOUT)
    rescuer = None
    try:
        claimed = run_dir / "rollouts" / "claimed"
        _wait_for(lambda: claimed.is_dir() and any(claimed.glob("*.victim.json")) or trainer.poll() is not None, 120,
                  "the worker to claim a group", lambda: (tmp_path / "victim.log").read_text()[-2000:])
        assert trainer.poll() is None, trainer.communicate()[0][-3000:]
        victim.send_signal(signal.SIGKILL)  # mid-group: the claim stays behind without a heartbeat
        victim.wait()
        rescuer = subprocess.Popen(cmd + ["role=rollout"], env=dict(_env(), RL_WORKER_NAME="rescuer"),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out, _ = trainer.communicate(timeout=240)
        assert trainer.returncode == 0, out[-3000:]
    finally:
        for p in (trainer, victim, rescuer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        victim_log.close()
    assert "lost its worker" in out
    assert _trained_prompts(run_dir) == list(range(len(PROMPTS)))
    assert _metrics(run_dir)[-1]["requeued_crashed"] >= 1


def test_trainer_killed_after_a_checkpoint_resumes_the_epoch(assets, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "rl_composer.py"), "--config", str(ROOT / "examples/tiny/rl.yaml"),
           *_overrides(assets, run_dir, **{"checkpoint.interval": 2})]
    first = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: (run_dir / "latest").is_file() and metrics.is_file()
                  and any(json.loads(x)["step"] >= 3 for x in metrics.read_text().splitlines() if x.strip()),
                  180, "step 3 after the first checkpoint")
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (run_dir / "latest").read_text().strip() == "checkpoints/step_2"
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from" in res.stdout
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _trained_prompts(run_dir) == list(range(len(PROMPTS)))


def test_help_lists_the_rl_schema():
    res = subprocess.run([sys.executable, str(ROOT / "rl_composer.py"), "--help"], capture_output=True, text=True,
                         env=_env(), timeout=120)
    assert res.returncode == 0
    for key in ("run:", "rollout:", "max_staleness", "weight_sync:", "kl_coef", "checkpoint:"):
        assert key in res.stdout, key


@pytest.mark.parametrize("path", sorted(ROOT.glob("examples/*/rl*.yaml")), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_rl_configs_load(path):
    from megatron_composer.config import ConfigError
    from rl.config import RLConfig

    cfg = load_config(RLConfig, path)
    assert cfg.rollout.max_staleness >= 0 and cfg.rl.router_replay == "r3"
    if max(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.ep) > 1:  # a one-process launch is refused by name
        with pytest.raises(ConfigError, match="single trainer rank|needs rollout processes"):
            cfg.check_runnable(world=1)


def test_bad_task_files_are_named(tmp_path):
    from megatron_composer.config import ConfigError
    from rl.rollout.tasks import load_rl_tasks

    (tmp_path / "tasks.jsonl").write_text('{"prompt": "x", "check": {"regex": "("}}\n')
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: check.regex does not compile"):
        load_rl_tasks(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_rl_tasks(tmp_path / "missing")
    from tests.unit.envs.test_envs_real_tasks import multi_step_task

    multi_step_task(tmp_path / "agentic")
    with pytest.raises(ConfigError, match=r"multi-step is a multi-step task \(\[\[steps\]\]\); RL rollouts run "
                                          r"single-step tasks"):
        load_rl_tasks(tmp_path / "agentic")


def test_pass_at_k():
    from rl.metrics import pass_at_k

    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)


def test_agent_episode_on_a_bundled_task_keeps_the_exact_token_stream(assets, tmp_path):
    """A bundled Harbor task through the rollout worker: sandbox, tool observations as context tokens, verifier."""
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.config import RLConfig
    from rl.model import full_model
    from rl.orchestrator import WorkItem
    from rl.rollout.config import RolloutConfig
    from rl.rollout.tasks import load_rl_tasks
    from rl.rollout.worker import RolloutWorker
    from rl.sandbox import LocalBackend, SandboxError

    try:
        backend = LocalBackend()
    except SandboxError as e:
        pytest.skip(f"no isolated sandbox on this host: {e}")
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    import shutil

    shutil.copytree(ROOT / "examples/tasks/python-roman-numerals", task_dir / "python-roman-numerals")
    cfg = load_config(RLConfig, None, _overrides(assets, tmp_path / "run", **{"rollout.max_seq_len": 4096}))
    tok = load_tokenizer(cfg.data.tokenizer)
    torch.manual_seed(0)
    model, _ = full_model(cfg, tok)
    rollout = RolloutConfig(group_size=2, agent_max_turns=2, agent_max_new_tokens=24, max_seq_len=4096,
                            cache_memory_mb=128)
    worker = RolloutWorker("t", rollout, model, tok, load_rl_tasks(task_dir), queue=None, subscriber=None,
                           sandbox_backend=backend)
    result = worker.run_group(WorkItem(0, 0))
    assert result["kind"] == "agent" and len(result["episodes"]) == 2
    for ep in result["episodes"]:
        seg = ep["segments"][0]
        n = len(seg["response_ids"])
        assert len(seg["response_mask"]) == len(seg["response_logprobs"]) == n
        assert sum(seg["response_mask"]) == len(seg["weight_versions"]) == ep["meta"]["tokens"] > 0
        assert seg["routed_experts"].shape[1] == len(seg["prompt_ids"]) + n
        assert 0.0 <= ep["reward"] <= 1.0 and ep["meta"]["turns"] >= 1


@pytest.mark.parametrize("async_versions", [0, 1])
def test_weight_store_outage_is_counted_and_training_continues(assets, tmp_path, monkeypatch, async_versions):
    from rl.config import RLConfig
    from rl.trainer import Trainer
    from rl.weight_sync import ObjectStoreError

    cfg = load_config(RLConfig, None, _overrides(assets, tmp_path / "run", **{
        "train.steps": 2, "weight_sync.async_versions": async_versions}))
    trainer = Trainer(cfg)
    store = trainer.publisher.store
    real = store.put
    calls = {"n": 0}

    def flaky(key, data):
        if "v000000000001/" in key:   # the first publish after step 1: the store is down
            calls["n"] += 1
            raise ObjectStoreError(f"put weights/{key}: connection refused (after 5 retries)")
        return real(key, data)

    monkeypatch.setattr(store, "put", flaky)
    trainer.start_embedded_workers(1)
    trainer.fit()
    rows = _metrics(tmp_path / "run")
    # in the background (async_versions=1) step 2 learns of version 1's failure when it publishes version 2
    assert [r["weight_sync_failures"] for r in rows] == ([1.0, 1.0] if async_versions == 0 else [0.0, 1.0])
    assert trainer.publish_failures == 1 and calls["n"] >= 1
    prompts = _trained_prompts(tmp_path / "run")
    assert len(prompts) == len(set(prompts)) == 4
    assert not store.exists("v000000000001/manifest.json")   # the failed version stays invisible
    assert store.exists("v000000000002/manifest.json")       # the next one is published (a delta on version 0)
    if async_versions == 0:
        assert rows[1]["weight_sync_version"] == 2.0 and rows[1]["weight_sync_bytes"] > 0