"""End-to-end pretraining runs: exact resume after SIGKILL, safe saves, layout changes, and bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("pt")
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data
    import train_tokenizer

    assert train_tokenizer.main(["--input", str(STDLIB / "json"), "--output", str(d / "tok"),
                                 "--vocab-size", "512"]) == 0
    assert preprocess_data.main(["--input", str(STDLIB / "json"), "--tokenizer", str(d / "tok"),
                                 "--output-prefix", str(d / "code"), "--workers", "1"]) == 0
    cfg = {
        "run": {"dir": str(d / "run")},
        "model": {"preset": "tiny-deepseek-v3", "overrides": {"num_layers": 2, "hidden_size": 64, "num_heads": 2,
                                                              "intermediate_size": 128, "moe_intermediate_size": 32}},
        "data": {"tokenizer": str(d / "tok"), "paths": [str(d / "code")], "split": "90,10,0", "seq_length": 32},
        "train": {"steps": 24, "global_batch_tokens": 256, "micro_batch_size": 4, "eval_interval": 0, "eval_samples": 8,
                  "peak_flops": 1e11},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"interval": 4, "keep_last": 2},
        "logging": {"interval": 100},
    }
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return d


def _cmd(cfg, *overrides, nproc=1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    return [*launcher, str(ROOT / "pretrain_composer.py"), "--config", str(cfg), *overrides]


def _run(cfg, *overrides, nproc=1):
    return subprocess.run(_cmd(cfg, *overrides, nproc=nproc), capture_output=True, text=True, env=ENV, cwd=ROOT)


def _losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.e2e
def test_resume_after_sigkill_reproduces_loss_sequence(setup):
    cfg = setup / "cfg.yaml"
    ref = _run(cfg, f"run.dir={setup / 'ref'}")
    assert ref.returncode == 0, ref.stderr[-2000:]
    reference = _losses(setup / "ref")
    assert [s for s, _ in reference] == list(range(1, 25))

    killed_dir = setup / "killed"
    proc = subprocess.Popen(_cmd(cfg, f"run.dir={killed_dir}"), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if (killed_dir / "latest").exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 11:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_before = len(_losses(killed_dir))
    assert 0 < steps_before < 24, "the run finished before it could be killed"
    resumed = _run(cfg, f"run.dir={killed_dir}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert _losses(killed_dir) == reference  # bit-identical losses, one entry per step


@pytest.mark.e2e
@pytest.mark.dist
def test_layout_change_expert_parallel_to_single_rank_and_tensor_parallel(setup):
    """A checkpoint written by 2 ranks with ep=2 (experts sharded) resumes on 1 rank and on tp=2."""
    cfg = setup / "cfg.yaml"
    ep2 = setup / "ep2"
    r = _run(cfg, f"run.dir={ep2}", "train.steps=5", "parallel.ep=2", nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, nproc, layout in (("one", 1, []), ("tp2", 2, ["parallel.tp=2"])):
        run = setup / name
        shutil.copytree(ep2, run)
        shutil.rmtree(run / "checkpoints" / "step_5")
        (run / "latest").write_text("checkpoints/step_4")
        r = _run(cfg, f"run.dir={run}", "train.steps=5", *layout, nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _losses(run)[:4] == _losses(ep2)[:4]
        assert abs(_losses(run)[-1][1] - _losses(ep2)[-1][1]) < 1e-5, name


def test_bad_inputs_fail_cleanly_without_overwriting(setup):
    cfg = setup / "cfg.yaml"
    run = setup / "bad"
    r = _run(cfg, f"run.dir={run}", "train.steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    before = {p: p.read_bytes() for p in (run / "metrics.jsonl", run / "config.yaml", run / "latest")}

    cases = [
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (["model.vocab_size=256"], "vocab_size"),
        (["model.overrides={num_layers: 3, hidden_size: 64, num_heads: 2, intermediate_size: 128, "
          "moe_intermediate_size: 32}"], "different model architecture"),
        ([f"data.paths=[{setup / 'missing'}]"], "missing"),
    ]
    for overrides, message in cases:
        r = _run(cfg, f"run.dir={run}", "train.steps=30", *overrides)
        assert r.returncode != 0, overrides
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (overrides, r.stderr[-1500:])
        assert "Traceback" not in r.stderr
    assert {p: p.read_bytes() for p in before} == before


def test_kill_during_save_keeps_previous_latest(setup, monkeypatch, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp_mod

    from megatron_composer.checkpoint import dcp

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    meta = {"model": {"kind": "linear"}}
    dcp.save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, meta)
    saved = model.weight.detach().clone()

    def dies_midway(state, checkpoint_id):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(dcp_mod, "save", dies_midway)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        dcp.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, meta)
    monkeypatch.undo()
    assert dcp.find_latest(tmp_path).name == "step_1"
    state = dcp.load_checkpoint(dcp.find_latest(tmp_path), model, opt, meta)
    assert state["step"] == 1 and torch.equal(model.weight, saved)
    dcp.save_checkpoint(tmp_path, 2, model, opt, {"step": 2}, meta)  # the next save cleans the partial one
    assert not list((tmp_path / "checkpoints").glob(".*tmp")) and dcp.find_latest(tmp_path).name == "step_2"
    with pytest.raises(dcp.CheckpointError, match="different model architecture"):
        dcp.load_checkpoint(dcp.find_latest(tmp_path), model, opt, {"model": {"kind": "conv"}})
