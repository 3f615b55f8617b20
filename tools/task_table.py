"""Run real tasks as their authors wrote them and tabulate what happened: untouched, after the reference solution,
how long the environment took to build and to prepare again, and for a task that cannot run here, why.

    python tools/task_table.py TASK_DIR... [--backend local|docker|podman] [--local-base] [--out table.md]
        [--json rows.jsonl]

A task folder is Harbor (1.0, 1.1 multi-step) or Terminal-Bench 1 (tools/check_task.py reads both). A task "runs"
when its untouched check gives reward 0 and its oracle check reward 1, neither with an error. A task that cannot be
loaded or built here (a GPU, a multi-container compose file on the local backend, a download from beyond the package
registries, a base that is not Debian) is a row with its one-line reason. Exit status 1 when a task gives other
rewards than 0 and 1 with no reason (a verdict that would mislead training).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from rl.envs.check_task import check_task, load_task, make_backend, printable  # noqa: E402
from rl.envs.harbor import TaskFormatWarning  # noqa: E402
from rl.envs.task import TaskError, prepare_task  # noqa: E402
from rl.sandbox import SandboxError  # noqa: E402
from rl.sandbox.image import ImageBuilder  # noqa: E402
from rl.sandbox.leftovers import release_on_signals  # noqa: E402


@dataclass
class Row:
    task: str
    format: str = ""
    environment: str = ""  # what stands in for the task's image
    build_s: float | None = None  # the image's build (from the cache's record when it was built before)
    second_prepare_s: float | None = None  # a prepare once the image is built: what every later run pays
    unsolved: float | None = None
    oracle: float | None = None
    reason: str = ""  # why it cannot run here, or what went wrong

    @property
    def runs(self) -> bool:
        return self.unsolved == 0.0 and self.oracle == 1.0 and not self.reason


def task_format(path: Path, task) -> str:
    if (path / "task.yaml").is_file() and not (path / "task.toml").is_file():
        return "Terminal-Bench 1"
    return f"Harbor, {len(task.steps)} steps" if task.steps else "Harbor"


def one_line(error: Exception) -> str:
    return printable(" ".join(str(error).split()))


def check_one(path: Path, backend) -> Row:
    row = Row(task=path.name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TaskFormatWarning)
            task = load_task(str(path))
        row.format = task_format(path, task)
        builds = task.image is not None and (task.image.required or getattr(backend, "build_images", False))
        row.environment = backend.name if hasattr(backend, "build") else ("built image" if builds else "host system")
        t0 = time.monotonic()
        prepare_task(task, backend).discard()
        first_s = time.monotonic() - t0
        if builds and not hasattr(backend, "build"):
            image = ImageBuilder(backend.image_cache, progress=lambda _: None).lookup(task.image.key)
            row.build_s = image.build_s if image is not None else first_s
        elif hasattr(backend, "build"):
            row.build_s = first_s
        t0 = time.monotonic()
        prepare_task(task, backend).discard()
        row.second_prepare_s = time.monotonic() - t0
    except (TaskError, SandboxError) as e:
        row.reason = one_line(e)
        return row
    for oracle in (False, True):
        try:
            result = check_task(task, backend, oracle, log=lambda _: None)
        except (TaskError, SandboxError) as e:
            row.reason = one_line(e)
            return row
        setattr(row, "oracle" if oracle else "unsolved", result.reward)
        if "error" in result.details:
            row.reason = f"{'oracle' if oracle else 'untouched'}: {one_line(result.details['error'])}"
            return row
    return row


def markdown(rows: list[Row]) -> str:
    def num(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = ["| task | format | environment | build s | 2nd prepare s | untouched | oracle | runs here / why not |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.task} | {r.format} | {r.environment} | {num(r.build_s, '.1f')} | "
                     f"{num(r.second_prepare_s, '.2f')} | {num(r.unsolved, 'g')} | {num(r.oracle, 'g')} | "
                     f"{'yes' if r.runs else r.reason.replace('|', '/')} |")
    ran = sum(r.runs for r in rows)
    lines.append(f"\n{ran} of {len(rows)} tasks give 0 untouched and 1 with the oracle; "
                 f"{len(rows) - ran} cannot run here (the reason is in the row).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", nargs="+", help="task folders (Harbor or Terminal-Bench 1)")
    parser.add_argument("--backend", default="local", choices=["local", "docker", "podman", "apptainer"])
    parser.add_argument("--local-base", action="store_true", help="docker/podman: build on the local Debian base")
    parser.add_argument("--out", help="write the markdown table here too")
    parser.add_argument("--json", help="write one JSON row per task here")
    args = parser.parse_args(argv)
    release_on_signals()
    missing = [t for t in args.tasks if not Path(t).is_dir()]
    if missing:
        print(f"error: not a task folder: {missing[0]}", file=sys.stderr)
        return 2
    try:
        backend = make_backend(args.backend, local_base=args.local_base)
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    bar = tqdm([Path(t) for t in args.tasks], unit="task", file=sys.stderr)
    for path in bar:
        bar.set_description(path.name[:40])
        rows.append(check_one(path, backend))
        r = rows[-1]
        tqdm.write(f"{r.task}: untouched {r.unsolved} oracle {r.oracle}"
                   + (f" ({r.reason})" if r.reason else ""), file=sys.stderr)
    table = markdown(rows)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text("".join(json.dumps({**asdict(r), "runs": r.runs}) + "\n" for r in rows))
    return 1 if any(not r.runs and not r.reason for r in rows) else 0  # a verdict wrong without a reason


if __name__ == "__main__":
    sys.exit(main())
