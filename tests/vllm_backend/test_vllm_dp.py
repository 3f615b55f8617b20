"""Data-parallel attention + expert parallelism on vLLM's CPU build: two engine processes (one per "GPU"), each
with its own requests and cache, the tiny Qwen3-MoE's experts split between them (vLLM's DP + EP, with the CPU
build's missing pieces from inference/vllm_cpu_dp.py). While the ranks generate, the test publishes versions to
the weight store; every version is applied on both ranks between the same two engine steps, every token carries
the version it was sampled under, and on the last version both ranks' greedy tokens and log-probs equal the
project's engine's on the same weights."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in its own environment")

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_data_parallel_ranks_apply_every_version_at_the_same_step(tmp_path):
    from megatron_composer.model import Transformer, get_preset
    from rl.weight_sync import ObjectStore, WeightPublisher

    torch.manual_seed(0)
    cfg = get_preset("tiny-qwen3-moe").replace(num_layers=2)
    model = Transformer(cfg)
    store = ObjectStore(str(tmp_path / "store"))
    publisher = WeightPublisher(store, snapshot_interval=10, dtype=torch.float32)
    publisher.publish(model, 0)
    port, last = _free_port(), 3
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "vllm_backend" / "dp_rank.py"), "--rank", str(r),
                               "--size", "2", "--port", str(port), "--store", str(tmp_path / "store"), "--last",
                               str(last), "--out", str(tmp_path / f"rank{r}.json")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"rank{r}.ready").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the ranks did not start"
            time.sleep(0.2)
        g = torch.Generator().manual_seed(1)
        for version in range(1, last + 1):
            time.sleep(3)  # the ranks generate under the previous version meanwhile
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
            publisher.publish(model, version)
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"(engine step, version) applied: {ranks[0]['applied_at']}; rounds per rank {[r['rounds'] for r in ranks]}; "
          f"log-prob gaps {[r['logprob_gap'] for r in ranks]}")
    # every version either rank applied, both applied, at the same engine step
    assert ranks[0]["applied_at"] == ranks[1]["applied_at"]
    versions = [v for _, v in ranks[0]["applied_at"]]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == last
    for rank in ranks:
        assert rank["final_version"] == last and rank["rounds"] >= 1
        assert all(v == sorted(v) and set(v) <= set(versions) for v in rank["versions_seen"])
        assert rank["greedy_equal"] and rank["logprob_gap"] <= 1e-4, rank
        assert all(v == [last] * len(v) for v in rank["final_versions"])
