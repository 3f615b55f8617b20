"""Whole-sandbox limits: memory and processes in one cgroup, disk as a filesystem of its own size.

Memory and processes. Where this process may create cgroups (root, with cgroup v2's `memory` and `pids`
controllers or cgroup v1's `memory` and `pids` hierarchies), each sandbox gets one cgroup: memory.max and
pids.max (v1: memory.limit_in_bytes, memory.memsw.limit_in_bytes where swap is accounted, pids.max). Every
process of every command joins it before anything else runs, so the limit holds for all of them together and
the kernel's OOM killer ends them when their sum passes memory_mb. Files the sandbox writes to its tmpfs (see
below) are memory too and count against the same limit.
Fallback where cgroups are not available (not root, no delegated controllers): while a command runs, a
monitor sums the private resident memory of all the command's processes and the shared memory they hold
(memfds and /dev/shm files, by descriptor or mapping) every 0.25 s and kills them all when the sum passes
memory_mb. RLIMIT_AS (per process) and RLIMIT_NPROC stay as bounds between two polls.

Disk. Where this process may mount (root), the sandbox's writable directories are one tmpfs of
size=disk_mb and nr_inodes=max_files: the kernel counts every block and inode, also of files that are
unlinked but still open, and writes past the limit fail with "No space left on device".
Fallback: the writable directories are walked every 0.25 s (allocated blocks and the number of entries), and
deleted files still held open or mapped by the command's processes are added; the command is killed past
either limit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from rl.sandbox.owners import make_dir

PAGE = os.sysconf("SC_PAGE_SIZE")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class CgroupParents:
    """Where sandbox cgroups are made: one directory per controller ("memory", "pids", "freezer"); v2 has one for
    all (its freezer is cgroup.freeze). Without a v1 freezer hierarchy, episodes are stopped by signals instead."""

    version: int
    memory: Path
    pids: Path
    freezer: Path | None = None


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    for line in _read(Path("/proc/self/mounts")).splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ("" is the v2 unified hierarchy)."""
    out = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _probe(parent: Path, files: dict[str, str]) -> bool:
    probe = parent / f"mc-probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return all(_write(probe / name, value) for name, value in files.items())
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


@functools.lru_cache(maxsize=1)
def find_cgroup_parents() -> CgroupParents | None:
    """Directories in which this process can make sandbox cgroups, or None (then the monitor is used)."""
    if os.geteuid() != 0:
        return None
    own = _own_cgroups()
    mounts = _mounts()
    for mountpoint, fstype, _ in mounts:
        if fstype != "cgroup2":
            continue
        for cand in dict.fromkeys([Path(mountpoint + own.get("", "/")), Path(mountpoint)]):
            if not {"memory", "pids"} <= set(_read(cand / "cgroup.controllers").split()):
                continue
            if not {"memory", "pids"} <= set(_read(cand / "cgroup.subtree_control").split()):
                _write(cand / "cgroup.subtree_control", "+memory +pids")  # fails where cand holds processes
            if _probe(cand, {"memory.max": str(64 << 20), "pids.max": "64"}):
                return CgroupParents(2, cand, cand)
    v1 = {}
    for controller in ("memory", "pids"):
        for mountpoint, fstype, options in mounts:
            if fstype == "cgroup" and controller in options:
                for cand in dict.fromkeys([Path(mountpoint + own.get(controller, "/")), Path(mountpoint)]):
                    limit_file = "memory.limit_in_bytes" if controller == "memory" else "pids.max"
                    if _probe(cand, {limit_file: str(64 << 20) if controller == "memory" else "64"}):
                        v1[controller] = cand
                        break
            if controller in v1:
                break
    if len(v1) == 2:
        freezer = None
        for mountpoint, fstype, options in mounts:
            if fstype == "cgroup" and "freezer" in options:
                for cand in dict.fromkeys([Path(mountpoint + own.get("freezer", "/")), Path(mountpoint)]):
                    if _probe(cand, {"freezer.state": "THAWED"}):
                        freezer = cand
                        break
            if freezer is not None:
                break
        return CgroupParents(1, v1["memory"], v1["pids"], freezer)
    return None


