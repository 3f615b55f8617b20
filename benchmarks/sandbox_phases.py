"""What each phase of an episode costs on the local backend: sandbox start, one agent step, verifier-phase entry.

Uses only the sandbox's public interface (LocalBackend, snapshot, fork, exec, enter_verifier), so the same command
measures any version of the backend (run it from another checkout with PYTHONPATH=that/checkout to compare). The
named baseline is a plain subprocess (`bash -c`, no isolation) measured in the same run, so each figure also reads
as a ratio.

  - start: `backend.fork(prepared task)` and its first command;
  - agent step: one command in a running episode (`true`, and a step that writes a file);
  - verifier entry: `enter_verifier()` after the agent wrote a few files.

    python benchmarks/sandbox_phases.py [--samples 30]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.sandbox.local import LocalBackend, bwrap_problem  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args()
    if bwrap_problem():
        print(f"cannot benchmark LocalSandbox: {bwrap_problem()}")
        return 1
    times: dict[str, list[float]] = {k: [] for k in ("start", "step", "write step", "verifier entry", "plain")}
    backend = LocalBackend()
    with tempfile.TemporaryDirectory(prefix="mc-bench-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        for i in range(20):
            (tree / f"f{i}.py").write_text(f"x = {i}\n")
        with backend.create(tree) as base:
            snapshot = base.snapshot()
        try:
            for _ in range(args.samples):
                t0 = time.perf_counter()
                sbx = backend.fork(snapshot)
                try:
                    sbx.exec("true")
                    times["start"].append(time.perf_counter() - t0)
                    for _ in range(3):
                        t0 = time.perf_counter()
                        sbx.exec("true")
                        times["step"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    sbx.exec("echo 'x = 1' > /app/f0.py && mkdir -p /app/out && echo done > /app/out/r.txt")
                    times["write step"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    sbx.enter_verifier()
                    times["verifier entry"].append(time.perf_counter() - t0)
                finally:
                    sbx.close()
                t0 = time.perf_counter()
                subprocess.run(["bash", "-c", "true"], check=True)
                times["plain"].append(time.perf_counter() - t0)
        finally:
            snapshot.discard()
    plain = pct(times["plain"], 0.5)
    print(f"p50 / p90 in ms over {args.samples} episodes (baseline: plain subprocess `bash -c true`, "
          f"p50 {1e3 * plain:.2f} ms)")
    print(f"{'phase':<16}{'p50':>9}{'p90':>9}{'p50/plain':>11}")
    for name in ("start", "step", "write step", "verifier entry"):
        xs = times[name]
        print(f"{name:<16}{1e3 * pct(xs, 0.5):>9.1f}{1e3 * pct(xs, 0.9):>9.1f}{pct(xs, 0.5) / plain:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
