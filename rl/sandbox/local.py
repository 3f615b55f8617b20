"""LocalSandbox: a task's files in a private directory, commands run under bubblewrap.

A sandbox's agent commands share one episode, as a container's do: user, pid, network, ipc, uts and mount
namespaces of their own, held by a keeper shell (the init of the episode's pid namespace), so that what one
command leaves running in the background serves the next and the verifier. The sandbox sees the host's system
directories read-only (they stand in for a container image), its own copy of the task tree at /app, and
private /tmp, /logs, /var and /run; nothing else of the host exists inside (no /root, /home, /work, no host
processes, only a loopback network). The new root and /dev are read-only; /dev/shm is a small tmpfs.
When the host user is root, commands run as a fresh unprivileged uid per sandbox, so file permissions protect
host secrets and RLIMIT_NPROC (which root ignores) bounds the process count; where unprivileged user
namespaces are disabled, bwrap runs as root without one and the command drops to that uid with setpriv.
A command's timeout kills it and what it started that is still its descendant; the episode's end (the next
verifier with services=False, or close) kills everything, counted. Verifier commands run in namespaces of their
own, their shell the init, sharing only the episode's network.

Whole-sandbox limits (rl/sandbox/limits.py): on a root host the writable directories live on a tmpfs of
disk_mb/max_files of their own and every command runs in the sandbox's cgroup (memory_mb, max_processes);
elsewhere a monitor polls memory and disk use while a command runs. The verifier phase (`enter_verifier`) gets
its own fresh /tmp and /logs, made by the host on a new tmpfs, so nothing the agent left there reaches it.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import select
import shlex
import shutil
import signal
import stat
import subprocess
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
    dir_usage,
    note_limits,
    process_tree,
    run_process,
)
from rl.sandbox.leftovers import force_rmtree, hold, let_go, sweep
from rl.sandbox.limits import (
    SandboxCgroup,
    cgroup_problem,
    find_cgroup_parents,
    fs_full,
    held_files,
    mount_tmpfs,
    private_memory,
    tmpfs_problem,
)
from rl.sandbox.owners import make_dir
from rl.sandbox.seccomp import filter_fd

_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
SANDBOX_UID_INSIDE = 1000
# Sandboxes of a root host run as uid UID_BASE + random offset: unused by real accounts, one per sandbox.
UID_BASE = 3_000_000
UID_RANGE = 1_000_000
# Writable directories every sandbox has; the task tree lives under /app (Harbor's convention). /var (log, lib,
# cache, spool; /var/tmp is /tmp) and /run are where services keep their logs, state and pid files, as in a
# container; like /app they are the sandbox's for the whole episode, while /tmp and /logs are the verifier's own.
WRITABLE_DIRS = ("app", "tmp", "logs", "var", "run")
VAR_DIRS = ("log", "lib", "cache", "spool")
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# An image's top-level folders that are neither its system nor the sandbox's own (its /opt, /srv, /home, /root,
# /workspace ...) become writable copies per sandbox, as a container's; these are never copied.
IMAGE_SKIPPED = ("proc", "dev", "sys", "tmp", "run", "boot", "lost+found")
# A container's /etc/hosts, the sandbox's own file (docker writes the same): what an entrypoint adds stays its own.
HOSTS_FILE = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tsandbox\n"
# $HOME/.local/bin/env as uv's installer writes it: verifiers run `curl ... astral.sh/uv/install.sh | sh` (offline,
# it fails) and `source $HOME/.local/bin/env`, which under `set -e` must not stop them; the image has uv already.
UV_INSTALLER_ENV = 'case ":${PATH}:" in *:"$HOME/.local/bin":*) ;; *) export PATH="$HOME/.local/bin:$PATH" ;; esac\n'
# How long an episode waits for the image's ENTRYPOINT to hand over to its command (`exec "$@"`); one that is still
# running then is the container's main process (a server) and keeps running, as in a container.
ENTRYPOINT_WAIT_S = 5.0
# Readable by root only; masked in case the sandbox user can read them anyway.
MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")
SHM_BYTES = 64 * 1024 * 1024  # /dev/shm is a per-command tmpfs of this size (memory-backed)
# Root mode (no user namespace): everything else is unshared; setpriv needs these capabilities to drop to
# the sandbox uid, after which the command has none.
ROOT_CAPS = ("--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP")
ROOT_NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                   *ROOT_CAPS)
RESERVED_DESTS = ("/", "/usr", "/etc", "/proc", "/dev", "/bin", "/sbin", "/lib", "/lib64", "/app", "/tmp", "/logs",
                  "/var", "/run", "/opt/verifier")
# The verifier phase's own tools, read-only at /opt/verifier/bin. `judge COMMAND...` runs the code under test in a
# sandbox nested in the verifier's: its own user, pid, ipc, network, uts and mount namespaces, so the verifier's
# shell and processes do not exist for it (nothing to signal, stop, ptrace or prlimit), /logs is an empty tmpfs
# (the reward folder is out of its sight and reach), /tmp is a small tmpfs of its own (it cannot fill the
# verifier's), the system is read-only, /tests is empty but for what the task lets it read, and the work tree /app
# is as the agent left it. Whatever it leaves running dies with it; its exit status is the command's. Where a
# sandbox cannot be nested it refuses (status 125) rather than run the code unisolated.
JUDGE_DIR = "/opt/verifier"
JUDGE_TMP_MB = 64
_JUDGE_SCRIPT = """#!/bin/bash
# judge COMMAND [ARG...]: run the code under test in a sandbox nested in the verifier's (rl/sandbox/local.py).
# bubblewrap by its absolute path: a task's PATH may name folders the agent wrote.
bwrap={bwrap}
if [ $# -eq 0 ]; then echo "judge: usage: judge COMMAND [ARG...]" >&2; exit 2; fi
[ -x "$bwrap" ] && "$bwrap" --unshare-all --die-with-parent --ro-bind / / /bin/sh -c : 2>/dev/null || {{
  echo "judge: cannot isolate the code under test: this host cannot nest a sandbox (unprivileged user namespaces)" >&2
  exit 125; }}
# The verifier's files stay out of sight: /tests is an empty folder but for the files the task lets the code under
# test read ([verifier].judge_reads in task.toml, passed as MC_JUDGE_READS, paths under /tests separated by ':').
tests=()
if [ -d /tests ]; then
  tests=(--tmpfs /tests)
  IFS=: read -r -a reads <<< "${{MC_JUDGE_READS:-}}"
  for f in "${{reads[@]}}"; do
    [ -n "$f" ] && [ -e "/tests/$f" ] && tests+=(--ro-bind "/tests/$f" "/tests/$f")
  done
  tests+=(--remount-ro /tests)
fi
exec "$bwrap" --unshare-all --die-with-parent --new-session --ro-bind / / --bind /app /app --dev /dev --proc /proc \\
  --size {tmp_bytes} --tmpfs /tmp --tmpfs /logs --tmpfs {judge_dir} "${{tests[@]}}" --unsetenv MC_JUDGE_READS \\
  --chdir "$PWD" -- "$@"
"""


# The episode: a sandbox's agent commands share one set of namespaces, as a container's do, so what one starts in
# the background (a server, a database) serves the next and the verifier. The namespaces are held by a keeper shell,
# the init of the episode's pid namespace: it ignores every signal it can (an init takes from inside its namespace
# only the signals it handles, never SIGKILL or SIGSTOP), reaps what is orphaned to it, and exits when its input
# closes (the host closes it at the episode's end; the kernel does when the host process dies), whereupon the kernel
# kills everything left in the episode.
_KEEPER = ('trap "" HUP INT QUIT TERM USR1 USR2 PIPE ALRM TSTP TTIN TTOU; echo ready; exec >/dev/null; '
           'while read -r _; do :; done')
# Entering a user namespace as its owner grants every capability in it; the command gets none.
_DROP_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]


@dataclass
class _Episode:
    launcher: subprocess.Popen  # bubblewrap, which started the keeper
    keeper: int  # the keeper's host pid
    keep_w: int  # the keeper's input: closing it ends the episode
    mounts: tuple  # the mounts its filesystem was built with
    pid_ns: str  # its pid namespace, so that a keeper pid the kernel gave to another process is not entered

    def alive(self) -> bool:
        try:
            return self.launcher.poll() is None and os.readlink(f"/proc/{self.keeper}/ns/pid") == self.pid_ns
        except OSError:
            return False

    def processes(self) -> set[int]:
        """Host pids of what runs in the episode but its keeper (what the agent's commands left running)."""
        return set(process_tree(self.keeper)) - {self.keeper}


def read_bwrap_info(fd: int, timeout_s: float = 30.0) -> dict:
    """bubblewrap's --info-fd JSON (it closes the descriptor after writing, or at its exit)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while len(data) < 1 << 16:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise SandboxError(f"bubblewrap did not start within {timeout_s:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        if data.rstrip().endswith(b"}"):
            break
    try:
        return json.loads(data)
    except ValueError:
        return {}


def _kill_launcher(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def judge_script(bwrap: str) -> str:
    """The `judge` tool's text for a host whose bubblewrap is at `bwrap` (the same path inside the sandbox, whose
    system folders are the host's)."""
    return _JUDGE_SCRIPT.format(bwrap=shlex.quote(bwrap), tmp_bytes=JUDGE_TMP_MB << 20, judge_dir=JUDGE_DIR)


class UnisolatedWarning(UserWarning):
    pass


@dataclass
class LocalSnapshot:
    """A frozen task tree on the host; forks copy it (copy-on-write where the filesystem supports reflinks)."""

    path: Path
    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    limits: SandboxLimits | None = None  # the task's limits, applied to every fork
    image: Path | None = None  # the built image (rl/sandbox/image.py) its forks run on; None: the host's system
    entrypoint: tuple[str, ...] = ()  # the image's ENTRYPOINT: every episode of a fork starts with it
    held: int | None = field(default=None, repr=False)  # its key in rl/sandbox/leftovers.py (a stop signal frees it)

    def discard(self) -> None:
        let_go(self.held)
        force_rmtree(self.path.parent)


def copy_tree(src: Path, dest: Path) -> None:
    """Copy src's contents into dest, sharing blocks with src where the filesystem allows (reflink)."""
    dest.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SandboxError(f"cannot copy task tree {src} -> {dest}: {res.stderr.strip()}")


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def probe_bwrap() -> tuple[str | None, str | None]:
    """How bubblewrap can isolate commands here: (mode, None), or (None, why it cannot).

    "userns": bwrap runs unprivileged (as the sandbox uid when the host user is root) in a new user namespace.
    "root": the host user is root but unprivileged user namespaces are disabled; bwrap runs as root without a
    user namespace and the command drops to the sandbox uid with setpriv before anything else runs.
    """
    exe = bwrap_path()
    if exe is None:
        return None, ("bubblewrap (bwrap) is not installed; install it (apt-get install bubblewrap, "
                      "dnf install bubblewrap)")
    probe = [exe, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]
    kwargs = dict(user=UID_BASE, group=UID_BASE, extra_groups=[]) if os.geteuid() == 0 else {}
    try:
        res = subprocess.run(probe, capture_output=True, text=True, timeout=30, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"bwrap failed to start: {e}"
    if res.returncode == 0:
        return "userns", None
    problem = (f"bwrap cannot create namespaces here ({res.stderr.strip()}); enable unprivileged user namespaces "
               "(sysctl kernel.unprivileged_userns_clone=1) or use a container backend")
    if os.geteuid() == 0 and shutil.which("setpriv"):
        root_probe = [exe, *ROOT_NAMESPACES, "--die-with-parent", "--ro-bind", "/", "/",
                      *setpriv_argv(UID_BASE), "true"]
        try:
            if subprocess.run(root_probe, capture_output=True, timeout=30).returncode == 0:
                return "root", None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None, problem


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate commands on this machine, or None when it can."""
    return probe_bwrap()[1]


def setpriv_argv(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


def _choose(what: str, wanted: bool | None, problem) -> bool:
    """Use the kernel's mechanism `what` when wanted (True: required) and available; False: the monitor."""
    if wanted is False or problem is None:
        return False
    why = problem()
    if why is not None and wanted:
        raise SandboxError(f"LocalSandbox({what}=True): {why}")
    return why is None


def drop_to_uid_argv(uid: int) -> list[str]:
    """Run the rest as uid with no groups; a root launcher loses every capability with its uid."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def _check_traversable(path: Path) -> None:
    """The unprivileged sandbox uid must be able to reach its directories through every parent."""
    for parent in path.resolve().parents:
        if not os.stat(parent).st_mode & 0o001:
            raise SandboxError(f"sandbox directories under {path.parent} are unreachable for the unprivileged "
                               f"sandbox user ({parent} is not world-searchable); choose another root_parent")


def _processes_of(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


class LocalSandbox(Sandbox):
    """Isolated copy of a task tree. Commands run under bubblewrap; file tools run as commands too.

    `unisolated=True` runs commands as plain subprocesses of this host user with rlimits only: no namespaces,
    the task tree at its host path rather than /app. Only for machines without bubblewrap and trusted code.
    `cgroups` and `tmpfs` choose how whole-sandbox limits are enforced (rl/sandbox/limits.py): None uses the
    kernel's cgroup / a tmpfs of the sandbox's own where the host allows, else the polling monitor; False
    always uses the monitor; True requires the kernel's mechanism.
    """

    def __init__(self, tree: str | Path | None = None, *, workdir: str = "/app", env: dict[str, str] | None = None,
                 limits: SandboxLimits | None = None, root_parent: str | Path | None = None,
                 unisolated: bool = False, extra_ro_binds: tuple[str, ...] = (), bwrap_mode: str | None = None,
                 cgroups: bool | None = None, tmpfs: bool | None = None, image: str | Path | None = None,
                 entrypoint: tuple[str, ...] = ()):
        self.limits = limits or SandboxLimits()
        self.entrypoint = tuple(entrypoint)
        self.limits.validate()
        self.image = Path(image) if image is not None else None
        if self.image is not None and unisolated:
            raise SandboxError("an unisolated sandbox runs on the host's system; it cannot run on a built image")
        image_dirs = self._image_dirs()
        top = workdir.split("/")[1] if workdir.startswith("/") else ""
        if workdir != "/app" and not workdir.startswith("/app/") and top not in image_dirs:
            raise SandboxError(f"LocalSandbox keeps the task tree at /app; workdir {workdir!r} must be under it"
                               + (f" or under one of the image's folders {image_dirs}" if image_dirs else ""))
        self.unisolated = unisolated
        self.env = dict(env or {})
        self.extra_ro_binds = tuple(extra_ro_binds)
        self._mounts: list[tuple[Path, str]] = []
        self._image_mounts: list[tuple[Path, str]] = []  # the image's own folders: the sandbox's, like /app
        self._closed = False
        self._bwrap = bwrap_path()
        self._mode = bwrap_mode
        if not unisolated and self.needs_bwrap:
            problem = None
            if self._mode is None:
                self._mode, problem = probe_bwrap()
            if problem or self._bwrap is None:
                raise SandboxError(f"LocalSandbox refuses to run without isolation: {problem or 'bwrap missing'}. "
                                   "Pass unisolated=True only for trusted code (no isolation at all).")
        elif unisolated:
            msg = ("LocalSandbox(unisolated=True): COMMANDS RUN WITHOUT ANY ISOLATION as this host user; only "
                   "rlimits and timeouts apply. Never use this for model-generated code.")
            warnings.warn(msg, UnisolatedWarning, stacklevel=2)
        self._tmpfs = _choose("tmpfs", tmpfs, None if unisolated else tmpfs_problem)
        self.root = make_dir("sandbox", root_parent)
        self.uid: int | None = None
        self._cgroup: SandboxCgroup | None = None
        self._verifier_root: Path | None = None
        self._episode: _Episode | None = None
        self._held: int | None = None
        try:
            self._held = hold(self._release)  # a stop signal releases it (rl/sandbox/leftovers.py)
            if self._tmpfs:
                try:
                    mount_tmpfs(self.root, self.limits.disk_mb, self.limits.max_files)
                except OSError as e:
                    if tmpfs:
                        raise SandboxError(f"LocalSandbox(tmpfs=True): {e}") from None
                    self._tmpfs = False  # the monitor measures disk use instead
            os.chmod(self.root, 0o711)  # the sandbox uid must traverse it to reach its own directories
            self._dirs = self._make_dirs(self.root)
            (self.root / "hosts").write_text(HOSTS_FILE)
            for name in image_dirs:
                self._copy_from_image(name)
            if tree is not None:
                try:
                    copy_tree(Path(tree), self._dirs["app"])
                except SandboxError as e:
                    if self._tmpfs and fs_full(self.root):
                        raise SandboxError(f"the task tree {tree} does not fit the sandbox's disk limit "
                                           f"({self.limits.disk_mb} MB, {self.limits.max_files} files)") from None
                    raise e
            if os.geteuid() == 0 and not unisolated:
                _check_traversable(self.root)
                self.uid = UID_BASE + 1 + secrets.randbelow(UID_RANGE)
                self._chown(self.root)
            if _choose("cgroups", cgroups, None if unisolated else cgroup_problem):
                try:
                    self._cgroup = SandboxCgroup(find_cgroup_parents(), self.root.name, self.limits.memory_mb,
                                                 self.limits.max_processes)
                except OSError as e:
                    if cgroups:
                        raise SandboxError(f"LocalSandbox(cgroups=True): cannot make the sandbox's cgroup: {e}") \
                            from None  # otherwise the monitor limits memory instead
        except BaseException:
            self._release()
            raise
        self.workdir = str(self.host_path(workdir)) if unisolated else workdir
        self.tree_root = str((self.root / "app").resolve()) if unisolated else "/app"

    def _image_dirs(self) -> list[str]:
        """The image's top-level folders the sandbox gets a writable copy of (its /app and /var among them)."""
        if self.image is None:
            return []
        if not self.image.is_dir():
            raise SandboxError(f"the image {self.image} does not exist; build the task again")
        return sorted(e.name for e in self.image.iterdir() if e.is_dir() and not e.is_symlink()
                      and e.name not in SYSTEM_DIRS + IMAGE_SKIPPED)

    def _copy_from_image(self, name: str) -> None:
        """The sandbox's own copy of the image's folder /name: into its /app or /var (/var/tmp stays /tmp), or a
        writable mount of its own."""
        source = self.image / name
        target = self._dirs[name] if name in WRITABLE_DIRS else self._dirs["mounts"] / f"image-{name}"
        entries = [str(e) for e in source.iterdir() if not (name == "var" and e.name == "tmp")]
        if name not in WRITABLE_DIRS:
            target.mkdir()
            os.chmod(target, stat.S_IMODE(source.stat().st_mode))
        if entries:  # one copy of all it holds (apt and dpkg keep working for the verifiers' `apt-get install curl`)
            res = subprocess.run(["cp", "-a", "--reflink=auto", *entries, str(target)], capture_output=True, text=True)
            if res.returncode != 0:
                raise SandboxError(f"cannot copy the image's /{name}: {res.stderr.strip()[:300]}")
        if name not in WRITABLE_DIRS:
            self._image_mounts.append((target, f"/{name}"))
            self._judge_mountpoint()

    def _judge_mountpoint(self) -> None:
        """Where an image's folder (its /opt) holds the judge's tools' place: the mount point they need there (made
        again, never through a link, if the agent removed or replaced it)."""
        for host, dest in self._image_mounts:
            if JUDGE_DIR.startswith(dest + "/"):
                point = host / os.path.relpath(JUDGE_DIR, dest)
                if point.is_symlink() or (point.exists() and not point.is_dir()):
                    point.unlink()
                real_parent = os.path.realpath(point.parent)
                if not (real_parent + "/").startswith(str(host.resolve()) + "/"):
                    raise SandboxError(f"the sandbox replaced {os.path.dirname(JUDGE_DIR)} with a link")
                try:
                    point.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise SandboxError(f"cannot make {JUDGE_DIR} for the verifier's tools: {e.strerror}") from None

    @staticmethod
    def _make_dirs(root: Path) -> dict[str, Path]:
        dirs = {d: root / d for d in WRITABLE_DIRS + ("mounts",)}
        for d in dirs.values():
            d.mkdir()
        (dirs["logs"] / "verifier").mkdir()
        (dirs["logs"] / "agent").mkdir()
        for name in VAR_DIRS:
            (dirs["var"] / name).mkdir()
        (dirs["var"] / "tmp").symlink_to("../tmp")  # resolved inside the sandbox: /var/tmp is /tmp
        return dirs

    @property
    def whole_sandbox_limits(self) -> dict[str, str]:
        """How memory and disk are limited for this sandbox: 'cgroup'/'tmpfs' (kernel) or 'monitor'."""
        return {"memory": "cgroup" if self._cgroup else "monitor", "disk": "tmpfs" if self._tmpfs else "monitor"}

    # Paths
    def host_path(self, sandbox_path: str) -> Path:
        """Host location of a path under /app, /tmp or /logs (what the sandbox can write)."""
        parts = Path(sandbox_path).parts
        if len(parts) >= 2 and parts[0] == "/" and parts[1] in WRITABLE_DIRS:
            return self._dirs[parts[1]].joinpath(*parts[2:])
        for host, dest in self._image_mounts + self._mounts:
            if sandbox_path == dest or sandbox_path.startswith(dest + "/"):
                return host / os.path.relpath(sandbox_path, dest)
        raise SandboxError(f"{sandbox_path} is not inside the sandbox's writable directories /app, /tmp, /logs")

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        """Read on the host from the sandbox's own folder, one component at a time and never through a link
        (O_NOFOLLOW), without blocking on a FIFO; see Sandbox.read_file."""
        parts = Path(path).parts
        if len(parts) < 3 or parts[0] != "/" or parts[1] not in WRITABLE_DIRS or ".." in parts:
            return super().read_file(path, max_bytes)
        fd = os.open(self._dirs[parts[1]], _DIR_OPEN)
        try:
            for name in parts[2:-1]:
                inner = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = inner
            inner = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            what = "a symbolic link" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
            raise SandboxError(f"{path} cannot be read: {what}") from None
        finally:
            os.close(fd)
        try:
            if not stat.S_ISREG(os.fstat(inner).st_mode):
                raise SandboxError(f"{path} is not a regular file")
            chunks, left = [], max_bytes + 1
            while left > 0 and (chunk := os.read(inner, min(left, 1 << 16))):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(inner)

    @property
    def app_dir(self) -> Path:
        return self._dirs["app"]

    def _writable_host_dirs(self) -> list[str]:
        """The folders the sandbox writes: its own (which the episode keeps in the verifier phase) and the
        verifier's."""
        dirs = {str(self.root / d) for d in WRITABLE_DIRS} | {str(self._dirs[d]) for d in WRITABLE_DIRS}
        return sorted(dirs) + [str(h) for h, _ in self._image_mounts + self._mounts]

    def _chown(self, path: Path) -> None:
        """Give `path` (recursively, never following symlinks) to the sandbox user."""
        if self.uid is None:
            return
        try:
            os.lchown(path, self.uid, self.uid)
            for dirpath, dirnames, filenames in os.walk(path):
                for name in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, name), self.uid, self.uid)
        except OSError as e:
            raise SandboxError(f"cannot hand {path} to the sandbox user: {e}") from None

    # Commands
    def _rlimit_argv(self) -> list[str]:
        lim = self.limits
        nproc = lim.max_processes
        if self.uid is None and os.geteuid() != 0:
            nproc += _processes_of(os.geteuid())  # RLIMIT_NPROC counts all of this user's processes
        mb = 1024 * 1024
        # CPU: soft limit sends SIGXCPU (reported by name), the hard limit one second later kills.
        return ["prlimit", f"--cpu={lim.cpu_time_s}:{lim.cpu_time_s + 1}", f"--as={lim.memory_mb * mb}",
                f"--nproc={nproc}", f"--fsize={lim.max_file_mb * mb}", f"--nofile={lim.max_open_files}", "--core=0",
                "--"]

    needs_bwrap = True
    provides_judge = True  # the verifier phase has /opt/verifier/bin/judge (a nested bubblewrap sandbox)

    def _filesystem_argv(self) -> list[str]:
        """bubblewrap's options that build the sandbox's filesystem: the system read-only, its own writable
        folders and mounts (read-only in the verifier phase: the code it tests cannot rewrite its files)."""
        argv = []
        system = str(self.image) if self.image is not None else ""
        for name in SYSTEM_DIRS:
            host = f"{system}/{name}"
            if os.path.islink(host):
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif os.path.isdir(host):
                argv += ["--ro-bind", host, f"/{name}"]
        if self.image is not None:  # the image's own files at its root (a COPY to /entrypoint.sh), read-only
            for entry in sorted(os.scandir(self.image), key=lambda e: e.name):
                if entry.is_file(follow_symlinks=False):
                    argv += ["--ro-bind", entry.path, f"/{entry.name}"]
        for path in MASKED_FILES:
            if os.path.exists(system + path):
                argv += ["--ro-bind", "/dev/null", path]
        bind = "--ro-bind" if self._verifier_root is not None else "--bind"
        if os.path.exists(system + "/etc/hosts"):  # the sandbox's own, as a container's (an entrypoint adds names)
            argv += [bind, str(self.root / "hosts"), "/etc/hosts"]
        for host in self.extra_ro_binds:
            argv += ["--ro-bind", host, host]
        argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(SHM_BYTES),
                 "--tmpfs", "/dev/shm"]
        for d in WRITABLE_DIRS:
            argv += ["--bind", str(self._dirs[d]), f"/{d}"]
        for host, dest in self._image_mounts:
            argv += ["--bind", str(host), dest]
        for host, dest in self._mounts:
            argv += [bind, str(host), dest]
        # bwrap's new root and /dev are memory-backed tmpfs: read-only, so writing cannot fill host RAM.
        return argv + ["--remount-ro", "/dev", "--remount-ro", "/"]

    def _launcher_argv(self, argv: list[str]) -> tuple[list[str], int | None]:
        """(argv, the user to start it as): bubblewrap runs as the sandbox uid on a root host (as root without
        a user namespace, the command dropping to that uid first thing), in the sandbox's cgroup."""
        launcher_uid = None if self._mode == "root" else self.uid
        if self._cgroup is not None:  # join as root, then become the launcher's user
            argv = self._cgroup.join_argv() + (drop_to_uid_argv(launcher_uid) if launcher_uid else []) + argv
            launcher_uid = None
        return argv, launcher_uid

    def _start_episode(self) -> None:
        """Start the episode's keeper (see _KEEPER): bubblewrap with every namespace new and the sandbox's
        filesystem, its shell as pid 1. Where bwrap makes a user namespace the host writes its uid map (the
        sandbox user, uid 1000 inside, is the launcher outside), so that the host can later enter the episode's
        namespaces as their owner (`nsenter`)."""
        block_r, block_w = os.pipe()
        info_r, info_w = os.pipe()
        keep_r, keep_w = os.pipe()
        seccomp_fd = filter_fd()
        if self._mode == "root":
            argv = [self._bwrap, *ROOT_NAMESPACES]
            inner = setpriv_argv(self.uid)
        else:  # bwrap makes the user namespace and waits until the host has mapped its user
            argv = [self._bwrap, "--unshare-all", "--unshare-user", "--userns-block-fd", str(block_r)]
            inner = []
        argv += ["--info-fd", str(info_w), "--as-pid-1", "--clearenv", "--setenv", "PATH", BASE_ENV["PATH"],
                 "--hostname", "sandbox", *self._filesystem_argv()]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        argv, launcher_uid = self._launcher_argv(argv + ["--chdir", "/", "--", *inner, "bash", "--noprofile",
                                                         "--norc", "-c", _KEEPER])
        passed = [fd for fd in (block_r, info_w, seccomp_fd) if fd is not None]
        try:
            proc = subprocess.Popen(argv, stdin=keep_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={"PATH": BASE_ENV["PATH"]}, start_new_session=True, user=launcher_uid,
                                    group=launcher_uid, extra_groups=[] if launcher_uid is not None else None,
                                    pass_fds=passed)
        except OSError as e:
            for fd in (block_r, block_w, info_r, info_w, keep_r, keep_w):
                os.close(fd)
            raise SandboxError(f"cannot start the sandbox's episode: {e}") from None
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        for fd in (block_r, info_w, keep_r):
            os.close(fd)
        try:
            info = read_bwrap_info(info_r)
            keeper = info.get("child-pid") if isinstance(info, dict) else None
            if not isinstance(keeper, int):
                raise SandboxError("bubblewrap gave no child pid")
            if self._mode != "root":
                outer = self.uid if self.uid is not None else os.geteuid()
                for name, text in (("setgroups", "deny"), ("uid_map", f"{SANDBOX_UID_INSIDE} {outer} 1\n"),
                                   ("gid_map", f"{SANDBOX_UID_INSIDE} {outer} 1\n")):
                    with open(f"/proc/{keeper}/{name}", "w") as f:
                        f.write(text)
            os.write(block_w, b"1")
            # bwrap builds the filesystem after it names its child: the keeper says when it runs on it.
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            if not ready or proc.stdout.read(6) != b"ready\n":
                raise SandboxError("the episode's init did not start")
            pid_ns = os.readlink(f"/proc/{keeper}/ns/pid")
            try:  # the OOM killer takes the sandbox's other processes, not its init (where the host may say so)
                with open(f"/proc/{keeper}/oom_score_adj", "w") as f:
                    f.write("-1000")
            except OSError:
                pass
        except (OSError, SandboxError) as e:
            os.close(keep_w)
            _kill_launcher(proc)
            err = proc.stderr.read().decode(errors="replace").strip()[:500]
            raise SandboxError(f"cannot start the sandbox's episode: {err or e}") from None
        finally:
            os.close(block_w)
            os.close(info_r)
            proc.stdout.close()
            proc.stderr.close()
        self._episode = _Episode(proc, keeper, keep_w, tuple(self._mounts), pid_ns)
        self._open_low_ports(keeper)

    def _open_low_ports(self, keeper: int) -> None:
        """Let the episode's processes listen on ports below 1024 in its own network namespace (a server the
        task's image starts on port 80), as docker sets up every container (net.ipv4.ip_unprivileged_port_start).
        Host root sets it (root holds every capability over the namespaces it made); an unprivileged host cannot
        (a shell it starts inside its user namespace as uid 1000 has no capability left), so low ports stay
        closed there, as docs/SANDBOX.md says."""
        if os.geteuid() != 0:
            return
        res = subprocess.run(["nsenter", "-t", str(keeper), "--net", "sh", "-c",
                              "echo 0 > /proc/sys/net/ipv4/ip_unprivileged_port_start"],
                             capture_output=True, text=True, env={"PATH": BASE_ENV["PATH"]}, timeout=30)
        if res.returncode != 0:
            self.end_episode()
            raise SandboxError(f"cannot open the episode's ports below 1024: {res.stderr.strip()[:200]}")

    def _start_container(self) -> None:
        """A new episode, started as a container starts: its namespaces, then the image's ENTRYPOINT (if any) with
        the image's environment."""
        self._start_episode()
        if self.entrypoint:
            self._run_entrypoint({**BASE_ENV, **self.env})

    def _run_entrypoint(self, env: dict[str, str]) -> None:
        """Start the episode as a container starts: the image's ENTRYPOINT with a command that says it was reached
        (Harbor and Terminal-Bench give the main container `sh -c 'sleep infinity'`). What it starts in the
        background serves the episode; an entrypoint that fails first is a one-line error with its log."""
        marker = f"/run/.mc-entrypoint-{secrets.token_hex(4)}"
        argv = shlex.join([*self.entrypoint, "sh", "-c", f"touch {marker}"])
        script = (f"{argv} </dev/null >>/var/log/entrypoint.log 2>&1 & pid=$!; end=$((SECONDS + "
                  f"{int(ENTRYPOINT_WAIT_S)})); while [ ! -e {marker} ] && [ $SECONDS -lt $end ]; do "
                  f"kill -0 $pid 2>/dev/null || {{ wait $pid; s=$?; [ -e {marker} ] && break; [ $s = 0 ] && break; "
                  f"echo \"exited with status $s $(tail -n 1 /var/log/entrypoint.log)\"; exit 3; }}; sleep 0.02; done; "
                  f"rm -f {marker}")
        res = self._exec_isolated(script, self.workdir, env, ENTRYPOINT_WAIT_S + 60, None)
        if res.exit_code != 0:
            self.end_episode()
            last = res.output.strip().splitlines()[-1:] or [res.describe()]
            raise SandboxError(f"the image's ENTRYPOINT {list(self.entrypoint)} failed before its command ran: "
                               f"{last[0].strip()[:200]} (its log: /var/log/entrypoint.log in the sandbox)")

    def end_episode(self) -> int | None:
        """Kill what the episode's commands left running (by killing its keeper, the init of its pid namespace)
        and return how many processes that was; the next agent command starts a new episode."""
        episode, self._episode = self._episode, None
        if episode is None:
            return 0
        left = len(episode.processes())
        try:
            os.kill(episode.keeper, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        os.close(episode.keep_w)
        _kill_launcher(episode.launcher)
        return left

    def _command_argv(self, command: str, cwd: str, env: dict[str, str], seccomp_fd: int | None) -> list[str]:
        """bubblewrap argv that runs `command`. An agent command enters the episode's namespaces (what it leaves
        running stays, as in a container); a verifier command gets its own user, pid, ipc, uts and mount
        namespaces, its shell as pid 1 (so nothing it starts outlives it, and nothing inside can signal it), and
        shares only the episode's network, where the episode's services answer on loopback."""
        shell = ["bash", "--noprofile", "--norc", "-c", command]
        keeper = str(self._episode.keeper) if self._episode else None
        root = self._mode == "root"
        common = ["--die-with-parent", "--new-session", "--clearenv"]
        for k, v in env.items():
            common += ["--setenv", k, v]
        if seccomp_fd is not None:  # rl/sandbox/seccomp.py: no ptrace, pidfd_getfd, process_vm_* for anything run
            common += ["--seccomp", str(seccomp_fd)]
        common += ["--chdir", cwd, "--"]
        drop = setpriv_argv(self.uid) if root else []
        inside = ["--uid", str(SANDBOX_UID_INSIDE), "--gid", str(SANDBOX_UID_INSIDE)]
        # Without a user namespace (root mode) the host enters as root; with one, as the namespaces' owner, which
        # grants every capability inside them until _DROP_CAPS.
        owner = [] if root else ["--user", "--preserve-credentials"]
        after_enter = ["--"] + ([] if root else _DROP_CAPS)
        if self._verifier_root is None:  # enter the episode's namespaces, a mount namespace of its own over them
            enter = ["nsenter", "-t", keeper, *owner, "--pid", "--net", "--ipc", "--uts", "--mount", "-r", "-w",
                     *after_enter]
            own = list(ROOT_CAPS) if root else ["--unshare-user", *inside]
            return enter + [self._bwrap, *own, "--dev-bind", "/", "/", *common, *drop, *shell]
        # The verifier: namespaces of its own but the episode's network (a fresh one when there is no episode).
        join = ["nsenter", "-t", keeper, *owner, "--net", *after_enter] if keeper else []
        if root:
            spaces = [a for a in ROOT_NAMESPACES if not (keeper and a == "--unshare-net")]
        elif keeper:
            spaces = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                      *inside]
        else:
            spaces = ["--unshare-all", *inside]
        return join + [self._bwrap, *spaces, "--as-pid-1", "--hostname", "sandbox", *self._filesystem_argv(),
                       *common, *drop, *shell]

    def _disk_roots(self) -> list[Path]:
        return [self.root] + ([self._verifier_root] if self._verifier_root else [])

    def _disk_event(self) -> str | None:
        """Why the sandbox's disk is over its limit after a command, or None (tmpfs: it is full)."""
        lim = self.limits
        if self._tmpfs:
            for root in self._disk_roots():
                full = fs_full(root)
                if full:
                    what = f"{lim.disk_mb} MB" if full == "space" else f"{lim.max_files} files"
                    return f"disk limit exceeded: the sandbox's filesystem is full ({what}); writes fail"
            return None
        size, files = dir_usage(self._writable_host_dirs())
        if size > lim.disk_mb << 20:
            return f"disk limit exceeded: the sandbox holds more than {lim.disk_mb} MB"
        if files > lim.max_files:
            return f"disk limit exceeded: the sandbox holds more than {lim.max_files} files"
        return None

    def _monitor(self):
        """watch(pid) for run_process: the polling fallback for the limits the kernel does not enforce here."""
        if self._cgroup is not None and self._tmpfs:
            return None
        lim = self.limits
        dirs = self._writable_host_dirs()
        devices = {os.stat(d).st_dev for d in dirs}
        # Only growth past a limit stops a command, so cleanup can run in a sandbox that is already full.
        size0, files0 = (0, 0) if self._tmpfs else dir_usage(dirs)

        def watch(pid: int):
            pids = process_tree(pid) + (list(self._episode.processes()) if self._episode else [])
            shm, unlinked = held_files(pids, devices)
            if self._cgroup is None:
                held = private_memory(pids) + shm
                if held > lim.memory_mb << 20:
                    return "memory", (f"memory limit exceeded: the sandbox's processes held {held >> 20} MB together "
                                      f"(limit {lim.memory_mb} MB); process tree killed")
            if not self._tmpfs:
                size, files = dir_usage(dirs)
                size += unlinked
                if (size > lim.disk_mb << 20 and size > size0) or (files > lim.max_files and files > files0):
                    return "disk", (f"disk limit exceeded: the sandbox wrote more than {lim.disk_mb} MB or "
                                    f"{lim.max_files} files; process tree killed")
            return None

        return watch

    def exec(self, command: str, *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        timeout = self.limits.command_timeout_s if timeout is None else timeout
        full_env = {**BASE_ENV, **self.env, **(env or {})}
        if self._verifier_root is not None:
            full_env.update(VERIFIER_ENV)
        ooms = self._cgroup.oom_kills() if self._cgroup else 0
        if self.unisolated:
            full_env["HOME"] = str(self._dirs["tmp"])
            argv = self._rlimit_argv() + ["bash", "--noprofile", "--norc", "-c", command]
            res = run_process(argv, timeout=timeout, max_output=self.limits.max_output_bytes, stdin=stdin,
                              cwd=cwd or self.workdir, env=full_env, watch=self._monitor())
        else:
            res = self._exec_isolated(command, cwd or self.workdir, full_env, timeout, stdin)
        if self._cgroup is not None:
            killed = self._cgroup.oom_kills() - ooms
            if killed > 0:
                res.memory_exceeded = True
                res.events.append(f"memory limit exceeded: the sandbox's processes passed {self.limits.memory_mb} MB "
                                  f"together; the kernel killed {killed} of them")
        if not res.disk_exceeded:
            event = self._disk_event()
            if event:
                res.disk_exceeded = True
                res.events.append(event)
        note_limits(res, self.limits)
        if self._episode is not None and any(e.startswith("process limit reached") for e in res.events):
            # a fork bomb's detached processes would hold the limit for every later command, the verifier's too
            res.events.append(f"{self.end_episode()} background process(es) were ended to free the process limit")
        return res

    def _exec_isolated(self, command: str, cwd: str, env: dict[str, str], timeout: float,
                       stdin: bytes | None) -> ExecResult:
        events = []
        in_episode = self.needs_bwrap and self._verifier_root is None
        if in_episode:
            episode = self._episode
            if episode is not None and episode.mounts != tuple(self._mounts):  # its filesystem is fixed at start
                left = self.end_episode()
                events.append(f"the sandbox restarted to add a mount; {left} background process(es) ended")
            elif episode is not None and not episode.alive():
                self.end_episode()
                events.append("the sandbox's init was killed (memory?); its background processes ended")
            if self._episode is None:
                self._start_container()
            before = self._episode.processes()
        seccomp_fd = filter_fd() if self.needs_bwrap else None
        argv, launcher_uid = self._launcher_argv(self._rlimit_argv()
                                                 + self._command_argv(command, cwd, env, seccomp_fd))
        try:
            res = run_process(argv, timeout=timeout, max_output=self.limits.max_output_bytes, stdin=stdin,
                              env={"PATH": BASE_ENV["PATH"]}, user=launcher_uid, group=launcher_uid,
                              watch=self._monitor(), background=in_episode,
                              pass_fds=() if seccomp_fd is None else (seccomp_fd,))
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        if in_episode and self._episode is not None:
            if res.memory_exceeded and self._cgroup is None:  # the monitor counts the episode's processes too
                events.append(f"{self.end_episode()} background process(es) ended with it")
            else:
                res.background_processes = len(self._episode.processes() - before)
                if res.background_processes:
                    events.append(f"{res.background_processes} process(es) it started keep running in the "
                                  "background until the episode ends")
        res.events = events + res.events
        return res

    def enter_verifier(self, services: bool = True) -> None:
        """Fresh /tmp and /logs (with an empty /logs/verifier) on a new host-made tmpfs where the host allows;
        mounts the agent phase added (e.g. /solution) are dropped. What the agent left running keeps running in
        the episode's namespaces (services=False ends it first), which the verifier's commands share only the
        network of: its servers answer on loopback, and they see neither the verifier's processes nor its files."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        if not services:
            self.end_episode()
        self._drop_verifier_root()
        if services and self.entrypoint and self.needs_bwrap and self._episode is None:
            self._start_container()  # the container was up before the verifier came, with what its entrypoint started
        root = make_dir("verifier", self.root.parent)
        self._verifier_root = root
        try:
            if self._tmpfs:
                mount_tmpfs(root, self.limits.disk_mb, self.limits.max_files)
            os.chmod(root, 0o711)
            dirs = self._make_dirs(root)
            self._chown(root)
            if self.image is not None:  # what uv's installer leaves, which verifiers source; the image's uv is ours
                installed = dirs["tmp"] / ".local" / "bin"
                installed.mkdir(parents=True)
                (installed / "env").write_text(UV_INSTALLER_ENV)
        except OSError as e:
            raise SandboxError(f"cannot make the verifier's directories under {root}: {e}") from None
        self._dirs.update(tmp=dirs["tmp"], logs=dirs["logs"], mounts=dirs["mounts"])
        self._mounts = []
        if self.provides_judge:
            self._judge_mountpoint()
            tools = root / "tools"
            (tools / "bin").mkdir(parents=True)
            (tools / "bin" / "judge").write_text(judge_script(self._bwrap or "/usr/bin/bwrap"))
            for path in (tools, tools / "bin", tools / "bin" / "judge"):
                os.chmod(path, 0o755)  # root's (or the host user's), read-only to the verifier and what it runs
            self._mounts.append((tools, JUDGE_DIR))

    def leave_verifier(self) -> None:
        if self._closed:
            raise SandboxError("sandbox is closed")
        self._drop_verifier_root()
        self._dirs.update(tmp=self.root / "tmp", logs=self.root / "logs", mounts=self.root / "mounts")
        self._mounts = []

    def _drop_verifier_root(self) -> None:
        if self._verifier_root is not None:
            root, self._verifier_root = self._verifier_root, None
            force_rmtree(root)

    # Files
    def copy_in(self, host_path: str | Path, dest: str, merge: bool = False) -> None:
        host_path = Path(host_path)
        if not dest.startswith("/") or ".." in Path(dest).parts:
            raise SandboxError(f"copy_in destination must be an absolute path without '..', got {dest!r}")
        if self.unisolated and dest.split("/")[1] not in WRITABLE_DIRS:
            raise SandboxError(f"an unisolated sandbox cannot provide {dest}; it has only /app, /tmp and /logs")
        try:
            target = self.host_path(dest)
        except SandboxError:
            if dest.rstrip("/") in RESERVED_DESTS or dest.split("/")[1] in SYSTEM_DIRS + ("proc", "dev"):
                raise SandboxError(f"cannot mount over system path {dest}") from None
            target = self._dirs["mounts"] / str(len(self._mounts))
            self._mounts.append((target, dest.rstrip("/")))
        # The sandbox may have planted symlinks in its directories: never let a host-side copy follow them.
        real_parent = os.path.realpath(target.parent)
        if not any(real_parent == str(r.resolve()) or real_parent.startswith(str(r.resolve()) + "/")
                   for r in self._disk_roots()):
            raise SandboxError(f"copy_in destination {dest} resolves outside the sandbox (symlink); refusing")
        if merge and host_path.is_dir() and target.is_dir() and not target.is_symlink():
            pass
        elif target.exists() or target.is_symlink():
            if target.is_dir() and not target.is_symlink():
                force_rmtree(target)
            else:
                target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        if host_path.is_dir():
            copy_tree(host_path, target)
        else:
            shutil.copy2(host_path, target)
        self._chown(target)

    def snapshot(self) -> LocalSnapshot:
        snap_root = make_dir("snapshot", self.root.parent)
        snap = LocalSnapshot(path=snap_root / "app", workdir=self.workdir if not self.unisolated else "/app",
                             env=dict(self.env), image=self.image, entrypoint=self.entrypoint)
        try:
            snap.held = hold(snap.discard)
            copy_tree(self._dirs["app"], snap.path)
        except BaseException:
            snap.discard()
            raise
        return snap

    def close(self) -> None:
        if not self._closed:
            self._release()

    def _release(self) -> None:
        """Everything the sandbox holds goes, each part whatever happened to the others."""
        self._closed = True
        let_go(self._held)
        try:
            self.end_episode()
            self._drop_verifier_root()
        finally:
            try:
                force_rmtree(self.root)
            finally:
                if self._cgroup is not None:
                    self._cgroup.close()
                    self._cgroup = None

    def __del__(self):
        if not getattr(self, "_closed", True) and hasattr(self, "root"):
            self.close()


@dataclass
class LocalBackend:
    """Creates LocalSandboxes with shared settings; checks once that bubblewrap works."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    unisolated: bool = False
    root_parent: str | None = None
    extra_ro_binds: tuple[str, ...] = ()
    name: str = "local"

    bwrap_mode: str | None = None  # probed when not given
    cgroups: bool | None = None  # whole-sandbox memory/processes: None = a cgroup where possible, else the monitor
    tmpfs: bool | None = None  # whole-sandbox disk: None = a tmpfs of its own where possible, else the monitor
    image_cache: str | None = None  # where built images are kept (rl/sandbox/image.py; MC_IMAGE_CACHE by default)
    build_images: bool = False  # build every task's Dockerfile, even where the host's system could stand in

    @property
    def runs_images(self) -> bool:
        return not self.unisolated

    def __post_init__(self):
        sweep(self.root_parent)  # what killed runs left where this backend's sandboxes go (once per process)
        if not self.unisolated:
            if self.bwrap_mode is None:
                self.bwrap_mode, problem = probe_bwrap()
            else:
                problem = None
            if problem:
                raise SandboxError(f"LocalSandbox refuses to run without isolation: {problem}. "
                                   "Pass unisolated=True only for trusted code (no isolation at all).")
        else:
            warnings.warn("LocalBackend(unisolated=True): SANDBOXES RUN COMMANDS WITHOUT ANY ISOLATION as this host "
                          "user; only rlimits and timeouts apply. Never use this for model-generated code.",
                          UnisolatedWarning, stacklevel=2)

    def create(self, tree: str | Path | None, workdir: str = "/app", env: dict[str, str] | None = None,
               limits: SandboxLimits | None = None, image: str | Path | None = None,
               entrypoint: tuple[str, ...] = ()) -> LocalSandbox:
        with warnings.catch_warnings():
            if self.unisolated:  # warned once, here, instead of per sandbox
                warnings.simplefilter("ignore", UnisolatedWarning)
            return LocalSandbox(tree, workdir=workdir, env=env, limits=limits or self.limits,
                                root_parent=self.root_parent, unisolated=self.unisolated,
                                extra_ro_binds=self.extra_ro_binds, bwrap_mode=self.bwrap_mode,
                                cgroups=self.cgroups, tmpfs=self.tmpfs, image=image, entrypoint=entrypoint)

    def fork(self, snapshot: LocalSnapshot, limits: SandboxLimits | None = None) -> LocalSandbox:
        return self.create(snapshot.path, workdir=snapshot.workdir, env=snapshot.env,
                           limits=limits or snapshot.limits, image=snapshot.image, entrypoint=snapshot.entrypoint)
