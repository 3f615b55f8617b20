"""Per-rank host memory of a training start from a Hugging Face checkpoint (benchmarks/hf_import_memory.py, on a
smaller model), on 4 gloo ranks with fsdp x ep2 over the import and two optimizer steps:
- the import holds the rank's float32 shard and little more, not the whole model;
- the peak RSS of each phase exceeds the most memory malloc had handed out in it (live, sampled) by under a
  quarter of the checkpoint (under 0.1 of it measured on this model: blocks under the mmap threshold, peaks
  between samples): freed FSDP buffers do not stay resident. With glibc's default (dynamic) mmap threshold
  they do, by about 3x the checkpoint on this model; megatron_composer.host_memory.tune_host_allocator, which
  build_model calls, is what prevents it.
What is live above the training state's share is FSDP's per-unit working set (one MoE block's unsharded
parameters and gradients, the reduce-scatter buffers, the prefetched next unit, the root), reported by the
benchmark."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_composer.host_memory import malloc_in_use

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "16", "--hidden", "512", "--experts", "8", "--moe-ffn", "256", "--steps", "2", "--shard-mb", "32"]


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists() or malloc_in_use() is None,
                    reason="measures with Linux's VmHWM and glibc's mallinfo2")
def test_sharded_hf_start_imports_its_shard_and_keeps_no_freed_buffers_resident(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_import_memory.py"), *SMALL,
                           "--runs", "sharded", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    ckpt, shard_fp32 = r["checkpoint_bytes"], r["share"] / 4  # 4 of the share's 16 bytes per parameter
    ranks = r["runs"]["sharded"]
    assert len(ranks) == 4
    for rank, m in enumerate(ranks):
        phases = m["phases"]
        assert set(phases) == {"import", "forward", "backward", "optimizer"}
        assert phases["import"]["rss"] < shard_fp32 + ckpt / 10, (rank, phases["import"], shard_fp32)
        for name, p in phases.items():
            assert p["rss"] - p["live"] < ckpt / 4, (rank, name, p, ckpt, proc.stdout[-2500:])
        # the training state exists by the end of the first step: the run's peak is at least the share
        assert m["peak_above_baseline"] > 0.95 * r["share"], (rank, m, r["share"])
