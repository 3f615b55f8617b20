"""Check a task: run its verifier on the untouched task, or after its reference solution.

The command line is tools/check_task.py (``python tools/check_task.py TASK [--oracle]``); `check_task` here is
what it runs, and what the tests and the generated task family are checked with.
"""

from __future__ import annotations

import re
from pathlib import Path

from rl.envs.episode import after_agent, start_episode
from rl.envs.harbor import load_harbor_task
from rl.envs.network import PACKAGE_REGISTRIES, UV_INSTALLER, network_failure, unreached_hosts
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


def check_task(task: Task, backend, oracle: bool, log=print, artifacts_dir: Path | None = None) -> VerifyResult:
    """The task's verdict untouched (`oracle` False) or after its reference solution, with a reason wherever the
    verdict is not one (`explain`). Raises TaskError (EpisodeStartError) when the sandbox does not become ready."""
    for note in task.notes:
        log(printable(f"note: {note}"))
    if oracle and any(t.solution is None for t in [task] + [s.task for s in task.steps]):  # before any setup
        raise TaskError(f"{task.source or task.name} has no reference solution (solution/solve.sh)" if not task.steps
                        else f"{task.source or task.name}: a step has no reference solution (steps/<name>/solution/"
                        "solve.sh)")
    snapshot = prepare_task(task, backend)
    failed: list[str] = []  # the reference solution's commands that failed, each with its last line
    networks: list[str] = []  # the network each phase the reference solution ran in was given

    def solve(step: Task, box) -> None:
        res = step.solution.apply(box, step)
        log(printable(f"solution{'' if step is task else ' of ' + step.name}: {res.describe()}"))
        if res.output.strip():
            log(printable(res.output.rstrip()[-2000:]))
        networks.append(getattr(box, "network", "none"))
        if not res.ok:
            failed.append(f"{'' if step is task else step.name + ': '}{res.describe()}: {last_line(res.output)}"
                          + (f" ({host})" if (host := network_failure(res.output)) else ""))
    try:
        with backend.fork(snapshot) as sandbox:
            start_episode(task, sandbox)
            if task.steps:
                result = run_steps(task, sandbox, solve if oracle else lambda step, box: None, artifacts_dir)
            else:
                if oracle:
                    solve(task, sandbox)
                problems = after_agent(task, sandbox, artifacts_dir)
                result = task.verifier.verify(sandbox, task)
                if problems:
                    result.details["collect"] = problems
    finally:
        snapshot.discard()
    if failed:  # what it scores after a failed reference solution says nothing of the task
        why = f"the reference solution failed ({'; '.join(failed)}), so its verdict is void"
        result.details["error"] = f"{why}; {result.details['error']}" if "error" in result.details else why
    public = [t for t in [task] + [s.task for s in task.steps] if t.agent_network == "public"]
    reach = next((m.group(0).strip() for t in public for m in [_NETWORK_USE.search(solution_text(t))] if m), None)
    if oracle and "error" not in result.details and result.reward < reward_range(task)[1] and reach and (
            "public" not in networks):
        result.details["error"] = (f"the task gives its agent the network (network_mode \"public\"), which this "
                                   f"sandbox did not, and its reference solution reaches for it ({reach}): it scores "
                                   f"{result.reward:g} without it")
    return explain(result, task)


# What in a reference solution reaches for the network: a download, a clone, a package install, a URL.
_NETWORK_USE = re.compile(r"(?:^|[\s;&|(`])(?:curl|wget|git\s+clone|pip3?\s+install|uv\s+(?:pip\s+install|add|sync)|"
                          r"apt(?:-get)?\s+(?:-\S+\s+)*install|npm\s+(?:i|install|ci)|yarn\s+add|go\s+(?:get|install)|"
                          r"cargo\s+install)\b|\bhttps?://[\w.-]+", re.MULTILINE)


