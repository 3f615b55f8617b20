"""The task model: instruction, file tree, setup, verifier, reference solution, limits.

A task is backend-agnostic. `prepare_task` builds it once in a sandbox backend and returns a snapshot that a
pool forks per sample; `verify` runs the task's verifier in a sandbox after the agent finished and returns
the reward. Loaders for public formats (Harbor/Terminal-Bench folders, SWE-bench instances) produce Tasks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rl.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits


class TaskError(ValueError):
    """A task definition is invalid; the message names the file and the field."""


@dataclass
class TaskLimits:
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 600.0
    setup_timeout_s: float = 600.0
    memory_mb: int = 2048
    cpus: float = 1.0
    storage_mb: int = 10240
    max_turns: int = 50

    def sandbox_limits(self, base: SandboxLimits | None = None) -> SandboxLimits:
        """The sandbox limits this task asks for, on top of a backend's defaults."""
        base = base or SandboxLimits()
        return dataclasses.replace(base, memory_mb=self.memory_mb, disk_mb=min(base.disk_mb, self.storage_mb),
                                   cpu_time_s=max(base.cpu_time_s, int(self.agent_timeout_s)))


# File trees ---------------------------------------------------------------------------------------------------
class TaskTree(Protocol):
    def materialize(self, dest: Path) -> None: ...


@dataclass
class DirectoryTree:
    path: Path

    def materialize(self, dest: Path) -> None:
        from rl.sandbox.local import copy_tree

        copy_tree(self.path, dest)


@dataclass
class EmptyTree:
    def materialize(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)


@dataclass
class GitTree:
    """A local clone of a repository checked out at a commit (the origin remote is removed)."""

    repo: Path
    commit: str

    def materialize(self, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        for argv in (["git", "clone", "--quiet", "--no-hardlinks", str(self.repo), str(dest)],
                     ["git", "-C", str(dest), "-c", "advice.detachedHead=false", "checkout", "--quiet", self.commit],
                     ["git", "-C", str(dest), "remote", "remove", "origin"]):
            res = subprocess.run(argv, capture_output=True, text=True)
            if res.returncode != 0:
                raise TaskError(f"cannot check out {self.repo} at {self.commit}: {' '.join(argv[:4])}: "
                                f"{res.stderr.strip()}")


# Setup steps --------------------------------------------------------------------------------------------------
@dataclass
class CopyStep:
    """Put a host file or directory's contents at `dest` (Dockerfile COPY/ADD)."""

    src: Path
    dest: str
    origin: str
    unpack: bool = False  # src is a tar archive whose members go to dest (Dockerfile ADD)

    def apply(self, sandbox: Sandbox, timeout: float) -> None:
        try:
            if not self.unpack:
                sandbox.copy_in(self.src, self.dest, merge=True)
                return
            with tempfile.TemporaryDirectory(prefix="mc-add-") as tmp:
                _safe_extract(self.src, Path(tmp))
                sandbox.copy_in(tmp, self.dest, merge=True)
        except (SandboxError, tarfile.TarError) as e:
            raise TaskError(f"{self.origin}: {e}") from None


def _safe_extract(archive: Path, dest: Path) -> None:
    """Unpack a tar archive whose members may not escape dest (no absolute paths, '..' or device files)."""
    with tarfile.open(archive) as tf:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tf.extractall(dest, filter="data")
            return
        for m in tf.getmembers():
            target = os.path.realpath(dest / m.name)
            if not target.startswith(os.path.realpath(dest) + os.sep) or not (m.isfile() or m.isdir()):
                raise tarfile.TarError(f"{archive.name}: member {m.name!r} is not a plain file inside the archive")
        tf.extractall(dest)


@dataclass
class RunStep:
    """Run a shell command once when the task is prepared (Dockerfile RUN, a setup command)."""

    command: str
    cwd: str
    env: dict[str, str]
    origin: str

    def apply(self, sandbox: Sandbox, timeout: float) -> None:
        res = sandbox.exec(f"mkdir -p {shlex.quote(self.cwd)} && cd {shlex.quote(self.cwd)} && {self.command}",
                           cwd="/", env=self.env, timeout=timeout)
        if not res.ok:
            raise TaskError(f"{self.origin}: setup command failed ({res.describe()}): {self.command[:200]}\n"
                            f"{res.output[-2000:]}")


# Verifiers ----------------------------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    reward: float
    output: str
    details: dict = field(default_factory=dict)
    exec_result: ExecResult | None = None


class Verifier(Protocol):
    def verify(self, sandbox: Sandbox, task: "Task") -> VerifyResult: ...


@dataclass
class ScriptVerifier:
    """Harbor's verifier: tests/ copied to /tests after the agent finished, `bash /tests/test.sh` writes
    the reward to /logs/verifier/reward.txt (or a {"reward": x} object to reward.json)."""

    tests_dir: Path
    command: str = "bash /tests/test.sh"
    env: dict[str, str] = field(default_factory=dict)

    def verify(self, sandbox: Sandbox, task: "Task") -> VerifyResult:
        # A reward the agent wrote itself must not count: the verifier starts from an empty /logs/verifier.
        sandbox.exec("rm -rf /logs/verifier && mkdir -p /logs/verifier", cwd="/", timeout=60)
        sandbox.copy_in(self.tests_dir, "/tests")
        res = sandbox.exec(self.command, cwd=task.workdir, env=self.env, timeout=task.limits.verifier_timeout_s)
        details: dict = {"verifier": res.describe()}
        if res.timed_out:
            # A verifier that hangs has not decided; whatever it wrote before hanging does not count.
            details["error"] = f"the verifier timed out after {task.limits.verifier_timeout_s:g} s"
            return VerifyResult(0.0, res.output, details, res)
        text = sandbox.read_text("/logs/verifier/reward.txt")
        if text is not None:
            try:
                reward = float(text.strip().splitlines()[-1]) if text.strip() else 0.0
            except ValueError:
                details["error"] = f"/logs/verifier/reward.txt must hold a number, got {text[:100]!r}"
                return VerifyResult(0.0, res.output, details, res)
        else:
            raw = sandbox.read_text("/logs/verifier/reward.json")
            if raw is None:
                details["error"] = "the verifier wrote no /logs/verifier/reward.txt or reward.json"
                return VerifyResult(0.0, res.output, details, res)
            try:
                reward = float(json.loads(raw)["reward"])
            except (ValueError, KeyError, TypeError):
                details["error"] = f"/logs/verifier/reward.json has no numeric 'reward': {raw[:200]!r}"
                return VerifyResult(0.0, res.output, details, res)
        return VerifyResult(reward, res.output, details, res)


# Reference solutions ------------------------------------------------------------------------------------------
@dataclass
class ScriptSolution:
    """Harbor's solution/solve.sh, run from the task's working directory with the folder at /solution."""

    solution_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # task.toml [solution.env]

    def apply(self, sandbox: Sandbox, task: "Task") -> ExecResult:
        sandbox.copy_in(self.solution_dir, "/solution")
        return sandbox.exec("bash /solution/solve.sh", cwd=task.workdir, env=self.env,
                            timeout=task.limits.agent_timeout_s)

    def as_commands(self) -> list[str]:
        """The solution as shell commands an agent can send through the `run` tool."""
        others = [p.name for p in self.solution_dir.iterdir() if p.name != "solve.sh"]
        if others:
            raise TaskError(f"{self.solution_dir}: replaying through tools needs solve.sh alone, found {others}")
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.env.items())
        return [exports + (self.solution_dir / "solve.sh").read_text()]


