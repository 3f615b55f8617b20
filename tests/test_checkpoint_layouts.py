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
    for case, r in loads.items():
        assert r["wrong"] == [] and r["n"] > 100 and r["step"] == 1, (case, r["wrong"][:5])


def test_checkpoints_load_across_fsdp_hsdp_tp_ep_zero1_and_one_rank(tmp_path):
    """Model and AdamW state saved under FSDP x ep2 load exactly with FSDP off (tp2 + ZeRO-1, ep4, one rank),
    under HSDP and FSDP x tp2 x ep2, and the reverse (uneven FSDP chunks included)."""
    def launch(nproc, name, ckpts_from=None):
        extra = [f"--ckpt-dir={tmp_path / ckpts_from / 'ckpts'}"] if ckpts_from else []
        return run_worker("checkpoint_worker.py", nproc, ["--cases", "save_load", *extra], tmp_path / name)

    first = launch(1, "one")  # the one-rank checkpoint the 4-rank layouts load
    four = launch(4, "four", ckpts_from="one")
    one = launch(1, "one_again", ckpts_from="four")
    assert first["saved"] == ["one_rank"] and first["loads"] == {}
    assert four["saved"] == ["fsdp_ep2", "fsdp_tp2_ep2", "hsdp_ep2", "tp2_ep2", "ep4"]
    loads = {**four["loads"], **one["loads"]}
    assert len(loads) == 14
    _check(loads)


def test_fsdp_expert_parallel_resume_from_an_async_save_gives_the_uninterrupted_losses(tmp_path):
    r = run_worker("checkpoint_worker.py", 4, ["--cases", "resume"], tmp_path)
    assert len(r["straight"]) == 4 and r["resumed"] == r["straight"] and r["invisible_until_finished"]
