"""ZeRO-1 in the pretraining loop: two data-parallel ranks with parallel.zero1 give the single-process loss
sequence while each holds about half of the AdamW state, skip a step whose loss is non-finite on one rank
only, and their checkpoint resumes on one rank (and the one-rank checkpoint on two).

Run as a script under torchrun, this file is the data-parallel worker (it records each rank's optimizer)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero1")
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
        "train": {"steps": STEPS, "global_batch_tokens": 256, "micro_batch_size": 2, "eval_interval": 0,
                  "eval_samples": 0, "peak_flops": 1e11},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 0.5},
        "parallel": {"zero1": True, "grad_bucket_mb": 0.05},  # small buckets: several per parameter family
        "checkpoint": {"interval": 2, "keep_last": 0},
        "logging": {"interval": 100},
    }
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return d


def _losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _run_here(cfg_path, run_dir, monkeypatch):
    """One process, in this interpreter; returns the bytes of AdamW moments it held."""
    import pretrain.trainer as trainer
    from megatron_composer.config import load_config

    built = []
    real = trainer.Layout.build_optimizer

    def recording(layout, *args):
        built.append(real(layout, *args))
        return built[-1]

    monkeypatch.setattr(trainer.Layout, "build_optimizer", recording)
    trainer.run_stage(load_config(trainer.PretrainConfig, str(cfg_path), [f"run.dir={run_dir}"]))
    opt = built[0]
    assert type(opt).__name__ == "AdamW"
    return sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items()
               if k in ("exp_avg", "exp_avg_sq"))


def test_zero1_dp2_matches_one_process_and_resumes_on_one_rank(setup, monkeypatch):
    cfg = setup / "cfg.yaml"
    full_bytes = _run_here(cfg, setup / "ref", monkeypatch)
    ref = _losses(setup / "ref")
    assert [s for s, _ in ref] == list(range(1, STEPS + 1))

    dp2 = setup / "dp2"
    r = _run_dp2(cfg, dp2, poison_last_step_on_rank1=True)
    assert "ZeRO-1 sharded over dp x cp 2" in r.stdout
    got = _losses(dp2)
    assert [s for s, _ in got] == [s for s, _ in ref]
    for (_, a), (_, b) in zip(ref[:-1], got[:-1]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (ref, got)

    # the last step's loss is NaN on rank 1 only: both ranks skip the update (a rank that stepped alone would
    # leave its shard of the parameters out of step with the other's)
    rows = [json.loads(line) for line in (dp2 / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped"] for row in rows if "skipped" in row] == [0] * (STEPS - 1) + [1]

    # each rank keeps its half of every bucket's moments (plus at most a padding element per bucket)
    per_rank = [json.loads((dp2 / f"optimizer_rank{i}.json").read_text()) for i in range(2)]
    for rec in per_rank:
        assert rec["zero1"] and rec["buckets"] >= 2
        assert rec["updates_at_step"] == list(range(1, STEPS))
        assert abs(rec["state_bytes"] - full_bytes / 2) <= 8 * rec["buckets"], (rec, full_bytes)

    # the checkpoint holds every parameter's full moments, as the one-process run's does
    ref_ckpt = _flat_checkpoint(setup / "ref" / "checkpoints" / "step_2")
    dp2_ckpt = _flat_checkpoint(dp2 / "checkpoints" / "step_2")
    assert ref_ckpt.keys() == dp2_ckpt.keys()
    moments = [k for k in ref_ckpt if k.endswith(".exp_avg_sq")]
    assert moments and all(float(ref_ckpt[k].abs().max()) > 0 for k in moments)
    for k in moments:
        assert torch.allclose(ref_ckpt[k], dp2_ckpt[k], rtol=1e-4, atol=1e-12), k

    # the ZeRO-1 checkpoint of step 2 resumes on one rank (plain AdamW): steps 3 and 4 (whose loss depends on
    # the step-3 update, i.e. on the restored moments) give the one-process losses
    one = setup / "one"
    shutil.copytree(dp2, one)
    shutil.rmtree(one / "checkpoints" / f"step_{STEPS}")
    (one / "latest").write_text("checkpoints/step_2")
    _run_here(cfg, one, monkeypatch)
    resumed = _losses(one)
    assert [s for s, _ in resumed] == [s for s, _ in ref]
    for (_, a), (_, b) in zip(resumed[2:], ref[2:]):
        assert abs(a - b) < 1e-5, (resumed, ref)

    # and the one-process checkpoint resumes under ZeRO-1 on two ranks (moments re-sharded on load)
    two = setup / "two"
    shutil.copytree(setup / "ref", two)
    shutil.rmtree(two / "checkpoints" / f"step_{STEPS}")
    (two / "latest").write_text("checkpoints/step_2")
    r = _run_dp2(cfg, two)
    assert "resumed from" in r.stdout
    for (_, a), (_, b) in zip(_losses(two)[2:], ref[2:]):
        assert abs(a - b) < 1e-5, (_losses(two), ref)


def _run_dp2(cfg: Path, run_dir: Path, poison_last_step_on_rank1: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               ZERO1_TEST_POISON_STEP=str(STEPS if poison_last_step_on_rank1 else 0))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launcher, __file__, str(cfg), f"run.dir={run_dir}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _flat_checkpoint(ckpt: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    return {f"{top}.{k}": v for top in ("model", "optim") for k, v in sd[top].items()}


def _worker(cfg_path: str, overrides: list[str]) -> None:
    """One data-parallel rank: records its optimizer (state size, the steps it updated at) next to the run,
    and with ZERO1_TEST_POISON_STEP=s makes rank 1's loss NaN at step s."""
    import torch.distributed as dist

    import pretrain.trainer as trainer
    from megatron_composer.config import load_config

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_config(trainer.PretrainConfig, cfg_path, overrides)
    poison_step = int(os.environ.get("ZERO1_TEST_POISON_STEP", "0"))
    real_build, real_loss, real_lr = trainer.Layout.build_optimizer, trainer.pretrain_loss, trainer.lr_at
    record = {"updates_at_step": []}
    current = {"step": 0}

    def build(layout, model, ocfg):
        opt = real_build(layout, model, ocfg)
        real_step = opt.step

        def step():
            record["updates_at_step"].append(current["step"])
            real_step()

        opt.step = step
        record.update(zero1=opt.zero1, buckets=sum(1 for _ in opt._all_buckets()), state_bytes=opt.state_bytes())
        return opt

    def lr_at(step, *args):  # called once at the start of each step
        current["step"] = step + 1
        return real_lr(step, *args)

    def loss(output, batch, *args, **kwargs):
        value, stats = real_loss(output, batch, *args, **kwargs)
        if rank == 1 and current["step"] == poison_step:
            value, stats["lm_loss"] = value * float("nan"), stats["lm_loss"] * float("nan")
        return value, stats

    trainer.Layout.build_optimizer, trainer.pretrain_loss, trainer.lr_at = build, loss, lr_at
    try:
        trainer.run_stage(cfg)
        (Path(cfg.run.dir) / f"optimizer_rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
