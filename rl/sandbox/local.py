"""LocalSandbox: a container made of bubblewrap, overlayfs layers and one launcher per command.

A sandbox's root is a stack of read-only layers (rl/sandbox/layers.py) under a writable layer of its own, on a tmpfs
of `disk_mb`: the host's system folders (read-only binds) or a built image's system, the prepared task, then what the
episode writes. A fork of a prepared task is a new empty upper layer: it costs a mount, not a copy.

Identities, as docker's userns-remap gives them: every sandbox runs in user namespaces that map uids 0-65535 to the
image range on the host (ID_BASE onwards, shared with image builds), so that the image's files are root's inside and
nothing inside is the host's root. The agent is uid AGENT_UID with no capabilities: its work tree, HOME, /tmp and
/var/tmp are its own, the image's other files are root's and read-only to it. A host that is not root maps only its
own user (to AGENT_UID) and copies layers instead of stacking them.

The episode: a sandbox's agent commands share one set of namespaces (user, pid, network, ipc, uts, mount), held by a
keeper shell, the init of the episode's pid namespace, so that what one command leaves running in the background
serves the next. Each command is started by `mc-enter` (rl/sandbox/launcher.c): one process joins the sandbox's
cgroup, sets the rlimits, joins the episode's namespaces, takes the agent's uid, drops every capability, sets
no_new_privs and the seccomp filter, and execs the shell.

The verifier judges a frozen copy in a world of its own (`enter_verifier`): the episode is frozen, its writable layer
committed to a layer of the verifier's (links into private paths made to lead nowhere), thawed; the verifier's
overlay over it, its own user, network, ipc and uts namespaces, a pid and mount namespace per command (its shell the
init, not dumpable: its interpreters are execute-only copies its processes cannot read), its own cgroup, /logs and
/tests of the host's, and the ports the episode's services listen on published into its network (rl/sandbox/netns.py).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rl.sandbox.base import (
    AGENT_UID,
    BASE_ENV,
    HOME,
    ID_BASE,
    ID_RANGE,
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
from rl.sandbox.bwrap import bwrap_path, read_bwrap_info
from rl.sandbox.launcher import launcher_path
from rl.sandbox.layers import commit, materialize, mount_overlay, unmount, use_overlay
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
from rl.sandbox.netns import PortForward, VerifierNamespaces, in_netns, listening_ports
from rl.sandbox.owners import make_dir
from rl.sandbox.safe_tree import chown_tree, copy_into, copy_out, open_beneath, open_dir
from rl.sandbox.seccomp import filter_fd

NETWORKS = ("none", "public")  # an episode's network: loopback only, or the host's egress proxy (rl/sandbox/egress.py)
EGRESS_PORT = 3128  # where the egress proxy answers on an episode's loopback (HTTP_PROXY)
# The system folders of the host that stand in for an image where a task needs none; bound read-only.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# Folders every sandbox's root has, made where its layers lack them: (path, mode, the agent's). /var/tmp is a folder of
# its own, sticky like /tmp; /var itself is root's, so none of its entries can be swapped for a link by the agent.
AGENT_DIRS = (("app", 0o755, True), ("tmp", 0o1777, False), ("var", 0o755, False), ("var/tmp", 0o1777, False),
              ("var/log", 0o755, True), ("var/lib", 0o755, True), ("var/cache", 0o755, True),
              ("var/spool", 0o755, True), ("run", 0o755, True), ("logs", 0o755, True), ("logs/agent", 0o755, True),
              ("logs/verifier", 0o755, True), ("root", 0o700, True))
RESERVED_DESTS = ("/", "/proc", "/dev", "/sys", "/logs", "/opt/verifier")
# A container's /etc/hosts, the sandbox's own file (docker writes the same): what an entrypoint adds stays its own.
HOSTS_FILE = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tsandbox\n"
# How long an episode waits for the image's ENTRYPOINT to hand over to its command (`exec "$@"`); one that is still
# running then is the container's main process (a server) and keeps running, as in a container.
ENTRYPOINT_WAIT_S = 5.0
ENTRYPOINT_SETTLE_S = 10.0  # and at most this long for what it started to settle (its servers to listen)
# Readable by root only; masked where the host's /etc stands in.
MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")
SHM_BYTES = 64 * 1024 * 1024  # /dev/shm: a tmpfs of this size per episode (memory-backed)
# The verifier's root holds these capabilities in its own user namespace (docker's default set, without NET_RAW and
# MKNOD); never SYS_PTRACE or SYS_ADMIN.
VERIFIER_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
                 "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_SETFCAP", "CAP_AUDIT_WRITE")
# The interpreters a verifier's shell may be: bound as execute-only copies in its view, so that the shell (and any
# interpreter its scripts start) is not dumpable: nothing it runs can open its /proc/<pid>/mem, environ or fd.
VERIFIER_INTERPRETERS = ("/usr/bin/bash", "/bin/bash", "/usr/bin/dash", "/bin/dash", "/usr/bin/python3")
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
# The verifier's root nests the sandbox in the user namespace the host made for it (/opt/verifier/userns: the
# verifier's uids, itself their root) and runs the code as the agent's user, with no capability: the work tree is the
# agent's to write, nothing of root's is. Elsewhere (a host that is not root) it makes a user namespace of its own.
if [ "$(id -u)" = 0 ] && [ -e {judge_dir}/userns ] && exec 3<{judge_dir}/userns; then
  spaces=(--userns 3 --unshare-pid --unshare-ipc --unshare-net --unshare-uts --unshare-cgroup-try --cap-drop ALL
          --cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_SETPCAP)
  as_agent=(setpriv --reuid={agent} --regid={agent} --clear-groups --inh-caps=-all --bounding-set=-all --)
else
  spaces=(--unshare-all)
  as_agent=()
fi
[ -x "$bwrap" ] && "$bwrap" "${{spaces[@]}}" --die-with-parent --ro-bind / / /bin/sh -c : 2>/dev/null || {{
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
exec "$bwrap" "${{spaces[@]}}" --die-with-parent --new-session --ro-bind / / --bind /app /app --dev /dev \
  --proc /proc --size {tmp_bytes} --perms 1777 --tmpfs /tmp --size {tmp_bytes} --perms 1777 --tmpfs /var/tmp \
  --tmpfs /logs --tmpfs {judge_dir} "${{tests[@]}}" \
  --unsetenv MC_JUDGE_READS --chdir "$PWD" -- "${{as_agent[@]}}" "$@"
"""

# The episode's init: ignores every signal it can (an init takes from inside its namespace only the signals it
# handles, never SIGKILL or SIGSTOP), reaps what is orphaned to it, and exits when its input closes (the host closes it
# at the episode's end; the kernel does when the host process dies), whereupon the kernel kills everything left.
_KEEPER = ('trap "" HUP INT QUIT TERM USR1 USR2 PIPE ALRM TSTP TTIN TTOU; echo ready; exec >/dev/null; '
           'while read -r _; do :; done')


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[19])


@dataclass
class _Episode:
    launcher: subprocess.Popen  # mc-enter, whose child bubblewrap started the keeper
    keeper: int  # the keeper's host pid
    start: int  # and its start time: together they name it for mc-enter (--expect)
    keep_w: int  # the keeper's input: closing it ends the episode
    egress: socket.socket | None = None  # its listener for the egress proxy (network "public")

    def alive(self) -> bool:
        try:
            return self.launcher.poll() is None and _start_time(self.keeper) == self.start
        except (OSError, IndexError, ValueError):
            return False

    def processes(self) -> set[int]:
        """Host pids of what runs in the episode but its keeper (what the agent's commands left running)."""
        return set(process_tree(self.keeper)) - {self.keeper}


