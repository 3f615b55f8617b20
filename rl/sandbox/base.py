"""What every sandbox offers: run a shell command with limits, move files in and out, snapshot and fork.

Backends (local bubblewrap, container engines) differ only in how a command is launched. Everything an agent
tool needs (reading, writing, listing files) is built here on top of `exec`, so it runs inside the sandbox and
inherits its isolation: a symlink that points outside the task tree resolves inside the sandbox's own view of
the filesystem, never the host's.
"""

from __future__ import annotations

import os
import selectors
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Identities, as docker's userns-remap gives them: uids 0-65535 of every sandbox and image build are the image range on
# the host (ID_BASE onwards), so nothing inside is the host's root; the agent is AGENT_UID inside, HOME its home.
ID_BASE = 2_000_000
ID_RANGE = 65536
AGENT_UID = 1000
HOME = "/root"  # the image user's home: the agent's (and the verifier's), which lives through the episode

# Environment of every sandboxed command before the task's own ENV entries.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",  # the image user's home, the sandbox's own: it lives through the episode into the verifier
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Added for the verifier phase, over the task's own. HOME lives on from the agent into the verifier (the verifier
# judges what the agent left there), so no tool of the verifier's reads its settings from it: no user site, no git,
# npm or pip configuration of the agent's, and the XDG configuration folder is one the host makes fresh under /tests
# (a fixed path under /tmp or HOME could be the agent's). git runs none of the programs the agent's repository config
# names for it (git >= 2.31 reads GIT_CONFIG_*, which outranks every config file): no fsmonitor hook on
# `git status`, no hooks folder.
VERIFIER_ENV = {"PYTHONNOUSERSITE": "1", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                "NPM_CONFIG_USERCONFIG": "/dev/null", "PIP_CONFIG_FILE": "/dev/null",
                "XDG_CONFIG_HOME": "/tests/.verifier/config", "GIT_CONFIG_COUNT": "2",
                "GIT_CONFIG_KEY_0": "core.fsmonitor", "GIT_CONFIG_VALUE_0": "false",
                "GIT_CONFIG_KEY_1": "core.hooksPath", "GIT_CONFIG_VALUE_1": "/dev/null"}


class SandboxError(RuntimeError):
    """The sandbox cannot start or an operation on it failed; the message says what to do."""


@dataclass
class SandboxLimits:
    """Per-sandbox resource limits. memory_mb, max_processes, disk_mb and max_files hold for the whole sandbox
    (all its processes, everything it wrote; see rl/sandbox/limits.py for how each backend enforces them); the
    rlimits (RLIMIT_*) bound each process as well."""

    command_timeout_s: float = 120.0  # wall clock per command; the whole process tree is killed after it
    cpu_time_s: int = 600  # RLIMIT_CPU
    memory_mb: int = 2048  # memory of all the sandbox's processes together (the cgroup's, or the monitor's)
    max_processes: int = 256  # processes and threads of the sandbox together (pids.max and RLIMIT_NPROC)
    max_file_mb: int = 256  # RLIMIT_FSIZE (largest file a process may write)
    max_open_files: int = 1024  # RLIMIT_NOFILE
    disk_mb: int = 1024  # total size of the sandbox's writable directories, unlinked-but-open files included
    max_files: int = 100_000  # files and directories in the sandbox's writable directories (inodes)
    max_output_bytes: int = 1 << 20  # output kept per command; the rest is counted and dropped

    def validate(self) -> None:
        for name in ("command_timeout_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_mb",
                     "max_open_files", "disk_mb", "max_files", "max_output_bytes"):
            if getattr(self, name) <= 0:
                raise SandboxError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass
class HealthCheck:
    """A compose healthcheck: `test` run in its container until it succeeds (after `start_period_s`, every
    `interval_s`, at most `retries` failures)."""

    test: list[str]  # argv, or ["sh", "-c", text] for CMD-SHELL
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0


@dataclass
class Service:
    """A container beside the task's own (a compose file's other service): built from its own Dockerfile or a
    registry image, started with its own command, reachable from the task's container as `name` on loopback."""

    name: str
    build_context: Path | None = None  # its build: the context folder and the Dockerfile in it
    dockerfile: Path | None = None
    image: str | None = None  # or a registry image
    recipe: object | None = None  # its Dockerfile as the local base's recipe (rl/sandbox/image.py ImageRecipe)
    recipe_problem: str | None = None  # why there is none (a base that is not Debian): it needs a registry
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None  # replaces the image's CMD
    entrypoint: list[str] | None = None  # replaces the image's ENTRYPOINT
    healthcheck: HealthCheck | None = None


