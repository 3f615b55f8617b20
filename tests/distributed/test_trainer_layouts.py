"""The RL trainer on several trainer ranks equals one rank, and bad trainer layouts are refused up front.

tp2, tp2+sp, ep2 (also with a padding-only micro-batch on one dp rank), cp2 and dp2 with ZeRO-1 on 2 gloo
ranks, tp2+sp x cp2 x ep2, dp2 x tp2 x ep4 and fsdp x ep2 on 4 (workers/rl_worker.py): the step's RL loss
and every parameter gradient (max |diff| <= 1e-5 x max |ref| per tensor), the loss after one optimizer step,
the weights every rank publishes of its own shards (reconstructed from the store: bit-identical to the one-rank
initial weights and to the layout's own shards after the step), and a checkpoint save/load in the layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_composer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
from tests.distributed import torchrun  # noqa: E402

TOL = 1e-5
LAYOUTS = ["tp2", "tp2_sp", "ep2", "ep2_mbs1", "cp2", "dp2_zero1"]
LAYOUTS_4 = ["tp2_sp_cp2_ep2_zero1", "dp2_tp2_ep4_mbs2", "fsdp_ep2"]


@pytest.fixture(scope="module")
def results(rl_assets, tmp_path_factory):
    return torchrun.run_worker("rl_worker.py", 2, ["--tok", str(rl_assets / "tok")], tmp_path_factory.mktemp("rl2"))


@pytest.fixture(scope="module")
def results4(rl_assets, tmp_path_factory):
    return torchrun.run_worker("rl_worker.py", 4, ["--tok", str(rl_assets / "tok")], tmp_path_factory.mktemp("rl4"))


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rl_step_on_two_trainer_ranks_equals_one(results, layout):
    _check(results[layout])
    if layout == "ep2_mbs1":
        assert results[layout]["padding_only_micro_batches"] >= 1, "the padding-only micro-batch path did not run"


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS_4)
def test_rl_step_on_four_trainer_ranks_equals_one(results4, layout):
    _check(results4[layout])


@pytest.mark.dist
def test_each_trainer_rank_reads_only_its_own_samples(results4):
    """dp2 x tp2 from the step's record files: today's loss and gradients, and every rank read exactly its
    data-parallel share (tp peers the same share; the two dp shares together the whole step, once)."""
    r = results4["dp2_tp2_records"]
    assert r["ok"], r.get("error")
    bad = {k: v for k, v in r["errs"].items() if not v <= TOL}
    assert not bad and r["n_params"] >= 20, f"errors above {TOL}: {bad}"
    rows = r["bytes_per_rank"]  # [bytes read, dp rank, tp rank] per rank
    total = r["bytes_total"]
    by_dp = {}
    for read, dp, tp in rows:
        by_dp.setdefault(int(dp), set()).add(read)
        assert 0 < read < total
    assert all(len(v) == 1 for v in by_dp.values())  # tp peers read the same samples
    assert sum(v.pop() for v in by_dp.values()) == total


@pytest.mark.dist
def test_rl_checkpoints_resume_under_another_layout(rl_assets, tmp_path):
    """An RL checkpoint saved under fsdp x ep2 resumes under tp2 (2 ranks), and one saved there resumes under
    fsdp x ep2 (workers/rl_checkpoint_worker.py): the same weights exactly, and the saver's next optimizer step
    and loss (AdamW state carried over) within the layouts' reduction-order differences."""
    def launch(nproc, layout, name, load=None):
        extra = [f"--load={tmp_path / load}"] if load else []
        return torchrun.run_worker("rl_checkpoint_worker.py", nproc,
                                   ["--tok", str(rl_assets / "tok"), "--layout", layout, *extra], tmp_path / name)

    launch(4, "fsdp_ep2", "a")
    to_tp2 = launch(2, "tp2", "b", load="a")
    back = launch(4, "fsdp_ep2", "c", load="b")
    for res, src in ((to_tp2, "fsdp_ep2"), (back, "tp2")):
        assert res["loaded_from"] == src
        errs = res["errs"]
        assert errs["keys"] == errs["weights"] == errs["state"] == 0.0, errs
        assert errs["continuation"] <= TOL, errs


def _check(res):
    assert res["ok"], res.get("error")
    bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    assert res["n_params"] >= 20, "too few parameters compared"
    assert res["loss"] != 0.0 and res["loss"] != res["loss_after_step"], "the loss did not move"
    assert 0.0 < res["masked"] < 0.5 and res["train_tokens"] > 30, "mismatch masking or the token count is off"


def _cfg(**over):
    from rl.config import RLConfig

    return load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()]).validate()


@pytest.mark.parametrize("over, world, message", [
    ({"trainer_ranks": 3, "parallel.tp": 2}, 4, r"trainer_ranks=3 does not hold the layout .*tp\*cp = 2\*1"),
    ({"trainer_ranks": 2, "parallel.ep": 4}, 3, r"trainer_ranks=2 does not hold the layout .*parallel.ep = 4"),
    ({"trainer_ranks": 4}, 2, r"trainer_ranks=4 but this launch has 2 process"),
    ({"trainer_ranks": 2, "rollout.embedded_workers": 0}, 2, r"leaves no rollout rank"),
    ({"role": "trainer", "trainer_ranks": 1}, 4,
     r"role=trainer: all 4 process\(es\) of this launch train; set trainer_ranks=4"),
    ({"trainer_ranks": 1, "rollout.tp": 2, "rollout.ep": 2}, 3,
     r"rollout.tp x rollout.ep = 2 x 2 = 4 processes per engine does not divide the 2 rollout rank"),
    ({"role": "rollout", "rollout.ep": 2}, 3,
     r"rollout.tp x rollout.ep = 1 x 2 = 2 processes per engine does not divide"),
    ({"trainer_ranks": 2, "rollout.ep": 2}, 2, r"rollout.tp x rollout.ep = 1 x 2 needs rollout processes"),
])
def test_bad_trainer_layouts_are_refused_before_any_work(over, world, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**over).check_runnable(world)


def test_good_trainer_layouts_pass():
    _cfg(trainer_ranks=2, **{"parallel.tp": 2}).check_runnable(3)
    _cfg(trainer_ranks=2).check_runnable(2)  # no rollout rank: trainer rank 0 runs embedded workers
    _cfg(role="trainer", trainer_ranks=4, **{"parallel.cp": 2, "parallel.ep": 4}).check_runnable(4)
    _cfg(role="rollout", trainer_ranks=64, **{"parallel.ep": 8}).check_runnable(1)
    _cfg(trainer_ranks=1, **{"rollout.tp": 2, "rollout.ep": 2}).check_runnable(9)   # two engines of 2 x 2
    _cfg(role="rollout", **{"rollout.ep": 2}).check_runnable(4)


def test_a_previous_launchs_stop_marker_does_not_stop_a_worker_of_this_launch(tmp_path):
    import os
    import time

    from rl.orchestrator import WorkQueue

    q = WorkQueue(tmp_path / "rollouts")
    assert not q.stop_requested("w") and not q.stop_requested("w", since=time.time())
    q.stop_all()  # the previous launch's trainer finished
    old = time.time() - 60
    os.utime(q.root / "STOP", (old, old))
    started = time.time() - 1
    assert q.stop_requested("w") and not q.stop_requested("w", since=started)
    q.stop_all()  # this launch's trainer finishes
    assert q.stop_requested("w", since=started)
    q.clear_stop()
    (q.root / "workers" / "w.stop").write_text("stop\n")
    assert q.stop_requested("w", since=started) and not q.stop_requested("other", since=started)
