"""Sharded Hugging Face import and streaming export on 4 gloo ranks (workers/hf_worker.py): each rank reads
only its slices of an FP8 DeepSeek-V3 checkpoint, and of a Kimi K2.5-layout checkpoint with compressed-tensors
INT4 experts (fsdp x ep2); the assembled model equals the one-process load, whose logits equal transformers';
the export from the sharded model equals the one-process export."""


import pytest

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tests.distributed import torchrun  # noqa: E402

LAYOUTS = ["tp2_ep2", "fsdp_ep2", "fsdp_tp2_ep2", "int4_fsdp_ep2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun.run_worker("hf_worker.py", 4, [], tmp_path_factory.mktemp("hf4"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_hf_load_and_export(results, layout):
    r = results[layout]
    assert r["ok"], r.get("error")
    worst = {k: v for k, v in r["errs"].items() if v > 1e-4}
    assert not worst, worst
    assert r["errs"]["logits_vs_transformers"] <= 1e-4
