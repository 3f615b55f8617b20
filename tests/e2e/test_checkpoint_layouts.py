"""DCP checkpoints across parallel layouts (FSDP, HSDP, tensor/expert parallel, ZeRO-1, one rank): model and
AdamW state written under any layout load exactly under any other, and an FSDP run resumes exactly."""


import pytest

from tests.distributed import torchrun  # noqa: E402

run_worker = torchrun.run_worker

pytestmark = pytest.mark.dist


def _check(loads):
    for case, r in loads.items():
        assert r["wrong"] == [] and r["n"] > 100 and r["step"] == 1, (case, r["wrong"][:5])


@pytest.mark.e2e  # four launches; test_trainer_layouts resumes across layouts in make test
def test_checkpoints_load_across_every_layout(tmp_path):
    """Model and AdamW state saved under each of one rank, tp2, ep2, cp2, dp2 + ZeRO-1, fsdp, fsdp x tp2,
    fsdp x tp2 + sp, fsdp x cp2, fsdp x ep2, fsdp x tp2 x ep2 and HSDP x ep2 (after a forward with no backward,
    which leaves FSDP's root unit gathered) load exactly under at least two other layouts each: FSDP on and off,
    another tp, another ep, other world sizes (uneven FSDP chunks included)."""
    def launch(nproc, name, *sources):
        dirs = ",".join(str(tmp_path / s / "ckpts") for s in sources)
        return run_worker("checkpoint_worker.py", nproc, ["--cases", "save_load", f"--ckpt-dir={dirs}"],
                          tmp_path / name)

    launches = [launch(1, "one"), launch(4, "four", "one"), launch(2, "two", "one", "four"),
                launch(1, "one_again", "one", "four", "two")]
    saved = [name for r in launches for name in r["saved"]]
    loads = {k: v for r in launches for k, v in r["loads"].items()}
    savers = {"one_rank", "tp2", "ep2", "cp2", "dp2_zero1", "fsdp", "fsdp_tp2", "fsdp_tp2_sp", "fsdp_cp2",
              "fsdp_ep2", "fsdp_tp2_ep2", "hsdp_ep2"}
    assert savers <= set(saved)
    pairs = [tuple(k.split("->")) for k in loads]
    assert len(pairs) == 45, sorted(pairs)
    for saver in savers:
        into = [dst for src, dst in pairs if src == saver and dst != saver]
        assert len(into) >= 2, (saver, into)
        assert any(("sdp" in d) != ("sdp" in saver) for d in into), (saver, into)  # FSDP or HSDP on one side
    _check(loads)


@pytest.mark.e2e  # an async save's publication: tests/unit/checkpoint/test_checkpoint_async.py in make test
def test_fsdp_expert_parallel_resume_from_an_async_save_gives_the_uninterrupted_losses(tmp_path):
    r = run_worker("checkpoint_worker.py", 4, ["--cases", "resume"], tmp_path)
    assert len(r["straight"]) == 4 and r["resumed"] == r["straight"] and r["invisible_until_finished"]
