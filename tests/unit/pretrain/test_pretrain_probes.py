"""Evaluation probes of a pretraining stage (train.eval_hooks) and the early stop on them (train.stop_below): the
probes are logged beside the validation loss, the stage ends with a checkpoint at the first evaluation that
reaches every threshold, and a probe path or threshold that cannot work is refused before any step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_composer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
PROBE = "tests.unit.pretrain.test_pretrain_probes:countdown_probe"
_CALLS: list[int] = []


def countdown_probe(model, tokenizer) -> dict:
    """3, 2, 1, 0, ... over successive evaluations, and a number that depends on the model and the tokenizer."""
    _CALLS.append(1)
    param = next(model.parameters())
    return {"countdown": 3.0 - (len(_CALLS) - 1), "probe_vocab": float(tokenizer.vocab_size + 0 * param.sum())}


@pytest.fixture(scope="module")
def corpus(rl_assets, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    root = tmp_path_factory.mktemp("probe_corpus")
    (root / "src").mkdir()
    for i in range(8):
        (root / "src" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\nclass A{i}:\n    pass\n" * 8)
    assert preprocess_data.main(["--input", str(root / "src"), "--tokenizer", str(rl_assets / "tok"),
                                 "--output-prefix", str(root / "code"), "--workers", "1"]) == 0
    return root / "code"


def _cfg(rl_assets, corpus, run_dir, **extra):
    from pretrain.trainer import PretrainConfig

    over = {"run.dir": run_dir, "model.preset": "tiny-qwen3-moe", "model.overrides": "{num_layers: 1}",
            "data.tokenizer": rl_assets / "tok", "data.paths": f"[{corpus}]", "data.seq_length": 32,
            "data.split": "'90,10,0'", "train.steps": 8, "train.global_batch_tokens": 64,
            "train.micro_batch_size": 2, "train.eval_interval": 2, "train.eval_samples": 2, "checkpoint.interval": 100,
            "mtp.weight": 0.0, "logging.interval": 1, "train.eval_hooks": f"[{PROBE}]", **extra}
    cfg = load_config(PretrainConfig, None, [f"{k}={v}" for k, v in over.items()])
    cfg.validate()
    return cfg


def test_probes_are_logged_and_the_stage_stops_at_the_threshold_with_a_checkpoint(rl_assets, corpus, tmp_path,
                                                                                   capsys):
    from pretrain.trainer import run_stage

    _CALLS.clear()
    run_stage(_cfg(rl_assets, corpus, tmp_path / "run", **{"train.stop_below": "{countdown: 0.5}"}))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    probed = [r for r in rows if "countdown" in r]
    # evaluations at steps 0, 2, 4, 6: the countdown reaches 0 at step 6, which is the last step run
    assert [(r["step"], r["countdown"]) for r in probed] == [(0, 3.0), (2, 2.0), (4, 1.0), (6, 0.0)]
    assert all("val_loss" in r and r["probe_vocab"] > 0 for r in probed)
    assert rows[-1]["step"] == 6 and rows[-1].get("stopped_early") == 1.0
    assert (tmp_path / "run" / "checkpoints" / "step_6").is_dir()
    out = capsys.readouterr().out
    assert "stopping at step 6: countdown 0 < 0.5" in out
    assert "countdown 3" in out  # the probes' numbers are on the console line too


def test_without_a_threshold_the_stage_runs_its_steps(rl_assets, corpus, tmp_path):
    from pretrain.trainer import run_stage

    _CALLS.clear()
    run_stage(_cfg(rl_assets, corpus, tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 8 and [r["step"] for r in rows if "countdown" in r] == [0, 2, 4, 6, 8]


def test_a_threshold_on_a_metric_nobody_reports_is_refused_before_any_step(rl_assets, corpus, tmp_path):
    from pretrain.trainer import run_stage

    with pytest.raises(ConfigError, match=r"train.stop_below names \['copy_pool_second'\], which no evaluation"):
        run_stage(_cfg(rl_assets, corpus, tmp_path / "run", **{"train.stop_below": "{copy_pool_second: 1.0}"}))
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


@pytest.mark.parametrize("extra, needle", [
    ({"train.eval_hooks": "[no_such_module:probe]"}, "train.eval_hooks: function path 'no_such_module:probe'"),
    ({"train.eval_hooks": "[tools.copy_eval:no_such_probe]"}, "has no function 'no_such_probe'"),
    ({"parallel.tp": 2}, "train.eval_hooks run the whole model on every rank"),
])
def test_probes_that_cannot_run_are_one_config_error(rl_assets, corpus, tmp_path, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(rl_assets, corpus, tmp_path / "run", **extra)
