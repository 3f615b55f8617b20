"""The first check of a small task image against a cached one, on the local backend with the Debian base cached.

A fresh task whose Dockerfile has a COPY and one RUN that reaches past /app (so it must be built, rl/sandbox/image.py)
is prepared twice: the first prepare builds its image, the second finds it. The named baseline is that second prepare,
measured in the same run; the figure is the extra cost of the first, in seconds. Each repeat gives the Dockerfile a
unique comment, so every first prepare starts from nothing cached for it; what it built is pruned at the end only
where the running version can prune (tools/prune_images.py).

Uses only load_harbor_task and prepare_task, so the same command measures another checkout of the project (copy
this file into its benchmarks/ folder and run it there).

    python benchmarks/first_check.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.envs.harbor import load_harbor_task  # noqa: E402
from rl.envs.task import prepare_task  # noqa: E402
from rl.sandbox.image import build_problem  # noqa: E402
from rl.sandbox.local import LocalBackend  # noqa: E402

DOCKERFILE = """\
# {marker}
FROM python:3.11-slim-bookworm
WORKDIR /app
COPY data /app/data
RUN mkdir -p /opt/tool && python3 -c "print('tool {marker}')" > /opt/tool/version.txt
"""


def write_task(root: Path, marker: str) -> Path:
    files = {"instruction.md": "Write the tool's version into answer.txt.\n",
             "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n',
             "environment/Dockerfile": DOCKERFILE.format(marker=marker),
             "environment/data/items.txt": "\n".join(str(i) for i in range(100)) + "\n",
             "solution/solve.sh": "#!/bin/bash\ncp /opt/tool/version.txt answer.txt\n",
             "tests/test.sh": "#!/bin/bash\ncmp -s answer.txt /opt/tool/version.txt"
                              " && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def timed_prepare(task, backend) -> float:
    t0 = time.perf_counter()
    snapshot = prepare_task(task, backend)
    took = time.perf_counter() - t0
    snapshot.discard()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if (why := build_problem()) is not None:
        print(f"cannot benchmark image builds: {why}")
        return 1
    backend = LocalBackend()
    with tempfile.TemporaryDirectory(prefix="mc-bench-first-") as tmp:
        # Warm the Debian base and the host's caches once, with a task of its own.
        timed_prepare(load_harbor_task(write_task(Path(tmp) / "warm", secrets.token_hex(8))), backend)
        firsts, seconds = [], []
        for i in range(args.repeat):
            task = load_harbor_task(write_task(Path(tmp) / f"t{i}", secrets.token_hex(8)))
            firsts.append(timed_prepare(task, backend))
            seconds.append(timed_prepare(task, backend))
    first, second = statistics.median(firsts), statistics.median(seconds)
    print(f"prepare of a fresh task with a COPY and one RUN, median of {args.repeat} (s): first {first:.2f}, "
          f"cached (baseline) {second:.3f}; first costs {first - second:.2f} s more ({first / second:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
