"""The mismatch filter's threshold is the quantile over the whole step's tokens, on 2 gloo ranks with several
micro-batches each (workers/rl_mismatch_worker.py): the masked fraction equals the single-batch quantile's,
through the algorithm and through the RL learner on dp=2."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from tests.distributed import torchrun  # noqa: E402


@pytest.fixture(scope="module")
def results(rl_assets, tmp_path_factory):
    return torchrun.run_worker("rl_mismatch_worker.py", 2, ["--tok", str(rl_assets / "tok")],
                               tmp_path_factory.mktemp("mismatch"))


@pytest.mark.dist
@pytest.mark.parametrize("case", ["algorithm_token", "algorithm_sequence"])
def test_step_quantile_over_ranks_and_micro_batches_equals_the_single_batch_quantile(results, case):
    r = results[case]
    assert r["ok"], r.get("error")
    assert r["threshold"] == pytest.approx(r["single_threshold"], rel=1e-6)
    assert r["masked_fraction"] == pytest.approx(r["single_masked_fraction"], abs=1e-12)
    assert 0 < r["masked_fraction"] < 0.1
    # a p99 per micro-batch (3 sequences) drops at least one token of each: several times the step's share
    assert r["per_micro_batch_masked_fraction"] > 2 * r["masked_fraction"]


@pytest.mark.dist
def test_learner_on_two_dp_ranks_masks_what_one_rank_masks(results):
    r = results["learner_dp2"]
    assert r["ok"], r.get("error")
    assert r["micro_batches_per_rank"] >= 2
    ref, par = r["mismatch_threshold"], r["mismatch_masked_fraction"]
    assert par[1] == pytest.approx(par[0], abs=1e-9) and 0 < par[0] < 0.3
    assert ref[1] == pytest.approx(ref[0], rel=1e-5)
    assert r["loss"][1] == pytest.approx(r["loss"][0], rel=1e-5)
