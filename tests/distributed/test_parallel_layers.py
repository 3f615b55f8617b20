"""Parallel building blocks on 2 and 4 CPU ranks (torchrun + gloo) against one process, plus mesh checks."""


import pytest

from megatron_composer.config import ConfigError
from megatron_composer.parallel.dims import ParallelDims
from tests.distributed import torchrun  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    return torchrun.run_worker("layers_worker.py", 2, [], tmp_path_factory.mktemp("layers2"))


@pytest.fixture(scope="module")
def results4(tmp_path_factory):
    return torchrun.run_worker("layers_worker.py", 4, [], tmp_path_factory.mktemp("layers4"))


def _check(res):
    assert res["ok"], res.get("error")
    bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    assert len(res["errs"]) > 0


@pytest.mark.dist
@pytest.mark.parametrize("case", [
    "collectives", "tp2", "tp2_sp", "vocab_losses", "cp_shift", "balance_loss", "ep2_capacity", "dp2_bf16_master",
    "dp2_bf16_master_zero1", "dp2_allreduce_train", "dp2_zero1_train"])
def test_two_ranks(results2, case):
    _check(results2[case])


@pytest.mark.dist
def test_capacity_factor_drops_only_when_tight(results2):
    res = results2["ep2_capacity"]
    assert res["dropped_small_cf"] > 0 and res["dropped_large_cf"] == 0


@pytest.mark.dist
def test_zero1_halves_optimizer_state(results2):
    res = results2["dp2_zero1_train"]
    # AdamW moments of every parameter, split over 2 data-parallel ranks (plus padding to an even split)
    assert res["opt_state_bytes"] <= 0.51 * res["ref_opt_state_bytes"] + 64
    assert len(res["losses"]) == 5 and res["losses"][0] != res["losses"][-1]


@pytest.mark.dist
@pytest.mark.parametrize("case", ["collectives4", "cp4_shift", "balance_loss4", "tp2_sp_dp2_zero1_train",
                                  "tp2_dp2_allreduce_train"])
def test_four_ranks(results4, case):
    _check(results4[case])


def test_dims_infers_dp_and_builds_coordinates():
    d = ParallelDims(8, tp=2, cp=2, ep=4)
    assert d.dp == 2 and d.edp == 2
    assert d.dense_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sorted(d.dense_groups("cp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.dense_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.dense_groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.dense_groups("cp_tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.expert_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.expert_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(world_size=6, tp=4), "change parallel.tp or parallel.cp"),
    (dict(world_size=8, tp=2, dp=3), "change parallel.dp"),
    (dict(world_size=8, ep=3), "change parallel.ep"),
    (dict(world_size=8, tp=0), "parallel.tp is 0"),
])
def test_impossible_layouts_fail_with_one_line(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        ParallelDims(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_heads=6, num_kv_heads=2, vocab_size=64), "attention heads = 6 is not divisible by parallel.tp = 4"),
    (dict(num_heads=8, num_kv_heads=2, vocab_size=64), "key/value heads = 2 is not divisible by parallel.tp"),
    (dict(num_heads=8, vocab_size=66), "vocabulary size = 66"),
    (dict(num_heads=8, vocab_size=64, num_experts=6), "routed experts = 6 is not divisible by parallel.ep = 4"),
    (dict(num_heads=8, vocab_size=64, seq_len=102), "change 2*parallel.cp"),
])
def test_model_checks_name_the_size_to_change(kwargs, needle):
    d = ParallelDims(16, tp=4, cp=2, ep=4)
    with pytest.raises(ConfigError) as e:
        d.validate_model(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
