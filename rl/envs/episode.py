"""What a task declares around its agent's phase, done in the sandbox as Harbor does it:

- before the agent: the [environment].healthcheck (and a step's [steps.healthcheck]) run as docker runs a
  HEALTHCHECK: failures within its start period do not count, then `retries` failures in a row fail the episode;
  each declared stdio MCP server's command must exist in the sandbox;
- after the agent, before the verifier: the [[verifier.collect]] hooks (best effort, as in Harbor: a failure is
  noted, never fatal), then the task's `artifacts` copied into the run's folder.

`start_episode` raises EpisodeStartError (one line) when the sandbox is not ready: there is no verdict then, as
Harbor records an exception instead of a reward.
"""

from __future__ import annotations

import base64
import io
import shlex
import tarfile
import time
from pathlib import Path, PurePosixPath

from rl.envs.task import Task, TaskError
from rl.envs.task_config import Artifact
from rl.sandbox.base import BASE_ENV, Sandbox, SandboxError

ARTIFACT_BYTES = 64 * 1024 * 1024  # the most one artifact may hold (as a base64 tar) to be collected


class EpisodeStartError(TaskError):
    """The sandbox did not become ready for the agent (a health check failed, a declared tool is missing)."""


def wait_healthy(sandbox: Sandbox, check, cwd: str, what: str) -> None:
    """Run `check` (task_config.Healthcheck) until it passes, as docker does; EpisodeStartError when it does not."""
    start_period_ends = time.monotonic() + check.start_period_s
    failures = 0
    while True:
        res = sandbox.exec(check.command, cwd=cwd, timeout=check.timeout_s)
        if res.ok:
            return
        if time.monotonic() < start_period_ends:
            time.sleep(check.start_interval_s)
            continue
        failures += 1
        if failures >= check.retries:
            last = next((line for line in reversed(res.output.splitlines()) if line.strip()), "no output")
            raise EpisodeStartError(f"{what} `{check.command}` failed {failures} times in a row ({res.describe()}): "
                                    f"{last.strip()[:200]}")
        time.sleep(check.interval_s)


def start_episode(task: Task, sandbox: Sandbox) -> None:
    """Before the agent's first command: the task's health check, and the commands of its stdio MCP servers."""
    if task.healthcheck is not None:
        wait_healthy(sandbox, task.healthcheck, task.workdir, f"{task.name}: the health check")
    for server in task.mcp_servers:
        if server.transport == "stdio":
            res = sandbox.exec(f"command -v {shlex.quote(server.command)}", cwd=task.workdir, timeout=60)
            if not res.ok:
                raise EpisodeStartError(f"{task.name}: MCP server {server.name!r} starts with `{server.command}`, "
                                        "which the sandbox does not have")


def after_agent(task: Task, sandbox: Sandbox, artifacts_dir: Path | None = None) -> list[str]:
    """After the agent's phase, before the verifier's: the collect hooks, then the artifacts (into
    `artifacts_dir` when given). Returns a line for each hook or artifact that did not work out."""
    problems = []
    for hook in task.collect:
        res = sandbox.exec(hook.command, cwd=task.workdir, timeout=hook.timeout_s)
        if not res.ok:
            problems.append(f"collect hook `{hook.command}` failed ({res.describe()})")
    if artifacts_dir is not None:
        problems += collect_artifacts(task, sandbox, artifacts_dir)
    return problems


CONVENTION = Artifact("/logs/artifacts")  # collected whenever it exists, as Harbor collects it


def collect_artifacts(task: Task, sandbox: Sandbox, dest: Path) -> list[str]:
    """Copy each of the task's artifacts (and /logs/artifacts, where the task left it) out of the sandbox into `dest`
    (at its destination, else at its path without the leading /), as Harbor fills a trial's artifacts folder.
    Nothing of the archive may leave `dest`."""
    problems = []
    dest.mkdir(parents=True, exist_ok=True)
    for n, artifact in enumerate((*task.artifacts, CONVENTION)):
        source = artifact.source if artifact.source.startswith("/") else str(PurePosixPath(task.workdir) /
                                                                               artifact.source)
        name = PurePosixPath(source).name or "root"
        excludes = " ".join(f"--exclude={shlex.quote(e)}" for e in artifact.exclude)
        staged = f"/tmp/.mc-artifact-{n}.b64"
        parent = shlex.quote(str(PurePosixPath(source).parent))
        res = sandbox.exec(f"[ -e {shlex.quote(source)} ] || exit 3; set -o pipefail; tar -C {parent} {excludes} "
                           f"-cf - {shlex.quote(name)} | base64 -w0 > {staged}", cwd="/",
                           env={"PATH": BASE_ENV["PATH"]}, timeout=300)
        if res.exit_code == 3:
            if artifact is not CONVENTION:
                problems.append(f"artifact {artifact.source} does not exist")
            continue
        try:
            data = sandbox.read_file(staged, ARTIFACT_BYTES) if res.ok else None
        except SandboxError as e:
            data, res.output = None, str(e)
        sandbox.exec(f"rm -f {staged}", cwd="/", timeout=60)
        if data is None or len(data) > ARTIFACT_BYTES:
            problems.append(f"artifact {artifact.source} could not be collected"
                            + (f" (more than {ARTIFACT_BYTES} bytes)" if data else f": {res.output.strip()[-200:]}"))
            continue
        target = dest / (artifact.destination or source.lstrip("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data)), mode="r:") as tar:
            members = tar.getmembers()
            for member in members:  # the archive holds `name` and what is under it; it lands at `target`
                inner = PurePosixPath(member.name).relative_to(name) if member.name != name else PurePosixPath(".")
                member.name = str(PurePosixPath(target.name) / inner)
            tar.extractall(target.parent, members=members, filter="data")
    return problems
