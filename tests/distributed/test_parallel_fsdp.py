"""FSDP2 layouts and the meta-device build against one process, on 4 gloo ranks (workers/fsdp_worker.py):
the layout-independent initialisation assembles the one-process model (tp2, ep2 and every FSDP layout); loss,
every parameter's gradient piece (max |diff| <= 1e-5 x max |ref|) and the clipped global norm after one
backward; and the loss sequence of 5 optimizer steps through TrainingCore.step (2 micro-batches each).
Every expert kernel path runs under every layout against the one-process model: the few-rows inference
kernels (a forward with no gradient: pair_swiglu without expert parallelism, swiglu_rows behind the
all-to-all), the reference loops (under a torch function mode), the C++ autograd pass (the backward) and,
in the MXFP8 layout, the quantised grouped GEMM.

Layouts: fsdp (dp4); fsdp x ep2 with 2 experts (expert shards outnumber local experts: dim 1 sharded);
fsdp x ep2 with the pretraining loss's fused head (the root's weight read after forward); fsdp x tp2 with
MXFP8; fsdp x tp2 with sequence parallelism; fsdp x cp2 with selective recompute; fsdp x tp2 x ep2; fsdp x ep2
with INT4 QAT of the experts under MXFP8; HSDP
(dp_replicate=2) x ep2 with full recompute. One torchrun launch runs them all. Bad FSDP sizes are one-line
config errors."""


import pytest

from megatron_composer.config import ConfigError
from megatron_composer.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import torchrun  # noqa: E402

TOL = 1e-5
# `make test` runs the layouts that combine the most features (each feature under FSDP at least once); `make
# test-e2e` the rest, in a launch of their own.
LAYOUTS = ["tp2", "fsdp_tp2_mxfp8", "fsdp_cp2_selective_ac", "fsdp_tp2_ep2", "hsdp_ep2_full_ac"]
LAYOUTS_E2E = ["ep2", "fsdp", "fsdp_ep2_expert_dim1", "fsdp_ep2_fused_head", "fsdp_tp2_sp", "fsdp_ep2_int4_qat_mxfp8"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """layout -> its result; each group of layouts is one launch, made when a test first asks for one of them."""
    launched = {}

    def get(layout):
        group = ",".join(LAYOUTS if layout in LAYOUTS else LAYOUTS_E2E)
        if group not in launched:
            launched[group] = torchrun.run_worker("fsdp_worker.py", 4, ["--cases", group],
                                                  tmp_path_factory.mktemp("fsdp4"))
        return launched[group][layout]
    return get


@pytest.mark.dist
@pytest.mark.parametrize("layout", LAYOUTS + [pytest.param(x, marks=pytest.mark.e2e) for x in LAYOUTS_E2E])
def test_fsdp_layout_equals_one_process(results, layout):
    res = results(layout)
    assert res["ok"], res.get("error")
    bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    assert res["n_params"] >= 20, "too few parameters compared"
    assert sum(k.startswith("init:") for k in res["errs"]) >= res["n_params"], "initialisation not checked"
    assert len(res["losses"]) >= 2 and res["losses"][0] != res["losses"][-1], "training did not move the loss"
    assert "eval_few_rows" in res["errs"] and "eval_reference" in res["errs"], "expert paths not compared"
    if res["few_rows_expected"]:  # AVX2, experts not quantised
        assert res["few_rows_chosen"] > 0, "the few-rows expert kernel was never chosen"


def test_bad_fsdp_sizes_are_one_line_errors():
    with pytest.raises(ConfigError, match="needs parallel.fsdp=true"):
        ParallelConfig(dp_replicate=2).validate()
    with pytest.raises(ConfigError, match="dp_replicate is 0"):
        ParallelConfig(fsdp=True, dp_replicate=0).validate()
    with pytest.raises(ConfigError, match=r"dp_replicate = 3 does not divide dp\*cp = 4"):
        ParallelDims.from_config(ParallelConfig(fsdp=True, dp_replicate=3), 4)
    with pytest.raises(ConfigError, match="dp_replicate = 2 does not divide world/ep = 1"):
        ParallelDims.from_config(ParallelConfig(fsdp=True, dp_replicate=2, ep=4), 4)
    ParallelDims.from_config(ParallelConfig(fsdp=True, dp_replicate=2, ep=2), 4)
