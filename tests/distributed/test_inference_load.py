"""Engines loaded per rank (inference/loading.py): each rank builds the model on the meta device, applies the
engine's layout and reads only its slices from a Hugging Face directory, a training checkpoint (DCP) or a
weight-sync version; its local tensors equal the slices of the full ones and it generates what the one-rank
engine of the full model generates. ep = 2 on 2 gloo ranks; tp = 2 x ep = 2 on 4."""


import pytest

from tests.distributed import torchrun  # noqa: E402

CASES = [f"{p}_{s}" for p in ("mla", "gqa") for s in ("hf", "dcp", "weight_sync")]
TP_EP_CASES = ["mla_hf", "mla_weight_sync", "gqa_dcp"]


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    return torchrun.run_worker("inference_load_worker.py", 2, [], tmp_path_factory.mktemp("inference_load_ep"))


@pytest.fixture(scope="module")
def tp_ep_results(tmp_path_factory):
    return torchrun.run_worker("inference_load_worker.py", 4, ["--cases", ",".join(TP_EP_CASES)],
                               tmp_path_factory.mktemp("inference_load_tp_ep"))


def _check(res, case):
    assert res["ok"], res.get("error")
    assert res["slices_equal"], "a rank's local tensors differ from the slices of the full tensors"
    assert res["local_experts"] == 4  # 8 experts over ep = 2
    assert res["ranks_agree"] and res["num_tokens"] == 3 * 40
    assert res["tokens_equal"] and res["routes_equal"] and res["versions_equal"]
    assert res["max_logprob_diff"] <= 1e-5
    if case.endswith("hf"):
        assert res["shards"] > 1 and res["max_read_within_piece"]
    if case.endswith("weight_sync"):  # planned from the snapshot of version 1 plus the delta of version 2
        assert res["version"] == 2 and res["parts"] == ["snapshot", "delta"]
        assert res["max_read_within_piece"] and res["expert_reads_own_chunks"]


@pytest.mark.dist
@pytest.mark.e2e  # expert parallelism alone; tp x ep below runs in make test
@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_engine_loaded_per_rank(ep_results, case):
    _check(ep_results[case], case)


@pytest.mark.dist
@pytest.mark.parametrize("case", TP_EP_CASES)
def test_tensor_and_expert_parallel_engine_loaded_per_rank(tp_ep_results, case):
    _check(tp_ep_results[case], case)