def solution_text(task: Task) -> str:
    """The reference solution's commands as text (solve.sh, or a Terminal-Bench solution's commands)."""
    solution = task.solution
    if solution is None:
        return ""
    script = getattr(solution, "solution_dir", None)
    if script is not None and (Path(script) / "solve.sh").is_file():
        return (Path(script) / "solve.sh").read_text(errors="replace")
    return "\n".join(getattr(solution, "commands", []) or [getattr(solution, "patch", "")])


def last_line(output: str) -> str:
    return next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")[:200]


_MISSING_COMMAND = re.compile(r"(?:^|[\s:])([\w.+/-]+): (?:command )?not found\b|^env: ['‘]?([\w.+-]+)['’]?: No such "
                              r"file or directory", re.MULTILINE)


def missing_command(output: str) -> str | None:
    """The command a shell could not find (exit status 127), from its own message, or None."""
    found = _MISSING_COMMAND.findall(output)
    names = [a or b for a, b in found]
    return names[-1] if names else None


def explain(result: VerifyResult, task: Task) -> VerifyResult:
    """The verdict with a reason where it is not one: a network failure names its host; a verifier that stopped
    with exit status 127 names the command it lacked; a verdict of 0 that a network failure explains is an error."""
    details, res = result.details, result.exec_result
    output = result.output or ""
    local = tuple(s.name for s in task.services)
    hosts, host = unreached_hosts(output, local), network_failure(output, local)
    if "error" in details:
        error = details["error"]
        beyond = [h for h in hosts if h not in PACKAGE_REGISTRIES]  # a verifier's apt/pip retries are beside the point
        if beyond and not any(h in error for h in beyond):
            details["error"] = f"{error} ({network_failure(output, local, ignore=UV_INSTALLER + PACKAGE_REGISTRIES)})"
        elif host and not beyond and "it asked for" not in error:
            details["error"] = f"{error} ({host})"
        if res is not None and res.exit_code == 127 and (command := missing_command(output)) and \
                f"`{command}`" not in details["error"] and f" {command}," not in details["error"]:
            details["error"] += f" (the command `{command}` is missing: exit status 127)"
    elif host and result.reward <= reward_range(task)[0] and not all(h in PACKAGE_REGISTRIES for h in hosts):
        details["error"] = f"the verifier needs the network, which the sandbox did not give it: {host}"
    return result


def reward_range(task: Task) -> tuple[float, float]:
    return getattr(task.verifier, "reward_range", (0.0, 1.0))


def verdict_problem(untouched: VerifyResult, reference: VerifyResult | None, high: float = 1.0) -> str | None:
    """Why an untouched task's reward is no verdict on the agent's work, or None: it scores as much as the reference
    solution (or the most there is)."""
    if untouched.reward >= high or (reference is not None and untouched.reward > 0 and
                                    untouched.reward >= reference.reward):
        scored = f"the untouched task scores {untouched.reward:g}" + (
            f", as much as the reference solution ({reference.reward:g})" if reference is not None else "")
        return f"the verifier does not depend on the agent's work: {scored}"
    return None


def reference_problem(reference: VerifyResult, high: float = 1.0) -> str | None:
    """Why the reference solution's verdict says nothing of the agent's work, or None: it ran without an error and
    still scores below the most there is, so its verifier rejects the task's own solution."""
    if reference.reward >= high or "error" in reference.details:
        return None
    lines = [line.strip() for line in reference.output.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith("FAILED ")]  # pytest -rA: the test that failed, and why
    said = (f" ({failed[0][:200]})" if failed else f" (the verifier's last line: {lines[-1][:200]})" if lines
            else " (the verifier printed nothing)")
    return (f"the reference solution ran without an error and scores {reference.reward:g} of {high:g}: the verifier "
            f"rejects the task's own solution{said}")


def partial_credit(untouched: VerifyResult, low: float = 0.0) -> str | None:
    """One line for an untouched task that gets partial credit (a weighted rubric), or None."""
    if untouched.reward <= low or "error" in untouched.details:
        return None
    keys = untouched.details.get("rewards")
    return (f"partial credit: the untouched task scores {untouched.reward:g}"
            + (f" ({', '.join(f'{k} {v:g}' for k, v in keys.items())})" if keys else "")
            + ", which its verifier gives for work already there")


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

