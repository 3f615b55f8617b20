"""Launch a torchrun + gloo worker from pytest and collect the JSON results it writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(script: str, nproc: int, args: list[str], out_dir: Path, timeout: int = 600) -> dict:
    """Run tests/distributed/workers/<script> on `nproc` CPU ranks; the worker writes results.json (rank 0) in
    out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "tests" / "distributed" / "workers" / script), "--out", str(out_dir), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    result_file = out_dir / "results.json"
    if proc.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-8000:]}")
    return json.loads(result_file.read_text())
