"""The training entrypoint under parallel layouts: the same loss sequence as one process."""


import pytest

from tests.distributed.test_pretrain_resume import _losses, _run, setup  # noqa: E402,F401  (module fixture: tokenizer + data)


@pytest.mark.e2e
@pytest.mark.parametrize("nproc,layout", [
    (4, ["parallel.tp=2", "parallel.ep=2"]),
    (2, ["parallel.cp=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
])
def test_layout_gives_the_single_process_loss_sequence(setup, nproc, layout):  # noqa: F811 (the fixture)
    cfg = setup / "cfg.yaml"
    ref_dir = setup / "layout_ref"
    if not (ref_dir / "metrics.jsonl").exists():
        r = _run(cfg, f"run.dir={ref_dir}", "train.steps=6", "checkpoint.interval=100")
        assert r.returncode == 0, r.stderr[-3000:]
    run_dir = setup / ("layout_" + "_".join(o.replace("parallel.", "").replace("=", "") for o in layout))
    r = _run(cfg, f"run.dir={run_dir}", "train.steps=6", "checkpoint.interval=100", *layout, nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = _losses(ref_dir), _losses(run_dir)
    assert [s for s, _ in got] == [s for s, _ in ref] and len(ref) == 6
    for (_, a), (_, b) in zip(ref, got):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (ref, got)
