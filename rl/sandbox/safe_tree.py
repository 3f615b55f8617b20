"""Every copy, chown and removal the host makes in a tree that a task or an agent wrote, in one place.

Such a tree may hold links planted to lead the host out of it (`/app/x -> /etc/passwd`), and its processes may swap
a folder for a link while the host works in it. The host, often root, must never write through either. So every
operation here walks the tree one directory descriptor at a time and opens each component with openat2's
RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV: a link (or a mount) on the way is an
error, never followed, and a descriptor, once open, names the same folder whatever is renamed later. A file is put
in place by unlinking what was there and creating it anew with O_CREAT | O_EXCL | O_NOFOLLOW (an entry that appears
in between makes the create fail rather than be written through), then its owner, mode and times are set through its
descriptor. Where the kernel has no openat2 (before Linux 5.6), O_NOFOLLOW per component gives the same guarantee
for every component but none of the cross-mount checks.

What the host copies in (a task's files, a verifier's tests) is its own; links inside it are copied as links.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
import stat
from pathlib import Path

from rl.sandbox.base import SandboxError

_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64 (a syscall of the unified table)
_RESOLVE = 0x01 | 0x02 | 0x04 | 0x08  # NO_XDEV | NO_MAGICLINKS | NO_SYMLINKS | BENEATH
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@functools.lru_cache(maxsize=1)
def _has_openat2() -> bool:
    how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE)
    fd = _libc().syscall(_SYS_OPENAT2, -100, b"/", ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        os.close(fd)
        return True
    return False


def open_beneath(dir_fd: int, name: str, flags: int, mode: int = 0) -> int:
    """Open `name` (one component, or a relative path) beneath dir_fd without following any link or crossing a
    mount. Raises OSError (ELOOP for a link, EXDEV for a mount) like os.open."""
    if _has_openat2():
        how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
        fd = _libc().syscall(_SYS_OPENAT2, dir_fd, os.fsencode(name), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), name)
        return fd
    fd = os.dup(dir_fd)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    try:
        for i, part in enumerate(parts):
            if part == "..":
                raise OSError(errno.EXDEV, "'..' leaves the tree", name)
            last = i == len(parts) - 1
            inner = os.open(part, (flags if last else _DIR) | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def _parts(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SandboxError(f"{path!r}: a path inside a sandbox tree may not hold '..'")
    return parts


def open_dir(root: Path | str, path: str, make: bool = False, owner: tuple[int, int] | None = None,
             replace: bool = False) -> int:
    """A descriptor of the folder `path` inside the tree at `root`, each component opened without following links.
    With `make`, missing folders are made (mode 0755, given to `owner`); with `replace`, a link or file where a
    folder is needed is removed and made a folder."""
    fd = os.open(root, _DIR)
    try:
        for part in _parts(path):
            try:
                inner = open_beneath(fd, part, _DIR)
            except OSError as e:
                if e.errno == errno.ENOENT and make:
                    os.mkdir(part, 0o755, dir_fd=fd)
                elif e.errno in (errno.ELOOP, errno.ENOTDIR) and replace:
                    os.unlink(part, dir_fd=fd)
                    os.mkdir(part, 0o755, dir_fd=fd)
                else:
                    raise
                inner = open_beneath(fd, part, _DIR)
                if owner is not None:
                    os.fchown(inner, *owner)
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove whatever `name` is in dir_fd (a folder with all it holds), never following a link."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        fd = open_beneath(dir_fd, name, _DIR)
        try:
            _empty_dir(fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _empty_dir(fd: int) -> None:
    with os.scandir(fd) as it:
        names = [e.name for e in it]
    for name in names:
        _remove_entry(fd, name)


def _copy_file(src: str, st: os.stat_result, dir_fd: int, name: str, owner: tuple[int, int] | None) -> None:
    _remove_entry(dir_fd, name)
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with open(src, "rb") as f:
            while True:
                if os.sendfile(out, f.fileno(), None, 1 << 24) == 0:
                    break
        if owner is not None:
            os.fchown(out, *owner)
        os.fchmod(out, stat.S_IMODE(st.st_mode))
        os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(out)


def _copy_link(src: str, dir_fd: int, name: str, owner: tuple[int, int] | None) -> None:
    _remove_entry(dir_fd, name)
    os.symlink(os.readlink(src), name, dir_fd=dir_fd)
    if owner is not None:
        os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)


def _copy_dir_contents(src: str, dir_fd: int, owner: tuple[int, int] | None) -> None:
    with os.scandir(src) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            inner = _dir_entry(dir_fd, entry.name, owner, stat.S_IMODE(st.st_mode))
            try:
                _copy_dir_contents(entry.path, inner, owner)
            finally:
                os.close(inner)
        elif stat.S_ISLNK(st.st_mode):
            _copy_link(entry.path, dir_fd, entry.name, owner)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(entry.path, st, dir_fd, entry.name, owner)
        # fifos, sockets and devices of a host folder are not copied into a sandbox


def _dir_entry(dir_fd: int, name: str, owner: tuple[int, int] | None, mode: int) -> int:
    """A descriptor of the folder `name` in dir_fd, made (or made in place of a link or file) as needed."""
    try:
        fd = open_beneath(dir_fd, name, _DIR)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise
        _remove_entry(dir_fd, name)
        os.mkdir(name, 0o700, dir_fd=dir_fd)
        fd = open_beneath(dir_fd, name, _DIR)
    if owner is not None:
        os.fchown(fd, *owner)
    os.fchmod(fd, mode)
    return fd


def copy_into(src: Path | str, root: Path | str, dest: str, owner: tuple[int, int] | None = None,
              merge: bool = False) -> None:
    """Put the host file or folder `src` at `dest` inside the tree at `root`, as Dockerfile COPY does: a folder's
    contents go into dest (added to what is there with `merge`, else replacing it), a file becomes dest. Missing
    parents are made. Everything written is given to `owner` (uid, gid) when set. Nothing in the tree is followed:
    a link where a folder or file goes is replaced, never written through."""
    src = os.fspath(src)
    parts = _parts(dest)
    try:
        if not parts:  # the tree's root itself
            if not os.path.isdir(src):
                raise SandboxError(f"cannot copy the file {src} onto the root of a tree")
            fd = os.open(root, _DIR)
            try:
                if not merge:
                    _empty_dir(fd)
                _copy_dir_contents(src, fd, owner)
            finally:
                os.close(fd)
            return
        parent = open_dir(root, "/".join(parts[:-1]), make=True, owner=owner, replace=True)
        try:
            st = os.stat(src)
            if stat.S_ISDIR(st.st_mode):
                if not merge:
                    _remove_entry(parent, parts[-1])
                fd = _dir_entry(parent, parts[-1], owner, stat.S_IMODE(st.st_mode))
                try:
                    _copy_dir_contents(src, fd, owner)
                finally:
                    os.close(fd)
            else:
                _copy_file(src, st, parent, parts[-1], owner)
        finally:
            os.close(parent)
    except OSError as e:
        raise SandboxError(f"cannot copy {src} to {dest}: {e.strerror or e}") from None


def chown_tree(root: Path | str, path: str, uid: int, gid: int) -> None:
    """Give `path` inside the tree at `root` and everything under it to uid:gid, never following a link (links
    themselves change owner)."""
    parts = _parts(path)
    parent = open_dir(root, "/".join(parts[:-1])) if parts else None
    try:
        if parent is None:
            fd = os.open(root, _DIR)
        else:
            try:
                st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                return
            if not stat.S_ISDIR(st.st_mode):
                os.chown(parts[-1], uid, gid, dir_fd=parent, follow_symlinks=False)
                return
            fd = open_beneath(parent, parts[-1], _DIR)
        try:
            _chown_fd(fd, uid, gid)
        finally:
            os.close(fd)
    except OSError as e:
        raise SandboxError(f"cannot hand {path} to uid {uid}: {e.strerror or e}") from None
    finally:
        if parent is not None:
            os.close(parent)


def _chown_fd(fd: int, uid: int, gid: int) -> None:
    os.fchown(fd, uid, gid)
    with os.scandir(fd) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            try:
                inner = open_beneath(fd, entry.name, _DIR)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    continue  # gone or swapped for a link since the listing: not followed
                raise
            try:
                _chown_fd(inner, uid, gid)
            finally:
                os.close(inner)
        else:
            try:
                os.chown(entry.name, uid, gid, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass


# Removing a tree ----------------------------------------------------------------------------------------------------
def _open_dir_for_removal(name: str, dir_fd: int | None = None) -> int:
    """A descriptor of the directory `name` itself (never through a symlink), made readable and writable for
    us first if the sandbox took those permissions away."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except PermissionError:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:  # chmod through the O_PATH handle changes this directory, not what any link points to
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
        finally:
            os.close(handle)
        return os.open(name, _DIR, dir_fd=dir_fd)


