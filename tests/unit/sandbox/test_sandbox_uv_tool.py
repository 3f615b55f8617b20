"""The `uv` and `uvx` of built task images (rl/sandbox/image_tools/uv.py) in front of the real uv: run here against
a recording stand-in for the real binary, they pass every argument on, and for an offline verifier (UV_OFFLINE=1)
start its cache from the image's warmed one and give a Python version uv cannot download offline the image's own.
The real uv itself runs in tests/unit/envs/test_envs_images.py (a built image)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.sandbox.image import UV_HOME, UV_TOOL, UV_WARM_CACHE


@pytest.fixture
def uv_bin(tmp_path):
    """The tool under both names, its real uv a script that records its arguments (and finds only Python 3.11)."""
    real = tmp_path / "real" / "bin"
    real.mkdir(parents=True)
    for name in ("uv", "uvx"):
        (real / name).write_text(f'#!/bin/sh\nif [ "$1 $2" = "python find" ]; then case "$4" in /*|3.11*) exit 0;; '
                                 f'*) exit 2;; esac; fi\necho "{name} $*"\n')
        (real / name).chmod(0o755)
    warm = tmp_path / "warm" / "simple-v1"
    warm.mkdir(parents=True)
    (warm / "pytest.rkyv").write_text("what the build cached")
    folder = tmp_path / "bin"
    folder.mkdir()
    text = UV_TOOL.read_text().replace(f"{UV_HOME}/bin", str(real)).replace(UV_WARM_CACHE, str(warm.parent))
    for name in ("uv", "uvx"):
        (folder / name).write_text(f"#!{sys.executable}\n" + text.split("\n", 1)[1])
        (folder / name).chmod(0o755)
    return folder


def run(uv_bin: Path, *argv: str, offline: bool = True, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"UV_OFFLINE": "1"} if offline else {}),
           **({"UV_CACHE_DIR": str(cache)} if cache else {})}
    return subprocess.run([str(uv_bin / argv[0]), *argv[1:]], env=env, capture_output=True, text=True, timeout=60)


def test_a_python_uv_cannot_download_offline_is_the_images_and_a_venv_is_fresh(uv_bin):
    res = run(uv_bin, "uvx", "-p", "3.13", "-w", "pytest==8.4.1", "pytest", "-p", "no:cacheprovider", "-rA")
    assert res.stdout.split() == ["uvx", "-p", sys.executable, "-w", "pytest==8.4.1", "pytest", "-p",
                                  "no:cacheprovider", "-rA"], res.stdout  # the tool's own -p is the tool's
    (line,) = res.stderr.splitlines()
    assert "Python 3.13 is not in this image and cannot be downloaded offline" in line
    for argv, want in [(("uv", "run", "--python=3.12", "pytest", "-p", "x"), f"uv run --python={sys.executable} "
                        "pytest -p x"),
                       (("uv", "venv", "-p", "3.11", ".venv"), "uv venv --clear --force -p 3.11 .venv"),
                       (("uv", "venv", "--allow-existing", ".venv"), "uv venv --allow-existing .venv"),
                       (("uv", "--python", "3.13", "init"), f"uv --python {sys.executable} init")]:
        assert run(uv_bin, *argv).stdout.strip() == want, argv
    online = run(uv_bin, "uvx", "-p", "3.13", "pytest", offline=False)  # with the network uv downloads it itself
    assert online.stdout.split() == ["uvx", "-p", "3.13", "pytest"] and not online.stderr


def test_an_offline_cache_starts_as_the_images_warmed_one(uv_bin, tmp_path):
    cache = tmp_path / "tests" / ".verifier" / "uv-cache"
    assert run(uv_bin, "uv", "pip", "install", "pytest", cache=cache).returncode == 0
    assert (cache / "simple-v1" / "pytest.rkyv").read_text() == "what the build cached"
    (cache / "simple-v1" / "pytest.rkyv").write_text("written since")
    run(uv_bin, "uv", "run", "pytest", cache=cache)  # a cache already there is the verifier's own
    assert (cache / "simple-v1" / "pytest.rkyv").read_text() == "written since"
    assert sorted(os.listdir(cache.parent)) == ["uv-cache"]  # nothing half-copied left beside it


def test_an_image_without_uv_says_so_in_one_line(uv_bin, tmp_path):
    for name in ("uv", "uvx"):
        (tmp_path / "real" / "bin" / name).unlink()
    res = run(uv_bin, "uvx", "pytest")
    (line,) = res.stderr.splitlines()
    assert res.returncode == 127 and "this image has no uvx" in line and "PyPI" in line
