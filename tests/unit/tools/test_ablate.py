"""tools/ablate.py's table and plot from the metrics rows of finished runs (the runs themselves are RL runs;
`tools/ablate.py --report-only` tabulates existing ones)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
import ablate  # noqa: E402


def _rows(rewards, tokens=16.0):
    return [{"step": i + 1, "reward_mean": r - 0.1, "verifier_reward_mean": r, "mismatch_masked_fraction": 0.01,
             "kl": 0.002, "generated_tokens": tokens * 8, "episodes": 8.0} for i, r in enumerate(rewards)]


def test_table_and_plot_from_finished_runs(tmp_path):
    for seed, rewards in ((1, [0.0, 0.2, 0.4]), (2, [0.0, 0.4, 0.6])):
        run = tmp_path / "baseline" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(rewards)) + '{"step": 4, "cut')
        (run / "done").write_text("ok\n")
    assert ablate.main(["--config", "unused.yaml", "--arms", "baseline,shaping", "--seeds", "2", "--out", str(tmp_path),
                        "--final-steps", "2", "--report-only"]) == 0
    rows = {r["arm"]: r for r in __import__("csv").DictReader(open(tmp_path / "ablation.csv"))}
    assert float(rows["baseline"]["verifier_reward_mean"]) == pytest.approx((0.3 + 0.5) / 2)
    assert float(rows["baseline"]["verifier_reward_std"]) == pytest.approx(2 ** 0.5 * 0.1)
    assert float(rows["baseline"]["reward_mean"]) == pytest.approx(0.3)
    assert float(rows["baseline"]["tokens_per_episode_mean"]) == 16.0 and rows["shaping"]["seeds"] == "0"
    assert "| baseline | 2 | 3 |" in (tmp_path / "ablation.md").read_text()
    assert (tmp_path / "reward_curves.png").stat().st_size > 1000


def test_unknown_arm_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        ablate.main(["--config", "x.yaml", "--arms", "nope", "--out", str(tmp_path)])
