"""A step whose loss is not finite is skipped (no parameter update), logged, and training continues."""

import json
import sysconfig
from pathlib import Path

import torch

import pretrain.trainer as trainer
from megatron_composer.config import from_dict

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_nonfinite_step_is_skipped_and_logged(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    import preprocess_data
    import train_tokenizer

    assert train_tokenizer.main(["--input", str(STDLIB / "json"), "--output", str(tmp_path / "tok"),
                                 "--vocab-size", "512"]) == 0
    assert preprocess_data.main(["--input", str(STDLIB / "json"), "--tokenizer", str(tmp_path / "tok"),
                                 "--output-prefix", str(tmp_path / "code"), "--workers", "1"]) == 0
    cfg = from_dict(trainer.PretrainConfig, {
        "run": {"dir": str(tmp_path / "run")},
        "model": {"overrides": {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                                "moe_intermediate_size": 32}},
        "data": {"tokenizer": str(tmp_path / "tok"), "paths": [str(tmp_path / "code")], "split": "90,10,0",
                 "seq_length": 32},
        "train": {"steps": 4, "global_batch_tokens": 128, "micro_batch_size": 4, "eval_interval": 0, "eval_samples": 0,
                  "peak_flops": 1e11},
        "checkpoint": {"interval": 10},
    })
    cfg.validate()
    calls = {"n": 0}
    real_loss = trainer.pretrain_loss
    snapshots = []

    def poisoned(output, batch, *args, **kwargs):
        loss, stats = real_loss(output, batch, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:  # the single micro-batch of step 2
            loss = loss * float("nan")
            stats["lm_loss"] = stats["lm_loss"] * float("nan")
        return loss, stats

    real_step = torch.optim.AdamW.step

    def recording_step(self, *a, **k):
        snapshots.append(calls["n"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(trainer, "pretrain_loss", poisoned)
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    trainer.run_stage(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "skipped" in r]
    assert [r["skipped"] for r in train_rows] == [0, 1, 0, 0]
    assert snapshots == [1, 3, 4]  # no optimizer update after the poisoned micro-batch
    assert all(r["loss"] == r["loss"] for r in train_rows if not r["skipped"])  # finite afterwards
