"""DCP checkpoints across parallel layouts (FSDP, HSDP, tensor/expert parallel, ZeRO-1, one rank): model and
AdamW state written under any layout load exactly under any other, and an FSDP run resumes exactly."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("dist_torchrun", Path(__file__).parent / "dist" / "torchrun.py")
torchrun = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torchrun)
run_worker = torchrun.run_worker

pytestmark = pytest.mark.dist


def _check(loads):
    assert loads
    for case, r in loads.items():
        assert r["wrong"] == [] and r["n"] > 200 and r["step"] == 1, (case, r["wrong"][:5])


def test_every_layout_loads_every_other_layouts_checkpoint(tmp_path):
    four = run_worker("checkpoint_worker.py", 4, ["--cases", "save_load"], tmp_path / "w4")
    assert set(four["saved"]) == {"fsdp_ep2", "fsdp_tp2_ep2", "hsdp_ep2", "tp2_zero1", "ep4", "tp2_ep2"}
    _check(four["loads"])
    one = run_worker("checkpoint_worker.py", 1, ["--cases", "save_load", f"--ckpt-dir={tmp_path / 'w4' / 'ckpts'}",
                                                 f"--ckpt-in={','.join(four['saved'])}"], tmp_path / "w1")
    assert one["saved"] == ["one_rank"]
    assert {k.split("->")[0] for k in one["loads"]} == {"one_rank", *four["saved"]}
    _check(one["loads"])


def test_fsdp_expert_parallel_resume_from_an_async_save_gives_the_uninterrupted_losses(tmp_path):
    r = run_worker("checkpoint_worker.py", 4, ["--cases", "resume"], tmp_path)
    assert len(r["straight"]) == 4 and r["resumed"] == r["straight"] and r["invisible_until_finished"]
