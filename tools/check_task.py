"""Check a task: run its verifier on the untouched task, or after its reference solution.

    python tools/check_task.py TASK_DIR            # a valid task prints reward 0 (nothing solved yet)
    python tools/check_task.py TASK_DIR --oracle   # after solution/solve.sh it prints reward 1
    python tools/check_task.py INSTANCES.jsonl --instance ID [--repos DIR] [--oracle]   # SWE-bench

A SWE-bench JSONL needs local clones of its repositories under --repos (default: the JSONL's folder) named
owner__name or name; --oracle applies the instance's gold patch. The reward is the last line of output. No verdict
goes without a reason:
- exit status 2: the task, its verifier or the sandbox backend is broken (the message says which), for example a
  verifier that wrote no reward, needed a tool or a host the sandbox lacks (named), or a reference solution whose
  commands failed (its last line);
- exit status 1: the untouched task scores as much as its reference solution (or the most there is): the verifier
  does not depend on the agent's work; or, with --oracle, a reference solution that ran without an error scores
  below the most there is: the verifier rejects the task's own solution;
- an untouched task that gets partial credit (a weighted rubric) says so in one line (its reference solution is
  run to compare).
--artifacts DIR collects the task's declared `artifacts` there (steps/<name>/artifacts/ for a multi-step task).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from rl.envs.task import TaskError  # noqa: E402
from rl.sandbox import SandboxError  # noqa: E402
from rl.sandbox.leftovers import release_on_signals  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", help="a Harbor/Terminal-Bench task folder, or a SWE-bench JSONL file")
    parser.add_argument("--oracle", action="store_true",
                        help="apply the reference solution (solution/solve.sh, the gold patch) before verifying")
    parser.add_argument("--instance", help="the instance_id to check in a SWE-bench JSONL")
    parser.add_argument("--repos", help="folder with the SWE-bench repositories' clones (default: the JSONL's)")
    parser.add_argument("--backend", default="local", choices=["local", "docker", "podman", "apptainer"])
    parser.add_argument("--local-base", action="store_true",
                        help="docker/podman: build on the local backend's Debian base instead of the FROM image "
                             "of a registry (for hosts without one; the same system as the local backend)")
    parser.add_argument("--build-image", action="store_true",
                        help="local backend: build the Dockerfile into an image even where the host's system could "
                             "stand in (docs/SANDBOX.md, task images)")
    parser.add_argument("--artifacts", type=Path, help="collect the task's declared artifacts into this folder")
    args = parser.parse_args(argv)
    release_on_signals()  # a stopped check leaves no sandbox, mount or cgroup behind
    try:
        with warnings.catch_warnings():  # a task's format notes are printed once, as check_task's "note:" lines
            warnings.simplefilter("ignore", TaskFormatWarning)
            task = load_task(args.task, args.instance, args.repos)
        backend = make_backend(args.backend, build_images=args.build_image, local_base=args.local_base)
        result = check_task(task, backend, args.oracle, artifacts_dir=args.artifacts)
        low, high = reward_range(task)
        reference = None
        if not args.oracle and low < result.reward < high and "error" not in result.details and (
                task.solution is not None and all(s.task.solution is not None for s in task.steps)):
            reference = check_task(task, backend, True, log=lambda _: None)  # partial credit, or all of it?
    except (TaskError, SandboxError) as e:
        print(printable(f"error: {e}"), file=sys.stderr)
        return 2
    if result.output.strip():
        print(printable(result.output.rstrip()[-4000:]))
    for key, value in result.details.items():
        print(printable(f"{key}: {value}"))
    print(f"{result.reward:g}")
    if "error" in result.details:
        print(printable(f"error: {result.details['error']}"), file=sys.stderr)
        return 2
    if args.oracle and (problem := reference_problem(result, high)):
        print(printable(f"error: {problem}"), file=sys.stderr)
        return 1
    if not args.oracle:
        if problem := verdict_problem(result, reference, high):
            print(printable(f"error: {problem}"), file=sys.stderr)
            return 1
        if line := partial_credit(result, low):
            print(printable(line), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
