"""Sandboxes on container engines, driven through their command-line tools.

- docker / podman (`ContainerSandbox`): the task's environment/Dockerfile is built as an image (its RUN lines run
  in the build); a container started from it with no network, a memory limit, a pid limit and rlimits stays up
  for the episode and each command runs with `exec` under `timeout -s KILL`. Snapshots are committed images,
  so every fork starts from the prepared state. With `local_base` (no registry needed) the image is built on the
  local backend's Debian base, imported into the engine, from the same recipe as the local backend's images
  (rl/sandbox/image.py `containerfile`): the same tasks get the same system on both.
- apptainer (`ApptainerSandbox`): like LocalSandbox, each command is a fresh `apptainer exec --containall` of
  the backend's image (default docker://python:3.11-slim-bookworm) with the task tree bound at /app; the
  Dockerfile subset is applied as for the local backend.
"""

from __future__ import annotations

import resource
import secrets
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rl.sandbox.base import (
    BASE_ENV,
    VERIFIER_ENV,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    note_limits,
    run_process,
)
from rl.sandbox.image import ImageBuilder, containerfile, host_network_view
from rl.sandbox.local import LocalSandbox, LocalSnapshot

ENGINES = ("docker", "podman", "apptainer")
BUILD_RLIMIT = 16384  # open files and processes of a build's RUN steps


def engine_problem(engine: str) -> str | None:
    """Why `engine` cannot run containers here, or None when it can."""
    if engine not in ENGINES:
        return f"unknown container engine {engine!r}; choose one of {list(ENGINES)}"
    exe = shutil.which(engine)
    if exe is None:
        return f"{engine} is not installed"
    probe = [exe, "version"] if engine == "apptainer" else [exe, "info"]
    try:
        res = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{engine} does not respond: {e}"
    if res.returncode != 0:
        lines = (res.stderr or res.stdout).strip().splitlines()
        return f"{engine} cannot run containers: {lines[-1] if lines else 'exit ' + str(res.returncode)}"
    return None


def _cli(argv: list[str], what: str, timeout: float = 600, stdin: bytes | None = None) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, timeout=timeout, input=stdin)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{what} timed out after {timeout:g}s: {shlex.join(argv[:6])}") from None
    if res.returncode != 0:
        raise SandboxError(f"{what} failed: {res.stderr.decode(errors='replace').strip()[-2000:]}")
    return res.stdout.decode(errors="replace").strip()


@dataclass
class ContainerSnapshot:
    engine: str
    image: str
    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    owned: bool = True  # a committed image this project made (removed on discard), not a task's base image
    limits: SandboxLimits | None = None

    def discard(self) -> None:
        if self.owned:
            subprocess.run([self.engine, "rmi", "-f", self.image], capture_output=True)


