"""Task images on the local backend: what a build costs once, what a prepare costs after, and episodes on 8 concurrent
sandboxes of a built image.

The task installs a Debian package and a Python package and places files outside /app (so it must be built,
rl/sandbox/image.py). The named baseline is the same task's files on the host's system stand-in (a Dockerfile that
only copies into /app), measured in the same run: the ratios say what an image costs over it. Each episode forks the
prepared task, runs the reference solution and the verifier.

    python benchmarks/task_images.py [--episodes 16] [--concurrency 8] [--fresh]

--fresh builds into a new image cache (the Debian base included: it needs the Debian mirror); by default the
host's cache is used, so the first prepare is a build only the first time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.envs.harbor import load_harbor_task  # noqa: E402
from rl.envs.task import prepare_task, verify  # noqa: E402
from rl.sandbox.image import build_problem  # noqa: E402
from rl.sandbox.local import LocalBackend  # noqa: E402

BUILT = """\
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends jq && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir six
WORKDIR /opt/project
COPY data /opt/project/data
"""
HOST = "FROM python:3.11-slim-bookworm\nWORKDIR /app/project\nCOPY data /app/project/data\n"
TEST_SH = """\
#!/bin/bash
total=$(python3 -c "import json; print(sum(i['n'] for i in json.load(open('data/items.json'))))")
if [ "$(cat answer.txt 2>/dev/null)" = "$total" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""
SOLVE = "#!/bin/bash\npython3 -c \"import json; print(sum(i['n'] for i in json.load(open('data/items.json'))))\" " \
        "> answer.txt\n"


def write_task(root: Path, name: str, dockerfile: str) -> Path:
    files = {"instruction.md": "Write the sum of the items' n to answer.txt.\n",
             "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n',
             "environment/Dockerfile": dockerfile,
             "environment/data/items.json": "[" + ", ".join(f'{{"n": {i}}}' for i in range(50)) + "]\n",
             "solution/solve.sh": SOLVE, "tests/test.sh": TEST_SH}
    for rel, text in files.items():
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_text(text)
    return root / name


def timed_prepare(task, backend) -> tuple[float, object]:
    t0 = time.perf_counter()
    snapshot = prepare_task(task, backend)
    return time.perf_counter() - t0, snapshot


def episodes_per_s(task, backend, snapshot, episodes: int, concurrency: int) -> float:
    def job(_):
        with backend.fork(snapshot) as sandbox:
            task.solution.apply(sandbox, task)
            reward = verify(task, sandbox).reward
            if reward != 1.0:
                raise RuntimeError(f"{task.name}: the solved episode scored {reward}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(job, range(episodes)))
    return episodes / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--fresh", action="store_true", help="build into a new image cache (base included)")
    args = ap.parse_args()
    if (why := build_problem()) is not None:
        print(f"cannot benchmark task images: {why}")
        return 1
    with tempfile.TemporaryDirectory(prefix="mc-bench-images-") as tmp:
        if args.fresh:
            os.chmod(tmp, 0o755)
            os.environ["MC_IMAGE_CACHE"] = str(Path(tmp) / "images")
        backend = LocalBackend()
        built = load_harbor_task(write_task(Path(tmp), "built", BUILT))
        host = load_harbor_task(write_task(Path(tmp), "host", HOST))
        first, snap = timed_prepare(built, backend)
        snap.discard()
        second, built_snap = timed_prepare(built, backend)
        host_s, host_snap = timed_prepare(host, backend)
        rates = {name: episodes_per_s(task, backend, snap, args.episodes, args.concurrency)
                 for name, task, snap in (("image", built, built_snap), ("host", host, host_snap))}
        built_snap.discard()
        host_snap.discard()
    print(f"prepare (s): first {first:.2f} ({'a build' if first > 5 * second else 'found in the cache'}), "
          f"second {second:.3f}; host's system stand-in (baseline) {host_s:.3f}; second/baseline "
          f"{second / host_s:.2f}x")
    print(f"solved episodes/s at concurrency {args.concurrency} ({args.episodes} episodes): image "
          f"{rates['image']:.2f}, host stand-in (baseline) {rates['host']:.2f}, image/baseline "
          f"{rates['image'] / rates['host']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
