"""tools/evaluate.py: a checkpoint with its run's config scored on a task set (K samples per task, pass@1 <=
pass@K, a transcript row per episode, the summary file), the same rows on a second run (seeded), and a checkpoint
without its run's config refused with one line and status 2."""

import json
import subprocess
import sys
from pathlib import Path

from megatron_composer.config import load_config, save_config

ROOT = Path(__file__).resolve().parents[3]
EVALUATE = ROOT / "tools" / "evaluate.py"


def _checkpoint(assets: Path, where: Path) -> Path:
    from megatron_composer.checkpoint.dcp import save_checkpoint
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.config import RLConfig
    from rl.model import full_model

    cfg = load_config(RLConfig, None, [
        f"data.tokenizer={assets / 'tok'}", f"data.tasks={assets / 'tasks'}", "model.preset=tiny-deepseek-v3",
        "model.overrides={num_layers: 2, num_mtp_layers: 0}", "rollout.max_new_tokens=6", "rollout.max_seq_len=128",
        "rollout.cache_memory_mb=16", "checkpoint.init_from=''", f"run.dir={where}"])
    model, meta = full_model(cfg, load_tokenizer(cfg.data.tokenizer), seed=3)
    save_checkpoint(where, 0, model, None, {"step": 0}, meta)  # where/checkpoints/step_0, where/latest
    save_config(cfg, where / "config.yaml")
    return where / "checkpoints" / "step_0"


def _evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EVALUATE), *args], capture_output=True, text=True, timeout=600)


def test_a_checkpoint_is_scored_on_a_task_set(rl_assets, tmp_path):
    ckpt = _checkpoint(rl_assets, tmp_path / "run")
    tasks = sorted(json.loads(x)["id"] for x in (rl_assets / "tasks" / "tasks.jsonl").read_text().splitlines() if x)
    rows = []
    for i in range(2):
        res = _evaluate("--tasks", str(rl_assets / "tasks"), "--checkpoint", str(ckpt), "--samples", "3",
                        "--output", str(tmp_path / f"rows{i}.jsonl"), "--summary", str(tmp_path / f"s{i}.json"))
        assert res.returncode == 0, res.stderr[-3000:]
        rows.append((tmp_path / f"rows{i}.jsonl").read_text())
    summary = json.loads((tmp_path / "s0.json").read_text())
    assert summary["tasks"] == len(tasks) and summary["samples"] == 3
    assert 0 <= summary["pass@1"] <= summary["pass@3"] <= 1
    assert sorted(t["task"] for t in summary["per_task"]) == tasks
    lines = [json.loads(x) for x in rows[0].splitlines()]
    assert len(lines) == 3 * len(tasks) and {r["sample"] for r in lines} == {0, 1, 2}
    assert rows[0] == rows[1]  # seeded: the same episodes again
    assert res.stdout.strip().splitlines()[-1].startswith("pass@1 ")
    # the run directory names the same checkpoint (its latest)
    again = _evaluate("--tasks", str(rl_assets / "tasks"), "--checkpoint", str(tmp_path / "run"), "--samples", "3",
                      "--output", str(tmp_path / "rows2.jsonl"))
    assert again.returncode == 0 and (tmp_path / "rows2.jsonl").read_text() == rows[0]


def test_a_checkpoint_without_its_run_config_is_one_line(rl_assets, tmp_path):
    ckpt = _checkpoint(rl_assets, tmp_path / "run")
    (tmp_path / "run" / "config.yaml").unlink()
    res = _evaluate("--tasks", str(rl_assets / "tasks"), "--checkpoint", str(ckpt))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "config.yaml" in res.stderr and "does not exist" in res.stderr
