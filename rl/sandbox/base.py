"""What every sandbox offers: run a shell command with limits, move files in and out, snapshot and fork.

Backends (local bubblewrap, container engines) differ only in how a command is launched. Everything an agent
tool needs (reading, writing, listing files) is built here on top of `exec`, so it runs inside the sandbox and
inherits its isolation: a symlink that points outside the task tree resolves inside the sandbox's own view of
the filesystem, never the host's.
"""

from __future__ import annotations

import os
import re
import selectors
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Environment of every sandboxed command before the task's own ENV entries.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Added for the verifier phase, over the task's own: no user site (HOME is fresh anyway), so no agent-planted
# start-up hooks; git runs none of the programs the agent's repository config names for it (git >= 2.31 reads
# GIT_CONFIG_*, which outranks every config file): no fsmonitor hook on `git status`, no hooks folder.
VERIFIER_ENV = {"PYTHONNOUSERSITE": "1", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_COUNT": "2",
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
    memory_mb: int = 2048  # memory of all the sandbox's processes together; also RLIMIT_AS of each process
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
    leftover_processes: int = 0  # processes still alive when the command's shell exited (all killed)
    events: list[str] = field(default_factory=list)
    reported: bool = True  # the in-sandbox wrapper reported the exit status (False: it was killed or silenced)

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


# Messages by which programs say that an rlimit stopped them; the sandbox names the limit in its report.
# Program messages count only when the command failed; the shell's own job reports count always.
_LIMIT_MARKERS = (
    (("MemoryError", "Cannot allocate memory", "std::bad_alloc", "JavaScript heap out of memory"), False,
     "memory limit reached (address space {memory_mb} MB)"),
    (("Resource temporarily unavailable",), False, "process limit reached ({max_processes} processes)"),
    (("fork: retry: Resource temporarily unavailable",), True, "process limit reached ({max_processes} processes)"),
    (("File size limit exceeded",), True, "file size limit reached ({max_file_mb} MB per file)"),
)


def note_limits(result: "ExecResult", limits: SandboxLimits) -> None:
    """Add an event when the output shows that a program ran into one of the sandbox's rlimits."""
    failed = result.exit_code != 0 or result.leftover_processes > 0
    for markers, always, event in _LIMIT_MARKERS:
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


# Runs inside the sandbox: the user's command in its own shell, then a count of the processes it left behind,
# reported on a private descriptor the command itself cannot write to (it is closed for the command).
_WRAPPER = r"""
status_fd=$1; shift
exec {err}>&2 2>/dev/null  # the wrapper's own messages (e.g. "Killed") are not the command's output
( eval "exec ${status_fd}>&- 2>&${err} ${err}>&-"; exec bash -c "$1" ); rc=$?
self=$$
left() {  # live processes but this shell and the namespace's init (the dead, being reaped, do not count)
  n=0
  for p in /proc/[0-9]*; do
    s=$(< "$p/stat") 2>/dev/null || continue; s=${s##*) }; p=${p#/proc/}
    [ "$p" = 1 ] || [ "$p" = "$self" ] || [ "${s%% *}" = Z ] || n=$((n+1))
  done
}
left; for i in 1 2 3 4 5 6 7 8 9 10; do [ "$n" = 0 ] && break; sleep 0.05; left; done  # a nested sandbox's teardown
printf '%s %s\n' "$rc" "$n" >&"$status_fd"
exit $rc
"""
STATUS_FD = "{STATUS_FD}"
# The report is "<exit code> <leftover processes>\n" in ASCII digits; the host reads at most STATUS_BYTES of it.
STATUS_BYTES = 32
_STATUS = re.compile(rb"(\d{1,3}) (\d{1,7})\n?", re.ASCII)


def parse_status(report: bytes, kernel_code: int) -> tuple[int, int] | None:
    """(exit code, leftover processes) of the wrapper's report, or None when it is not one the wrapper writes:
    anything but the strict format, or an exit code other than the one the kernel gave the launcher (the report
    travels on a pipe that the sandbox's processes may reach; the kernel's status they cannot forge). Never
    raises, whatever the bytes."""
    m = _STATUS.fullmatch(report)
    if m is None or int(m.group(1)) != kernel_code:
        return None
    return kernel_code, int(m.group(2))


def wrapper_argv(command: str) -> list[str]:
    """argv that runs `command` in the sandbox and reports on the descriptor that replaces STATUS_FD."""
    return ["bash", "--noprofile", "--norc", "-c", _WRAPPER, "sandbox-wrapper", STATUS_FD, command]


def run_process(argv: list[str], *, timeout: float, max_output: int, stdin: bytes | None = None,
                cwd: str | None = None, env: dict | None = None, user: int | None = None,
                group: int | None = None, status_pipe: bool = True,
                watch: Callable[[int], tuple[str, str] | None] | None = None, poll_s: float = 0.25,
                pass_fds: tuple[int, ...] = ()) -> ExecResult:
    """Run argv in a new session, stream its merged output with a cap, kill its session on timeout.

    With status_pipe, the argument STATUS_FD is replaced by the write end of a pipe on which the in-sandbox
    wrapper reports the exit code and the number of leftover processes. Once the launched process exits,
    output still arriving from processes it left behind is read for a short grace period, then its session
    is killed. `watch(pid)` is polled every poll_s while the command runs; when it returns (kind, event) with
    kind "disk" or "memory", the session is killed and the event says why. `pass_fds` are handed to the launched
    process as they are (e.g. bubblewrap's --seccomp descriptor).
    """
    status_r = status_w = -1
    if status_pipe:
        status_r, status_w = os.pipe()
        argv = [str(status_w) if a == STATUS_FD else a for a in argv]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True, user=user, group=group,
            extra_groups=[] if user is not None else None,
            pass_fds=((status_w,) if status_pipe else ()) + tuple(pass_fds),
        )
    except OSError as e:
        if status_pipe:
            os.close(status_r)
            os.close(status_w)
        raise SandboxError(f"cannot start {argv[0]}: {e}") from None
    if status_pipe:
        os.close(status_w)
    kept = bytearray()
    total = 0
    status = b""
    timed_out = False
    stopped: tuple[str, str] | None = None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    if status_pipe:
        sel.register(status_r, selectors.EVENT_READ, "status")
    pending_in = memoryview(stdin) if stdin is not None else None
    if pending_in is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
    deadline = t0 + timeout
    next_poll = t0 + poll_s
    open_streams = 2 if status_pipe else 1
    drain_until = None
    try:
        while open_streams:
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
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                if key.data == "status":
                    status = (status + chunk)[:STATUS_BYTES + 1]  # more than a report holds: not a report
                else:
                    total += len(chunk)
                    room = max_output - len(kept)
                    if room > 0:
                        kept += chunk[:room]
    finally:
        if open_streams or timed_out or stopped:
            _kill_session(proc)
        sel.close()
        proc.stdout.close()
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if status_pipe:
            os.close(status_r)
    rc = proc.wait()
    duration = time.monotonic() - t0
    events: list[str] = []
    leftover = 0
    reported = True
    exit_code = rc if rc >= 0 else 128 - rc
    report = parse_status(status, exit_code) if status_pipe else None
    if timed_out:
        events.append(f"wall-clock timeout after {timeout:g}s: process tree killed")
        exit_code = 124
    elif stopped is not None:
        events.append(stopped[1])
        exit_code = 125 if stopped[0] == "disk" else 137
    elif report is not None:
        exit_code, leftover = report
        if leftover:
            events.append(f"{leftover} background process(es) left running were killed when the command ended")
    elif status_pipe:
        events.append("the command's shell did not report its status (it could not start, or was stopped or killed)")
        reported = False
    meaning = describe_exit(exit_code) if not (timed_out or stopped) else None
    if meaning:
        events.append(meaning)
    if total > len(kept):
        events.append(f"output capped: kept {len(kept)} of {total} bytes")
    return ExecResult(exit_code=exit_code, output=kept.decode("utf-8", errors="replace"), output_bytes=total,
                      duration_s=duration, timed_out=timed_out, output_truncated=total > len(kept),
                      disk_exceeded=stopped is not None and stopped[0] == "disk",
                      memory_exceeded=stopped is not None and stopped[0] == "memory", leftover_processes=leftover,
                      events=events, reported=reported)


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

    def enter_verifier(self) -> None:
        """Start the verifier phase. Later commands see a fresh, empty /tmp (their HOME) and /logs with an empty
        /logs/verifier, both made by the host; PYTHONNOUSERSITE=1; no process of the agent's is left; of what the
        agent wrote, only the work tree remains. Each call starts the phase afresh."""
        raise NotImplementedError

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
