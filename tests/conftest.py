"""Shared fixtures: one thread for tiny matmuls; the RL tests' assets (a tiny byte-level BPE tokenizer with the chat
markers and a task set of single-turn prompts the tiny model can be scored on)."""

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from tests.rl_assets import write_rl_assets


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine: extra threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


PROMPTS = [("Start a function.", r"[\s\S]*def[\s\S]*"), ("Write an import.", r"[\s\S]*import[\s\S]*"),
           ("Return a value.", r"[\s\S]*return[\s\S]*"), ("Say hi.", r"[\s\S]*hi[\s\S]*"),
           ("Name a loop keyword.", r"[\s\S]*(for|while)[\s\S]*"), ("Write a class.", r"[\s\S]*class[\s\S]*")]


@pytest.fixture(scope="session")
def rl_assets(tmp_path_factory):
    return write_rl_assets(tmp_path_factory.mktemp("rl_assets"), PROMPTS)


@pytest.fixture
def sandbox_parent():
    """A folder for sandboxes that their uid can traverse (pytest's tmp_path is private to root); what is left in it
    is swept and it is removed afterwards. Skips where no isolated sandbox can run."""
    from rl.sandbox import LocalBackend, SandboxError
    from rl.sandbox.leftovers import sweep

    try:
        LocalBackend()
    except SandboxError as e:
        pytest.skip(f"no isolated sandbox on this host: {e}")
    path = Path(tempfile.mkdtemp(prefix="sandbox-parent-"))
    os.chmod(path, 0o711)
    yield path
    sweep(path, force=True)
    subprocess.run(["rm", "-rf", str(path)])


@pytest.fixture(scope="session")
def image_base():
    """The Debian base of built images (rl/sandbox/image.py), made once per host into the image cache. Skips, with
    the reason, where this host cannot build images: not root, no mmdebstrap, or no way to the Debian mirror."""
    from rl.sandbox.base import SandboxError
    from rl.sandbox.image import ImageBuilder, build_problem

    if build_problem() is not None:
        pytest.skip(build_problem())
    try:
        return ImageBuilder().base()
    except SandboxError as e:
        pytest.skip(f"no Debian base for task images here: {e}")


@pytest.fixture(scope="session")
def test_image(image_base):
    """A small built image (rl/sandbox/image.py) on the Debian base: a tool in /opt and a command in
    /usr/local/bin."""
    from rl.sandbox.image import ImageBuilder

    def steps(root):
        res = root.exec("mkdir -p /opt/tool /srv/data && echo tool > /opt/tool/version && "
                        "printf '#!/bin/sh\\necho hello from the image\\n' > /usr/local/bin/hello && "
                        "chmod 755 /usr/local/bin/hello && echo data > /srv/data/f", timeout=120)
        assert res.ok, res.output

    return ImageBuilder().build("tests/conftest.py test_image v1", steps, what="the tests' image")
