"""A tensor-parallel (tp 2) or expert-parallel (ep 2) rollout worker generates what a one-rank worker does with the
same weight versions, each rank reading only its own boxes of them (workers/rl_rollout_tp_worker.py), for MLA
and GQA."""

from __future__ import annotations

import pytest

from tests.distributed.torchrun import run_worker


@pytest.fixture(scope="module")
def results(rl_assets, tmp_path_factory):
    return run_worker("rl_rollout_tp_worker.py", 2, ["--tok", str(rl_assets / "tok")],
                      tmp_path_factory.mktemp("rollout_tp"))


@pytest.mark.dist
@pytest.mark.parametrize("case", ["mla_rollout_tp2", "gqa_rollout_tp2", "mla_rollout_ep2"])
def test_tensor_parallel_rollout_worker_matches_one_rank(results, case):
    r = results[case]
    assert r["ok"], r.get("error")
    assert r["first_version"] == 0 and r["applied"] == [0, 1]
    assert r["tokens_equal"] and r["num_tokens"] > 0
    assert r["versions"] == [[0]] * 3 + [[1]] * 3
    assert r["max_logprob_diff"] < 1e-4