@dataclass
class ExecResult:
    """Outcome of one command. `events` says in words what the sandbox had to do (kill, cap, ...)."""

    exit_code: int
    output: str  # stdout and stderr interleaved, capped at SandboxLimits.max_output_bytes
    output_bytes: int  # everything the command wrote, including what was dropped
    duration_s: float
    timed_out: bool = False
    output_truncated: bool = False
    disk_exceeded: bool = False
    memory_exceeded: bool = False  # the sandbox's processes together passed memory_mb and were killed
    background_processes: int = 0  # processes the command started that keep running (until the episode ends)
    events: list[str] = field(default_factory=list)
    # a verifier's command that cannot be judged whatever it printed (a published port of the episode answered it
    # where the verifier then listened itself); the verdict is void, with this reason
    void: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.disk_exceeded and not self.memory_exceeded

    def describe(self) -> str:
        head = f"exit code {self.exit_code}" + (f" ({'; '.join(self.events)})" if self.events else "")
        return head


SIGNAL_MEANING = {
    signal.SIGXCPU: "CPU time limit reached (SIGXCPU)",
    signal.SIGXFSZ: "file size limit reached (SIGXFSZ)",
    signal.SIGKILL: "killed (SIGKILL)",
    signal.SIGSEGV: "segmentation fault (SIGSEGV)",
    signal.SIGABRT: "aborted (SIGABRT)",
}


def describe_exit(code: int) -> str | None:
    """Name a shell exit status that encodes a signal (128 + n)."""
    if code > 128 and code - 128 < signal.NSIG:
        sig = signal.Signals(code - 128)
        return SIGNAL_MEANING.get(sig, f"terminated by {sig.name}")
    return None


# Messages by which programs say that an rlimit stopped them, read only where the host gives no cgroup (whose counters
# say it for the kernel); the sandbox names the limit in its report. Program messages count only when the command
# failed; the shell's own job reports count always.
_LIMIT_MARKERS = (
    (("Resource temporarily unavailable",), False, "process limit reached ({max_processes} processes)"),
    (("fork: retry: Resource temporarily unavailable",), True, "process limit reached ({max_processes} processes)"),
    (("File size limit exceeded",), True, "file size limit reached ({max_file_mb} MB per file)"),
)


def note_limits(result: "ExecResult", limits: SandboxLimits, processes: bool = True) -> None:
    """Add an event when the output shows that a program ran into one of the sandbox's rlimits; `processes=False`
    where the kernel's own count says whether the process limit was reached (a cgroup's pids.events)."""
    failed = result.exit_code != 0
    for markers, always, event in _LIMIT_MARKERS:
        if not processes and event.startswith("process limit"):
            continue
        if (always or failed) and any(m in result.output for m in markers):
            text = event.format(**vars(limits))
            if text not in result.events:
                result.events.append(text)


def dir_usage(paths: list[str]) -> tuple[int, int]:
    """(bytes allocated, number of entries) under `paths`, not following symlinks."""
    total = entries = 0
    stack = list(paths)
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
        except OSError:
            continue
    return total, entries


def process_tree(root_pid: int) -> list[int]:
    """root_pid and all its descendants, from /proc: each process's children lists where the kernel keeps them,
    else the parent of every process."""
    children = _children_listed if os.path.exists(f"/proc/{root_pid}/task/{root_pid}/children") \
        else _children_by_parent()
    out, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children(pid))
    return out


def _children_listed(pid: int) -> list[int]:
    """The children of pid's threads, as the kernel lists them."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return out


def _children_by_parent() -> Callable[[int], list[int]]:
    """A lookup of children built from every process's parent (a scan of /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                tail = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(tail[1]), []).append(int(name))
    return lambda pid: children.get(pid, [])


