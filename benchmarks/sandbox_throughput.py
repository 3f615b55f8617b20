"""Sandbox throughput: start-to-first-command latency and scripted episodes per second.

Compares LocalSandbox (bubblewrap: fresh namespaces, private tree copy, rlimits, one episode of namespaces,
whole-sandbox limits by a cgroup and a tmpfs of its own where the host allows) with the named baseline "plain
subprocess": a temporary copy of the same tree and `subprocess.run(bash -c)` without any isolation, measured in
the same run. The latency table also shows LocalSandbox with the polling monitor in place of the cgroup and
tmpfs (what a host without them gets), so the cost of the kernel's limits reads off as a ratio. The episode is
fixed: the agent protocol's tools (list, write, edit, read, search, run the tests) on a small Python project,
ending with submit, 8 tool calls in 6 turns.

Then host memory per idle sandbox: `--idle` sandboxes at once, each with its episode started (its init waiting),
from the kernel's MemAvailable before and after (page tables, namespaces and tmpfs included) and the resident memory
of their processes.

    python benchmarks/sandbox_throughput.py [--samples 40] [--episodes 16] [--concurrency 1 2 4 8 16 32] [--idle 16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.data.chat_template import format_tool_call  # noqa: E402
from rl.envs.agent import EpisodeConfig, ScriptedPolicy, run_episode  # noqa: E402
from rl.envs.task import DirectoryTree, ScriptVerifier, Task  # noqa: E402
from rl.sandbox.base import BASE_ENV, ExecResult, Sandbox  # noqa: E402
from rl.sandbox.local import LocalBackend, bwrap_problem  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a convenience
    def tqdm(x, **_):
        return x

CALC = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('tests passed')\n"


class PlainSubprocessSandbox(Sandbox):
    """Baseline: a temporary copy of the tree, commands via subprocess.run with no isolation at all."""

    def __init__(self, tree: Path):
        self.root = Path(tempfile.mkdtemp(prefix="mc-plain-"))
        shutil.copytree(tree, self.root / "app")
        self.workdir = self.tree_root = str(self.root / "app")
        self.env = {**BASE_ENV, "HOME": str(self.root)}  # same PATH (system python) as the sandbox

    def exec(self, command, *, timeout=None, cwd=None, env=None, stdin=None) -> ExecResult:
        t0 = time.monotonic()
        res = subprocess.run(["bash", "-c", command], cwd=cwd or self.workdir, input=stdin, env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout or 120)
        out = res.stdout.decode(errors="replace")
        return ExecResult(res.returncode, out, len(res.stdout), time.monotonic() - t0)

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def episode_turns() -> list[str]:
    c = format_tool_call
    return [
        "Looking around." + c("list_dir", {"path": "."}),
        c("read_file", {"path": "calc.py"}) + c("write_file", {"path": "test_calc.py", "content": TEST}),
        c("run", {"command": "python3 test_calc.py"}),
        c("edit_file", {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}),
        c("search", {"pattern": "def add", "glob": "*.py"}) + c("run", {"command": "python3 test_calc.py"}),
        c("submit", {"summary": "fixed add"}),
    ]


def run_one(task: Task, sandbox: Sandbox) -> None:
    res = run_episode(task, sandbox, ScriptedPolicy(episode_turns()), EpisodeConfig(), verify=False)
    last_run = [m["content"] for m in res.messages if m["role"] == "tool"][-2]
    if res.stop_reason != "submitted" or "tests passed" not in last_run:
        raise RuntimeError(f"benchmark episode went wrong: {res.stop_reason}: {last_run[:300]}")


def latency(make, samples: int, label: str) -> list[float]:
    out = []
    for _ in tqdm(range(samples), desc=f"latency {label}", leave=False):
        t0 = time.perf_counter()
        sbx = make()
        res = sbx.exec("true")
        out.append(time.perf_counter() - t0)
        sbx.close()
        assert res.exit_code == 0, res.output
    return out


def throughput(make, task: Task, episodes: int, concurrency: int, label: str) -> float:
    def job(_):
        sbx = make()
        try:
            run_one(task, sbx)
        finally:
            sbx.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(tqdm(pool.map(job, range(episodes)), total=episodes, desc=f"{label} x{concurrency}", leave=False))
    return episodes / (time.perf_counter() - t0)


def mem_available_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def idle_memory(make, n: int) -> tuple[float, float]:
    """(MB of MemAvailable per idle sandbox, MB of its processes' resident memory) over n sandboxes at once."""
    from rl.sandbox.base import process_tree

    before = mem_available_kb()
    own = set(process_tree(os.getpid()))
    sandboxes = [make() for _ in range(n)]
    try:
        for s in sandboxes:
            s.exec("true")  # its episode started: the init that holds its namespaces, waiting
        time.sleep(1.0)
        after = mem_available_kb()
        rss = 0
        for pid in set(process_tree(os.getpid())) - own:
            try:
                rss += int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                if line.startswith("VmRSS:")).split()[1])
            except (OSError, StopIteration):
                continue
    finally:
        for s in sandboxes:
            s.close()
    return (before - after) / 1024 / n, rss / 1024 / n


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40, help="sandbox starts for the latency percentiles")
    ap.add_argument("--episodes", type=int, default=16, help="episodes per concurrency level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--idle", type=int, default=16, help="idle sandboxes at once for the memory figure")
    args = ap.parse_args()
    problem = bwrap_problem()
    if problem:
        print(f"cannot benchmark LocalSandbox: {problem}")
        return 1
    with tempfile.TemporaryDirectory(prefix="mc-bench-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        (tree / "calc.py").write_text(CALC)
        tests = Path(tmp) / "tests"
        tests.mkdir()
        task = Task(name="bench", instruction="Fix add().", tree=DirectoryTree(tree), verifier=ScriptVerifier(tests))
        backend = LocalBackend()
        monitored = LocalBackend(cgroups=False, tmpfs=False)
        with backend.create(tree) as base:
            snapshot = base.snapshot()
            mode = base.whole_sandbox_limits
        makers = {"bwrap": lambda: backend.fork(snapshot), "plain": lambda: PlainSubprocessSandbox(tree)}
        lat = {name: latency(make, args.samples, name) for name, make in
               {**makers, "monitor": lambda: monitored.fork(snapshot)}.items()}
        eps = {(name, c): throughput(make, task, args.episodes, c, name)
               for c in args.concurrency for name, make in makers.items()}
        idle = idle_memory(makers["bwrap"], args.idle)
        snapshot.discard()
    print(f"start-to-first-command latency over {args.samples} starts (ms)")
    print(f"LocalSandbox's whole-sandbox limits here: memory by {mode['memory']}, disk by {mode['disk']}")
    print(f"{'sandbox':<36}{'p50':>10}{'p99':>10}")
    for name, label in (("bwrap", "LocalSandbox (bubblewrap)"), ("monitor", "LocalSandbox, monitor limits"),
                        ("plain", "plain subprocess (baseline)")):
        print(f"{label:<36}{1e3 * pct(lat[name], 0.5):>10.2f}{1e3 * pct(lat[name], 0.99):>10.2f}")
    print(f"ratio bwrap/plain: p50 {pct(lat['bwrap'], 0.5) / pct(lat['plain'], 0.5):.2f}x, "
          f"p99 {pct(lat['bwrap'], 0.99) / pct(lat['plain'], 0.99):.2f}x; "
          f"bwrap/monitor: p50 {pct(lat['bwrap'], 0.5) / pct(lat['monitor'], 0.5):.2f}x")
    print(f"\nscripted episodes/s ({args.episodes} episodes of 8 tool calls per level)")
    print(f"{'concurrency':<14}{'bwrap':>10}{'plain':>10}{'bwrap/plain':>14}")
    for c in args.concurrency:
        print(f"{c:<14}{eps[('bwrap', c)]:>10.2f}{eps[('plain', c)]:>10.2f}"
              f"{eps[('bwrap', c)] / eps[('plain', c)]:>14.2f}")
    print(f"\nhost memory per idle sandbox ({args.idle} at once, each with its episode started): {idle[0]:.1f} MB of "
          f"MemAvailable, {idle[1]:.1f} MB resident in its processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
