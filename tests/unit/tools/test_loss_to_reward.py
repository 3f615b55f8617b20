"""tools/loss_to_reward.py (the report's Figure 2 at tiny scale): budgets, the trend statistics, and the table and
plot from finished stages and RL runs (the runs themselves are the demo chain's stages and RL runs)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tools import loss_to_reward as ltr

ROOT = Path(__file__).resolve().parents[3]


def test_budgets_scale_steps_and_warmup():
    cfg = ltr.pretrain_config(ROOT)
    budgets = ltr.budget_steps(cfg, [0.125, 0.25, 0.5, 1.0])
    assert [s for s, _ in budgets] == [round(cfg.train.steps * f) for f in (0.125, 0.25, 0.5, 1.0)]
    assert budgets[-1][1] == cfg.optim.warmup_steps
    assert all(1 <= w < s for s, w in budgets)


def test_trend_statistics():
    assert ltr.spearman([1, 2, 3, 4], [8, 6, 6, 1]) == pytest.approx(-0.9486832980505138)
    assert ltr.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    intercept, slope = ltr.fit_line([1.0, 2.0, 3.0], [5.0, 3.0, 1.0])
    assert (intercept, slope) == (pytest.approx(7.0), pytest.approx(-2.0))


def _metrics(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "done").write_text("ok\n")


def _rl_rows(final: float, start: float = 0.15) -> list[dict]:
    return ([{"step": 0, "eval_pass@1": start}]
            + [{"step": i, "reward_mean": final, "verifier_reward_mean": final, "generated_tokens": 64, "episodes": 4}
               for i in range(1, 4)]
            + [{"step": 3, "eval_pass@1": final}])


def test_report_from_finished_runs(tmp_path, capsys):
    budgets = ltr.budget_steps(ltr.pretrain_config(ROOT), [0.25, 0.5, 1.0])
    losses = {budgets[0][0]: 5.2, budgets[1][0]: 4.6, budgets[2][0]: 4.1}
    finals = {budgets[0][0]: [0.20, 0.24], budgets[1][0]: [0.30, 0.31], budgets[2][0]: [0.45, 0.41]}
    for steps, _ in budgets:
        b = tmp_path / f"budget{steps}"
        _metrics(b / "pretrain", [{"step": 1, "loss": 9.0}, {"step": steps, "val_loss": losses[steps]}])
        for seed, final in enumerate(finals[steps], 1):
            _metrics(b / "rl" / f"seed{seed}", _rl_rows(final))
    assert ltr.main(["--budgets", "0.25,0.5,1", "--seeds", "2", "--out", str(tmp_path), "--final-steps", "2",
                     "--report-only"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "loss_to_reward.csv")))
    assert [float(r["cpt_loss"]) for r in rows] == [5.2, 4.6, 4.1]
    assert float(rows[2]["heldout_pass1_mean"]) == pytest.approx(0.43)
    assert float(rows[0]["verifier_reward_low"]) == pytest.approx(0.20)
    md = (tmp_path / "loss_to_reward.md").read_text()
    assert "monotone (lower loss, higher reward at every budget): yes" in md and "Spearman rho -1.00" in md
    assert (tmp_path / "loss_to_reward.png").stat().st_size > 1000
    # a budget whose reward does not follow the loss is reported as not monotone
    _metrics(tmp_path / f"budget{budgets[1][0]}" / "rl" / "seed1", _rl_rows(0.6))
    _metrics(tmp_path / f"budget{budgets[1][0]}" / "rl" / "seed2", _rl_rows(0.6))
    assert ltr.main(["--budgets", "0.25,0.5,1", "--seeds", "2", "--out", str(tmp_path), "--report-only"]) == 0
    assert "monotone (lower loss, higher reward at every budget): no" in (tmp_path / "loss_to_reward.md").read_text()


def test_bad_budgets_and_missing_demo_data_are_refused(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        ltr.main(["--budgets", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        ltr.main(["--budgets", "0.5,x", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # both round to the same step count
        ltr.main(["--budgets", "0.5,0.501", "--out", str(tmp_path)])
    monkeypatch.setattr(ltr, "ROOT", tmp_path)  # a checkout where `make demo` has not run
    (tmp_path / "examples/tiny").mkdir(parents=True)
    (tmp_path / ltr.PRETRAIN).write_text((ROOT / ltr.PRETRAIN).read_text())
    assert ltr.main(["--budgets", "0.5,1", "--out", str(tmp_path / "out")]) == 2
    assert "run `make demo` first" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_slope_interval_resamples_seeds_within_budgets():
    points = [{"cpt_loss": x, "per_seed": {"heldout_pass1": ys}}
              for x, ys in ((6.0, [0.10, 0.12, 0.11]), (5.5, [0.20, 0.22, 0.21]), (5.0, [0.30, 0.29, 0.31]))]
    low, high = ltr.slope_interval(points, "heldout_pass1")
    assert low <= -0.2 <= high and high < 0  # the fitted slope -0.199 lies inside; the interval excludes 0
    noisy = [{"cpt_loss": x, "per_seed": {"heldout_pass1": ys}}
             for x, ys in ((6.0, [0.0, 0.4]), (5.5, [0.1, 0.3]), (5.0, [0.05, 0.35]))]
    low, high = ltr.slope_interval(noisy, "heldout_pass1")
    assert low < 0 < high
