"""The training entrypoint under FSDP x expert parallelism on 4 ranks: the single-process losses, an exact resume
after SIGKILL (from asynchronous checkpoints), and its checkpoint resumed with FSDP off in another layout."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.distributed.test_pretrain_resume import ENV, ROOT, _cmd, _losses, _run, setup  # noqa: E402,F401  (module fixture)

STEPS = 8
FSDP = ["parallel.fsdp=true", "parallel.ep=2"]
COMMON = [f"train.steps={STEPS}", "train.micro_batch_size=2", "checkpoint.interval=2", "checkpoint.keep_last=0"]


def _close(a, b, tol):
    return all(sa == sb and abs(x - y) <= tol * max(1.0, abs(x)) for (sa, x), (sb, y) in zip(a, b)) and len(a) == len(b)


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.timeout(3600)  # seven 1- to 4-rank runs
def test_fsdp_expert_parallel_pretraining_matches_one_process_resumes_exactly_and_changes_layout(setup):  # noqa: F811
    cfg = setup / "cfg.yaml"
    ref_dir, fsdp_dir, killed_dir = setup / "fsdp_ref", setup / "fsdp_ep2", setup / "fsdp_killed"
    r = _run(cfg, f"run.dir={ref_dir}", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(cfg, f"run.dir={fsdp_dir}", *COMMON, *FSDP, nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    reference, fsdp = _losses(ref_dir), _losses(fsdp_dir)
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))
    assert _close(fsdp, reference, 1e-4), (reference, fsdp)

    # SIGKILL every process of a 4-rank run once a checkpoint is published mid-run, then run it again
    proc = subprocess.Popen(_cmd(cfg, f"run.dir={killed_dir}", *COMMON, *FSDP, "checkpoint.async_save=true", nproc=4),
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = killed_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (killed_dir / "latest").exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 6:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    steps_before = len(_losses(killed_dir))
    assert 0 < steps_before < STEPS, "the run finished before it could be killed"
    r = _run(cfg, f"run.dir={killed_dir}", *COMMON, *FSDP, "checkpoint.async_save=true", nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    assert _losses(killed_dir) == fsdp  # bit-identical to the uninterrupted FSDP run
    assert (killed_dir / "latest").read_text().strip() == f"checkpoints/step_{STEPS}"

    # the FSDP run's step-4 checkpoint resumes with FSDP off: tensor parallel on 2 ranks, expert parallel 4
    for name, nproc, layout in (("fsdp_to_tp2", 2, ["parallel.tp=2"]), ("fsdp_to_ep4", 4, ["parallel.ep=4"])):
        run = setup / name
        shutil.copytree(fsdp_dir, run)
        for later in range(6, STEPS + 1, 2):
            shutil.rmtree(run / "checkpoints" / f"step_{later}")
        (run / "latest").write_text("checkpoints/step_4")
        r = _run(cfg, f"run.dir={run}", *COMMON, *layout, nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout
        got = _losses(run)
        assert got[:4] == fsdp[:4]
        assert _close(got, reference, 1e-4), (name, reference, got)
    (setup / "fsdp_losses.json").write_text(json.dumps({"one_process": reference, "fsdp_ep2": fsdp}))