def kill_tree(root_pid: int) -> None:
    """SIGKILL root_pid and every descendant. Each is stopped first and the tree walked again until nothing new
    appears: a process killed before its children would hand them to its namespace's init (where an episode's
    background processes live) instead of taking them along."""
    stopped: set[int] = set()
    for _ in range(100):
        new = [p for p in process_tree(root_pid) if p not in stopped]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
            stopped.add(pid)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class _Drain:
    """Reads and drops what background processes write to a finished command's output pipe, so that a server
    the command started (`server &`) keeps running instead of dying of SIGPIPE when it next logs. One thread for
    the process; a pipe is closed when its last writer is gone (at the latest when the episode ends)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._new: list[int] = []
        self._wake_w = -1

    def add(self, fd: int) -> None:
        with self._lock:
            self._new.append(fd)
            if self._wake_w < 0:
                wake_r, self._wake_w = os.pipe()
                threading.Thread(target=self._run, args=(wake_r,), name="sandbox-output-drain", daemon=True).start()
        os.write(self._wake_w, b"x")

    def _run(self, wake_r: int) -> None:
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except OSError:
                    chunk = b""
                if key.fd == wake_r:
                    with self._lock:
                        new, self._new = self._new, []
                    for fd in new:
                        sel.register(fd, selectors.EVENT_READ)
                elif not chunk:
                    sel.unregister(key.fd)
                    os.close(key.fd)


_drain = _Drain()


def run_process(argv: list[str], *, timeout: float, max_output: int, stdin: bytes | None = None,
                cwd: str | None = None, env: dict | None = None, user: int | None = None,
                group: int | None = None, watch: Callable[[int], tuple[str, str] | None] | None = None,
                poll_s: float = 0.25, pass_fds: tuple[int, ...] = (), background: bool = False) -> ExecResult:
    """Run argv in a new session, stream its merged output with a cap, kill its process tree on timeout.

    Once the launched process exits, output still arriving from processes it left behind is read for a short
    grace period. Then, with `background` (an episode's processes outlive its commands), the pipe goes on being
    read and dropped elsewhere; otherwise the launcher's session is killed. `watch(pid)` is polled every poll_s
    while the command runs; when it returns (kind, event) with kind "disk" or "memory", the process tree is
    killed and the event says why. `pass_fds` are handed to the launched process as they are (e.g.
    bubblewrap's --seccomp descriptor). The exit status is the kernel's (waitpid of the launcher).
    """
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True, user=user, group=group,
            extra_groups=[] if user is not None else None, pass_fds=tuple(pass_fds),
        )
    except OSError as e:
        raise SandboxError(f"cannot start {argv[0]}: {e}") from None
    kept = bytearray()
    total = 0
    timed_out = False
    stopped: tuple[str, str] | None = None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    pending_in = memoryview(stdin) if stdin is not None else None
    if pending_in is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
    deadline = t0 + timeout
    next_poll = t0 + poll_s
    output_open = True
    drain_until = None
    try:
        while output_open:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if drain_until is None and proc.poll() is not None:
                drain_until = now + 0.5
            if drain_until is not None and now >= drain_until:
                break
            if watch is not None and now >= next_poll:
                t_poll = time.monotonic()
                stopped = watch(proc.pid)
                if stopped is not None:
                    break
                # Poll less often when measuring is slow, so measuring never dominates the command.
                next_poll = time.monotonic() + max(poll_s, 10 * (time.monotonic() - t_poll))
            wait = min(deadline, next_poll if watch else deadline, now + 0.1) - now
            for key, _ in sel.select(timeout=max(0.0, wait)):
                if key.data == "in":
                    try:
                        n = os.write(proc.stdin.fileno(), pending_in[:65536])
                    except BlockingIOError:
                        n = 0
                    except OSError:  # the command closed its input; the rest is not wanted
                        n = len(pending_in)
                    pending_in = pending_in[n:]
                    if not len(pending_in):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    sel.unregister(proc.stdout)
                    output_open = False
                    continue
                total += len(chunk)
                room = max_output - len(kept)
                if room > 0:
                    kept += chunk[:room]
    finally:
        if timed_out or stopped or proc.poll() is None:
            kill_tree(proc.pid)
            _kill_session(proc)
        elif output_open and not background:
            _kill_session(proc)
        elif output_open:
            _drain.add(os.dup(proc.stdout.fileno()))
        sel.close()
        proc.stdout.close()
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    rc = proc.wait()
    duration = time.monotonic() - t0
    events: list[str] = []
    exit_code = rc if rc >= 0 else 128 - rc
    if timed_out:
        events.append(f"wall-clock timeout after {timeout:g}s: process tree killed")
        exit_code = 124
    elif stopped is not None:
        events.append(stopped[1])
        exit_code = 125 if stopped[0] == "disk" else 137
    meaning = describe_exit(exit_code) if not (timed_out or stopped) else None
    if meaning:
        events.append(meaning)
    if total > len(kept):
        events.append(f"output capped: kept {len(kept)} of {total} bytes")
    return ExecResult(exit_code=exit_code, output=kept.decode("utf-8", errors="replace"), output_bytes=total,
                      duration_s=duration, timed_out=timed_out, output_truncated=total > len(kept),
                      disk_exceeded=stopped is not None and stopped[0] == "disk",
                      memory_exceeded=stopped is not None and stopped[0] == "memory", events=events)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's whole session. For bubblewrap this also tears down the pid namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


class Sandbox:
    """Base class: subclasses implement `exec`, `copy_in`, `snapshot` and `close`."""

    workdir: str = "/app"
    limits: SandboxLimits

    def exec(self, command: str, *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        raise NotImplementedError

    def copy_in(self, host_path: str | Path, dest: str, merge: bool = False) -> None:
        """Place a host file or directory at `dest` inside the sandbox, replacing what was there.

        With merge (Dockerfile COPY semantics) a directory's contents are added to an existing `dest`."""
        raise NotImplementedError

    def snapshot(self):
        """Freeze the task tree so that `backend.fork(snapshot)` starts copies of it."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def enter_verifier(self, services: bool = True, *, separate: bool = False, artifacts=(), network: str = "none",
                       user: str | int | None = None) -> None:
        """Start the verifier phase: later commands are the verifier's, with /logs (an empty /logs/verifier) and
        /tests made by the host, and the environment of VERIFIER_ENV. With services, what the agent left running may
        go on (where the backend keeps an episode: a server the verifier queries over loopback) out of reach of the
        verifier's processes and files; without, no process of the agent's is left. `separate` (Harbor's
        environment_mode): the verifier starts from the prepared task with only `artifacts` (paths) of what the agent
        wrote; `network`: "none" or "public"; `user`: the verifier's user (root by default). A backend that cannot
        give one of these raises SandboxError saying so. Each call starts the phase afresh; how much of the agent's
        work the verifier sees (the work tree, or all it wrote, frozen) is the backend's, in docs/SANDBOX.md."""
        raise NotImplementedError

    def leave_verifier(self) -> None:
        """Back to the agent phase after a verifier (the next step of a multi-step task): the agent's own /tmp and
        /logs again, the verifier's gone; nothing of the verifier's is left running."""
        raise NotImplementedError

    def end_episode(self) -> int | None:
        """End what the episode's commands left running in the background (the services a task's verifier may
        query) and return how many processes that was; None where the backend does not count them."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # File access, run inside the sandbox (with the system's PATH: a task's PATH may name folders the agent wrote).
    def read_text(self, path: str) -> str | None:
        """Text of the file at `path` inside the sandbox, or None when there is no such file."""
        q = shlex.quote(path)
        res = self.exec(f"[ -f {q} ] || exit 3; cat -- {q}", timeout=60, env={"PATH": BASE_ENV["PATH"]})
        return res.output if res.exit_code == 0 else None

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        """The first max_bytes + 1 bytes of the regular file at `path` (so a longer file shows as longer), or None
        when nothing is there. Raises SandboxError when `path` is a link or not a regular file. Backends that
        reach the sandbox's folders from the host read them there (LocalSandbox); this one asks the sandbox."""
        q = shlex.quote(path)
        res = self.exec(f"if [ -L {q} ]; then exit 4; fi; [ -e {q} ] || exit 3; [ -f {q} ] || exit 5; "
                        f"exec head -c {max_bytes + 1} -- {q}", timeout=60, env={"PATH": BASE_ENV["PATH"]})
        if res.exit_code == 3:
            return None
        if res.exit_code in (4, 5):
            raise SandboxError(f"{path} is {'a symbolic link' if res.exit_code == 4 else 'not a regular file'}")
        if res.exit_code != 0:
            raise SandboxError(f"cannot read {path}: {res.describe()}")
        return res.output.encode()

    def write_file(self, path: str, data: bytes) -> None:
        q = shlex.quote(path)
        res = self.exec(f'mkdir -p -- "$(dirname -- {q})" && cat > {q}', stdin=data, timeout=60)
        if res.exit_code != 0:
            raise SandboxError(f"cannot write {path} in the sandbox: {res.output.strip()[:300]}")
