"""tools/ablate.py's table and plot from the metrics rows of finished runs (the runs themselves are RL runs;
`tools/ablate.py --report-only` tabulates existing ones)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
import ablate  # noqa: E402


def _rows(rewards, tokens=16.0, heldout=None):
    rows = [{"step": i + 1, "reward_mean": r - 0.1, "verifier_reward_mean": r, "mismatch_masked_fraction": 0.01,
             "kl": 0.002, "generated_tokens": tokens * 8, "episodes": 8.0} for i, r in enumerate(rewards)]
    if heldout is not None:  # (start, end): evaluations at step 0 and at the last step, as the trainer logs them
        rows.insert(0, {"step": 0, "eval_pass@1": heldout[0], "eval_pass@8": 0.5})
        rows.append({"step": len(rewards), "eval_pass@1": heldout[1], "eval_pass@8": 0.7})
    return rows


def _write(out: Path, arm: str, seed: int, rows: list[dict]) -> None:
    run = out / arm / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "cut')
    (run / "done").write_text("ok\n")


def _table(out: Path) -> dict[str, dict]:
    return {r["arm"]: r for r in csv.DictReader(open(out / "ablation.csv"))}


def test_table_and_plot_from_finished_runs(tmp_path):
    for seed, rewards in ((1, [0.0, 0.2, 0.4]), (2, [0.0, 0.4, 0.6])):
        _write(tmp_path, "baseline", seed, _rows(rewards))
    assert ablate.main(["--config", "unused.yaml", "--arms", "baseline,shaping", "--seeds", "2", "--out", str(tmp_path),
                        "--final-steps", "2", "--report-only"]) == 0
    rows = _table(tmp_path)
    assert float(rows["baseline"]["verifier_reward_mean"]) == pytest.approx((0.3 + 0.5) / 2)
    assert float(rows["baseline"]["verifier_reward_std"]) == pytest.approx(2 ** 0.5 * 0.1)
    assert float(rows["baseline"]["reward_mean"]) == pytest.approx(0.3)
    # the bootstrap interval of two seeds' means spans exactly the two values
    assert float(rows["baseline"]["verifier_reward_low"]) == pytest.approx(0.3)
    assert float(rows["baseline"]["verifier_reward_high"]) == pytest.approx(0.5)
    assert float(rows["baseline"]["tokens_per_episode_mean"]) == 16.0 and rows["shaping"]["seeds"] == "0"
    md = (tmp_path / "ablation.md").read_text()
    assert "| baseline | 2 | 3 | 0.400 [0.300, 0.500]" in md
    assert "verifier reward gain over the run" in md  # no held-out set: the training reward's rise
    assert (tmp_path / "reward_curves.png").stat().st_size > 1000


def test_differences_to_the_baseline_and_held_out_pass_at_1(tmp_path):
    base_end = [0.30, 0.34, 0.28, 0.33, 0.31]
    for seed, end in enumerate(base_end, 1):
        _write(tmp_path, "baseline", seed, _rows([0.2, 0.3, end], heldout=(0.15, end)))
        _write(tmp_path, "std_norm", seed, _rows([0.2, 0.4, end + 0.15], heldout=(0.15, end + 0.15)))
        _write(tmp_path, "r2", seed, _rows([0.2, 0.3, base_end[-seed]], heldout=(0.15, base_end[-seed])))
    assert ablate.main(["--config", "unused.yaml", "--arms", "std_norm,r2", "--seeds", "5", "--out", str(tmp_path),
                        "--final-steps", "1", "--report-only"]) == 0
    rows = _table(tmp_path)
    assert list(rows) == ["baseline", "std_norm", "r2"]  # the baseline is always run and listed first
    assert float(rows["std_norm"]["heldout_pass1_diff_mean"]) == pytest.approx(0.15)
    assert float(rows["std_norm"]["heldout_pass1_diff_low"]) > 0  # separated in every seed
    assert float(rows["std_norm"]["heldout_gain_mean"]) == pytest.approx(sum(base_end) / 5 + 0.15 - 0.15)
    assert float(rows["r2"]["heldout_pass1_diff_low"]) < 0 < float(rows["r2"]["heldout_pass1_diff_high"])
    assert json.loads(rows["r2"]["per_seed"])["heldout_start"] == [0.15] * 5
    md = (tmp_path / "ablation.md").read_text()
    std_line = next(line for line in md.splitlines() if line.startswith("| std_norm"))
    r2_line = next(line for line in md.splitlines() if line.startswith("| r2"))
    assert std_line.count(" *") == 2 and " *" not in r2_line
    gain, spread = sum(base_end) / 5 - 0.15, float(rows["baseline"]["heldout_pass1_std"])
    assert f"held-out pass@1 gain over the run {gain:.3f}" in md and f"= {gain / spread:.1f}" in md


def test_unknown_arm_and_bad_counts_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        ablate.main(["--config", "x.yaml", "--arms", "nope", "--out", str(tmp_path), "--report-only"])
    with pytest.raises(SystemExit):
        ablate.main(["--config", "x.yaml", "--jobs", "0", "--out", str(tmp_path), "--report-only"])


def test_all_leaves_summarisation_out_on_single_turn_tasks_and_adds_the_held_out_evaluations():
    config = str(ROOT / "examples/tiny/rl.yaml")
    assert "summarisation" not in ablate.default_arms(config, [])
    assert "summarisation" in ablate.default_arms(config, [f"data.tasks={ROOT / 'examples/tasks'}"])
    extra = ablate.run_overrides(config, ["train.steps=30"])
    assert "eval.at_start=true" in extra and "eval.interval=30" in extra  # 30 is no multiple of the config's 20
    assert not any(o.startswith("eval.interval") for o in ablate.run_overrides(config, ["train.steps=40"]))