def cgroup_problem() -> str | None:
    """Why whole-sandbox memory and process limits fall back to the monitor here, or None."""
    if find_cgroup_parents() is not None:
        return None
    if os.geteuid() != 0:
        return "not root: cannot create cgroups (whole-sandbox memory is enforced by the polling monitor)"
    return ("no writable cgroup v2 memory+pids controllers or cgroup v1 memory and pids hierarchies "
            "(whole-sandbox memory is enforced by the polling monitor)")


class SandboxCgroup:
    """One sandbox's cgroup(s): every command's processes join it; removed when the sandbox closes."""

    def __init__(self, parents: CgroupParents, name: str, memory_mb: int, max_processes: int):
        self.parents = parents
        self.memory_dir = parents.memory / name
        self.pids_dir = parents.pids / name
        self.freezer_dir = parents.memory / name if parents.version == 2 else (
            parents.freezer / name if parents.freezer is not None else None)
        self.dirs = list(dict.fromkeys([d for d in (self.memory_dir, self.pids_dir, self.freezer_dir) if d]))
        limit = str(memory_mb << 20)
        try:
            for d in self.dirs:
                d.mkdir()
            if parents.version == 2:
                ok = _write(self.memory_dir / "memory.max", limit)
                if (self.memory_dir / "memory.swap.max").exists():
                    ok &= _write(self.memory_dir / "memory.swap.max", "0")
            else:
                ok = _write(self.memory_dir / "memory.limit_in_bytes", limit)
                if (self.memory_dir / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap at all
                    ok &= _write(self.memory_dir / "memory.memsw.limit_in_bytes", limit)
            ok &= _write(self.pids_dir / "pids.max", str(max_processes))
            if not ok:
                raise OSError(f"cannot set limits in {self.memory_dir}")
        except OSError:
            self.close()
            raise

    def procs_files(self) -> list[str]:
        """The cgroup.procs files a launcher writes itself into (mc-enter --cgroup) before it runs anything."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def process_limit_hits(self) -> int:
        """How often a fork was refused at pids.max (the kernel's count, whatever the programs printed)."""
        for line in _read(self.pids_dir / "pids.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "max" and value.strip().isdigit():
                return int(value)
        return 0

    def freeze(self, timeout_s: float = 10.0) -> bool:
        """Stop every process of the sandbox where they stand (the cgroup freezer); False where there is none."""
        return self._set_frozen(True, timeout_s)

    def thaw(self) -> None:
        self._set_frozen(False, 10.0)

    def _set_frozen(self, frozen: bool, timeout_s: float) -> bool:
        if self.freezer_dir is None:
            return False
        if self.parents.version == 2:
            ok = _write(self.freezer_dir / "cgroup.freeze", "1" if frozen else "0")
            done = lambda: f"frozen {int(frozen)}" in _read(self.freezer_dir / "cgroup.events")  # noqa: E731
        else:
            ok = _write(self.freezer_dir / "freezer.state", "FROZEN" if frozen else "THAWED")
            done = lambda: _read(self.freezer_dir / "freezer.state").strip() == (  # noqa: E731
                "FROZEN" if frozen else "THAWED")
        deadline = time.monotonic() + timeout_s
        while ok and not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return ok

    def oom_kills(self) -> int:
        name = "memory.events" if self.parents.version == 2 else "memory.oom_control"
        for line in _read(self.memory_dir / name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def close(self) -> None:
        for d in reversed(self.dirs):
            remove_cgroup(self.parents.version, d)


def remove_cgroup(version: int, d: Path) -> None:
    """Kill every process in the cgroup `d` and remove it (retried for about a second while they die)."""
    _write(d / "freezer.state", "THAWED")  # a frozen v1 task takes no signal
    _write(d / "cgroup.freeze", "0")
    for _ in range(50):
        if not d.exists():
            return
        if version == 2:
            _write(d / "cgroup.kill", "1")
        else:
            for pid in _read(d / "cgroup.procs").split():
                try:
                    os.kill(int(pid), 9)
                except OSError:
                    pass
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.02)


# The monitor (fallback) -----------------------------------------------------------------------------------------
def private_memory(pids: list[int]) -> int:
    """Bytes of resident memory the processes do not share with files (statm resident - shared), summed."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                fields = f.read().split()
            total += max(0, int(fields[1]) - int(fields[2])) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def _is_shared_memory(path: str) -> bool:
    """A memory-backed file: a memfd, or a file on the command's own /dev/shm."""
    return path.startswith("/memfd:") or path.startswith("/dev/shm/")


def held_files(pids: list[int], devices: set[int]) -> tuple[int, int]:
    """(bytes of shared memory, bytes of unlinked files on `devices`) the processes hold: by an open descriptor
    or only by a mapping (the descriptor closed), each file counted once. Shared memory (memfds, /dev/shm files)
    is memory that the private resident set does not show; an unlinked file keeps its blocks until the last
    descriptor and mapping go. SysV shared memory segments are not seen (docs/SANDBOX.md)."""
    seen: set[tuple[int, int]] = set()
    shm = disk = 0

    def add(st: os.stat_result, path: str) -> None:
        nonlocal shm, disk
        key = (st.st_dev, st.st_ino)
        if key in seen or not stat.S_ISREG(st.st_mode):
            return
        if _is_shared_memory(path):
            seen.add(key)
            shm += st.st_blocks * 512
        elif st.st_nlink == 0 and st.st_dev in devices:
            seen.add(key)
            disk += st.st_blocks * 512

    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                add(os.stat(f"/proc/{pid}/fd/{fd}"), os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read().splitlines()
        except OSError:
            continue
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0":
                continue
            path = fields[5]
            if not (_is_shared_memory(path) or path.endswith(" (deleted)")):
                continue
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            if (os.makedev(major, minor), int(fields[4])) in seen:
                continue
            try:  # the mapped file itself (its size, not the mapping's); readable to root
                add(os.stat(f"/proc/{pid}/map_files/{fields[0]}"), path)
            except OSError:  # elsewhere the mapping's length stands in for the file's size
                start, end = (int(x, 16) for x in fields[0].split("-"))
                dev = os.makedev(major, minor)
                if _is_shared_memory(path) or dev in devices:
                    seen.add((dev, int(fields[4])))
                    if _is_shared_memory(path):
                        shm += end - start
                    else:
                        disk += end - start
    return shm, disk


# A filesystem of the sandbox's own ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount_tmpfs(path: Path, size_mb: int, max_files: int) -> None:
    """Mount a tmpfs of size_mb MB and max_files inodes at path (needs CAP_SYS_ADMIN); OSError otherwise."""
    opts = f"size={size_mb}m,nr_inodes={max_files},mode=0711".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    _libc().umount2(str(path).encode(), 2)  # MNT_DETACH: gone now, freed once nothing uses it


@functools.lru_cache(maxsize=1)
def tmpfs_problem() -> str | None:
    """Why sandbox directories cannot get a size-limited tmpfs here (then the disk walk is used), or None."""
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs per sandbox (disk use is measured by walking the directories)"
    probe = make_dir("probe")
    try:
        mount_tmpfs(probe, 1, 16)
        unmount(probe)
        return None
    except OSError as e:
        return f"cannot mount a tmpfs per sandbox ({e}); disk use is measured by walking the directories"
    finally:
        probe.rmdir()


def fs_full(path: Path) -> str | None:
    """'space' or 'inodes' when the filesystem at path has (almost) none left, else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_favail == 0:
        return "inodes"
    if st.f_bavail * st.f_frsize < min(1 << 20, st.f_blocks * st.f_frsize // 50):
        return "space"
    return None
