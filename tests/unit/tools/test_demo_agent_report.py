"""What `make demo-agent` prints after its RL run: the SFT checkpoint's held-out pass rates per tier (the RL run's
step-0 evaluation, with their sampling errors) and the RL table with the held-out gain in standard errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def _metrics(path: Path) -> Path:
    step0 = {"step": 0, "eval_tasks": 96, "eval_pass@1": 0.25, "eval_pass@1_se": 0.015, "eval_pass@8": 0.5,
             "eval_tier1_tasks": 6, "eval_tier1_pass@1": 0.5, "eval_tier1_pass@1_se": 0.07, "eval_tier1_pass@8": 0.8,
             "eval_tier4_tasks": 90, "eval_tier4_pass@1": 0.23, "eval_tier4_pass@1_se": 0.016,
             "eval_tier4_pass@8": 0.48, "eval_tool_calls_per_episode": 2.0}
    steps = [{"step": s, "verifier_reward_mean": 0.2 + 0.01 * s} for s in range(1, 41)]
    end = {"step": 40, "eval_tasks": 96, "eval_pass@1": 0.31, "eval_pass@1_se": 0.016, "eval_pass@8": 0.6,
           "eval_tool_calls_per_episode": 2.5}
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [step0, *steps, end]))
    return path


def test_the_held_out_tiers_are_the_rl_runs_step_zero_evaluation(tmp_path):
    from tools.demo import _step0_eval

    summary = _step0_eval(_metrics(tmp_path / "rl"), 8)
    assert summary["tasks"] == 96 and summary["pass@1"] == 0.25 and summary["pass@1_se"] == 0.015
    assert summary["per_tier"] == {1: {"tasks": 6, "pass@1": 0.5, "pass@1_se": 0.07, "pass@8": 0.8},
                                   4: {"tasks": 90, "pass@1": 0.23, "pass@1_se": 0.016, "pass@8": 0.48}}


def test_the_rl_table_states_the_held_out_gain_in_standard_errors(tmp_path, capsys):
    from tools.demo import _rl_table

    _rl_table(_metrics(tmp_path / "rl"))
    out = capsys.readouterr().out
    assert "first fifth 0.245 -> last fifth 0.565" in out
    assert "0: 0.250 ± 0.015, 40: 0.310 ± 0.016" in out
    gain_se = 0.06 / (0.015 ** 2 + 0.016 ** 2) ** 0.5
    assert f"step 0 -> 40: +0.060 ({gain_se:+.1f} standard errors)" in out
    assert gain_se == pytest.approx(2.7, abs=0.05)
