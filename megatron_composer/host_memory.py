"""Host (CPU) memory of this process: the allocator setting every training entry point applies, and readings.

`tune_host_allocator()` fixes glibc malloc's mmap threshold. By default glibc raises its threshold (from
128 KiB up to 32 MiB) to the size of the largest mmapped block freed so far, so after the first steps every
buffer below that size -- FSDP's per-block all-gather outputs and unsharded gradients, activations -- comes
from the heap, and the heap keeps the freed ones resident: the peak RSS then counts memory the process no
longer uses (per rank, about 2x the bf16 checkpoint above the live memory after 3 steps of a 4-rank FSDP run:
benchmarks/hf_import_memory.py). With a fixed threshold, blocks above it are mmapped and returned to the OS
when freed, and the peak RSS is the live peak, at the cost of their page faults (1.3-1.4x a CPU rank's step
CPU time there).
A fixed threshold also disables glibc's matching dynamic trim threshold; TRIM_THRESHOLD sets that.
It is a no-op off glibc (other allocators decide for themselves), when MALLOC_MMAP_THRESHOLD_ is set in the
environment (the user's own choice wins) and when MC_MALLOC_DEFAULTS=1 (glibc's defaults, e.g. to compare).

The readings (resident set, its high-water mark and a reset of it, the bytes malloc has handed out) are what
the memory benchmark and tests measure with.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

# glibc's own initial threshold, kept fixed: blocks above 128 KiB go back to the OS when freed (the benchmark's
# 329M, 28-layer model: working set 0.27x the checkpoint at 128 KiB, 0.34x at 1 MiB; 292M model 8 MiB: 0.47x)
MMAP_THRESHOLD = 128 << 10
TRIM_THRESHOLD = 32 << 20  # free heap top kept, not returned: at glibc's 128 KiB the heap would shrink and regrow

_tuned: dict | None = None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=None)
def _glibc():
    """This process's C library when it is glibc (it alone has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- raises AttributeError off glibc
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
        libc.mallinfo2.restype = _MallInfo2
    return libc


def tune_host_allocator(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> dict:
    """Fix glibc's mmap and trim thresholds for this process (module docstring); idempotent. Returns what was
    set ({} when nothing was: not glibc, or the environment sets the threshold)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("MC_MALLOC_DEFAULTS") == "1":
        _tuned = {}
        return _tuned
    set_ok = libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    trim_ok = "MALLOC_TRIM_THRESHOLD_" not in os.environ and libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    _tuned = {k: v for k, v, ok in (("mmap_threshold", mmap_threshold, set_ok),
                                    ("trim_threshold", trim_threshold, trim_ok)) if ok}
    return _tuned


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def rss_bytes() -> int:
    """This process's resident set now (anonymous and mapped-file pages)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The resident set's high-water mark since the process started or the last `reset_peak_rss()`."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Reset the high-water mark to the current resident set (Linux >= 4.0: /proc/self/clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not had back (heap blocks in use + mmapped blocks): the live host
    memory, without what the allocator keeps after free. None off glibc (or before glibc 2.33)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


__all__ = ["malloc_in_use", "peak_rss_bytes", "reset_peak_rss", "rss_bytes", "tune_host_allocator"]