@dataclass
class PatchSolution:
    """A unified diff applied with git (SWE-bench's gold patch)."""

    patch: str

    def as_commands(self) -> list[str]:
        marker = "MC_PATCH_EOF"
        while marker in self.patch:
            marker += "_"
        return [f"git apply --whitespace=nowarn - <<'{marker}'\n{self.patch.rstrip(chr(10))}\n{marker}\n"]

    def apply(self, sandbox: Sandbox, task: "Task") -> ExecResult:
        return sandbox.exec(self.as_commands()[0], cwd=task.workdir, timeout=task.limits.agent_timeout_s)


# The task -----------------------------------------------------------------------------------------------------
@dataclass
class Task:
    name: str
    instruction: str
    tree: TaskTree
    verifier: Verifier
    workdir: str = "/app"
    env: dict[str, str] = field(default_factory=dict)
    setup: list = field(default_factory=list)  # CopyStep | RunStep, applied in order
    solution: ScriptSolution | PatchSolution | None = None
    limits: TaskLimits = field(default_factory=TaskLimits)
    source: Path | None = None
    # For container backends: the build context with a Dockerfile, or a prebuilt image.
    environment_dir: Path | None = None
    docker_image: str | None = None
    notes: list[str] = field(default_factory=list)  # what a backend could not honour, said once


def prepare_task(task: Task, backend, limits: SandboxLimits | None = None):
    """Build the task once: materialise its tree, run its setup in a sandbox, and return a snapshot to fork."""
    build = getattr(backend, "build", None)
    if build is not None:  # container engines build the Dockerfile themselves
        return build(task)
    limits = limits or task.limits.sandbox_limits(backend.limits)
    with tempfile.TemporaryDirectory(prefix="mc-task-") as tmp:
        tree_dir = Path(tmp) / "tree"
        task.tree.materialize(tree_dir)
        sandbox = backend.create(tree_dir, workdir="/app", env=task.env, limits=limits)
    try:
        for step in task.setup:
            step.apply(sandbox, task.limits.setup_timeout_s)
        if task.workdir != "/app":
            sandbox.exec(f"mkdir -p {shlex.quote(task.workdir)}", cwd="/", timeout=60)
        snapshot = sandbox.snapshot()
        snapshot.workdir = task.workdir
        snapshot.env = dict(task.env)
        snapshot.limits = limits
        return snapshot
    finally:
        sandbox.close()


def verify(task: Task, sandbox: Sandbox) -> VerifyResult:
    return task.verifier.verify(sandbox, task)
