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

import json
import os
import resource
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from rl.sandbox.base import (
    BASE_ENV,
    VERIFIER_ENV,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    Service,
    note_limits,
    run_process,
)
from rl.sandbox.image import ImageBuilder, containerfile, host_network_view
from rl.sandbox.local import ENTRYPOINT_WAIT_S, HOSTS_FILE, LocalSandbox, LocalSnapshot

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
    entrypoint: tuple[str, ...] = ()  # the task image's ENTRYPOINT: each fork's container starts with it
    services: list[tuple[Service, str]] = field(default_factory=list)  # the containers beside it, and their images

    def discard(self) -> None:
        if self.owned:
            subprocess.run([self.engine, "rmi", "-f", self.image], capture_output=True)
        for service, image in self.services:
            if service.dockerfile is not None:  # built here; a registry's image is not this project's to remove
                subprocess.run([self.engine, "rmi", "-f", image], capture_output=True)


class ContainerSandbox(Sandbox):
    """A docker or podman container kept running for the episode; commands run via `exec`."""

    def __init__(self, engine: str, image: str, *, workdir: str = "/app", env: dict[str, str] | None = None,
                 limits: SandboxLimits | None = None, runtime: str | None = None, entrypoint: tuple[str, ...] = (),
                 pod: "Pod | None" = None):
        self.engine = engine
        self.limits = limits or SandboxLimits()
        self.workdir = workdir
        self.tree_root = "/app"
        self.env = dict(env or {})
        lim = self.limits
        self.name = f"mc-sandbox-{secrets.token_hex(6)}"
        self.pod = pod
        # Started as Harbor starts a task's container: its image's ENTRYPOINT with `sh -c "sleep infinity"` (which
        # first leaves a mark that the entrypoint handed over to it).
        start = (["--entrypoint", json.dumps(list(entrypoint)), image, "sh", "-c",
                  f"touch {STARTED_MARK}; exec sleep infinity"] if entrypoint
                 else ["--entrypoint", "sleep", image, "infinity"])
        argv = [engine, *(["--runtime", runtime] if runtime else []), "run", "-d", "--name", self.name,
                *(pod.join_argv("main") if pod else ["--network", "none"]), *container_limits(lim),
                "--workdir", workdir, *start]
        self._closed = False
        self._image_pids: set[str] | None = None  # what its entrypoint started: services the verifier may query
        try:
            self.container = _cli(argv, f"{engine} run")
        except BaseException:
            if pod is not None:
                pod.close()
            raise
        if entrypoint:
            try:
                self._wait_started(entrypoint)
            except BaseException:
                self.close()
                raise

    def _wait_started(self, entrypoint: tuple[str, ...]) -> None:
        """Wait until the entrypoint hands over to its command (what it starts is then running, and the verifier
        phase keeps it), as the local backend waits: an entrypoint that exits first is a one-line error with its
        last output; one still running after ENTRYPOINT_WAIT_S is the container's main process."""
        deadline = time.monotonic() + ENTRYPOINT_WAIT_S
        while time.monotonic() < deadline:
            probe = subprocess.run([self.engine, "exec", self.container, "test", "-e", STARTED_MARK],
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            state = subprocess.run([self.engine, "inspect", "-f", "{{.State.Running}}", self.container],
                                   capture_output=True, text=True)
            if state.stdout.strip() != "true":
                log = subprocess.run([self.engine, "logs", "--tail", "1", self.container], capture_output=True,
                                     text=True)
                last = (log.stdout + log.stderr).strip().splitlines()[-1:] or ["no output"]
                raise SandboxError(f"the image's ENTRYPOINT {list(entrypoint)} exited before its command ran: "
                                   f"{last[0][:200]}")
            time.sleep(0.1)
        self._note_image_processes()

    def exec(self, command: str, *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        timeout = self.limits.command_timeout_s if timeout is None else timeout
        self._note_image_processes()
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

    def _note_image_processes(self) -> None:
        """Before the first command: the processes the container started with (its init, what its entrypoint left
        running), which the verifier phase keeps."""
        if self._image_pids is None:
            listed = _cli([self.engine, "exec", self.container, "sh", "-c", "echo /proc/[0-9]*"], "listing processes")
            self._image_pids = {p.rsplit("/", 1)[-1] for p in listed.split()}

    def enter_verifier(self, services: bool = True) -> None:
        """Inside the running container, as its root: kill every process the agent phase started (a verifier shares
        the container's pid namespace with them, so they do not outlive the agent phase on this backend; what the
        image's entrypoint started keeps serving, as in Harbor), then replace /tmp and /logs with empty ones."""
        self._note_image_processes()
        keep = " ".join(sorted(self._image_pids | {"1"})) if services else "1"
        reset = (f"for p in /proc/[0-9]*; do p=${{p#/proc/}}; case ' {keep} '$$' ' in *\" $p \"*) ;; "
                 "*) kill -KILL $p 2>/dev/null;; esac; done; rm -rf /tmp /logs && mkdir -m 1777 /tmp && "
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
            subprocess.run([self.engine, "rm", "-f", "-t", "0", self.container], capture_output=True)
            if self.pod is not None:
                self.pod.close()


STARTED_MARK = "/tmp/.mc-entrypoint-started"  # left by a container's command once its ENTRYPOINT handed over


def build_network() -> list[str]:
    """A build's network: the engine's own, except for a rootless engine on a host whose /dev/net/tun it cannot open
    (its slirp4netns needs it), where the build shares the host's network as the local backend's builds do."""
    if os.geteuid() != 0 and not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return ["--network", "host"]
    return []


def container_limits(lim: SandboxLimits) -> list[str]:
    """An engine's `run` options for a sandbox's limits."""
    mb = 1024 * 1024
    return ["--memory", f"{lim.memory_mb}m", "--pids-limit", str(lim.max_processes), "--security-opt",
            "no-new-privileges", "--ulimit", f"fsize={lim.max_file_mb * mb}", "--ulimit",
            f"nofile={lim.max_open_files}", "--ulimit", f"nproc={lim.max_processes}", "--ulimit",
            f"cpu={lim.cpu_time_s}", "--ulimit", "core=0"]


class Pod:
    """The containers of a multi-container task (a compose file's services) sharing one network namespace, which
    has only loopback (no network, as a sandbox): the first service's, which the others and the task's container
    join. Each has its own /etc/hosts (writable, as a container's) where every service's name is loopback. Each
    service starts with its own command and is waited for until its healthcheck passes. (An engine's own pods are
    not used: their infra container takes the engine's default rlimits, which some kernels refuse.)"""

    def __init__(self, engine: str, services: list[tuple[Service, str]], limits: SandboxLimits,
                 runtime: str | None = None):
        self.engine = engine
        self.runtime = ["--runtime", runtime] if runtime else []
        self.name = f"mc-pod-{secrets.token_hex(6)}"
        self.folder = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.hosts = HOSTS_FILE + "".join(
            f"127.0.0.1\t{service.name}\n" for service, _ in services)
        self.containers: list[str] = []
        try:
            for service, image in services:
                argv = [engine, *self.runtime, "run", "-d", "--name", f"{self.name}-{service.name}",
                        *self.join_argv(service.name), *container_limits(limits)]
                for k, v in service.env.items():
                    argv += ["-e", f"{k}={v}"]
                if service.entrypoint is not None:
                    argv += ["--entrypoint", json.dumps(service.entrypoint)]
                self.containers.append(_cli(argv + [image, *(service.command or [])],
                                            f"starting the service {service.name}"))
                if service.healthcheck is not None:
                    self._wait_healthy(service, self.containers[-1])
        except BaseException:
            self.close()
            raise

    def join_argv(self, who: str) -> list[str]:
        """`run` options for a container of the pod: the shared network namespace and its own /etc/hosts."""
        hosts = self.folder / f"hosts-{who}"
        hosts.write_text(self.hosts)
        network = ["--network", f"container:{self.containers[0]}"] if self.containers else ["--network", "none"]
        return [*network, "--no-hosts", "-v", f"{hosts}:/etc/hosts"]

    def _wait_healthy(self, service: Service, container: str) -> None:
        """Run its healthcheck until it passes: failures in its start period do not count, then `retries` in a row
        are a one-line error with the service's last output."""
        hc = service.healthcheck
        started, failures = time.monotonic(), 0
        while True:
            try:
                res = subprocess.run([self.engine, "exec", container, *hc.test], capture_output=True, text=True,
                                     timeout=hc.timeout_s)
                if res.returncode == 0:
                    return
                last = ((res.stderr or res.stdout).strip().splitlines() or [f"exit {res.returncode}"])[-1]
            except subprocess.TimeoutExpired:
                last = f"timed out after {hc.timeout_s:g} s"
            if time.monotonic() - started < hc.start_period_s:
                time.sleep(min(hc.interval_s, 0.5))
                continue
            failures += 1
            if failures >= hc.retries:
                log = subprocess.run([self.engine, "logs", "--tail", "3", container], capture_output=True, text=True)
                tail = " / ".join((log.stdout + log.stderr).strip().splitlines()[-3:])
                raise SandboxError(f"the service {service.name} did not become healthy ({last[:200]}); its last "
                                   f"output: {tail[:300] or 'none'}")
            time.sleep(hc.interval_s)

    def close(self) -> None:
        for container in reversed(self.containers):
            subprocess.run([self.engine, "rm", "-f", "-t", "0", container], capture_output=True)
        self.containers = []
        shutil.rmtree(self.folder, ignore_errors=True)


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
        cgroup_v1 = not Path("/sys/fs/cgroup/cgroup.controllers").exists()
        if self.runtime is None and self.engine == "podman" and shutil.which("runc") and cgroup_v1:
            self.runtime = "runc"  # podman's crun refuses hosts whose cgroups are v1 (or hybrid)
        if self.engine == "podman" and os.geteuid() != 0 and cgroup_v1:
            warnings.warn("rootless podman on cgroups v1 cannot limit a sandbox's memory or processes (it ignores "
                          "--memory and --pids-limit): only the rlimits hold; use cgroups v2 or root", stacklevel=2)

    def _engine(self) -> list[str]:
        return [self.engine, *(["--runtime", self.runtime] if self.runtime else [])]

    def _build_argv(self, dockerfile: Path, recipe, image: str) -> tuple[list[str], str | None]:
        """The engine's build command for a Dockerfile (its folder the context), and a Containerfile it reads
        instead (local_base: `recipe`, the Dockerfile on the local Debian base)."""
        context = str(dockerfile.parent)
        if not self.local_base or recipe is None:
            return [*self._engine(), "build", "-q", "-t", image, *build_network(), "-f", str(dockerfile), context], None
        builder = ImageBuilder()
        text = containerfile(recipe, builder.export_base(self.engine))
        network = host_network_view(name_service=False)
        argv = [*self._engine(), "build", "-q", "-t", image, *build_network()]
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

    def _build(self, dockerfile: Path, recipe, timeout_s: float) -> str:
        image = f"mc-task-{secrets.token_hex(6)}"
        argv, text = self._build_argv(dockerfile, recipe, image)
        _cli(argv, f"building {dockerfile}", timeout=timeout_s, stdin=text.encode() if text is not None else None)
        return image

    def _service_images(self, task) -> list[tuple[Service, str]]:
        """Each service's image: built from its Dockerfile (on the local base with local_base), or its registry's."""
        built = []
        try:
            for service in task.services:
                if service.dockerfile is None:
                    if self.local_base:
                        raise SandboxError(f"the service {service.name} is the registry image {service.image}, which "
                                           "a local base cannot stand in for: run without --local-base")
                    built.append((service, service.image))
                    continue
                if self.local_base and service.recipe is None:
                    raise SandboxError(f"the service {service.name} cannot be built on the local base "
                                       f"({service.recipe_problem}): run without --local-base")
                built.append((service, self._build(service.dockerfile, service.recipe, task.limits.setup_timeout_s)))
        except BaseException:
            for service, image in built:
                if service.dockerfile is not None:
                    subprocess.run([self.engine, "rmi", "-f", image], capture_output=True)
            raise
        return built

    def build(self, task) -> ContainerSnapshot:
        limits = task.limits.sandbox_limits(self.limits)
        if task.environment_dir is not None:
            image = self._build(task.environment_dir / "Dockerfile", task.image, task.limits.setup_timeout_s)
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
            snap.entrypoint = tuple(task.entrypoint)
        finally:
            sandbox.close()
            base.discard()
        try:
            snap.services = self._service_images(task)
        except BaseException:
            snap.discard()
            raise
        return snap

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
        limits = limits or snapshot.limits or self.limits
        pod = Pod(self.engine, snapshot.services, limits, self.runtime) if snapshot.services else None
        return ContainerSandbox(self.engine, snapshot.image, workdir=snapshot.workdir, env=snapshot.env,
                                limits=limits, runtime=self.runtime, entrypoint=snapshot.entrypoint, pod=pod)


class ApptainerSandbox(LocalSandbox):
    """LocalSandbox whose commands run in `apptainer exec --containall` of an image instead of bubblewrap."""

    needs_bwrap = False
    provides_judge = False  # an image has no bubblewrap to nest a sandbox with (docs/SANDBOX.md)

    def __init__(self, tree, *, image: str, **kwargs):
        self._apptainer = shutil.which("apptainer")
        super().__init__(tree, **kwargs)
        self.image = image  # the runtime's image reference (the sandbox's own layers are copies on the host)

    def _command_argv(self, command: str, cwd: str, env: dict[str, str]) -> list[str]:
        """Each command its own `apptainer exec` (no episode: nothing outlives a command; no seccomp filter) with the
        sandbox's own folders bound: the agent's, or in the verifier phase the verifier's copy of them and its own
        /logs and /tests (read-only to it where the host made them for it)."""
        root, binds = self._view()
        mounts = [f"{root / name}:/{name}" for name in ("app", "tmp") if (root / name).is_dir()]
        mounts.append(f"{root / 'root'}:/root")
        if binds:
            mounts += [f"{host}:{dest}" for dest, host in binds.items()]
        else:
            mounts.append(f"{root / 'logs'}:/logs")
        argv = [self._apptainer, "exec", "--containall", "--cleanenv", "--no-home", "--net", "--network", "none",
                "--pwd", cwd, "--bind", ",".join(mounts)]
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
        return ApptainerSandbox(None, image=self.default_image, workdir=snapshot.workdir, env=snapshot.env,
                                limits=limits or snapshot.limits or self.limits, layers=snapshot.layers, fresh=False)


def make_container_backend(engine: str, limits: SandboxLimits | None = None, local_base: bool = False):
    limits = limits or SandboxLimits()
    if engine == "apptainer":
        return ApptainerBackend(limits=limits)
    return ContainerBackend(engine=engine, limits=limits, local_base=local_base)