class ContainerSandbox(Sandbox):
    """A docker or podman container kept running for the episode; commands run via `exec`."""

    def __init__(self, engine: str, image: str, *, workdir: str = "/app", env: dict[str, str] | None = None,
                 limits: SandboxLimits | None = None, runtime: str | None = None):
        self.engine = engine
        self.limits = limits or SandboxLimits()
        self.workdir = workdir
        self.tree_root = "/app"
        self.env = dict(env or {})
        lim = self.limits
        mb = 1024 * 1024
        self.name = f"mc-sandbox-{secrets.token_hex(6)}"
        argv = [engine, *(["--runtime", runtime] if runtime else []), "run", "-d", "--name", self.name,
                "--network", "none", "--memory", f"{lim.memory_mb}m", "--pids-limit", str(lim.max_processes),
                "--security-opt", "no-new-privileges", "--ulimit", f"fsize={lim.max_file_mb * mb}",
                "--ulimit", f"nofile={lim.max_open_files}", "--ulimit", f"nproc={lim.max_processes}",
                "--ulimit", f"cpu={lim.cpu_time_s}", "--ulimit", "core=0", "--workdir", workdir,
                "--entrypoint", "sleep", image, "infinity"]
        self.container = _cli(argv, f"{engine} run")
        self._closed = False

    def exec(self, command: str, *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        timeout = self.limits.command_timeout_s if timeout is None else timeout
        argv = [self.engine, "exec", "-i", "-w", cwd or self.workdir]
        for k, v in {**BASE_ENV, **self.env, **(env or {})}.items():
            argv += ["-e", f"{k}={v}"]
        # timeout inside the container kills the command there; the host-side limit is a backstop.
        argv += [self.container, "timeout", "-s", "KILL", f"{timeout:g}", "bash", "--noprofile", "--norc", "-c",
                 command]
        res = run_process(argv, timeout=timeout + 10, max_output=self.limits.max_output_bytes, stdin=stdin)
        if res.exit_code == 137 and res.duration_s >= timeout:
            res.timed_out = True
            res.events = [f"wall-clock timeout after {timeout:g}s: process killed"]
        note_limits(res, self.limits)
        return res

    def copy_in(self, host_path: str | Path, dest: str, merge: bool = False) -> None:
        host_path = Path(host_path)
        q = shlex.quote(dest)
        prep = f"mkdir -p {q}" if merge and host_path.is_dir() else f"rm -rf {q} && mkdir -p \"$(dirname {q})\""
        _cli([self.engine, "exec", self.container, "sh", "-c", prep], "preparing " + dest)
        if host_path.is_dir():
            if not merge:
                _cli([self.engine, "exec", self.container, "mkdir", "-p", dest], "mkdir " + dest)
            _cli([self.engine, "cp", f"{host_path}/.", f"{self.container}:{dest}"], f"copying {host_path}")
        else:
            _cli([self.engine, "cp", str(host_path), f"{self.container}:{dest}"], f"copying {host_path}")

    def enter_verifier(self, services: bool = True) -> None:
        """Inside the running container, as its root: kill every process but its init (the agent's background
        processes survive between commands here, but a verifier shares the container's pid namespace with them,
        so services do not outlive the agent phase on this backend), then replace /tmp and /logs with empty
        ones."""
        reset = ("kill -KILL -1 2>/dev/null; rm -rf /tmp /logs && mkdir -m 1777 /tmp && "
                 "mkdir -p /logs/verifier /logs/agent")
        _cli([self.engine, "exec", "-u", "0", self.container, "sh", "-c", reset], "starting the verifier phase")
        self.env = {**self.env, **VERIFIER_ENV}

    def leave_verifier(self) -> None:
        """The verifier's processes are gone with its command; its environment goes too (/tmp and /logs stay as the
        verifier left them: the container has one of each)."""
        self.env = {k: v for k, v in self.env.items() if k not in VERIFIER_ENV}

    def snapshot(self) -> ContainerSnapshot:
        image = f"mc-snapshot-{secrets.token_hex(6)}"
        _cli([self.engine, "commit", self.container, image], f"{self.engine} commit")
        return ContainerSnapshot(self.engine, image, self.workdir, dict(self.env))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            subprocess.run([self.engine, "rm", "-f", self.container], capture_output=True)


@dataclass
class ContainerBackend:
    """docker or podman. `build(task)` builds the task's Dockerfile (or starts from its docker_image / the
    default image and applies its setup steps) and commits the prepared container as the snapshot."""

    engine: str = "docker"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    default_image: str = "python:3.11-slim-bookworm"
    name: str = "container"
    local_base: bool = False  # build on the local backend's Debian base (imported), not the FROM image of a registry
    runtime: str | None = None  # the engine's OCI runtime; None: its own, or runc where crun cannot run (cgroup v1)

    def __post_init__(self):
        if self.engine == "apptainer":
            raise SandboxError("use ApptainerBackend for apptainer (see make_container_backend)")
        problem = engine_problem(self.engine)
        if problem:
            raise SandboxError(problem)
        if self.runtime is None and self.engine == "podman" and shutil.which("runc") and \
                not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            self.runtime = "runc"  # podman's crun refuses hosts whose cgroups are v1 (or hybrid)

    def _engine(self) -> list[str]:
        return [self.engine, *(["--runtime", self.runtime] if self.runtime else [])]

    def _build_argv(self, task, image: str) -> tuple[list[str], str | None]:
        """The engine's build command for the task's Dockerfile, and a Containerfile it reads (local_base)."""
        context = str(task.environment_dir)
        if not self.local_base or task.image is None:
            return [*self._engine(), "build", "-q", "-t", image, "-f", str(task.environment_dir / "Dockerfile"),
                    context], None
        builder = ImageBuilder()
        text = containerfile(task.image, builder.export_base(self.engine))
        network = host_network_view(name_service=False)
        argv = [*self._engine(), "build", "-q", "-t", image]
        for name, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
            # The engine's defaults (about a million) may pass what this host lets a process set: the build's own
            # limits are this process's, at most BUILD_RLIMIT.
            soft = resource.getrlimit(which)[0]
            value = BUILD_RLIMIT if soft == resource.RLIM_INFINITY else min(soft, BUILD_RLIMIT)
            argv += ["--ulimit", f"{name}={value}:{value}"]
        for host, dest in network.binds:
            argv += ["-v", f"{host}:{dest}:ro"]
        for k, v in network.env.items():
            argv += ["--build-arg", f"{k}={v}"]
        return argv + ["-f", "-", context], text

    def build(self, task) -> ContainerSnapshot:
        limits = task.limits.sandbox_limits(self.limits)
        if task.environment_dir is not None:
            image = f"mc-task-{secrets.token_hex(6)}"
            argv, text = self._build_argv(task, image)
            _cli(argv, f"building {task.environment_dir}/Dockerfile", timeout=task.limits.setup_timeout_s,
                 stdin=text.encode() if text is not None else None)
            base = ContainerSnapshot(self.engine, image, task.workdir, dict(task.env))
            steps = []  # the Dockerfile's own COPY/RUN lines ran in the build
        else:
            base = ContainerSnapshot(self.engine, task.docker_image or self.default_image, task.workdir,
                                     dict(task.env), owned=False)
            steps = task.setup
        sandbox = ContainerSandbox(self.engine, base.image, workdir="/", env=task.env, limits=limits,
                                   runtime=self.runtime)
        try:
            with tempfile.TemporaryDirectory(prefix="mc-task-") as tmp:
                task.tree.materialize(Path(tmp) / "tree")
                if any(Path(tmp, "tree").iterdir()):
                    sandbox.copy_in(Path(tmp) / "tree", "/app", merge=True)
            for step in steps:
                step.apply(sandbox, task.limits.setup_timeout_s)
            sandbox.exec(f"mkdir -p {shlex.quote(task.workdir)}", cwd="/", timeout=60)
            snap = sandbox.snapshot()
            snap.workdir, snap.env, snap.limits = task.workdir, dict(task.env), limits
            return snap
        finally:
            sandbox.close()
            base.discard()

    def create(self, tree, workdir: str = "/app", env=None, limits=None) -> ContainerSandbox:
        image = ImageBuilder().export_base(self.engine) if self.local_base else self.default_image
        sandbox = ContainerSandbox(self.engine, image, workdir="/", env=env, limits=limits or self.limits,
                                   runtime=self.runtime)
        if tree is not None:
            sandbox.copy_in(tree, "/app", merge=True)
        _cli([self.engine, "exec", sandbox.container, "mkdir", "-p", workdir], f"mkdir {workdir}")
        sandbox.workdir = workdir
        return sandbox

    def fork(self, snapshot: ContainerSnapshot, limits: SandboxLimits | None = None) -> ContainerSandbox:
        return ContainerSandbox(self.engine, snapshot.image, workdir=snapshot.workdir, env=snapshot.env,
                                limits=limits or snapshot.limits or self.limits, runtime=self.runtime)


class ApptainerSandbox(LocalSandbox):
    """LocalSandbox whose commands run in `apptainer exec --containall` of an image instead of bubblewrap."""

    needs_bwrap = False
    provides_judge = False  # an image has no bubblewrap to nest a sandbox with (docs/SANDBOX.md)

    def __init__(self, tree, *, image: str, **kwargs):
        self.image = image
        self._apptainer = shutil.which("apptainer")
        super().__init__(tree, **kwargs)

    def _command_argv(self, command: str, cwd: str, env: dict[str, str], seccomp_fd: int | None) -> list[str]:
        """Each command its own `apptainer exec` (no episode: nothing outlives a command; no seccomp filter)."""
        binds = [f"{self._dirs[d]}:/{d}" for d in ("app", "tmp", "logs")]
        ro = ":ro" if self._verifier_root is not None else ""  # the verifier's own files are read-only to it
        binds += [f"{host}:{dest}{ro}" for host, dest in self._mounts]
        argv = [self._apptainer, "exec", "--containall", "--cleanenv", "--no-home", "--net", "--network", "none",
                "--pwd", cwd, "--bind", ",".join(binds)]
        for k, v in env.items():
            argv += ["--env", f"{k}={v}"]
        return argv + [self.image, "bash", "--noprofile", "--norc", "-c", command]


@dataclass
class ApptainerBackend:
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    default_image: str = "docker://python:3.11-slim-bookworm"
    name: str = "apptainer"

    def __post_init__(self):
        problem = engine_problem("apptainer")
        if problem:
            raise SandboxError(problem)

    def create(self, tree, workdir: str = "/app", env=None, limits=None) -> ApptainerSandbox:
        return ApptainerSandbox(tree, image=self.default_image, workdir=workdir, env=env,
                                limits=limits or self.limits)

    def fork(self, snapshot: LocalSnapshot, limits: SandboxLimits | None = None) -> ApptainerSandbox:
        return self.create(snapshot.path, workdir=snapshot.workdir, env=snapshot.env,
                           limits=limits or snapshot.limits)


def make_container_backend(engine: str, limits: SandboxLimits | None = None, local_base: bool = False):
    limits = limits or SandboxLimits()
    if engine == "apptainer":
        return ApptainerBackend(limits=limits)
    return ContainerBackend(engine=engine, limits=limits, local_base=local_base)
