"""Check a task: run its verifier on the untouched task, or after its reference solution.

The command line is tools/check_task.py (``python tools/check_task.py TASK [--oracle]``); `check_task` here is
what it runs, and what the tests and the generated task family are checked with.
"""

from __future__ import annotations

import re
from pathlib import Path

from rl.envs.harbor import load_harbor_task
from rl.envs.steps import run_steps
from rl.envs.swebench import load_swebench
from rl.envs.task import Task, TaskError, VerifyResult, prepare_task
from rl.sandbox import SandboxLimits

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


def make_backend(name: str, limits: SandboxLimits | None = None, build_images: bool = False,
                 local_base: bool = False):
    limits = limits or SandboxLimits()
    if name == "local":
        from rl.sandbox.local import LocalBackend

        return LocalBackend(limits=limits, build_images=build_images)
    from rl.sandbox.container import make_container_backend

    return make_container_backend(name, limits=limits, local_base=local_base)


def check_task(task: Task, backend, oracle: bool, log=print) -> VerifyResult:
    for note in task.notes:
        log(printable(f"note: {note}"))
    if oracle and any(t.solution is None for t in [task] + [s.task for s in task.steps]):  # before any setup
        raise TaskError(f"{task.source or task.name} has no reference solution (solution/solve.sh)" if not task.steps
                        else f"{task.source or task.name}: a step has no reference solution (steps/<name>/solution/"
                        "solve.sh)")
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sandbox:
            if task.steps:
                def solve(step: Task, box) -> None:
                    res = step.solution.apply(box, step)
                    log(printable(f"solution of {step.name}: {res.describe()}"))

                return run_steps(task, sandbox, solve if oracle else lambda step, box: None)
            if oracle:
                res = task.solution.apply(sandbox, task)
                log(printable(f"solution: {res.describe()}"))
                if res.output.strip():
                    log(printable(res.output.rstrip()[-2000:]))
            result = task.verifier.verify(sandbox, task)
    finally:
        snapshot.discard()
    return result


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