def remove_tree(path: Path) -> list[str]:
    """Remove a tree a sandbox wrote, at any depth, without following any symlink in it and without changing
    anything outside it: one directory descriptor at a time (no recursion, no path length limit), entries
    unlinked relative to it, permissions restored only on directories it opened itself. Returns what could not be
    removed (empty when all went)."""
    try:
        fd = os.open(path, _DIR)
    except FileNotFoundError:
        return []
    except OSError:  # a file or a link where the tree should be: remove that entry only
        try:
            os.unlink(path)
            return []
        except OSError as e:
            return [f"{path}: {e.strerror}"]
    failed: list[str] = []
    names: list[str] = []  # the directories from `path` down to the one `fd` holds
    skip: list[set[str]] = [set()]  # per level: directories that could not be removed
    try:
        while True:
            try:
                os.fchmod(fd, 0o700)  # entries of a directory made read-only by the sandbox can be removed
            except OSError:
                pass
            child = None
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name not in skip[-1]:
                            child = entry.name
                            break
                        continue
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        failed.append(f"{'/'.join([str(path), *names, entry.name])}: {e.strerror}")
            if child is not None:
                try:
                    inner = _open_dir_for_removal(child, fd)
                except OSError as e:
                    failed.append(f"{'/'.join([str(path), *names, child])}: {e.strerror}")
                    skip[-1].add(child)
                    continue
                os.close(fd)
                fd = inner
                names.append(child)
                skip.append(set())
                continue
            if not names:
                break
            name = names.pop()
            skip.pop()
            # nothing in the tree runs any more: '..' is where we came from
            parent = os.open("..", _DIR, dir_fd=fd)
            os.close(fd)
            fd = parent
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as e:
                failed.append(f"{'/'.join([str(path), *names, name])}: {e.strerror}")
                skip[-1].add(name)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError as e:
        failed.append(f"{path}: {e.strerror}")
    return failed


