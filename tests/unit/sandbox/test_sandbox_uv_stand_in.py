"""The uv and uvx that built task images carry (rl/sandbox/image_tools/uv.py), run here with this Python: what a
verifier asks of them runs offline when the packages are installed, and stops with one line naming what is not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.sandbox.image import UV_STAND_IN


@pytest.fixture
def uv_bin(tmp_path):
    """uv and uvx as the image has them: the stand-in under both names, run by this Python (which has pytest)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("uv", "uvx"):
        script = folder / name
        script.write_text(f"#!{sys.executable}\n" + UV_STAND_IN.read_text().split("\n", 1)[1])
        script.chmod(0o755)
    return folder


def run(uv_bin: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{uv_bin}:{os.path.dirname(sys.executable)}:/usr/bin:/bin"}
    return subprocess.run([str(uv_bin / argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_uvx_runs_the_installed_tool_and_says_which_python(uv_bin, tmp_path):
    import pytest as installed

    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    res = run(uv_bin, "uvx", "-p", "3.99", "--with", f"pytest=={installed.__version__}", "pytest", "-q",
              "test_one.py", cwd=tmp_path)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr
    assert "Python 3.99 was asked for; the image's Python" in res.stderr


def test_a_requirement_that_is_not_installed_stops_with_one_line(uv_bin, tmp_path):
    absent = "no-such-package-xyz is not installed"
    for argv, said in [(("uvx", "--with", "no-such-package-xyz==1.0", "pytest"), absent),
                       (("uv", "pip", "install", "pytest==0.0.1"), "is installed, not ==0.0.1"),
                       (("uv", "add", "no-such-package-xyz"), absent)]:
        res = run(uv_bin, *argv, cwd=tmp_path)
        (line,) = res.stderr.splitlines()
        assert res.returncode == 2 and said in line and "offline stand-in" in line, (argv, res.stderr)


def test_uv_venv_sees_the_image_packages_and_uv_run_uses_it(uv_bin, tmp_path):
    assert run(uv_bin, "uv", "venv", ".testing", cwd=tmp_path).returncode == 0
    assert (tmp_path / ".testing" / "bin" / "activate").is_file()
    check = f"source .testing/bin/activate && {uv_bin}/uv pip install pytest && {uv_bin}/uv run python -c " \
            "'import pytest, sys; print(sys.prefix)'"
    res = subprocess.run(["bash", "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == str(tmp_path / ".testing"), res.stdout + res.stderr


def test_project_commands_only_check(uv_bin, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for argv in (("uv", "init"), ("uv", "add", "pytest"), ("uv", "sync"), ("uv", "--version")):
        res = run(uv_bin, *argv, cwd=tree)
        assert res.returncode == 0, (argv, res.stderr)
    assert list(tree.iterdir()) == []  # nothing written into the work tree
    res = run(uv_bin, "uv", "publish", cwd=tree)
    assert res.returncode == 2 and "`uv publish` is not supported offline" in res.stderr
