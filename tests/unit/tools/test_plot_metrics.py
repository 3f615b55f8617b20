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
