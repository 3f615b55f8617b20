"""The analytic activation model against the bytes autograd saves, in one process (parallel layouts are
checked in tests/test_parallel_model.py), and the planner's command line."""

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_composer.model import Transformer, get_preset
from megatron_composer.parallel.cost import Layout, activation_bytes, memory_per_rank, saved_tensor_bytes
from megatron_composer.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[1]


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
    lay = Layout(ParallelDims(1), seq_len=seq, micro_batch=batch, packed=packed)
    acts = activation_bytes(cfg, lay)
    assert 0.85 <= acts["none"] / saved <= 1.15
    assert acts["full"] < acts["none"]


def test_single_process_memory_is_the_whole_model():
    cfg = get_preset("tiny-deepseek-v3")
    n = sum(p.numel() for p in Transformer(cfg).parameters())
    mem = memory_per_rank(cfg, Layout(ParallelDims(1), seq_len=64, micro_batch=1))
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
