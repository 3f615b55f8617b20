"""Fill the expected outputs of a task's tests/cases.json from its reference solution.

A case names a program (`argv`, optional `stdin`) that prints what the code under test computes; the verifier's
harness (tools/case_harness.py, copied to tests/harness.py) runs each in its own `judge` child and compares
what it prints with the case's "expect". This tool applies the task's solution in a local sandbox, runs every
case there and writes what it printed as "expect"; a case that fails under the reference solution is an error.

    python tools/make_task_cases.py examples/tasks/python-lru-cache-bug [...]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.envs.harbor import load_harbor_task  # noqa: E402
from rl.envs.task import prepare_task  # noqa: E402
from rl.sandbox.local import LocalBackend  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "case_harness.py"


def fill(task_dir: Path, backend: LocalBackend) -> int:
    cases_path = task_dir / "tests" / "cases.json"
    spec = json.loads(cases_path.read_text())
    task = load_harbor_task(task_dir)
    if task.solution is None:
        raise SystemExit(f"{task_dir} has no solution/solve.sh to take the expected outputs from")
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sandbox:
            applied = task.solution.apply(sandbox, task)
            if task.verifier.judge_reads:  # what the cases' programs read of tests/ (drivers, inputs)
                sandbox.copy_in(task_dir / "tests", "/tests")
            if applied.exit_code != 0:
                raise SystemExit(f"{task_dir}: the solution failed: {applied.output[-500:]}")
            for case in spec["cases"]:
                res = sandbox.exec(shlex.join(case["argv"]), cwd="/app", stdin=case.get("stdin", "").encode())
                if res.exit_code != 0:
                    raise SystemExit(f"{task_dir}: case {case['name']!r} fails under the reference solution: "
                                     f"{res.describe()}: {res.output[-500:]}")
                case["expect"] = res.output
    finally:
        snapshot.discard()
    cases_path.write_text(json.dumps(spec, indent=1, ensure_ascii=False) + "\n")
    shutil.copyfile(HARNESS, task_dir / "tests" / "harness.py")
    return len(spec["cases"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tasks", nargs="+", type=Path, help="task folders with tests/cases.json")
    args = ap.parse_args()
    backend = LocalBackend()
    for task_dir in args.tasks:
        print(f"{task_dir}: {fill(task_dir, backend)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
