"""Layers, not copies: a sandbox's root is a stack of read-only layers under one thin writable layer (overlayfs).

The stack, bottom to top (docker's storage model): the Debian base -> the task image (its Dockerfile's steps) -> the
prepared task -> the episode (the agent's writes, on the sandbox's own tmpfs) -> the verifier's writes over a frozen
copy of the episode. A layer is a folder in overlayfs' upper format: what its owner wrote, deletions as whiteouts
(character devices 0/0) and replaced folders marked opaque (trusted.overlay.opaque). A fork is a new empty upper layer
over the same stack; no sandbox can write into a layer below its own (the kernel copies a file up before it changes).
A layer becomes read-only by `commit`: its upper copied into a folder of its own (only what changed: a commit costs
the episode's writes, not the image's size).

Overlayfs is mounted by the host (root) in the host's mount namespace; sandboxes bind the merged folder as their
root. Where the host cannot mount it (not root, a kernel without overlayfs) the stack is `materialize`d instead: its
layers copied bottom-up into one folder (the copies the layers replace); `overlay_problem` says why, once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import stat
import subprocess
import warnings
from pathlib import Path
from typing import Sequence

from rl.sandbox.base import SandboxError
from rl.sandbox.safe_tree import copy_layer

OPAQUE_XATTR = "trusted.overlay.opaque"
# Options of every overlay here: renamed folders are copied up whole (no redirect xattrs pointing into lower layers),
# so an upper folder holds all it changed and can be committed as a layer of its own.
OVERLAY_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"
# Paths a link in an agent's layer must not lead into once the verifier judges it: the verifier's own tests and logs,
# and the kernel's views that reach other processes' files (/proc/<pid>/root, /dev/fd).
PRIVATE_PATHS = ("/tests", "/logs", "/proc", "/sys", "/dev")
NOWHERE = "/dev/null/mc-unreachable"  # where such a link leads instead (ENOTDIR: nothing is there)
MAX_LINKS = 40


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(source: str, target: Path, fstype: str, flags: int, data: str | None) -> None:
    if _libc().mount(source.encode(), os.fsencode(target), fstype.encode(), flags,
                     data.encode() if data is not None else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def _check_path(path: Path) -> str:
    text = os.fspath(path)
    if any(c in text for c in ":,\\\n"):
        raise SandboxError(f"{text}: overlay layers cannot live under a path holding ':', ',' or '\\'; choose another "
                           "root_parent or MC_IMAGE_CACHE")
    return text


def mount_overlay(lowers: Sequence[Path], target: Path, upper: Path | None = None, work: Path | None = None) -> None:
    """Mount the layers `lowers` (top first) at `target`, writable into `upper` (with `work`, on the same filesystem),
    or read-only without one (then at least two layers: one alone is a folder, not a stack)."""
    if len(lowers) < (1 if upper is not None else 2):
        raise SandboxError(f"an overlay needs at least {1 if upper is not None else 2} lower layer(s)")
    data = "lowerdir=" + ":".join(_check_path(p) for p in lowers)
    if upper is not None:
        data += f",upperdir={_check_path(upper)},workdir={_check_path(work)}"
    data += "," + OVERLAY_OPTIONS
    flags = 0 if upper is not None else 1  # MS_RDONLY
    if len(data) >= 4000:
        raise SandboxError(f"the layer stack at {target} is too deep for one mount ({len(lowers)} layers)")
    _mount("overlay", target, "overlay", flags, data)


def bind_mount(source: Path, target: Path) -> None:
    """Bind `source` onto `target` (a file or folder that exists), in the host's mount namespace."""
    _mount(os.fspath(source), target, "none", 4096, None)  # MS_BIND


def unmount(path: Path) -> None:
    _libc().umount2(os.fsencode(path), 2)  # MNT_DETACH


@functools.lru_cache(maxsize=1)
def overlay_problem() -> str | None:
    """Why this host cannot stack layers with overlayfs (then they are copied), or None."""
    if os.geteuid() != 0:
        return "not root: layers are copied (overlayfs needs the host's root to mount it for a sandbox)"
    import tempfile

    probe = Path(tempfile.mkdtemp(prefix="mc-probe-"))
    try:
        for name in ("lower", "upper", "work", "merged"):
            (probe / name).mkdir()
        (probe / "lower" / "f").write_text("x")
        mount_overlay([probe / "lower"], probe / "merged", probe / "upper", probe / "work")
        try:
            os.unlink(probe / "merged" / "f")  # a whiteout: the upper filesystem must hold them
            ok = not os.path.exists(probe / "merged" / "f")
        finally:
            unmount(probe / "merged")
        return None if ok else "overlayfs does not hide a deleted lower file here; layers are copied"
    except (OSError, SandboxError) as e:
        return f"overlayfs cannot be mounted here ({e}); layers are copied"
    finally:
        subprocess.run(["rm", "-rf", str(probe)], capture_output=True)


