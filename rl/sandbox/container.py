"""Sandboxes on container engines, driven through their command-line tools.

- docker / podman (`ContainerSandbox`): the task's environment/Dockerfile is built as an image (its RUN lines run
  in the build); a container started from it with no network, a memory limit, a pid limit and rlimits stays up
  for the episode and each command runs with `exec` under `timeout -s KILL`. Snapshots are committed images,
  so every fork starts from the prepared state. A task's image and its prepared state are made once per digest of
  what makes them and tagged in the engine's store (`ContainerBackend.plan`): a later prepare is a lookup. With
  `local_base` (no registry needed) the image is built on the local backend's Debian base, imported into the
  engine, from the same recipe as the local backend's images (rl/sandbox/image.py `containerfile`): the same tasks
  get the same system on both.
- apptainer (`ApptainerSandbox`): like LocalSandbox, each command is a fresh `apptainer exec --containall` of
  the backend's image (default docker://python:3.11-slim-bookworm) with the task tree bound at /app; the
  Dockerfile subset is applied as for the local backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import secrets
import shlex
import shutil
import stat
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
from rl.sandbox.image import BUILD_HOST_DIR, ImageBuilder, ImageRecipe, containerfile, host_network_view
from rl.sandbox.local import ENTRYPOINT_WAIT_S, HOSTS_FILE, LocalSandbox, LocalSnapshot

ENGINES = ("docker", "podman", "apptainer")
BUILD_RLIMIT = 16384  # open files and processes of a build's RUN steps
# What the backend keeps in the engine's store, each image tagged by the digest of what made it: task images
# (`task:`), prepared tasks (`prepared:`), the local base with the host's network view for builds (`build-base:`).
CACHE_REPO = "localhost/megatron-composer"
CACHE_LABEL = "megatron-composer.cache"  # on each: `docker image prune -a --filter label=megatron-composer.cache`
CACHE_FORMAT = 1  # part of every digest: raise it when what a cached image holds changes


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


def _run_argv(engine: str, runtime: str | None) -> list[str]:
    """`run` on `engine` with its OCI runtime (a global option of podman's, an option of docker's `run`)."""
    if runtime is None:
        return [engine, "run"]
    return [engine, "--runtime", runtime, "run"] if engine == "podman" else [engine, "run", "--runtime", runtime]


def _remove_containers(engine: str, containers: list[str]) -> None:
    """Remove containers at once, with their anonymous volumes (an image's VOLUME makes one per container)."""
    if containers:
        subprocess.run([engine, "rm", "-f", "-v", *(["-t", "0"] if engine == "podman" else []), *containers],
                       capture_output=True)


def entrypoint_argv(entrypoint: list[str] | tuple[str, ...], image: str, command: list[str]) -> list[str]:
    """`run` options and arguments that start `image` with `entrypoint` (replacing the image's, and its CMD) and
    `command`: docker takes one word as --entrypoint, the rest go before the command."""
    first, rest = (entrypoint[0], list(entrypoint[1:])) if entrypoint else ("", [])
    return ["--entrypoint", first, image, *rest, *command]


def missing_images(engine: str, refs: list[str]) -> list[str]:
    """Those of `refs` the engine's store lacks (one call when it has them all)."""
    if not refs or subprocess.run([engine, "image", "inspect", "--format", "{{.Id}}", *refs],
                                  capture_output=True).returncode == 0:
        return []
    return [ref for ref in refs if subprocess.run([engine, "image", "inspect", "--format", "{{.Id}}", ref],
                                                  capture_output=True).returncode != 0]


def _partial_name() -> str:
    return f"{CACHE_REPO}/partial:{secrets.token_hex(8)}"


def _publish(engine: str, made: str, ref: str) -> None:
    """Tag the image just made (under a name of its own) as `ref`, unless another process published `ref` first
    (theirs is kept, this one goes), then drop the name it was made under."""
    if missing_images(engine, [ref]):
        _cli([engine, "tag", made, ref], f"tagging {ref}")
    subprocess.run([engine, "rmi", made], capture_output=True)


def copy_into_folders(dockerfile: str) -> str:
    """`dockerfile` with a '/' after the destination of each COPY or ADD that BuildKit and podman read as a folder
    and docker's classic builder refuses unless it ends in '/': several sources (`COPY a.py b.md .`), or `.`."""
    lines = []
    for line in dockerfile.splitlines():
        m = re.match(r"(\s*(?:COPY|ADD)\s+(?:--\S+\s+)*)(\S.*?)\s*$", line, re.IGNORECASE)
        if m and not line.rstrip().endswith("\\"):
            try:
                words = json.loads(m.group(2)) if m.group(2).startswith("[") else m.group(2).split()
            except json.JSONDecodeError:
                words = []
            if len(words) >= 2 and all(isinstance(w, str) for w in words):
                dest = words[-1]
                if not dest.endswith("/") and (len(words) > 2 or dest in (".", "..") or dest.endswith(("/.", "/.."))):
                    words[-1] = dest + "/"
                    line = m.group(1) + (json.dumps(words) if m.group(2).startswith("[") else " ".join(words))
        lines.append(line)
    return "\n".join(lines) + "\n"


def tree_digest(h, path: Path) -> None:
    """Feed a file or a folder to the hash `h` in a stable order: each entry's name under it, its mode, and its link
    target or contents (never following a link inside it)."""

    def entry(full: str, rel: str) -> None:
        st = os.lstat(full)
        h.update(f"{rel}\0{st.st_mode:o}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(full).encode())
        elif stat.S_ISREG(st.st_mode):
            with open(full, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        h.update(b"\0")

    path = Path(os.path.realpath(path))
    entry(str(path), ".")
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            entry(full, os.path.relpath(full, path))


def steps_digest(h, steps: list) -> None:
    """Feed setup steps (CopyStep, RunStep) to `h`: each one's kind and fields, a path field by its contents."""
    for step in steps:
        h.update(type(step).__name__.encode() + b"\0")
        for name, value in sorted(vars(step).items()):
            if name == "origin":  # where it was written, for messages: not what it does
                continue
            h.update(name.encode() + b"=")
            if isinstance(value, Path):
                tree_digest(h, value)
            else:
                h.update(json.dumps(value, sort_keys=True, default=str).encode())
            h.update(b"\0")


@dataclass
class ContainerSnapshot:
    engine: str
    image: str
    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    owned: bool = True  # a commit of a running sandbox (removed on discard), not a cached prepared task
    limits: SandboxLimits | None = None
    entrypoint: tuple[str, ...] = ()  # the task image's ENTRYPOINT: each fork's container starts with it
    services: list[tuple[Service, str]] = field(default_factory=list)  # the containers beside it, and their images

    def discard(self) -> None:
        """Remove a sandbox's commit; a prepared task and its services' images stay cached by their digests."""
        if self.owned:
            subprocess.run([self.engine, "rmi", "-f", self.image], capture_output=True)


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
        start = (entrypoint_argv(entrypoint, image, ["sh", "-c", f"touch {STARTED_MARK}; exec sleep infinity"])
                 if entrypoint else entrypoint_argv(["sleep"], image, ["infinity"]))
        argv = [*_run_argv(engine, runtime), "-d", "--name", self.name,
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

    def enter_verifier(self, services: bool = True, *, separate: bool = False, artifacts=(), network: str = "none",
                       user: str | int | None = None) -> None:
        """Inside the running container, as its root: kill every process the agent phase started (a verifier shares
        the container's pid namespace with them, so they do not outlive the agent phase on this backend; what the
        image's entrypoint started keeps serving, as in Harbor), then replace /tmp and /logs with empty ones. The
        separate mode and another user are the local backend's (refused here in one line). The container has no
        network, so a verifier whose network is "public" (Harbor's default, which most tasks leave as it is) runs
        offline, as the images are built for (what a verifier installs is in them), said in a warning (once per call
        site and engine, as Python's warnings filter repeats)."""
        if separate or user not in (None, "root", 0, "0"):
            asked = "a separate verifier" if separate else f"the user {user!r}"
            raise SandboxError(f"the {self.engine} backend's verifier runs in the task's container as its root: "
                               f"{asked} needs the local backend")
        if network != "none":
            warnings.warn(f"the {self.engine} backend runs verifiers without the network (a task's verifier network "
                          f"is {network!r}): what a verifier downloads must be in its image; the local backend gives "
                          "it the run's egress proxy", stacklevel=2)
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
        image = f"{CACHE_REPO}/snapshot:{secrets.token_hex(8)}"
        self.commit(image)
        return ContainerSnapshot(self.engine, image, self.workdir, dict(self.env))

    def commit(self, image: str) -> None:
        """The container's files as the image `image` (labelled as the backend's, so that a prune finds it)."""
        _cli([self.engine, "commit", "--change", f"LABEL {CACHE_LABEL}=1", self.container, image],
             f"{self.engine} commit")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _remove_containers(self.engine, [self.container])
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
        self.runtime = runtime
        self.name = f"mc-pod-{secrets.token_hex(6)}"
        self.folder = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.hosts = HOSTS_FILE + "".join(
            f"127.0.0.1\t{service.name}\n" for service, _ in services)
        self.containers: list[str] = []
        try:
            for service, image in services:
                argv = [*_run_argv(engine, runtime), "-d", "--name", f"{self.name}-{service.name}",
                        *self.join_argv(service.name), *container_limits(limits)]
                for k, v in service.env.items():
                    argv += ["-e", f"{k}={v}"]
                argv += (entrypoint_argv(service.entrypoint, image, service.command or [])
                         if service.entrypoint is not None else [image, *(service.command or [])])
                self.containers.append(_cli(argv, f"starting the service {service.name}"))
                if service.healthcheck is not None:
                    self._wait_healthy(service, self.containers[-1])
        except BaseException:
            self.close()
            raise

    def join_argv(self, who: str) -> list[str]:
        """`run` options for a container of the pod: the shared network namespace and its own /etc/hosts (a mount
        there replaces the engine's own file; podman is also told not to write its entries into it)."""
        hosts = self.folder / f"hosts-{who}"
        hosts.write_text(self.hosts)
        network = ["--network", f"container:{self.containers[0]}"] if self.containers else ["--network", "none"]
        return [*network, *(["--no-hosts"] if self.engine == "podman" else []), "-v", f"{hosts}:/etc/hosts"]

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
        _remove_containers(self.engine, self.containers[::-1])
        self.containers = []
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class ImageBuild:
    """An image to build from a Dockerfile (on the local base: from its recipe), tagged by the digest of all its build
    reads: the build text and every file of its context."""

    ref: str
    dockerfile: Path
    context: Path
    recipe: ImageRecipe | None  # build on the local base from this (else the Dockerfile as written)


@dataclass
class PreparePlan:
    """What a task's prepare finds or makes, all named by digests before anything is built."""

    prepared: str  # the prepared task's tag
    source: str  # the image it is prepared on: the task image's tag, or a registry image
    build: ImageBuild | None  # the task image's build (None: a registry image)
    steps: list  # setup steps run on `source` (none after a build: the Dockerfile's own ran in it)
    services: list[tuple[Service, str, ImageBuild | None]]  # each service, its image, and its build

    def images(self) -> list[str]:
        """The tags this prepare finds or makes in the engine's store."""
        return [self.prepared, *([self.build.ref] if self.build else []),
                *(b.ref for _, _, b in self.services if b is not None)]


@dataclass
class ContainerBackend:
    """docker or podman. `build(task)` prepares a task once per digest: its Dockerfile built into an image (or its
    docker_image / the default image with its setup steps applied), its tree copied in, committed. Both are tagged
    by digest in the engine's store (CACHE_REPO), so a later prepare of the same task starts no container."""

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
        """The engine with its global options (podman's runtime; docker's builds take none)."""
        return [self.engine, *(["--runtime", self.runtime] if self.runtime and self.engine == "podman" else [])]

    def image_build(self, dockerfile: Path, context: Path, recipe: ImageRecipe | None) -> ImageBuild:
        """What building `dockerfile` makes, and its tag: the digest of the build text (on the local base: the
        recipe's Containerfile on this host's base) and of every file in `context`."""
        h = hashlib.sha256(f"{CACHE_FORMAT}\0".encode())
        recipe = recipe if self.local_base else None
        if recipe is not None:
            h.update(f"local base {ImageBuilder().base_key}\0{containerfile(recipe, 'base')}".encode())
        else:
            h.update(b"dockerfile\0" + dockerfile.read_bytes())
        tree_digest(h, context)
        return ImageBuild(f"{CACHE_REPO}/task:{h.hexdigest()[:32]}", dockerfile, context, recipe)

    def _build(self, build: ImageBuild, timeout_s: float) -> None:
        """Build `build` and tag it (a failed build leaves no name behind). Each RUN step may take `timeout_s`, as
        each step of the local backend's builds may."""
        made = _partial_name()
        argv = [*self._engine(), "build", "-q", "--force-rm", "--label", f"{CACHE_LABEL}=1", "-t", made,
                *build_network()]
        if build.recipe is None:
            text = build.dockerfile.read_text()
        else:
            # What the local backend's builds see of the host to reach the network (rl/sandbox/image.py
            # `host_network_view`): podman mounts it read-only into each step, as they do; docker's builds have no
            # mounts, so there it is a layer below the image's own.
            base = ImageBuilder().export_base(self.engine)
            network = host_network_view(name_service=False)
            if self.engine == "podman":
                text = containerfile(build.recipe, base)
                for host, dest in network.binds:
                    argv += ["-v", f"{host}:{dest}:ro"]
            else:
                text = containerfile(build.recipe, *self._base_with_host_view(base, network.binds))
            for name, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
                # The engine's defaults (about a million) may pass what this host lets a process set: the build's
                # own limits are this process's, at most BUILD_RLIMIT.
                soft = resource.getrlimit(which)[0]
                value = BUILD_RLIMIT if soft == resource.RLIM_INFINITY else min(soft, BUILD_RLIMIT)
                argv += ["--ulimit", f"{name}={value}:{value}"]
            for k, v in network.env.items():
                argv += ["--build-arg", f"{k}={v}"]
        argv += ["-f", "-", str(build.context)]
        text = copy_into_folders(text)
        runs = sum(1 for line in text.splitlines() if re.match(r"\s*RUN\s", line, re.IGNORECASE))
        _cli(argv, f"building {build.dockerfile}", timeout=timeout_s * max(1, runs), stdin=text.encode())
        _publish(self.engine, made, build.ref)

    def _base_with_host_view(self, base: str, binds: list[tuple[str, str]]) -> tuple[str, str | None]:
        """For an engine whose builds have no mounts: the local base with the files builds see of the host (`binds`,
        each (host path, path in the build): its CA bundle at BUILD_HOST_DIR, pip's configuration and the local
        indexes it names), built once per content; and the command that removes them again as an image's last
        step, giving back any file of the base they covered. Returns (its reference, the command)."""
        binds = sorted(binds, key=lambda bind: bind[1])
        if not binds:
            return base, None
        h = hashlib.sha256(f"{CACHE_FORMAT}\0{base}".encode())
        for host, dest in binds:
            h.update(f"\0{dest}\0".encode())
            tree_digest(h, Path(host))
        ref = f"{CACHE_REPO}/build-base:{h.hexdigest()[:32]}"
        own, made = f"{BUILD_HOST_DIR}/own", f"{BUILD_HOST_DIR}/made"
        dests = [dest for _, dest in binds if not dest.startswith(BUILD_HOST_DIR + "/")]
        parents = sorted({str(p) for dest in dests for p in Path(dest).parents if str(p) != "/"},
                         key=lambda p: (p.count("/"), p))
        cleanup = (f"rm -rf {' '.join(map(shlex.quote, dests))}; if [ -d {own} ]; then cp -a {own}/. /; fi; "
                   f"if [ -f {made} ]; then tac {made} | while read -r d; do rmdir \"$d\" 2>/dev/null; done; fi; "
                   f"rm -rf {BUILD_HOST_DIR}")
        if not missing_images(self.engine, [ref]):
            return ref, cleanup
        lines = [f"FROM {base}",
                 f"RUN mkdir -p {own} && for p in {' '.join(map(shlex.quote, dests))}; do if [ -e \"$p\" ]; then "
                 f"cp -a --parents \"$p\" {own}/; fi; done; for d in {' '.join(map(shlex.quote, parents))}; do "
                 f"[ -e \"$d\" ] || echo \"$d\"; done > {made}"]
        with tempfile.TemporaryDirectory(prefix="mc-build-base-") as context:
            for i, (host, dest) in enumerate(binds):
                name = f"view{i}"
                if os.path.isdir(host):
                    shutil.copytree(host, Path(context, name), symlinks=True)
                else:
                    shutil.copy2(host, Path(context, name))
                lines.append("COPY " + json.dumps([name + ("/" if os.path.isdir(host) else ""), dest]))
            made_as = _partial_name()
            _cli([*self._engine(), "build", "-q", "--force-rm", "--label", f"{CACHE_LABEL}=1", "-t", made_as,
                  *build_network(), "-f", "-", context], "building the local base's view of the host",
                 stdin=("\n".join(lines) + "\n").encode())
        _publish(self.engine, made_as, ref)
        return ref, cleanup

    def _service_image(self, service: Service) -> tuple[str, ImageBuild | None]:
        """A service's image: its Dockerfile's build (on the local base with local_base), or its registry's."""
        if service.dockerfile is None:
            if self.local_base:
                raise SandboxError(f"the service {service.name} is the registry image {service.image}, which a "
                                   "local base cannot stand in for: run without --local-base")
            return service.image, None
        if self.local_base and service.recipe is None:
            raise SandboxError(f"the service {service.name} cannot be built on the local base "
                               f"({service.recipe_problem}): run without --local-base")
        build = self.image_build(service.dockerfile, service.build_context or service.dockerfile.parent,
                                 service.recipe)
        return build.ref, build

    def plan(self, task, tree: Path) -> PreparePlan:
        """The prepare of `task` whose tree is materialised at `tree`."""
        if task.environment_dir is not None:
            build = self.image_build(task.environment_dir / "Dockerfile", task.environment_dir, task.image)
            source, steps = build.ref, []
        else:
            build, source, steps = None, task.docker_image or self.default_image, task.setup
        h = hashlib.sha256(f"{CACHE_FORMAT}\0{source}\0{task.workdir}\0{json.dumps(task.env, sort_keys=True)}\0"
                           .encode())
        tree_digest(h, tree)
        steps_digest(h, steps)
        services = [(service, *self._service_image(service)) for service in task.services]
        return PreparePlan(f"{CACHE_REPO}/prepared:{h.hexdigest()[:32]}", source, build, steps, services)

    def cached_images(self, task) -> list[str]:
        """The tags a prepare of `task` finds or makes in the engine's store."""
        with tempfile.TemporaryDirectory(prefix="mc-task-") as tmp:
            task.tree.materialize(Path(tmp) / "tree")
            return self.plan(task, Path(tmp) / "tree").images()

    def build(self, task) -> ContainerSnapshot:
        """The prepared task, from the engine's store when a prepare of the same digest made it before."""
        limits = task.limits.sandbox_limits(self.limits)
        timeout_s = task.limits.setup_timeout_s
        with tempfile.TemporaryDirectory(prefix="mc-task-") as tmp:
            tree = Path(tmp) / "tree"
            task.tree.materialize(tree)
            plan = self.plan(task, tree)
            builds = [b for _, _, b in plan.services if b is not None]
            missing = set(missing_images(self.engine, [plan.prepared, *(b.ref for b in builds)]))
            if plan.prepared in missing:
                self._prepare(plan, task, tree, limits)
        for b in builds:
            if b.ref in missing:
                self._build(b, timeout_s)
        return ContainerSnapshot(self.engine, plan.prepared, task.workdir, dict(task.env), owned=False,
                                 limits=limits, entrypoint=tuple(task.entrypoint),
                                 services=[(service, ref) for service, ref, _ in plan.services])

    def _prepare(self, plan: PreparePlan, task, tree: Path, limits: SandboxLimits) -> None:
        """Build the task's image if its tag is missing, copy the tree in, run the setup steps, commit as
        `plan.prepared`."""
        if plan.build is not None and missing_images(self.engine, [plan.build.ref]):
            self._build(plan.build, task.limits.setup_timeout_s)
        sandbox = ContainerSandbox(self.engine, plan.source, workdir="/", env=task.env, limits=limits,
                                   runtime=self.runtime)
        try:
            if any(tree.iterdir()):
                sandbox.copy_in(tree, "/app", merge=True)
            for step in plan.steps:
                step.apply(sandbox, task.limits.setup_timeout_s)
            sandbox.exec(f"mkdir -p {shlex.quote(task.workdir)}", cwd="/", timeout=60)
            made = _partial_name()
            sandbox.commit(made)
        finally:
            sandbox.close()
        _publish(self.engine, made, plan.prepared)

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
