"""Check a task: run its verifier on the untouched task, or after its reference solution.

    python -m rl.envs.check_task TASK_DIR            # a valid task prints reward 0 (nothing solved yet)
    python -m rl.envs.check_task TASK_DIR --oracle   # after solution/solve.sh it prints reward 1
    python -m rl.envs.check_task INSTANCES.jsonl --instance ID [--repos DIR] [--oracle]   # SWE-bench

A SWE-bench JSONL needs local clones of its repositories under --repos (default: the JSONL's folder) named
owner__name or name; --oracle applies the instance's gold patch. The reward is the last line of output. Exit
status 2: the task, its verifier or the sandbox backend is broken (the message says which), for example a
verifier that wrote no reward or needed a tool the backend lacks.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rl.envs.harbor import load_harbor_task
from rl.envs.swebench import load_swebench
from rl.envs.task import Task, TaskError, VerifyResult, prepare_task
from rl.sandbox import SandboxError, SandboxLimits

# Terminal control the task's programs may print: escape sequences (CSI, OSC and the other ESC forms, including
# their 8-bit introducers) and every other control character but newline and tab.
_CONTROL = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"        # CSI ... final byte
                      r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d-\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC/DCS/...
                      r"|\x1b[ -/]*[0-~]?"                           # other ESC sequences
                      r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with terminal control sequences and characters removed: what a task's programs print reaches the
    operator's terminal as text, never as commands to it."""
    return _CONTROL.sub("", text)


def make_backend(name: str, limits: SandboxLimits | None = None):
    limits = limits or SandboxLimits()
    if name == "local":
        from rl.sandbox.local import LocalBackend

        return LocalBackend(limits=limits)
    from rl.sandbox.container import make_container_backend

    return make_container_backend(name, limits=limits)


def check_task(task: Task, backend, oracle: bool, log=print) -> VerifyResult:
    for note in task.notes:
        log(printable(f"note: {note}"))
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sandbox:
            if oracle:
                if task.solution is None:
                    raise TaskError(f"{task.source or task.name} has no reference solution (solution/solve.sh)")
                res = task.solution.apply(sandbox, task)
                log(printable(f"solution: {res.describe()}"))
                if res.output.strip():
                    log(printable(res.output.rstrip()[-2000:]))
            result = task.verifier.verify(sandbox, task)
    finally:
        snapshot.discard()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl.envs.check_task", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", help="a Harbor/Terminal-Bench task folder, or a SWE-bench JSONL file")
    parser.add_argument("--oracle", action="store_true",
                        help="apply the reference solution (solution/solve.sh, the gold patch) before verifying")
    parser.add_argument("--instance", help="the instance_id to check in a SWE-bench JSONL")
    parser.add_argument("--repos", help="folder with the SWE-bench repositories' clones (default: the JSONL's)")
    parser.add_argument("--backend", default="local", choices=["local", "docker", "podman", "apptainer"])
    args = parser.parse_args(argv)
    try:
        task = load_task(args.task, args.instance, args.repos)
        backend = make_backend(args.backend)
        result = check_task(task, backend, args.oracle)
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
    return 0


def load_task(path: str, instance: str | None = None, repos: str | None = None) -> Task:
    """A Harbor task folder, or one instance of a SWE-bench JSONL (the only one, or the one named)."""
    p = Path(path)
    if p.is_dir():
        if instance is not None:
            raise TaskError(f"--instance is for SWE-bench JSONL files; {p} is a Harbor task folder")
        return load_harbor_task(p)
    if not p.is_file():
        raise TaskError(f"{p} does not exist: give a Harbor task folder or a SWE-bench JSONL file")
    tasks = load_swebench(p, Path(repos) if repos else p.parent, only=instance)
    if not tasks:
        raise TaskError(f"{p} has no instance {instance!r}" if instance else f"{p} holds no instances")
    if len(tasks) > 1:
        names = ", ".join(t.name for t in tasks[:5]) + (", ..." if len(tasks) > 5 else "")
        raise TaskError(f"{p} holds {len(tasks)} instances ({names}); choose one with --instance ID")
    return tasks[0]


if __name__ == "__main__":
    sys.exit(main())