# Copying a tree an agent wrote (a frozen episode's layer) ------------------------------------------------------------
def _copy_xattrs(src_fd: int, dest_fd: int) -> None:
    """Extended attributes (overlayfs' opaque markers among them) from one open file to another."""
    try:
        names = os.listxattr(src_fd)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            os.setxattr(dest_fd, name, os.getxattr(src_fd, name))


def _copy_attrs(st: os.stat_result, src_fd: int, dest_fd: int, mode: bool = True) -> None:
    os.fchown(dest_fd, st.st_uid, st.st_gid)
    if mode:
        os.fchmod(dest_fd, stat.S_IMODE(st.st_mode))
    _copy_xattrs(src_fd, dest_fd)


def _copy_entry(sfd: int, dfd: int, dest_root: int, name: str, st: os.stat_result, parts: list[str],
                linked: dict, keep_link) -> int | None:
    """Copy one entry of the folder sfd into dfd; for a folder, return the descriptor of its source (its copy is
    made and its contents follow)."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        try:
            inner = os.open(name, _DIR, dir_fd=sfd)
        except OSError:
            return None  # swapped for something else since the listing: not followed
        os.mkdir(name, 0o700, dir_fd=dfd)
        return inner
    if stat.S_ISREG(mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in linked:  # another name of a file already copied
            first_parts, first_name = linked[key]
            first_dir = open_dir_fd(dest_root, first_parts)
            try:
                os.link(first_name, name, src_dir_fd=first_dir, dst_dir_fd=dfd, follow_symlinks=False)
                return None
            except OSError:
                pass
            finally:
                os.close(first_dir)
        try:
            fin = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fin).st_mode):
                return None
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)
            try:
                while os.sendfile(out, fin, None, 1 << 24):
                    pass
                _copy_attrs(st, fin, out)
                os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(out)
        finally:
            os.close(fin)
        if st.st_nlink > 1:
            linked[key] = (parts, name)
    elif stat.S_ISLNK(mode):
        try:
            target = os.readlink(name, dir_fd=sfd)
        except OSError:
            return None
        if keep_link is not None and (target := keep_link(parts, target)) is None:
            return None
        os.symlink(target, name, dir_fd=dfd)
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)
    elif (stat.S_ISCHR(mode) and st.st_rdev == 0) or stat.S_ISFIFO(mode):  # a whiteout, a fifo
        os.mknod(name, mode, st.st_rdev, dir_fd=dfd)
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
    # sockets (a live process's) and devices are not part of a layer
    return None


def open_dir_fd(root_fd: int, parts: list[str]) -> int:
    """A descriptor of the folder `parts` below root_fd (one component at a time, never through a link)."""
    fd = os.dup(root_fd)
    for part in parts:
        inner = os.open(part, _DIR, dir_fd=fd)
        os.close(fd)
        fd = inner
    return fd


MAX_DEPTH = 1024  # folders within folders a layer copy follows (one descriptor each while it fills them)


def _entries(fd: int) -> list[tuple[str, os.stat_result]]:
    out = []
    with os.scandir(fd) as it:
        for e in it:
            try:
                out.append((e.name, e.stat(follow_symlinks=False)))
            except OSError:
                continue
    return out


def copy_layer(src: Path | str, dest: Path | str, keep_link=None) -> None:
    """Copy the tree at `src` (a writer's layer, stopped) into the empty folder `dest` as it is: owners, modes, times,
    extended attributes, links (as links), hard links within the tree, fifos and whiteouts (character devices 0/0);
    sockets are left out. Depth-first with one descriptor per level of the folder being filled (no recursion; deeper
    than MAX_DEPTH is an error), never following a link. With `keep_link(dir_parts, target) -> str | None`, each
    link's target is what it returns (None: the link is left out)."""
    src_root = os.open(src, _DIR)
    try:
        dest_root = os.open(dest, _DIR)
    except OSError:
        os.close(src_root)
        raise
    linked: dict[tuple[int, int], tuple[list[str], str]] = {}  # (dev, ino) -> where its first copy went
    st = os.fstat(src_root)
    _copy_attrs(st, src_root, dest_root, mode=False)  # a folder's mode once it is filled (it may refuse writes)
    stack = [(src_root, dest_root, [], st, iter(_entries(src_root)))]
    try:
        while stack:
            sfd, dfd, parts, st, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:  # filled: its mode and times last (filling its folders later does not touch them)
                os.fchmod(dfd, stat.S_IMODE(st.st_mode))
                os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
                stack.pop()
                os.close(sfd)
                os.close(dfd)
                continue
            name, est = entry
            inner = _copy_entry(sfd, dfd, dest_root, name, est, parts, linked, keep_link)
            if inner is None:
                continue
            if len(stack) >= MAX_DEPTH:
                os.close(inner)
                raise SandboxError(f"the tree {src} holds folders nested deeper than {MAX_DEPTH}")
            try:
                out = os.open(name, _DIR, dir_fd=dfd)
                _copy_attrs(est, inner, out, mode=False)
            except OSError:
                os.close(inner)
                raise
            stack.append((inner, out, parts + [name], est, iter(_entries(inner))))
    finally:
        for sfd, dfd, *_ in stack:
            os.close(sfd)
            os.close(dfd)


def copy_out(root: Path | str, path: str, dest_root: Path | str) -> None:
    """Copy `path` of the tree at `root` (one a writer made, stopped) to the same path under `dest_root` (an empty
    tree the host made): a regular file, or a folder with the regular files and folders it holds; links and other
    entries are left out at every level, and nothing on the way is followed (a link where a folder of `path` should be
    means there is nothing to copy). A path that is not there copies nothing."""
    parts = _parts(path)
    if not parts:
        raise SandboxError("an artifact must name a path below /, not / itself")
    try:
        parent = open_dir(root, "/".join(parts[:-1]))
    except OSError:
        return
    try:
        try:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return
        dest_parent = open_dir(dest_root, "/".join(parts[:-1]), make=True)
        try:
            if stat.S_ISREG(st.st_mode):
                _copy_entry(parent, dest_parent, dest_parent, parts[-1], st, [], {}, None)
                return
            src = open_beneath(parent, parts[-1], _DIR)
            os.mkdir(parts[-1], 0o755, dir_fd=dest_parent)
            out = open_beneath(dest_parent, parts[-1], _DIR)
            _copy_attrs(st, src, out)
            stack = [(src, out, iter(_entries(src)))]
            try:
                while stack:
                    sfd, dfd, entries = stack[-1]
                    entry = next(entries, None)
                    if entry is None:
                        stack.pop()
                        os.close(sfd)
                        os.close(dfd)
                        continue
                    name, est = entry
                    if stat.S_ISREG(est.st_mode):
                        _copy_entry(sfd, dfd, dfd, name, est, [], {}, None)
                    elif stat.S_ISDIR(est.st_mode) and len(stack) < MAX_DEPTH:
                        inner = _copy_entry(sfd, dfd, dfd, name, est, [], {}, None)
                        if inner is not None:
                            made = os.open(name, _DIR, dir_fd=dfd)
                            _copy_attrs(est, inner, made)
                            stack.append((inner, made, iter(_entries(inner))))
            finally:
                for sfd, dfd, _ in stack:
                    os.close(sfd)
                    os.close(dfd)
        finally:
            os.close(dest_parent)
    finally:
        os.close(parent)
