"""megatron_composer.host_memory: the glibc allocator setting every training entry point applies (through
build_model), and the readings the memory benchmark uses. The setting is process-wide, so each case runs in
a fresh interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_composer.host_memory import malloc_in_use, peak_rss_bytes, reset_peak_rss, rss_bytes

ROOT = Path(__file__).resolve().parents[3]
glibc = pytest.mark.skipif(malloc_in_use() is None, reason="glibc's mallopt/mallinfo2")


def _tuned(**env) -> dict:
    code = ("import json; from megatron_composer.host_memory import tune_host_allocator as t; "
            "a = t(); print(json.dumps([a, t() is a]))")
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MC_MALLOC_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    tuned, idempotent = json.loads(out)
    assert idempotent
    return tuned


@glibc
def test_tune_host_allocator_fixes_the_thresholds_unless_the_environment_decides():
    from megatron_composer.host_memory import MMAP_THRESHOLD, TRIM_THRESHOLD

    assert _tuned() == {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    assert _tuned(MALLOC_MMAP_THRESHOLD_="65536") == {}
    assert _tuned(MC_MALLOC_DEFAULTS="1") == {}


@glibc
def test_a_freed_large_buffer_leaves_the_resident_set_once_tuned():
    # glibc's default raises the mmap threshold to the size of a freed mmapped block: the second buffer of that
    # size then comes from the heap and stays resident after free; tuned, it is unmapped
    code = ("import json, torch; from megatron_composer.host_memory import tune_host_allocator, rss_bytes; "
            "import sys; sys.argv[1:] and tune_host_allocator(); n = 24 << 20; "
            "a = torch.ones(n // 4); del a; b = torch.ones(n // 4); c = torch.ones(1 << 10); base = rss_bytes(); "
            "del b; print(json.dumps(base - rss_bytes()))")
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MC_MALLOC_DEFAULTS")}
    run = lambda *a: json.loads(subprocess.run([sys.executable, "-c", code, *a], env={**clean, "PYTHONPATH": str(ROOT)},
                                               cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert run("tune") > 20 << 20  # returned to the OS
    assert run() < 4 << 20  # kept in the heap: what the benchmark's glibc-default row shows at scale


def test_peak_rss_resets_to_the_current_resident_set():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("Linux only")
    reset_peak_rss()
    assert peak_rss_bytes() <= rss_bytes() + (8 << 20)