@dataclass
class _Verifier:
    """The verifier phase's host resources: its folder (a tmpfs), namespaces, cgroup and published ports."""

    root: Path
    network: str = "none"
    uid: int = 0  # its user inside its user namespace (root, as in Harbor)
    namespaces: VerifierNamespaces | None = None
    cgroup: SandboxCgroup | None = None
    ports: PortForward | None = None
    egress: socket.socket | None = None  # its listener for the egress proxy (network "public")
    interpreters: list[tuple[str, str]] = field(default_factory=list)  # (execute-only copy, path in the view)

    def close(self) -> None:
        for part in (self.egress, self.ports, self.namespaces, self.cgroup):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        for mount in ("root", "frozen", "tools/userns"):
            with contextlib.suppress(OSError):
                if os.path.ismount(self.root / mount) or mount == "tools/userns":
                    unmount(self.root / mount)
        force_rmtree(self.root)


def _kill_launcher(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def judge_script(bwrap: str, agent_uid: int = AGENT_UID) -> str:
    """The `judge` tool's text for a sandbox whose bubblewrap is at `bwrap` inside and whose agent is `agent_uid`."""
    return _JUDGE_SCRIPT.format(bwrap=shlex.quote(bwrap), tmp_bytes=JUDGE_TMP_MB << 20, judge_dir=JUDGE_DIR,
                                agent=int(agent_uid))


class UnisolatedWarning(UserWarning):
    pass


@dataclass
class LocalSnapshot:
    """A frozen sandbox: the layer stack (top first) every fork starts from. Its own top layer lives in `own` (removed
    by `discard`); the layers below it (an image's, a parent snapshot's) belong to others."""

    layers: tuple[Path, ...]
    workdir: str
    own: Path | None = None
    host_system: bool = True  # the host's system folders stand in for an image (the stack holds none)
    env: dict[str, str] = field(default_factory=dict)
    limits: SandboxLimits | None = None  # the task's limits, applied to every fork
    entrypoint: tuple[str, ...] = ()  # the image's ENTRYPOINT: every episode of a fork starts with it
    user: str | int | None = None  # the agent's user (the task's [agent].user; None: the sandbox's own)
    network: str = "none"  # the agent's network (the task's network_mode): "none" or "public"
    held: int | None = field(default=None, repr=False)  # its key in rl/sandbox/leftovers.py (a stop signal frees it)

    def discard(self) -> None:
        let_go(self.held)
        if self.own is not None:
            force_rmtree(self.own)


def probe_bwrap() -> tuple[str | None, str | None]:
    """("userns", None) when bubblewrap can make the sandbox's namespaces here, else (None, why it cannot); probed
    once per process, on the host's system folders alone (not the host's whole tree, whose mounts come and go)."""
    return _probe_bwrap(bwrap_path())


@functools.lru_cache(maxsize=4)
def _probe_bwrap(exe: str | None) -> tuple[str | None, str | None]:
    if exe is None:
        return None, ("bubblewrap (bwrap) is not installed; install it (apt-get install bubblewrap, "
                      "dnf install bubblewrap)")
    system = []
    for name in SYSTEM_DIRS:
        if os.path.islink(f"/{name}"):
            system += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            system += ["--ro-bind", f"/{name}", f"/{name}"]
    probe = [exe, "--unshare-all", "--die-with-parent", *system, "true"]
    kwargs = dict(user=ID_BASE, group=ID_BASE, extra_groups=[]) if os.geteuid() == 0 else {}
    try:
        res = subprocess.run(probe, capture_output=True, text=True, timeout=30, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"bwrap failed to start: {e}"
    if res.returncode == 0:
        return "userns", None
    return None, (f"bwrap cannot create namespaces here ({res.stderr.strip()}); enable user namespaces "
                  "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces) or use a container backend")


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate commands on this machine, or None when it can."""
    return probe_bwrap()[1]


def _choose(what: str, wanted: bool | None, problem) -> bool:
    """Use the kernel's mechanism `what` when wanted (True: required) and available; False: the monitor."""
    if wanted is False or problem is None:
        return False
    why = problem()
    if why is not None and wanted:
        raise SandboxError(f"LocalSandbox({what}=True): {why}")
    return why is None


def _check_traversable(path: Path) -> None:
    """The sandbox's users must be able to reach its folders through every parent."""
    for parent in path.resolve().parents:
        if not os.stat(parent).st_mode & 0o001:
            raise SandboxError(f"sandbox directories under {path.parent} are unreachable for the sandbox's users "
                               f"({parent} is not world-searchable); choose another root_parent")


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


def _exec_only_copy(source: str) -> str | None:
    """An execute-only copy (mode 0111) of the binary `source` (a host path), owned by this host user, in the
    launcher's cache, named by its content. A process that runs it cannot read it, so the kernel makes it not
    dumpable: its memory, environment and descriptors are closed to processes of its own uid."""
    try:
        st = os.stat(source)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    key = (source, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    found = _EXEC_ONLY.get(key)
    if found and os.path.exists(found):
        return found
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:24]
    folder = Path(launcher_path()).parent / "exec-only"
    folder.mkdir(exist_ok=True)
    os.chmod(folder, 0o711)
    target = folder / f"{digest}-{os.path.basename(source)}"
    if not target.exists():
        tmp = folder / f".{target.name}.{os.getpid()}"
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o111)
        os.replace(tmp, target)
    _EXEC_ONLY[key] = str(target)
    return str(target)


_EXEC_ONLY: dict[tuple, str] = {}


class LocalSandbox(Sandbox):
    """A sandbox of layers: `layers` (top first; a snapshot's, or an image's) under a writable layer of its own, and
    `tree` (a host folder) put at /app. `image` is a built image (rl/sandbox/image.py Image, or its layers): the
    sandbox runs on its system instead of the host's.

    `unisolated=True` runs commands as plain subprocesses of this host user with rlimits only: no namespaces,
    the task tree at its host path rather than /app. Only for machines without bubblewrap and trusted code.
    `cgroups` and `tmpfs` choose how whole-sandbox limits are enforced (rl/sandbox/limits.py): None uses the
    kernel's cgroup / a tmpfs of the sandbox's own where the host allows, else the polling monitor; False
    always uses the monitor; True requires the kernel's mechanism.
    """

    needs_bwrap = True
    provides_judge = True  # the verifier phase has /opt/verifier/bin/judge (a nested bubblewrap sandbox)

    def __init__(self, tree: str | Path | None = None, *, workdir: str = "/app", env: dict[str, str] | None = None,
                 limits: SandboxLimits | None = None, root_parent: str | Path | None = None,
                 unisolated: bool = False, extra_ro_binds: tuple[str, ...] = (), cgroups: bool | None = None,
                 tmpfs: bool | None = None, image=None, entrypoint: tuple[str, ...] = (),
                 layers: Sequence[Path] = (), host_system: bool | None = None, fresh: bool = True,
                 user: str | int | None = None, network: str = "none", egress=None):
        self.limits = limits or SandboxLimits()
        self.limits.validate()
        self.entrypoint = tuple(entrypoint)
        self.unisolated = unisolated
        self.env = dict(env or {})
        self.extra_ro_binds = tuple(extra_ro_binds)
        image_layers = tuple(getattr(image, "layers", image or ()))
        if image_layers and unisolated:
            raise SandboxError("an unisolated sandbox runs on the host's system; it cannot run on a built image")
        self.layers = tuple(Path(p) for p in layers) + tuple(Path(p) for p in image_layers)
        self.host_system = (not image_layers) if host_system is None else host_system
        self.image = image_layers or None
        if not (workdir == "/app" or workdir.startswith("/app/")) and self.host_system:
            raise SandboxError(f"LocalSandbox keeps the task tree at /app; workdir {workdir!r} must be under it (a "
                               "task whose work tree is elsewhere runs on its image)")
        self._closed = False
        self._bwrap = bwrap_path()
        if not unisolated and self.needs_bwrap:
            mode, problem = probe_bwrap()
            if problem or self._bwrap is None:
                raise SandboxError(f"LocalSandbox refuses to run without isolation: {problem or 'bwrap missing'}. "
                                   "Pass unisolated=True only for trusted code (no isolation at all).")
            self._launcher = launcher_path()
        elif unisolated:
            warnings.warn("LocalSandbox(unisolated=True): COMMANDS RUN WITHOUT ANY ISOLATION as this host user; only "
                          "rlimits and timeouts apply. Never use this for model-generated code.",
                          UnisolatedWarning, stacklevel=2)
        self.root_user = os.geteuid() == 0
        if network not in NETWORKS:
            raise SandboxError(f"LocalSandbox(network={network!r}): one of {list(NETWORKS)}")
        if network == "public" and egress is None:
            raise SandboxError("LocalSandbox(network='public') needs the run's egress proxy (egress=, or a callable "
                               "that gives it)")
        self.network, self._egress = network, egress
        self._user = user
        self.agent_uid, self.agent_gid, self.home = AGENT_UID, AGENT_UID, HOME  # settled once the root is built
        # host uid:gid of the agent, and of root inside (on a root host: the image range; else this host user)
        self.agent_ids = (ID_BASE + AGENT_UID,) * 2 if self.root_user and not unisolated else (os.geteuid(),) * 2
        self.root_ids = (ID_BASE,) * 2 if self.root_user and not unisolated else (os.geteuid(),) * 2
        self.uids = {self.agent_ids[0], self.root_ids[0]}  # the host uids its processes run as
        self._overlay = not unisolated and self.needs_bwrap and use_overlay()
        self._tmpfs = _choose("tmpfs", tmpfs, None if unisolated else tmpfs_problem)
        self.root = make_dir("sandbox", root_parent)
        self._cgroup: SandboxCgroup | None = None
        self._verifier: _Verifier | None = None
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
            os.chmod(self.root, 0o711)  # the sandbox's users traverse it to reach their root
            if self.root_user and not unisolated:
                _check_traversable(self.root)
            self._mount_root(self.root)
            self._settle_user(user)
            if fresh:
                self._make_agent_dirs(workdir)
            hosts = self.root / "hosts"
            hosts.write_text(HOSTS_FILE)
            os.chown(hosts, *self.agent_ids)
            if tree is not None:
                try:
                    copy_into(tree, self.fs_root, "/app", owner=self.agent_ids, merge=True)
                except SandboxError as e:
                    if self._tmpfs and fs_full(self.root):
                        raise SandboxError(f"the task tree {tree} does not fit the sandbox's disk limit "
                                           f"({self.limits.disk_mb} MB, {self.limits.max_files} files)") from None
                    raise e
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
        self.tree_root = str(self.fs_root / "app") if unisolated else "/app"

    # The filesystem ----------------------------------------------------------------------------------------------
    @property
    def fs_root(self) -> Path:
        """The sandbox's root as the host sees it (the merged overlay, or the materialized copy)."""
        return self.root / "root"

    @property
    def _upper(self) -> Path:
        """What the sandbox wrote: its overlay's upper layer, or (copies) its whole root."""
        return self.root / "upper" if self._overlay else self.fs_root

    def _mount_root(self, folder: Path) -> None:
        """The layer stack under a writable layer in `folder`: an overlay at folder/root (upper and work beside it),
        or the stack copied into folder/root."""
        root = folder / "root"
        root.mkdir()
        if self._overlay:
            for name in ("upper", "work"):
                (folder / name).mkdir()
            os.chown(folder / "upper", *self.root_ids)
            os.chmod(folder / "upper", 0o755)
            lowers = list(self.layers)
            if not lowers:  # overlayfs needs one lower layer: an empty one
                (folder / "empty").mkdir()
                os.chown(folder / "empty", *self.root_ids)
                os.chmod(folder / "empty", 0o755)
                lowers = [folder / "empty"]
            try:
                mount_overlay(lowers, root, folder / "upper", folder / "work")
            except OSError as e:
                raise SandboxError(f"cannot stack the sandbox's layers: {e}") from None
        else:
            if self.layers:
                materialize(self.layers, root)
            os.chown(root, *self.root_ids)
            os.chmod(root, 0o755)

    def _make_agent_dirs(self, workdir: str) -> None:
        """A fresh sandbox's own folders (AGENT_DIRS), made where its layers lack them (never through a link), the
        agent's given to it, with its work tree and HOME and all they hold; where the host's system stands in, the
        places its folders are bound to (and its links among them, /bin -> usr/bin)."""
        if self.host_system:
            fd = os.open(self.fs_root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for name in SYSTEM_DIRS + ("proc", "dev", "sys"):
                    host = f"/{name}"
                    with contextlib.suppress(FileExistsError):
                        if os.path.islink(host):
                            os.symlink(os.readlink(host), name, dir_fd=fd)
                            os.chown(name, *self.root_ids, dir_fd=fd, follow_symlinks=False)
                        elif os.path.isdir(host) or name in ("proc", "dev", "sys"):
                            os.mkdir(name, 0o755, dir_fd=fd)
                            os.chown(name, *self.root_ids, dir_fd=fd)
            finally:
                os.close(fd)
        for rel, mode, agents in AGENT_DIRS:
            parts = rel.split("/")
            parent = open_dir(self.fs_root, "/".join(parts[:-1]))
            try:
                try:
                    fd = open_beneath(parent, parts[-1], os.O_RDONLY | os.O_DIRECTORY)
                except OSError as e:
                    if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        raise
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(parts[-1], dir_fd=parent)
                    os.mkdir(parts[-1], mode, dir_fd=parent)
                    fd = open_beneath(parent, parts[-1], os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fchown(fd, *(self.agent_ids if agents else self.root_ids))
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
            finally:
                os.close(parent)
        for path in dict.fromkeys(["/app", self.home, "/logs", workdir]):
            os.close(open_dir(self.fs_root, path, make=True, owner=self.root_ids))  # made as root's, if missing
            chown_tree(self.fs_root, path, *self.agent_ids)

    def _settle_user(self, user: str | int | None) -> None:
        """The agent's uid, gid and HOME: AGENT_UID and /root, or a user of the image's /etc/passwd (by name or uid).
        Root is not given to the agent: the verifier runs on the image's system, which the agent must not change
        (the sandbox's own user stands in for it)."""
        if user is None or user in ("root", 0, "0"):
            return
        entries = {}
        text = self.read_file("/etc/passwd", 1 << 20) if not self.host_system else None
        for line in (text or b"").decode(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) >= 7 and fields[2].isdigit() and fields[3].isdigit():
                entries[fields[0]] = (int(fields[2]), int(fields[3]), fields[5] or "/")
        if isinstance(user, int) or str(user).isdigit():
            uid = int(user)
            found = next((e for e in entries.values() if e[0] == uid), (uid, uid, HOME))
        elif user in entries:
            found = entries[user]
        else:
            raise SandboxError(f"the task's user {user!r} is not in its image's /etc/passwd: name a user the image "
                               "has (its Dockerfile's useradd) or a uid")
        if not 0 < found[0] < ID_RANGE or not 0 <= found[1] < ID_RANGE:
            raise SandboxError(f"the task's user {user!r} has uid {found[0]}: a sandbox's users are 1-{ID_RANGE - 1}")
        self.agent_uid, self.agent_gid, self.home = found
        if self.root_user and not self.unisolated:
            self.agent_ids = (ID_BASE + self.agent_uid, ID_BASE + self.agent_gid)

    @property
    def whole_sandbox_limits(self) -> dict[str, str]:
        """How memory and disk are limited for this sandbox: 'cgroup'/'tmpfs' (kernel) or 'monitor'."""
        return {"memory": "cgroup" if self._cgroup else "monitor", "disk": "tmpfs" if self._tmpfs else "monitor"}

    @property
    def app_dir(self) -> Path:
        return self.fs_root / "app"

    def host_path(self, sandbox_path: str) -> Path:
        """Host location of a path in the sandbox's own root (for an unisolated sandbox, where commands see host
        paths). Do not write through it: it may hold the agent's links; use copy_in."""
        rel = os.path.normpath(sandbox_path).lstrip("/")
        if rel.startswith(".."):
            raise SandboxError(f"{sandbox_path} is not inside the sandbox")
        return self.fs_root / rel

    def _view(self) -> tuple[Path, dict[str, Path]]:
        """The root commands see now and the host folders bound over parts of it."""
        if self._verifier is not None:
            v = self._verifier.root
            return v / "root", {"/logs": v / "logs", "/tests": v / "tests"}
        return self.fs_root, {}

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        """Read on the host from the sandbox's root, one component at a time and never through a link or onto
        another mount, without blocking on a FIFO; see Sandbox.read_file."""
        if not path.startswith("/") or ".." in Path(path).parts:
            raise SandboxError(f"{path} is not an absolute path inside the sandbox")
        root, binds = self._view()
        for dest, host in binds.items():
            if path.startswith(dest + "/"):
                root, path = host, path[len(dest):]
        parts = path.strip("/").split("/")
        try:
            parent = open_dir(root, "/".join(parts[:-1]))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SandboxError(f"{path} cannot be read: {_why(e)}") from None
        try:
            inner = open_beneath(parent, parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SandboxError(f"{path} cannot be read: {_why(e)}") from None
        finally:
            os.close(parent)
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

    def copy_in(self, host_path: str | Path, dest: str, merge: bool = False) -> None:
        """Put a host file or folder at `dest`: into the root commands see (the agent's, given to the agent; the
        verifier's, given to its root), never through a link the sandbox holds."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        if not dest.startswith("/") or ".." in Path(dest).parts:
            raise SandboxError(f"copy_in destination must be an absolute path without '..', got {dest!r}")
        top = "/" + dest.strip("/").split("/")[0]
        if dest.rstrip("/") in RESERVED_DESTS or top in ("/proc", "/dev", "/sys") or (
                self.host_system and top.lstrip("/") in SYSTEM_DIRS):
            raise SandboxError(f"cannot copy into system path {dest}")
        root, binds = self._view()
        owner = self.agent_ids if self._verifier is None else self.root_ids
        for prefix, host in binds.items():
            if dest == prefix or dest.startswith(prefix + "/"):
                root, dest = host, dest[len(prefix):] or "/"
        copy_into(host_path, root, dest, owner=owner, merge=merge)

    # Commands -----------------------------------------------------------------------------------------------------
    def _rlimit_args(self) -> list[str]:
        lim = self.limits
        nproc = lim.max_processes
        if not self.root_user:
            nproc += _processes_of(os.geteuid())  # RLIMIT_NPROC counts all of this user's processes
        mb = 1024 * 1024
        # CPU: soft limit sends SIGXCPU (reported by name), the hard limit one second later kills. Memory is the
        # cgroup's (or the monitor's) for the whole sandbox, never a per-process address-space limit.
        out = []
        for spec in (f"cpu={lim.cpu_time_s}:{lim.cpu_time_s + 1}", f"nproc={nproc}:{nproc}",
                     f"fsize={lim.max_file_mb * mb}:{lim.max_file_mb * mb}",
                     f"nofile={lim.max_open_files}:{lim.max_open_files}", "core=0:0"):
            out += ["--rlimit", spec]
        return out

    def _cgroup_args(self, cgroup: SandboxCgroup | None) -> list[str]:
        return [a for f in (cgroup.procs_files() if cgroup else []) for a in ("--cgroup", f)]

    def _system_binds(self) -> list[str]:
        """bubblewrap's options that put the host's system folders (read-only, secrets masked) into a root that has
        no system of its own."""
        if not self.host_system:
            return []
        argv = []
        for name in SYSTEM_DIRS:  # the links among them (/bin -> usr/bin) are in the root already
            host = f"/{name}"
            if os.path.isdir(host) and not os.path.islink(host):
                argv += ["--ro-bind", host, host]
        for path in MASKED_FILES:
            if os.path.exists(path):
                argv += ["--ro-bind", "/dev/null", path]
        for host in self.extra_ro_binds:
            argv += ["--ro-bind", host, host]
        return argv

    def _start_episode(self) -> None:
        """Start the episode's keeper (see _KEEPER): bubblewrap with every namespace new and the sandbox's root, its
        shell as pid 1, as the agent. The host maps the user namespace (uids 0-65535 to the image range on a root
        host; else this host user to the agent) while bubblewrap waits."""
        block_r, block_w = os.pipe()
        info_r, info_w = os.pipe()
        keep_r, keep_w = os.pipe()
        seccomp_fd = filter_fd()
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--userns-block-fd", str(block_r), "--info-fd",
                str(info_w), "--as-pid-1", "--die-with-parent", "--clearenv", "--setenv", "PATH", BASE_ENV["PATH"],
                "--hostname", "sandbox", "--bind", str(self.fs_root), "/", *self._system_binds(),
                "--bind", str(self.root / "hosts"), "/etc/hosts", "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        if self.root_user:  # root inside becomes the agent, with no capability left
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP", "--chdir", "/",
                     "--", "setpriv", f"--reuid={self.agent_uid}", f"--regid={self.agent_gid}", "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all", "--"]
        else:
            argv += ["--chdir", "/", "--"]
        argv += ["bash", "--noprofile", "--norc", "-c", _KEEPER]
        launch = [self._launcher, *self._cgroup_args(self._cgroup)]
        if self.root_user:
            launch += ["--uid", str(ID_BASE), "--gid", str(ID_BASE)]
        passed = [fd for fd in (block_r, info_w, seccomp_fd) if fd is not None]
        try:
            proc = subprocess.Popen([*launch, "--", *argv], stdin=keep_r, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env={"PATH": BASE_ENV["PATH"]}, start_new_session=True,
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
            mapping = f"0 {ID_BASE} {ID_RANGE}\n" if self.root_user else f"{self.agent_uid} {os.geteuid()} 1\n"
            writes = [("uid_map", mapping), ("gid_map", mapping)]
            if not self.root_user:
                writes.insert(0, ("setgroups", "deny"))
            for name, text in writes:
                with open(f"/proc/{keeper}/{name}", "w") as f:
                    f.write(text)
            os.write(block_w, b"1")
            # bwrap builds the filesystem after it names its child: the keeper says when it runs on it.
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            if not ready or proc.stdout.read(6) != b"ready\n":
                raise SandboxError("the episode's init did not start")
            start = _start_time(keeper)
            with contextlib.suppress(OSError):  # the OOM killer takes the sandbox's other processes, not its init
                with open(f"/proc/{keeper}/oom_score_adj", "w") as f:
                    f.write("-1000")
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
        self._episode = _Episode(proc, keeper, start, keep_w)
        self._open_low_ports(keeper)

    def _open_low_ports(self, keeper: int) -> None:
        """Let the episode's processes listen on ports below 1024 in its own network namespace (a server the
        task's image starts on port 80), as docker sets up every container (net.ipv4.ip_unprivileged_port_start).
        Only a root host can set it for them; elsewhere low ports stay closed, as docs/SANDBOX.md says."""
        if not self.root_user:
            return
        res = subprocess.run(["nsenter", "-t", str(keeper), "--net", "sh", "-c",
                              "echo 0 > /proc/sys/net/ipv4/ip_unprivileged_port_start"],
                             capture_output=True, text=True, env={"PATH": BASE_ENV["PATH"]}, timeout=30)
        if res.returncode != 0:
            self.end_episode()
            raise SandboxError(f"cannot open the episode's ports below 1024: {res.stderr.strip()[:200]}")

    def _start_container(self) -> None:
        """A new episode, started as a container starts: its namespaces (with the egress proxy on its loopback where
        the task declares the network), then the image's ENTRYPOINT (if any) with the image's environment."""
        self._start_episode()
        if self.network == "public":
            self._episode.egress = self._serve_egress(f"/proc/{self._episode.keeper}/ns/net", "agent")
        if self.entrypoint:
            self._run_entrypoint({**BASE_ENV, **self.env})

    def _run_entrypoint(self, env: dict[str, str]) -> None:
        """Start the episode as a container starts: the image's ENTRYPOINT with a command that says it was reached
        (Harbor and Terminal-Bench give the main container `sh -c 'sleep infinity'`). What it starts in the
        background serves the episode; an entrypoint that fails first is a one-line error with its log."""
        marker = f"/run/.mc-entrypoint-{secrets.token_hex(4)}"
        log = f"/run/.mc-entrypoint-{secrets.token_hex(4)}.log"
        argv = shlex.join([*self.entrypoint, "sh", "-c", f"touch {marker}"])
        script = (f"{argv} </dev/null >>{log} 2>&1 & pid=$!; end=$((SECONDS + "
                  f"{int(ENTRYPOINT_WAIT_S)})); while [ ! -e {marker} ] && [ $SECONDS -lt $end ]; do "
                  f"kill -0 $pid 2>/dev/null || {{ wait $pid; s=$?; [ -e {marker} ] && break; [ $s = 0 ] && break; "
                  f"echo \"exited with status $s $(tail -n 1 {log})\"; exit 3; }}; sleep 0.02; done; "
                  f"rm -f {marker}")
        res = self._exec_episode(script, self.workdir, env, ENTRYPOINT_WAIT_S + 60, None)
        if res.exit_code != 0:
            self.end_episode()
            last = res.output.strip().splitlines()[-1:] or [res.describe()]
            raise SandboxError(f"the image's ENTRYPOINT {list(self.entrypoint)} failed before its command ran: "
                               f"{last[0].strip()[:200]} (its log: {log} in the sandbox)")
        self._settle(ENTRYPOINT_SETTLE_S)

    def _settle(self, limit_s: float) -> None:
        """Wait until what the entrypoint left running has settled: every process of the episode asleep (a server in
        accept, not still starting) on three looks in a row, or `limit_s` passed. A container is up a while before
        an agent reaches it (Harbor sets the agent up); an episode here is reached at once, and its first command must
        not find the entrypoint's server still starting."""
        deadline, quiet = time.monotonic() + limit_s, 0
        while quiet < 3 and time.monotonic() < deadline:
            states = []
            for pid in self._episode.processes() if self._episode else ():
                try:
                    with open(f"/proc/{pid}/stat", "rb") as f:
                        states.append(f.read().rsplit(b")", 1)[1].split()[0])
                except OSError:
                    continue
            quiet = quiet + 1 if all(state in (b"S", b"T", b"t", b"Z", b"I") for state in states) else 0
            time.sleep(0.05)

    def end_episode(self) -> int | None:
        """Kill what the episode's commands left running (by killing its keeper, the init of its pid namespace)
        and return how many processes that was; the next agent command starts a new episode."""
        episode, self._episode = self._episode, None
        if episode is None:
            return 0
        left = len(episode.processes())
        if self._cgroup is not None:
            self._cgroup.thaw()  # a frozen process takes no signal
        if episode.egress is not None:
            episode.egress.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(episode.keeper, signal.SIGKILL)
        os.close(episode.keep_w)
        _kill_launcher(episode.launcher)
        return left

    def _monitor(self, cgroup: SandboxCgroup | None):
        """watch(pid) for run_process: the polling fallback for the limits the kernel does not enforce here."""
        if cgroup is not None and self._tmpfs:
            return None
        lim = self.limits
        dirs = self._writable_host_dirs()
        # files held open show the device of the overlay they were opened through, not their upper layer's
        roots = [self.fs_root] + ([self._verifier.root / "root"] if self._verifier else [])
        devices = {os.stat(d).st_dev for d in dirs + [str(r) for r in roots if r.exists()]}
        # Only growth past a limit stops a command, so cleanup can run in a sandbox that is already full.
        size0, files0 = (0, 0) if self._tmpfs else dir_usage(dirs)

        def watch(pid: int):
            pids = process_tree(pid) + (list(self._episode.processes()) if self._episode else [])
            shm, unlinked = held_files(pids, devices)
            if cgroup is None:
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

    def _writable_host_dirs(self) -> list[str]:
        """What the commands of the phase write: the episode's layer, or the verifier's own."""
        if self._verifier is None:
            return [str(self._upper)]
        v = self._verifier.root
        return [str(v / ("upper" if self._overlay else "root")), str(v / "logs"), str(v / "tests")]

    def exec(self, command: str, *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        timeout = self.limits.command_timeout_s if timeout is None else timeout
        full_env = {**BASE_ENV, "HOME": self.home, **self._network_env(), **self.env, **(env or {})}
        if self._verifier is not None:
            full_env.update(VERIFIER_ENV)
        cgroup = self._verifier.cgroup if self._verifier is not None else self._cgroup
        ooms = cgroup.oom_kills() if cgroup else 0
        forks = cgroup.process_limit_hits() if cgroup else 0
        if self.unisolated:
            full_env["HOME"] = str(self.fs_root / HOME.lstrip("/"))
            argv = [*self._rlimit_prlimit(), "bash", "--noprofile", "--norc", "-c", command]
            res = run_process(argv, timeout=timeout, max_output=self.limits.max_output_bytes, stdin=stdin,
                              cwd=cwd or self.workdir, env=full_env, watch=self._monitor(None))
        elif not self.needs_bwrap:  # another runtime's launcher (apptainer): each command on its own
            res = run_process(self._command_argv(command, cwd or self.workdir, full_env), timeout=timeout,
                              max_output=self.limits.max_output_bytes, stdin=stdin, env={"PATH": BASE_ENV["PATH"]},
                              watch=self._monitor(cgroup))
        elif self._verifier is not None:
            res = self._exec_verifier(command, cwd or self.workdir, full_env, timeout, stdin)
        else:
            res = self._exec_episode(command, cwd or self.workdir, full_env, timeout, stdin)
        if cgroup is not None:
            killed = cgroup.oom_kills() - ooms
            if killed > 0:
                res.memory_exceeded = True
                res.events.append(f"memory limit exceeded: the sandbox's processes passed {self.limits.memory_mb} MB "
                                  f"together; the kernel killed {killed} of them")
            if cgroup.process_limit_hits() > forks:
                res.events.append(f"process limit reached ({self.limits.max_processes} processes)")
        if not res.disk_exceeded:
            event = self._disk_event()
            if event:
                res.disk_exceeded = True
                res.events.append(event)
        note_limits(res, self.limits, processes=cgroup is None)  # the process limit: the kernel counts it if it can
        if self._verifier is None and self._episode is not None and any(
                e.startswith("process limit reached") for e in res.events):
            # a fork bomb's detached processes would hold the limit for every later agent command
            res.events.append(f"{self.end_episode()} background process(es) were ended to free the process limit")
        return res

    def _command_argv(self, command: str, cwd: str, env: dict[str, str]) -> list[str]:
        """argv of one command for a subclass whose runtime is not bubblewrap (needs_bwrap = False)."""
        raise NotImplementedError

    def _rlimit_prlimit(self) -> list[str]:
        """The rlimits as a prlimit prefix (the unisolated mode, which has no launcher)."""
        args = self._rlimit_args()
        out = ["prlimit"]
        for spec in args[1::2]:
            name, _, value = spec.partition("=")
            out.append(f"--{name}={value}")
        return out + ["--"]

    def _exec_episode(self, command: str, cwd: str, env: dict[str, str], timeout: float,
                      stdin: bytes | None) -> ExecResult:
        events = []
        episode = self._episode
        if episode is not None and not episode.alive():
            self.end_episode()
            events.append("the sandbox's init was killed (memory?); its background processes ended")
        if self._episode is None:
            self._start_container()
        before = self._episode.processes()
        seccomp_fd = filter_fd()
        argv = [self._launcher, *self._cgroup_args(self._cgroup), *self._rlimit_args(),
                "--ns", str(self._episode.keeper), "--expect", f"{self._episode.keeper}:{self._episode.start}",
                "--uid", str(self.agent_uid), "--gid", str(self.agent_gid), "--chdir", cwd]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        argv += ["--", "bash", "--noprofile", "--norc", "-c", command]
        try:
            res = run_process(argv, timeout=timeout, max_output=self.limits.max_output_bytes, stdin=stdin, env=env,
                              watch=self._monitor(self._cgroup), background=True,
                              pass_fds=() if seccomp_fd is None else (seccomp_fd,))
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        if self._episode is not None:
            if res.memory_exceeded and self._cgroup is None:  # the monitor counts the episode's processes too
                events.append(f"{self.end_episode()} background process(es) ended with it")
            else:
                res.background_processes = len(self._episode.processes() - before)
                if res.background_processes:
                    events.append(f"{res.background_processes} process(es) it started keep running in the "
                                  "background until the episode ends")
        res.events = events + res.events
        return res

    def _exec_verifier(self, command: str, cwd: str, env: dict[str, str], timeout: float,
                       stdin: bytes | None) -> ExecResult:
        """A verifier command: its own pid and mount namespace (its shell the init, so nothing it starts outlives
        it), in the verifier's user, network, ipc and uts namespaces, as the verifier's root."""
        v = self._verifier
        seccomp_fd = filter_fd()
        launch = [self._launcher, *self._cgroup_args(v.cgroup), *self._rlimit_args()]
        if v.namespaces is not None:
            launch += [*v.namespaces.enter_argv(), "--uid", "0", "--gid", "0", "--keep-caps"]
            spaces = ["--unshare-pid", "--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL"]
            for cap in VERIFIER_CAPS:
                spaces += ["--cap-add", cap]
        else:  # a host that is not root: the episode's user and network, a user namespace of its own inside
            episode = self._episode
            launch += ["--keep-caps"]
            if episode is not None:
                launch += ["--expect", f"{episode.keeper}:{episode.start}", "--ns-file",
                           f"user=/proc/{episode.keeper}/ns/user", "--ns-file", f"net=/proc/{episode.keeper}/ns/net"]
                spaces = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                          "--uid", str(self.agent_uid), "--gid", str(self.agent_gid)]
            else:
                spaces = ["--unshare-all", "--uid", str(self.agent_uid), "--gid", str(self.agent_gid)]
        argv = [self._bwrap, *spaces, "--as-pid-1", "--die-with-parent", "--new-session", "--hostname", "sandbox",
                "--bind", str(v.root / "root"), "/", *self._system_binds(),
                "--ro-bind", str(v.root / "hosts"), "/etc/hosts", "--bind", str(v.root / "logs"), "/logs",
                "--bind", str(v.root / "tests"), "/tests", "--ro-bind", str(v.root / "tools"), JUDGE_DIR,
                "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs",
                "/dev/shm"]
        for copy, path in v.interpreters:
            argv += ["--ro-bind", copy, path]
        argv += ["--clearenv"]
        for k, val in env.items():
            argv += ["--setenv", k, val]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        as_user = [] if v.uid == 0 or v.namespaces is None else [
            "setpriv", f"--reuid={v.uid}", f"--regid={v.uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]
        argv += ["--chdir", cwd, "--", *as_user, "bash", "--noprofile", "--norc", "-c", command]
        try:
            res = run_process([*launch, "--", *argv], timeout=timeout, max_output=self.limits.max_output_bytes,
                              stdin=stdin, env={"PATH": BASE_ENV["PATH"]}, watch=self._monitor(v.cgroup),
                              pass_fds=() if seccomp_fd is None else (seccomp_fd,))
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        conflicts = v.ports.conflicts() if v.ports is not None else []
        if conflicts:
            names = ", ".join(f"{proto} {port}" for proto, port in conflicts)
            res.void = (f"the episode's service on {names} answered the verifier, which listens there itself: what "
                        "it got may have been the episode's, not its own")
            res.events.append(res.void)
        return res

    def _disk_event(self) -> str | None:
        """Why the sandbox's disk is over its limit after a command, or None (tmpfs: it is full)."""
        lim = self.limits
        if self._tmpfs:
            for root in [self._verifier.root if self._verifier else self.root]:  # the phase's own disk
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

    # The verifier phase -------------------------------------------------------------------------------------------
    def _freeze(self) -> list[int]:
        """Stop every process of the episode where it stands: its cgroup's freezer, else SIGSTOP to each. Returns
        the pids stopped by signal (to continue by `_thaw`)."""
        if self._episode is None:
            return []
        if self._cgroup is not None and self._cgroup.freeze():
            return []
        pids = [self._episode.keeper, *self._episode.processes()]
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        return pids

    def _thaw(self, stopped: list[int]) -> None:
        if self._cgroup is not None:
            self._cgroup.thaw()
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)

    def enter_verifier(self, services: bool = True, *, separate: bool = False, artifacts: Sequence[str] = (),
                       network: str = "none", user: str | int | None = None) -> None:
        """The verifier phase: the episode frozen, what it wrote committed to a layer of the verifier's own, the
        episode thawed (its services go on for the verifier, unless services=False ends them first); the verifier
        gets its overlay over that layer, its own namespaces and cgroup, fresh /logs (with an empty /logs/verifier)
        and /tests of the host's, a read-only /etc/hosts, and the episode's listening ports published into its
        network. Each call starts the phase afresh.

        `separate` (Harbor's environment_mode = "separate"): the verifier's root is the prepared task alone (a fresh
        sandbox of the image), with only `artifacts` (paths the agent wrote: regular files and the folders of them,
        never links) copied over, and no process of the episode's published. `network`: "public" gives the verifier
        the run's egress proxy. `user`: the verifier's user (root by default, as in Harbor)."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        if network not in NETWORKS or (network == "public" and self._egress is None):
            raise SandboxError(f"the verifier's network {network!r}: one of {list(NETWORKS)}, and 'public' needs "
                               "the run's egress proxy")
        if not services:
            self.end_episode()
        self._drop_verifier()
        if services and not separate and self.entrypoint and self.needs_bwrap and not self.unisolated \
                and self._episode is None:
            self._start_container()  # the container was up before the verifier came, with what its entrypoint started
        folder = make_dir("verifier", self.root.parent)
        verifier = _Verifier(folder, network=network, uid=self._verifier_uid(user))
        self._verifier = verifier
        try:
            if self._tmpfs and self._overlay:
                mount_tmpfs(folder, self.limits.disk_mb, self.limits.max_files)
                # the frozen episode on a tmpfs of its own: what the agent wrote does not fill the verifier's disk
                (folder / "frozen").mkdir()
                mount_tmpfs(folder / "frozen", self.limits.disk_mb + 16, self.limits.max_files + 1024)
            elif self._tmpfs:  # copies: the verifier writes into its copy of the episode, with room for both
                mount_tmpfs(folder, 2 * self.limits.disk_mb + 16, 2 * self.limits.max_files + 1024)
            os.chmod(folder, 0o711)
            stopped = self._freeze()
            try:
                ports = listening_ports(self._episode.keeper) if self._episode and not separate else []
                if separate:
                    frozen = folder / "frozen"
                    frozen.mkdir(exist_ok=True)
                    for path in artifacts:
                        copy_out(self.fs_root, path, frozen)
                else:
                    frozen = commit(self._upper, folder / "frozen", view=self.fs_root)
                hosts = _verifier_hosts((self.root / "hosts").read_text(errors="replace"))
            finally:
                self._thaw(stopped)
            root = folder / "root"
            if self._overlay:
                root.mkdir()
                for name in ("upper", "work"):
                    (folder / name).mkdir()
                os.chown(folder / "upper", *self.root_ids)
                os.chmod(folder / "upper", 0o755)
                mount_overlay([frozen, *self.layers], root, folder / "upper", folder / "work")
            elif separate:  # copies: the prepared task's layers, then the artifacts over them
                materialize([frozen, *self.layers], root)
            else:
                os.rename(frozen, root)
            for name in ("logs", "tests", "tools"):
                (folder / name).mkdir()
            (folder / "logs" / "verifier").mkdir()
            (folder / "logs" / "agent").mkdir()
            for path in (folder / "logs", folder / "logs" / "verifier", folder / "logs" / "agent", folder / "tests"):
                os.chown(path, *self.root_ids)
                os.chmod(path, 0o755)
            (folder / "hosts").write_text(hosts)
            if self.provides_judge:
                (folder / "tools" / "bin").mkdir()
                (folder / "tools" / "bin" / "judge").write_text(judge_script(self._inner_bwrap(), self.agent_uid))
                for path in (folder / "tools", folder / "tools" / "bin", folder / "tools" / "bin" / "judge"):
                    os.chmod(path, 0o755)  # the host's, read-only to the verifier and what it runs
                (folder / "tools" / "userns").touch()  # where the judge's user namespace is bound
            if not self.needs_bwrap or self.unisolated:
                return
            verifier.interpreters = self._interpreters(root)
            if self.root_user:
                verifier.namespaces = VerifierNamespaces(ID_BASE).start()
                if self.provides_judge:  # where judge nests the code under test
                    verifier.namespaces.bind_judge_userns(folder / "tools" / "userns")
                if ports:
                    verifier.ports = PortForward(verifier.namespaces.net, verifier.namespaces.pid,
                                                 f"/proc/{self._episode.keeper}/ns/net", ports).start()
                if network == "public":
                    verifier.egress = self._serve_egress(verifier.namespaces.net, "verifier")
            if self._cgroup is not None:
                verifier.cgroup = SandboxCgroup(self._cgroup.parents, folder.name, self.limits.memory_mb,
                                                self.limits.max_processes)
        except BaseException as e:
            self._drop_verifier()
            if isinstance(e, (OSError, SandboxError)):
                raise SandboxError(f"cannot enter the verifier phase: {_why(e) if isinstance(e, OSError) else e}") \
                    from None
            raise

    def _verifier_uid(self, user: str | int | None) -> int:
        """The verifier's uid inside: root (Harbor's default), or a user of the image's /etc/passwd."""
        if user is None or user in ("root", 0, "0"):
            return 0
        if isinstance(user, int) or str(user).isdigit():
            return int(user)
        text = (self.read_file("/etc/passwd", 1 << 20) or b"").decode(errors="replace")
        for line in text.splitlines():
            fields = line.split(":")
            if len(fields) >= 3 and fields[0] == user and fields[2].isdigit():
                return int(fields[2])
        raise SandboxError(f"the verifier's user {user!r} is not in the image's /etc/passwd")

    def _serve_egress(self, netns: str, who: str) -> socket.socket:
        """A listener on EGRESS_PORT of the network namespace `netns` (the episode's, the verifier's), served by the
        run's egress proxy as this sandbox's `who`."""
        def listen() -> socket.socket:
            sock = socket.socket()
            sock.bind(("127.0.0.1", EGRESS_PORT))
            sock.listen(64)
            return sock

        sock = in_netns(netns, listen)
        proxy = self._egress() if callable(self._egress) else self._egress
        hosts = self._verifier.root / "hosts" if who == "verifier" else self.root / "hosts"

        def local(host: str, port: int) -> socket.socket | None:
            """What the sandbox itself serves under `host` (its loopback; a name its /etc/hosts gives loopback)."""
            address = _loopback_address(host, hosts)
            if address is None:
                return None
            return in_netns(netns, lambda: socket.create_connection((address, port), timeout=10))

        proxy.serve(sock, f"{self.root.name}:{who}", local=local)
        return sock

    def _network_env(self) -> dict[str, str]:
        """HTTP(S)_PROXY where the phase has the network (the egress proxy on its loopback), else nothing."""
        public = self._verifier.network == "public" if self._verifier is not None else self.network == "public"
        if not public:
            return {}
        url = f"http://127.0.0.1:{EGRESS_PORT}"
        local = "localhost,127.0.0.1,::1"
        return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url, "NO_PROXY": local,
                "no_proxy": local}

    def _inner_bwrap(self) -> str:
        """bubblewrap's path inside the sandbox (the host's where its system stands in; the image's otherwise)."""
        if self.host_system:
            return self._bwrap or "/usr/bin/bwrap"
        return "/usr/bin/bwrap"

    def _interpreters(self, view: Path) -> list[tuple[str, str]]:
        """(execute-only copy, path) for each of the verifier's interpreters that exists in its view: the host's
        where its system stands in, else the image's (found through the view's links, read from the image's layer
        that holds it: the agent cannot write the system)."""
        out, seen = [], set()
        for path in VERIFIER_INTERPRETERS:
            if self.host_system:
                real = os.path.realpath(path)
                source = real if os.path.isfile(real) else None
            else:
                found = _resolve_in(view, path)
                real = "/" + os.path.relpath(found, view) if found else None
                source = next((str(layer / real.lstrip("/")) for layer in self.layers
                               if real and os.path.isfile(layer / real.lstrip("/"))), None)
            if source is None or real in seen:
                continue
            copy = _exec_only_copy(source)
            if copy is not None:
                seen.add(real)
                out.append((copy, real))
        return out

    def leave_verifier(self) -> None:
        if self._closed:
            raise SandboxError("sandbox is closed")
        self._drop_verifier()

    def _drop_verifier(self) -> None:
        verifier, self._verifier = self._verifier, None
        if verifier is not None:
            verifier.close()

    # Snapshots and the end ----------------------------------------------------------------------------------------
    def snapshot(self) -> LocalSnapshot:
        """The sandbox as it is now, as a layer on the host's disk over its stack: what every fork starts from."""
        own = make_dir("snapshot", self.root.parent)
        snap = LocalSnapshot(layers=(), workdir=self.workdir if not self.unisolated else "/app", own=own,
                             host_system=self.host_system, env=dict(self.env), entrypoint=self.entrypoint,
                             user=self._user, network=self.network)
        try:
            snap.held = hold(snap.discard)
            stopped = self._freeze()
            try:
                layer = commit(self._upper, own / "layer")
            finally:
                self._thaw(stopped)
            os.chmod(own, 0o711)
            snap.layers = (layer, *self.layers) if self._overlay else (layer,)
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
            self._drop_verifier()
        finally:
            try:
                with contextlib.suppress(OSError):
                    if os.path.ismount(self.fs_root):
                        unmount(self.fs_root)
                force_rmtree(self.root)
            finally:
                if self._cgroup is not None:
                    self._cgroup.close()
                    self._cgroup = None

    def __del__(self):
        if not getattr(self, "_closed", True) and hasattr(self, "root"):
            self.close()


def _why(e: OSError) -> str:
    return "a symbolic link" if e.errno in (errno.ELOOP, errno.ENOTDIR) else (
        "another filesystem" if e.errno == errno.EXDEV else e.strerror or str(e))


_LOCALHOST = re.compile(r"(^|\s)(localhost|localhost\.localdomain|ip6-localhost|ip6-loopback)(\s|$)")


def _verifier_hosts(agents: str) -> str:
    """The verifier's /etc/hosts: the standard loopback lines, then the names the episode added (a service's, an
    entrypoint's), but none that makes `localhost` name anything else."""
    kept = [line for line in agents.splitlines() if line.strip() and not line.lstrip().startswith("#")
            and not _LOCALHOST.search(line.split("#")[0]) and line not in HOSTS_FILE.splitlines()]
    return HOSTS_FILE + "".join(f"{line}\n" for line in kept)


def _loopback_address(host: str, hosts_file: Path) -> str | None:
    """The loopback address `host` names in the sandbox (an address of 127.0.0.0/8 or ::1, localhost, or a name its
    /etc/hosts maps to one), else None."""
    import ipaddress

    name = host.strip("[]").lower()
    try:
        return name if ipaddress.ip_address(name).is_loopback else None
    except ValueError:
        pass
    if name in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return "127.0.0.1"
    try:
        lines = hosts_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split("#")[0].split()
        if len(fields) >= 2 and name in (f.lower() for f in fields[1:]):
            try:
                return fields[0] if ipaddress.ip_address(fields[0]).is_loopback else None
            except ValueError:
                return None
    return None


def _resolve_in(view: Path, path: str) -> str | None:
    """The host path of the regular file `path` names inside `view`, following links inside the view only."""
    current, pending, links = "", path.strip("/").split("/"), 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.rsplit("/", 1)[0]
            continue
        nxt = f"{current}/{part}"
        try:
            st = os.lstat(f"{view}{nxt}")
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > 40:
                return None
            target = os.readlink(f"{view}{nxt}")
            if target.startswith("/"):
                current = ""
            pending = target.split("/") + pending
        else:
            current = nxt
    host = f"{view}{current}"
    return host if os.path.isfile(host) else None


@dataclass
class LocalBackend:
    """Creates LocalSandboxes with shared settings; checks once that bubblewrap works."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    unisolated: bool = False
    root_parent: str | None = None
    extra_ro_binds: tuple[str, ...] = ()
    name: str = "local"

    cgroups: bool | None = None  # whole-sandbox memory/processes: None = a cgroup where possible, else the monitor
    tmpfs: bool | None = None  # whole-sandbox disk: None = a tmpfs of its own where possible, else the monitor
    image_cache: str | None = None  # where built images are kept (rl/sandbox/image.py; MC_IMAGE_CACHE by default)
    build_images: bool = False  # build every task's Dockerfile, even where the host's system could stand in
    # The agents' network: None gives each sandbox what its task declares ("none", or "public" through the egress
    # proxy); "none" gives none to any, whatever the tasks declare (RL on tasks whose fix is published upstream).
    network: str | None = None
    egress_hosts: tuple[str, ...] = ()  # what the egress proxy allows beyond this host's package registries
    egress_log: str | None = None  # where it logs every host each episode asked for (JSON lines)

    @property
    def runs_images(self) -> bool:
        return not self.unisolated

    def __post_init__(self):
        sweep(self.root_parent)  # what killed runs left where this backend's sandboxes go (once per process)
        if not self.unisolated:
            problem = bwrap_problem()
            if problem:
                raise SandboxError(f"LocalSandbox refuses to run without isolation: {problem}. "
                                   "Pass unisolated=True only for trusted code (no isolation at all).")
            launcher_path()  # built once, before any sandbox needs it
        else:
            warnings.warn("LocalBackend(unisolated=True): SANDBOXES RUN COMMANDS WITHOUT ANY ISOLATION as this host "
                          "user; only rlimits and timeouts apply. Never use this for model-generated code.",
                          UnisolatedWarning, stacklevel=2)

    @property
    def egress(self):
        """The run's egress proxy (rl/sandbox/egress.py), started with the first sandbox that has the network: it
        allows the package registries this host is configured for and those the image base's apt reads (Debian's
        security archive, say), and the run's `egress_hosts`."""
        if getattr(self, "_egress", None) is None:
            from rl.sandbox.egress import EgressProxy, PackageSources, apt_sources, registry_hosts
            from rl.sandbox.image import ImageBuilder

            base_apt = ImageBuilder(self.image_cache, progress=lambda _: None).base_folder() / "rootfs" / "etc" / "apt"
            images = PackageSources(pip=[], apt=apt_sources(base_apt), npm=[]).hosts() if base_apt.is_dir() else []
            self._egress = EgressProxy(allowed_hosts=list(dict.fromkeys([*registry_hosts(), *images,
                                                                          *self.egress_hosts])),
                                       log=self.egress_log)
        return self._egress

    def _make(self, tree, network: str = "none", **kwargs) -> LocalSandbox:
        if network not in NETWORKS:
            raise SandboxError(f"a sandbox's network is one of {list(NETWORKS)}, got {network!r}")
        # the proxy is made when a phase first has the network (a verifier's, too: the run's setting is the agents')
        kwargs.update(network="none" if self.network == "none" else network, egress=lambda: self.egress)
        with warnings.catch_warnings():
            if self.unisolated:  # warned once, here, instead of per sandbox
                warnings.simplefilter("ignore", UnisolatedWarning)
            return LocalSandbox(tree, root_parent=self.root_parent, unisolated=self.unisolated,
                                extra_ro_binds=self.extra_ro_binds, cgroups=self.cgroups, tmpfs=self.tmpfs, **kwargs)

    def create(self, tree: str | Path | None, workdir: str = "/app", env: dict[str, str] | None = None,
               limits: SandboxLimits | None = None, image=None, entrypoint: tuple[str, ...] = (),
               user: str | int | None = None, network: str = "none") -> LocalSandbox:
        return self._make(tree, workdir=workdir, env=env, limits=limits or self.limits, image=image,
                          entrypoint=entrypoint, user=user, network=network)

    def fork(self, snapshot: LocalSnapshot, limits: SandboxLimits | None = None) -> LocalSandbox:
        return self._make(None, workdir=snapshot.workdir, env=snapshot.env, limits=limits or snapshot.limits or
                          self.limits, layers=snapshot.layers, host_system=snapshot.host_system,
                          entrypoint=snapshot.entrypoint, fresh=False, user=snapshot.user, network=snapshot.network)
