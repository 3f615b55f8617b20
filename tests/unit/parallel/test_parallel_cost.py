"""The analytic activation model against the bytes autograd saves, in one process (parallel layouts are
checked in tests/distributed/test_parallel_model.py), and the planner's command line."""

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_composer.model import Transformer, get_preset
from megatron_composer.parallel.cost import StepPlan, activation_bytes, memory_per_rank, saved_tensor_bytes
from megatron_composer.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[3]


def use_grouped_path(model):
    """Measure the grouped-matmul expert path GPUs run (a CPU fast path may pad tokens per expert instead)."""
    for m in model.modules():
        if hasattr(m, "grouped_mm"):
            m.grouped_mm = functools.partial(m.grouped_mm)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("batch, seq, packed", [(2, 64, False), (1, 128, True)])
def test_activation_model_matches_saved_tensors(preset, batch, seq, packed):
    cfg = get_preset(preset).replace(vocab_size=512, num_layers=3)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    pos = torch.arange(seq).repeat(batch, 1)
    if packed:
        pos[:, seq // 3:] = torch.arange(seq - seq // 3)

    def run():
        out = model(ids, position_ids=pos, mtp=True)
        loss = sum(F.cross_entropy(x.flatten(0, 1), ids.flatten()) for x in [out.logits, *out.mtp_logits])
        return out, loss

    use_grouped_path(model)
    saved, (out, _) = saved_tensor_bytes(run, list(model.parameters()))
    saved += sum(x.numel() * x.element_size() for x in [out.logits, *out.mtp_logits])
    lay = StepPlan(ParallelDims(1), seq_len=seq, micro_batch=batch, packed=packed)
    acts = activation_bytes(cfg, lay)
    assert 0.85 <= acts["none"] / saved <= 1.15
    assert acts["full"] < acts["none"]


def test_single_process_memory_is_the_whole_model():
    cfg = get_preset("tiny-deepseek-v3")
    n = sum(p.numel() for p in Transformer(cfg).parameters())
    mem = memory_per_rank(cfg, StepPlan(ParallelDims(1), seq_len=64, micro_batch=1))
    assert mem["params"] == mem["grads"] == 4 * n and mem["optimizer"] == 8 * n


def _plan(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan_parallel.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_plan_parallel_reports_memory_and_comm_for_kimi():
    r = _plan("--preset", "kimi-k2.5", "--gpus", "512", "--gpu-mem", "288", "--tp", "8", "--ep", "64", "--cp", "8",
              "--seq", "262144")
    assert r.returncode == 0, r.stderr
    for needle in ("optimizer state", "activations", "full recompute", "all_to_all", "dp=8"):
        assert needle in r.stdout


def test_plan_parallel_rejects_impossible_layout_in_one_line():
    r = _plan("--preset", "kimi-k2.5", "--gpus", "512", "--gpu-mem", "288", "--tp", "3", "--seq", "4096")
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "\n" not in err and "change parallel.tp" in err


def test_rollout_plan_counts_weights_and_cache_of_an_engine():
    import math

    from megatron_composer.model import get_preset
    from megatron_composer.parallel.cost import (
        RolloutEngine,
        model_params,
        rollout_kv_bytes_per_token,
        rollout_plan,
        rollout_weight_bytes,
        smallest_rollout_engine,
    )

    for preset in ("tiny-deepseek-v3", "tiny-qwen3-moe"):
        cfg = get_preset(preset)
        params = model_params(cfg)
        main = [(n, s) for n, s in params if not n.startswith("mtp.")]
        experts = sum(math.prod(s) for n, s in main if ".experts." in n and ".shared_experts." not in n)
        one = rollout_weight_bytes(cfg, RolloutEngine(gpus=1), params)
        assert sum(one.values()) == 2 * sum(math.prod(s) for _, s in main)  # bf16 on one GPU: the whole model
        assert one["routed experts"] == 2 * experts
        int4 = rollout_weight_bytes(cfg, RolloutEngine(gpus=4, tp=2, weights="int4"), params)
        assert int4["routed experts"] == experts * (0.5 + 2 / 32) / 4  # packed nibbles + a bf16 scale per 32
        tp2 = rollout_weight_bytes(cfg, RolloutEngine(gpus=2, tp=2), params)
        assert (tp2["embeddings and head"] == one["embeddings and head"] / 2
                and tp2["routed experts"] == one["routed experts"] / 2)
        kv = rollout_kv_bytes_per_token(cfg, RolloutEngine(gpus=2, tp=2))
        if cfg.attention == "mla":  # the latent row is replicated over tp
            assert kv == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_layers * 2
        else:
            assert kv == 2 * (cfg.num_kv_heads // 2) * cfg.gqa_head_dim * cfg.num_layers * 2
        # vLLM's decode context parallelism: each token's cache row on one of dcp ranks
        assert rollout_kv_bytes_per_token(cfg, RolloutEngine(gpus=2, tp=2, dcp=2)) == kv / 2
        with pytest.raises(ValueError, match="dcp=3 must divide tp=2"):
            RolloutEngine(gpus=2, tp=2, dcp=3)
        engine = RolloutEngine(gpus=4, tp=2)
        mem = 64 << 20
        p = rollout_plan(cfg, engine, seq_len=512, concurrency=4, gpu_mem_bytes=mem, params=params)
        n = p["max_concurrency"]
        assert n > 0 and n % engine.attention_groups == 0
        assert rollout_plan(cfg, engine, 512, n, mem, params=params)["fits"]
        assert not rollout_plan(cfg, engine, 512, n + engine.attention_groups, mem, params=params)["fits"]
        found = smallest_rollout_engine(cfg, 512, 4 * n, mem, params=params)
        assert found is not None and found[1]["fits"]
        smaller = found[0].gpus // 2
        assert smaller == 0 or all(
            not rollout_plan(cfg, RolloutEngine(gpus=smaller, tp=t), 512, 4 * n, mem, params=params)["fits"]
            for t in (1, 2, 4, 8) if smaller % t == 0)


def test_plan_parallel_rollout_for_kimi_int4():
    r = _plan("--rollout", "--preset", "kimi-k2.5", "--gpus", "8", "--gpu-mem", "288", "--tp", "8", "--weights", "int4",
              "--seq", "131072", "--concurrency", "8")
    assert r.returncode == 0, r.stderr
    for needle in ("routed experts", "KV cache per token", "fits", "smallest engine for 8 x 131072"):
        assert needle in r.stdout
    r = _plan("--rollout", "--preset", "kimi-k2.5", "--gpus", "8", "--gpu-mem", "288", "--tp", "3", "--seq", "4096")
    assert r.returncode != 0 and "\n" not in r.stderr.strip() and "must divide" in r.stderr


def test_rollout_update_plan_for_kimi_on_one_node():
    """Host bytes a node keeps for weight updates (one engine worker per GPU, each holding the non-expert tensors
    whole and 1/ep of the experts in the served format), bytes fetched per version and the pause."""
    import math

    from megatron_composer.parallel.cost import RolloutEngine, model_params, rollout_update_plan

    cfg = get_preset("kimi-k2.5")
    params = model_params(cfg)
    experts = sum(math.prod(s) for n, s in params if ".experts." in n and ".shared_experts." not in n
                  and not n.startswith("mtp."))
    other = sum(math.prod(s) for n, s in params if not n.startswith("mtp.")) - experts
    GiB, TiB = 2**30, 2**40
    bf16 = rollout_update_plan(cfg, RolloutEngine(gpus=8, weights="bf16"), base="host", staging="dense",
                               params=params)
    assert bf16["worker_bytes"] == 2 * other + 2 * experts / 8
    assert abs(bf16["host"]["base"] / TiB - 2.02) < 0.02  # the figure the vLLM backend's bf16 base reached
    assert bf16["host"]["staging"] == bf16["host"]["base"]  # a version decoded whole
    int4 = dict(gpus_per_node=8, delta_ratio=0.03, expert_delta_ratio=0.0015, link_gbps=400, params=params)
    host = rollout_update_plan(cfg, RolloutEngine(gpus=8, weights="int4"), base="host", **int4)
    device = rollout_update_plan(cfg, RolloutEngine(gpus=8, weights="int4"), base="device", **int4)
    assert host["worker_experts"] == experts * (0.5 + 2 / 32) / 8
    assert host["host"]["base"] == 8 * host["worker_bytes"] and device["host"]["base"] == 0
    fetched = 0.03 * 2 * other + 0.0015 * host["worker_experts"]
    assert device["fetched_per_version"] == host["fetched_per_version"] == 8 * fetched
    # sparse staging: the compressed version while decoding, then 4 position bytes per changed element
    staged = fetched + 0.03 * 2 * other * 3 + 0.0015 * host["worker_experts"] * 2
    assert device["host_total"] == host["host"]["staging"] == 8 * staged
    assert device["host_total"] < 0.25 * 2048 * GiB and device["device_base"] == host["worker_bytes"]
    assert device["pause_s"] == 8 * fetched * 8 / 400e9
    r = _plan("--rollout", "--preset", "kimi-k2.5", "--gpus", "8", "--gpu-mem", "288", "--tp", "1", "--weights", "int4",
              "--seq", "262144", "--concurrency", "32")
    assert r.returncode == 0, r.stderr
    for needle in ("host base, dense staging: base 2065 GiB", "base on the GPU, sparse staging:",
                   "fetched per version", "apply pause"):
        assert needle in r.stdout, r.stdout
