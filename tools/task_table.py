"""Run real tasks as their authors wrote them and tabulate what happened: untouched, after the reference solution,
how long the environment took to build and to prepare again, and for a task that cannot run here, why.

    python tools/task_table.py TASK_DIR... [--backend local|docker|podman] [--local-base] [--out table.md]
        [--json rows.jsonl]

A task folder is Harbor (schema up to 1.4, multi-step) or Terminal-Bench 1 (tools/check_task.py reads both). Every
row is one of:
- right: untouched reward 0 and reward 1 after the reference solution, neither with an error;
- refused: it cannot be loaded, built or verified here, with its one-line reason (the host, tool or key it needs);
- flagged: its verdicts are not verdicts on the agent's work (the untouched task scores as much as the reference
  solution, or the most there is; or the reference solution ran without an error and scores less than the most
  there is) or the untouched task gets partial credit, said in one line;
- wrong: any other rewards with no reason: a verdict that would mislead training.
The table closes with the count of each; exit status 1 when a row is wrong.
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

from rl.envs.check_task import (  # noqa: E402
    check_task,
    load_task,
    make_backend,
    partial_credit,
    printable,
    reference_problem,
    reward_range,
    verdict_problem,
)
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
    reason: str = ""  # why it cannot run here (refused), or why its verdicts are no verdicts (flagged)
    flagged: bool = False

    @property
    def verdict(self) -> str:
        if self.flagged:
            return "flagged"
        if self.reason:
            return "refused"
        return "right" if (self.unsolved, self.oracle) == (0.0, 1.0) else "wrong"

    @property
    def runs(self) -> bool:
        return self.verdict == "right"


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
    results = {}
    for oracle in (False, True):
        try:
            result = check_task(task, backend, oracle, log=lambda _: None)
        except (TaskError, SandboxError) as e:
            row.reason = f"{'oracle' if oracle else 'untouched'}: {one_line(e)}"
            return row
        results[oracle] = result
        setattr(row, "oracle" if oracle else "unsolved", result.reward)
        if "error" in result.details:
            row.reason = f"{'oracle' if oracle else 'untouched'}: {one_line(result.details['error'])}"
            return row
    low, high = reward_range(task)
    why = (verdict_problem(results[False], results[True], high) or reference_problem(results[True], high)
           or partial_credit(results[False], low))
    if why:
        row.reason, row.flagged = printable(why), True
    return row


def markdown(rows: list[Row]) -> str:
    def num(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = ["| task | format | environment | build s | 2nd prepare s | untouched | oracle | verdict | reason |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.task} | {r.format} | {r.environment} | {num(r.build_s, '.1f')} | "
                     f"{num(r.second_prepare_s, '.2f')} | {num(r.unsolved, 'g')} | {num(r.oracle, 'g')} | "
                     f"{r.verdict} | {r.reason.replace('|', '/')} |")
    count = {v: sum(r.verdict == v for r in rows) for v in ("right", "refused", "flagged", "wrong")}
    lines.append(f"\n{len(rows)} tasks: {count['right']} right (0 untouched, 1 with the oracle), {count['refused']} "
                 f"refused with their reason, {count['flagged']} flagged with their reason, {count['wrong']} wrong "
                 "(a verdict without a reason).")
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
        tqdm.write(f"{r.task}: {r.verdict}: untouched {r.unsolved} oracle {r.oracle}"
                   + (f" ({r.reason})" if r.reason else ""), file=sys.stderr)
    table = markdown(rows)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text("".join(json.dumps({**asdict(r), "verdict": r.verdict}) + "\n" for r in rows))
    return 1 if any(r.verdict == "wrong" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
