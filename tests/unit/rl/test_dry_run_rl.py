"""The RL-step dry run (rl/dry_run.py): one trainer rank of examples/kimi_k25/rl.yaml's layout (EP 8 x CP 8 x
FSDP over 512 ranks, MXFP8, full recompute, one MTP layer) on fake tensors, running the learner's own step --
the old-policy pass with the reference log-probs, the replayed update pass, the free-routing pass, the policy
loss -- measured by torch's memory tracker against the planner."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_composer.config import load_config
from megatron_composer.parallel.cost import StepPlan, memory_per_rank
from megatron_composer.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[3]
RL_YAML = ROOT / "examples" / "kimi_k25" / "rl.yaml"


def _cfg(*overrides):
    from rl.config import RLConfig

    return load_config(RLConfig, RL_YAML, list(overrides)).validate()


def test_rl_step_dry_run_in_the_kimi_rl_layout_runs_the_rl_loss_and_measures_the_planned_parameters():
    """Two layers (one dense, one MoE) and the MTP layer at the real widths, 128-token samples: the sharded
    parameters are the planner's; the step ran every pass the config asks for and its loss reached every
    parameter the policy loss depends on (the MTP layer is not trained by the RL loss)."""
    from rl.dry_run import policy_model_config, simulate_rl

    cfg = _cfg("model.overrides.num_layers=2")
    assert cfg.parallel.fsdp and (cfg.parallel.cp, cfg.parallel.ep) == (8, 8) and cfg.fp8.recipe == "mxfp8"
    assert cfg.rl.kl_coef > 0 and cfg.rl.router_replay == "r3" and cfg.rl.mismatch_mask != "off"
    seq = 2 * cfg.parallel.cp * 8
    r = simulate_rl(cfg, 512, seq_len=seq)
    mc = policy_model_config(cfg)
    assert mc.num_layers == 2 and mc.num_mtp_layers == 1
    lay = StepPlan(ParallelDims.from_config(cfg.parallel, 512), seq_len=seq, micro_batch=1, fsdp=True)
    assert r.by_kind["params"] == pytest.approx(memory_per_rank(mc, lay)["params"], rel=0.01)
    # per micro-batch (2 run): the old-policy pass, the update pass and the free-routing pass of the policy,
    # the reference pass (its log-probs for the KL term)
    assert r.extra["forwards"] == {"policy": 6, "reference": 2}
    missing = r.extra["without_grad"]
    assert missing and all(n.startswith("mtp.") for n in missing), missing
    trained = set(r.extra["parameters"]) - set(missing)
    for part in ("tok_embeddings", "attention.wq_a", "attention.wkv_b", "feed_forward.router", "feed_forward.experts",
                 "feed_forward.shared_experts", "layers.0.feed_forward", "output"):
        assert any(part in n for n in trained), part
    # the frozen reference policy holds only its shards between passes (its root unit is resharded after each
    # forward: PolicyLearner._reference_logprobs), as many bytes as the policy's
    assert r.by_kind["reference"] == pytest.approx(r.by_kind["params"], rel=0.01)
    assert r.extra["micro_batches_per_step"] == 16  # 64 groups x 16 episodes over 64 data-parallel ranks
    assert any("rl.router_replay=r3" in a for a in r.assumptions)


def test_metric_reads_select_every_element_and_read_floats_as_zero():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_composer.training.dry_run import HostReads

    with FakeTensorMode(), HostReads(metrics=True):
        x = torch.randn(2, 5, 3)
        picked = x[torch.ones(2, 5, dtype=torch.bool)]
        assert picked.shape == (10, 3)
        assert float(x.sum()) == 0.0
    with FakeTensorMode(), HostReads(), pytest.raises(RuntimeError, match="cannot read"):
        float(torch.randn(3).sum())


@pytest.mark.e2e
def test_kimi_rl_step_dry_run_fits_e2e():
    """131072-token samples, 3 and 4 layers extrapolated to 61: the measured peak fits the example's 288 GiB."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "dry_run_rl.py"), "--config", str(RL_YAML), "--gpus",
                        "512", "--gpu-mem", "288", "--sim-layers", "3"], capture_output=True, text=True, cwd=ROOT,
                       timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "measured peak" in r.stdout and "of 288 GiB: fits" in r.stdout, r.stdout
    assert "forward passes measured: policy 6, reference 2" in r.stdout, r.stdout