_warned: set[str] = set()


def use_overlay() -> bool:
    """Whether layers are stacked (True) or copied; says why once when they are copied."""
    problem = overlay_problem()
    if problem and problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"sandbox: {problem}", stacklevel=2)
    return problem is None


def copy_tree(src: Path, dest: Path) -> None:
    """Copy src's contents into dest (made if missing) as they are: owners, modes, times, links, extended attributes
    (opaque markers), devices (whiteouts). src must not change meanwhile (a frozen episode, a layer)."""
    dest.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SandboxError(f"cannot copy {src} -> {dest}: {res.stderr.strip()[:300]}")


def _is_private(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PRIVATE_PATHS)


def leads_into_private(view: Path, link_dir: str, target: str) -> bool:
    """Whether a link in folder `link_dir` (an absolute path in the view) with `target` reaches a private path
    (PRIVATE_PATHS) anywhere on its way, resolving every link on the way inside `view` (the sandbox's root as the
    host sees it), never outside it."""
    pending = (target if target.startswith("/") else f"{link_dir}/{target}").split("/")
    current = ""
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.rsplit("/", 1)[0]
            continue
        nxt = f"{current}/{part}"
        if _is_private(nxt):
            return True
        try:
            st = os.lstat(f"{view}{nxt}")  # every component of `current` is a real folder: nothing is followed
        except OSError as e:
            # the path ends here and leads nowhere; too long to tell here: counted as private (made to lead nowhere)
            return e.errno == errno.ENAMETOOLONG
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return False
            inner = os.readlink(f"{view}{nxt}")
            if inner.startswith("/"):
                current = ""
            pending = inner.split("/") + pending
        else:
            current = nxt
    return _is_private(current or "/")


def commit(upper: Path, dest: Path, view: Path | None = None) -> Path:
    """A read-only layer at `dest` (made, or an empty folder) holding what `upper` holds now (its writer stopped):
    rl/sandbox/safe_tree.py copy_layer, at any depth, never following a link. With `view` (the merged root `upper` is
    the top of), each link that leads into a private path (PRIVATE_PATHS) is made to lead nowhere (NOWHERE + its
    target), and sockets (a live process's) are left out as always."""
    keep = None
    if view is not None:
        def keep(parts: list[str], target: str) -> str:
            here = "/" + "/".join(parts)
            if leads_into_private(view, here, target):
                return NOWHERE + (target if target.startswith("/") else "/" + target)
            return target
    dest.mkdir(parents=True, exist_ok=True)
    copy_layer(upper, dest, keep_link=keep)
    return dest


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def materialize(lowers: Sequence[Path], dest: Path) -> None:
    """The merged view of `lowers` (top first) copied into `dest`: the fallback where overlayfs is unavailable."""
    dest.mkdir(parents=True, exist_ok=True)
    for layer in reversed(lowers):
        for dirpath, dirnames, filenames in os.walk(layer):
            rel = os.path.relpath(dirpath, layer)
            target = dest if rel == "." else dest / rel
            if rel != "." and _opaque(dirpath):
                subprocess.run(["rm", "-rf", str(target)], check=True)
                target.mkdir()
            for name in dirnames + filenames:
                st = os.lstat(os.path.join(dirpath, name))
                if _whiteout(st):
                    subprocess.run(["rm", "-rf", str(target / name)], check=True)
        res = subprocess.run(["cp", "-a", f"{layer}/.", str(dest)], capture_output=True, text=True)
        if res.returncode != 0:
            raise SandboxError(f"cannot copy the layer {layer}: {res.stderr.strip()[:300]}")
        for dirpath, _, filenames in os.walk(dest):  # the whiteouts the copy brought along
            for name in filenames:
                path = os.path.join(dirpath, name)
                if _whiteout(os.lstat(path)):
                    os.unlink(path)


def in_use(layer: Path) -> bool:
    """Whether a mounted overlay (of any sandbox of this host) stacks `layer`."""
    text = _check_path(layer)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                if " - overlay " in line and (f"lowerdir={text}:" in line or f":{text}:" in line
                                               or f":{text}," in line or f"lowerdir={text}," in line):
                    return True
    except OSError:
        pass
    return False
