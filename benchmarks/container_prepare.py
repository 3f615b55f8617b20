"""Preparing a task on docker and podman: the first prepare of a fresh task (its image built) against the second
(everything it built found again), and the local backend's second prepare of the same task, in the same run.

Each task folder is copied and its Dockerfile given a unique comment, so that the first prepare starts from nothing
the engine has cached for it (as a fresh task in an RL run); the copy and what the engine built for it are removed
at the end. Prepares build on the local Debian base (`--local-base`), so no registry is needed.

    python benchmarks/container_prepare.py [TASK_DIR ...] [--engines docker podman] [--repeat 3]

Prints, per engine and task, the first prepare, the median of `--repeat` later prepares, and the ratios of that
median to the first prepare and to the local backend's second prepare (the named baseline).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.envs.harbor import load_harbor_task  # noqa: E402
from rl.envs.task import prepare_task  # noqa: E402
from rl.sandbox import SandboxLimits  # noqa: E402
from rl.sandbox.container import engine_problem, make_container_backend  # noqa: E402
from rl.sandbox.image import build_problem  # noqa: E402
from rl.sandbox.local import LocalBackend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = [REPO / "examples" / "tasks" / "python-csv-report"]


def fresh_copy(task_dir: Path, root: Path) -> Path:
    """The task with a Dockerfile no engine has built before."""
    copy = root / f"{task_dir.name}-{secrets.token_hex(4)}"
    shutil.copytree(task_dir, copy, symlinks=True)
    dockerfile = copy / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"\n# benchmark {copy.name}\n")
    return copy


def timed_prepare(task, backend) -> float:
    t0 = time.perf_counter()
    prepare_task(task, backend).discard()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks", nargs="*", type=Path, default=DEFAULT_TASKS)
    parser.add_argument("--engines", nargs="+", default=["docker", "podman"])
    parser.add_argument("--repeat", type=int, default=3, help="later prepares to take the median of")
    args = parser.parse_args()
    if (why := build_problem()) is not None:
        print(f"no local Debian base to build on: {why}")
        return 2
    local = LocalBackend()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mc-bench-prepare-") as tmp:
        for engine in args.engines:
            if (why := engine_problem(engine)) is not None:
                print(f"{engine}: skipped ({why})")
                continue
            backend = make_container_backend(engine, SandboxLimits(), local_base=True)
            for task_dir in args.tasks:
                task = load_harbor_task(fresh_copy(task_dir.resolve(), Path(tmp)))
                images = getattr(backend, "cached_images", lambda _: [])(task)
                try:
                    first = timed_prepare(task, backend)
                    later = statistics.median(timed_prepare(task, backend) for _ in range(args.repeat))
                    timed_prepare(task, local)
                    local_second = statistics.median(timed_prepare(task, local) for _ in range(args.repeat))
                finally:
                    if images:
                        subprocess.run([engine, "rmi", "-f", *images], capture_output=True)
                rows.append((engine, task_dir.name, first, later, local_second))
    print(f"{'engine':8} {'task':28} {'first s':>8} {'second s':>9} {'second/first':>13} {'local 2nd s':>12} "
          f"{'second/local 2nd':>17}")
    for engine, name, first, later, local_second in rows:
        print(f"{engine:8} {name[:28]:28} {first:8.2f} {later:9.3f} {later / first:13.3f} {local_second:12.3f} "
              f"{later / local_second:17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
