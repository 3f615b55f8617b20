"""Every C++ kernel builds wherever a compiler and ninja are present: the kernels' own tests skip when a kernel
is unavailable (their Python references still run), so a broken .cpp must fail here instead of skipping."""

import pytest

from megatron_composer.kernels import cpp

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


def test_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / "stale_ext" / "lock"
    fresh = tmp_path / "fresh_ext" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    assert _get_build_directory("stale_ext", False) == str(stale.parent)
    old = time.time() - cpp._STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    with pytest.warns(UserWarning, match="did not finish"):
        cpp._remove_stale_lock("stale_ext")
    cpp._remove_stale_lock("fresh_ext")  # a build in progress elsewhere keeps its lock
    assert not stale.exists() and fresh.exists()
