"""Every C++ kernel builds wherever a compiler and ninja are present: the kernels' own tests skip when a kernel
is unavailable (their Python references still run), so a broken .cpp must fail here instead of skipping."""

import fcntl
import os
from pathlib import Path

import pytest

from megatron_composer.kernels.cpu import cpp

KERNELS = ["decode", "causal_attention", "cross_entropy", "grouped_mm", "rms_norm", "rope"]


@pytest.mark.parametrize("name", KERNELS)
def test_cpp_kernel_builds_where_a_toolchain_exists(name):
    if not cpp.enabled():
        pytest.skip("MEGATRON_COMPOSER_CPP=0")
    if not cpp.toolchain_present():
        pytest.skip("no C++ compiler or ninja on PATH: the Python implementations run")
    assert cpp.load(name) is not None, f"csrc/{name}.cpp did not build: {cpp.failure(name)}"


def test_kernel_list_matches_sources():
    assert sorted(p.stem for p in cpp._CSRC.glob("*.cpp")) == sorted(KERNELS)


def test_a_build_lock_left_by_a_killed_process_blocks_nobody(tmp_path, monkeypatch):
    """A process SIGKILLed while it holds the build directory (here: right after taking it, as a rollout worker
    killed during its first forward's kernel load) leaves torch's lock file behind; the next load removes it
    instead of waiting on it forever, and a live holder still excludes others."""
    import signal
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = Path(_get_build_directory("killed_ext", False))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib; from megatron_composer.kernels.cpu import cpp\n"
        "with cpp._build_dir_lock('killed_ext'):\n"
        f"    pathlib.Path({str(build_dir / 'lock')!r}).touch(); print('held', flush=True); time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path)))
    assert holder.stdout.readline().strip() == "held"
    with open(build_dir / "flock") as f:  # a live holder excludes others
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (build_dir / "lock").exists()
    with pytest.warns(UserWarning, match="did not finish"):
        with cpp._build_dir_lock("killed_ext"):
            assert not (build_dir / "lock").exists()
