"""tools/plot_metrics.py draws pretraining curves and RL reward/staleness charts to PNG."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import plot_metrics  # noqa: E402


def _write(run: Path, rows: list[dict]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')  # cut line
    return run


def test_rl_run_gets_reward_and_staleness_panels(tmp_path):
    run = _write(tmp_path / "rl", [{"step": s, "loss": 0.1, "reward_mean": 0.1 * s, "reward_best_of_k": 0.2 * s,
                                     "staleness_hist": {"0": 10, "1": 50 + s, "2": s},
                                     **({"eval_pass@1": 0.05 * s} if s % 2 else {})}
                                    for s in range(1, 6)])
    out = tmp_path / "rl.png"
    assert plot_metrics.main([str(run), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pretraining_chain_and_missing_run(tmp_path, capsys):
    a = _write(tmp_path / "a", [{"step": s, "loss": 5 - 0.1 * s, "mtp1_top1": 0.1 * s} for s in range(1, 5)])
    b = _write(tmp_path / "b", [{"step": s, "loss": 4 - 0.1 * s, "val_loss": 4.2} for s in range(1, 5)])
    out = tmp_path / "loss.png"
    assert plot_metrics.main([str(a), str(b), "--output", str(out)]) == 0 and out.stat().st_size > 1000
    assert plot_metrics.main([str(tmp_path / "nope"), "--output", str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_ema_is_debiased_and_follows_the_mean_of_an_alternating_curve():
    assert plot_metrics.ema([3.0, 3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0, 3.0])  # no pull toward 0
    alternating = [0.1 if s % 2 else 4.5 for s in range(200)]  # two data sets taking turns, as in the SFT stage
    late = plot_metrics.ema(alternating, 0.9)[100:]
    assert max(late) - min(late) < 0.5 and abs(sum(late) / len(late) - 2.3) < 0.1


def test_training_curve_is_drawn_raw_in_a_light_shade_under_its_ema(tmp_path, capsys):
    import matplotlib.pyplot as plt

    run = _write(tmp_path / "sft", [{"step": s, "loss": 0.1 if s % 2 else 4.5, **({"val_loss": 1.0} if s % 10 == 0
                                                                                    else {})} for s in range(1, 41)])
    assert plot_metrics.main([str(run), "--output", str(tmp_path / "a.png")]) == 0
    lines = {line.get_label(): line for line in plt.gcf().axes[0].get_lines()}
    smooth = lines["sft train (EMA 0.9)"]
    raw = next(line for line in lines.values() if list(line.get_ydata()) == [0.1 if s % 2 else 4.5
                                                                            for s in range(1, 41)])
    assert raw.get_alpha() < 0.5 and raw.get_color() == smooth.get_color()
    assert max(smooth.get_ydata()[10:]) - min(smooth.get_ydata()[10:]) < 1.0
    assert list(lines["sft val"].get_ydata()) == [1.0] * 4  # validation points as they are
    assert plot_metrics.main([str(run), "--output", str(tmp_path / "b.png"), "--smoothing", "0"]) == 0
    assert "sft train" in {line.get_label() for line in plt.gcf().axes[0].get_lines()}
    assert plot_metrics.main([str(run), "--output", str(tmp_path / "c.png"), "--smoothing", "1"]) == 2
    assert "--smoothing must be in [0, 1)" in capsys.readouterr().err


def test_copy_probe_panel_plots_against_tokens_with_the_gate_and_the_law(tmp_path):
    """A stage with the copy probe (train.eval_hooks: tools.copy_eval:copy_probe) gets a panel of the probe against
    training tokens, the gate line, the measured formation points of the open copy (its second copy first under 1.5,
    then under 1 nat/word) and the induction-head law's prediction for its tokens per step."""
    import matplotlib.pyplot as plt

    rows = [{"step": s, "loss": 8 - s / 1000, "tokens_seen": 1024 * s,
             **({"copy_pool_first": 9.0, "copy_pool_second": 8.0 - s / 500, "copy_open_second": 7.5 - s / 400}
                if s % 500 == 0 else {})} for s in range(1, 3001)]
    rows.insert(0, {"step": 0, "copy_pool_first": 9.0, "copy_pool_second": 9.0, "copy_open_second": 8.5})
    run = _write(tmp_path / "tiny_base", rows)
    assert plot_metrics.main([str(run), "--output", str(tmp_path / "base.png")]) == 0
    ax = plt.gcf().axes[-1]
    lines = {line.get_label(): line for line in ax.get_lines()}
    second = lines["tiny_base pool second"]
    assert list(second.get_xdata()) == pytest.approx([1024 * s / 1e6 for s in range(0, 3001, 500)])
    assert list(lines["gate 1 nat/word"].get_ydata()) == [1.0, 1.0]
    assert list(lines["tiny_base open < 1.5"].get_xdata()) == pytest.approx([2500 * 1024 / 1e6])
    assert list(lines["tiny_base open < 1"].get_xdata()) == pytest.approx([3000 * 1024 / 1e6])
    law = [line for line in ax.get_lines() if line.get_label().startswith("_") and line.get_xdata()[0] > 0]
    assert law and law[0].get_xdata()[0] == pytest.approx(10 ** 5.7 * 1024 ** 0.5 / 1e6)
