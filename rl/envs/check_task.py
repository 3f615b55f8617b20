"""Check a task folder: run its verifier on the untouched task, or after its reference solution.

    python -m rl.envs.check_task TASK_DIR            # a valid task prints reward 0 (nothing solved yet)
    python -m rl.envs.check_task TASK_DIR --oracle   # after solution/solve.sh it prints reward 1

The reward is the last line of output. Exit status 2: the task or the sandbox backend is broken (the message
says which).
"""

from __future__ import annotations

import argparse
import sys

from rl.envs.harbor import load_harbor_task
from rl.envs.task import Task, TaskError, VerifyResult, prepare_task
from rl.sandbox import SandboxError, SandboxLimits


def make_backend(name: str, limits: SandboxLimits | None = None):
    limits = limits or SandboxLimits()
    if name == "local":
        from rl.sandbox.local import LocalBackend

        return LocalBackend(limits=limits)
    from rl.sandbox.container import make_container_backend

    return make_container_backend(name, limits=limits)


def check_task(task: Task, backend, oracle: bool, log=print) -> VerifyResult:
    for note in task.notes:
        log(f"note: {note}")
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sandbox:
            if oracle:
                if task.solution is None:
                    raise TaskError(f"{task.source or task.name} has no reference solution (solution/solve.sh)")
                res = task.solution.apply(sandbox, task)
                log(f"solution: {res.describe()}")
                if res.output.strip():
                    log(res.output.rstrip()[-2000:])
            result = task.verifier.verify(sandbox, task)
    finally:
        snapshot.discard()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl.envs.check_task", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task_dir", help="a Harbor/Terminal-Bench task folder")
    parser.add_argument("--oracle", action="store_true", help="apply solution/solve.sh before verifying")
    parser.add_argument("--backend", default="local", choices=["local", "docker", "podman", "apptainer"])
    args = parser.parse_args(argv)
    try:
        task = load_harbor_task(args.task_dir)
        backend = make_backend(args.backend)
        result = check_task(task, backend, args.oracle)
    except (TaskError, SandboxError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.output.strip():
        print(result.output.rstrip()[-4000:])
    for key, value in result.details.items():
        print(f"{key}: {value}")
    print(f"{result.reward:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
