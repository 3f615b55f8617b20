"""A task whose verifier hangs scores 0 with the reason, within its timeout; nothing waits forever."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_hanging_verifier_scores_zero_with_the_reason(tmp_path):
    task = tmp_path / "hanging-verifier"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 2.0\n[agent]\ntimeout_sec = 30.0\n')
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    # Writes a passing reward, then never returns: the reward must not count.
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\nsleep 1000\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task), "--oracle"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    lines = res.stdout.strip().splitlines()
    assert float(lines[-1].split()[-1]) == 0.0, res.stdout
    assert "timed out" in res.stdout + res.stderr
