"""What sandboxes hold on the host, and how it goes when a run stops.

A local sandbox holds host resources outside its own process tree: its directories (``mc-sandbox-*``, the
verifier phase's ``mc-verifier-*``, snapshots ``mc-snapshot-*`` and the build folders ``mc-task-*``), the tmpfs
mounted on them and its cgroup. Each is named with its owner: the pid and start time of the process that made it
(rl/sandbox/owners.py), so that whoever finds it later knows whether its owner still runs. Removing such a tree
never follows a link the sandbox planted in it (`remove_tree`).

- **A stop signal** (SIGTERM as SLURM and torchrun send it, SIGINT, SIGHUP): `release_on_signals`, called by the
  command lines that run sandboxes, releases everything this process holds (`hold`), refuses new sandboxes, then
  lets the signal take its course (the process ends as the signal asks; SIGINT raises KeyboardInterrupt).
- **A killed run** (SIGKILL, an OOM kill, a lost host): `sweep`, run when a local backend starts (the next run,
  `check_task`), removes what carries the tag of a process that no longer runs (mounts, cgroups, then directories)
  and says in one line what it removed. What a live process owns, and anything not named by this module, is never
  touched.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import sys
import tempfile
import threading
import types
import warnings
import weakref
from pathlib import Path
from typing import Callable, Iterator

from rl.sandbox.base import SandboxError
from rl.sandbox.limits import find_cgroup_parents, remove_cgroup, unmount
from rl.sandbox.owners import kind_of, make_dir, owner_alive, owner_of
from rl.sandbox.safe_tree import remove_tree

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_lock = threading.RLock()  # re-entrant: a signal handler may run while its own thread holds it
_held: dict[int, Callable[[], Callable[[], None] | None]] = {}  # key -> () -> its release (None: collected)
_keys = itertools.count()
_stopping = False
_swept: set[str] = set()


# Releasing on a stop signal ---------------------------------------------------------------------------------------
def hold(release: Callable[[], None]) -> int:
    """Remember `release` (it frees one sandbox, snapshot or folder) until `let_go`; a stop signal, or the end of
    the process, calls it. A bound method is held weakly, so an object that is dropped unclosed is still collected
    (its own finaliser frees it). Raises SandboxError once a stop signal arrived: a stopping process makes no new
    sandbox."""
    ref = weakref.WeakMethod(release) if isinstance(release, types.MethodType) else (lambda: release)
    with _lock:
        if _stopping:
            raise SandboxError("this process is stopping (a stop signal arrived); no new sandbox is made")
        key = next(_keys)
        _held[key] = ref
        return key


def let_go(key: int | None) -> None:
    with _lock:
        _held.pop(key, None)


def release_all() -> int:
    """Release everything this process holds, newest first (a sandbox before the snapshot it was forked from), and
    refuse new holds from now on. Returns how many were released."""
    global _stopping
    with _lock:
        _stopping = True
        releases = [r for r in (ref() for ref in _held.values()) if r is not None]
        _held.clear()
    for release in reversed(releases):
        try:
            release()
        except Exception as e:  # the rest must still go
            print(f"sandbox: releasing on stop: {e}", file=sys.stderr, flush=True)
    return len(releases)


atexit.register(release_all)  # a run that ends with sandboxes still open (an error in another thread) frees them


def _on_stop_signal(signum, frame, previous) -> None:
    n = release_all()
    if n:
        print(f"sandbox: {signal.Signals(signum).name}: released {n} sandbox resource(s)", file=sys.stderr, flush=True)
    signal.signal(signum, previous)
    if callable(previous):  # e.g. Python's SIGINT handler (KeyboardInterrupt), or a launcher's own
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        os.kill(os.getpid(), signum)  # the default action: the process ends as the signal asks


def release_on_signals() -> None:
    """Install the stop-signal handlers (from the main thread; a no-op elsewhere, where Python cannot)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)
        if previous is None or previous == signal.SIG_IGN or getattr(previous, "_releases_sandboxes", False):
            continue

        def handler(signum, frame, previous=previous):
            _on_stop_signal(signum, frame, previous)

        handler._releases_sandboxes = True
        signal.signal(sig, handler)


# Removing a tree a sandbox wrote ------------------------------------------------------------------------------------
def force_rmtree(path: Path) -> None:
    """Detach the sandbox's own tmpfs at `path` (if it is one) and remove what is there (remove_tree); what
    cannot be removed is said in a warning, never raised, so that the caller goes on to release the rest."""
    if os.path.ismount(path):
        unmount(path)
    failed = remove_tree(path)
    if failed:
        warnings.warn(f"could not remove {len(failed)} path(s) of a sandbox, e.g. {failed[0]}", stacklevel=2)


# Sweeping what killed runs left ------------------------------------------------------------------------------------
def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_points() -> list[str]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    return [_unescape(line.split()[4]) for line in lines if len(line.split()) > 4]


def _dead(name: str) -> bool:
    owner = owner_of(name)
    return owner is not None and not owner_alive(owner)


def sweep(parent: str | Path | None = None, force: bool = False) -> str | None:
    """Remove what runs that no longer exist left under `parent` (the temporary directory by default) and in the
    sandbox cgroups: mounts first (detached), then cgroups (their processes killed), then the directories. Runs once
    per process and parent unless `force`. Returns the one-line account of what was removed (also printed to
    stderr), or None when there was nothing."""
    parent = Path(parent or tempfile.gettempdir()).resolve()
    with _lock:
        if str(parent) in _swept and not force:
            return None
        _swept.add(str(parent))
    try:
        names = [n for n in os.listdir(parent) if _dead(n)]
    except OSError:
        names = []
    mounts = 0
    for point in sorted(_mount_points(), key=len, reverse=True):  # deepest first
        rel = os.path.relpath(point, parent)
        if not rel.startswith("..") and rel != "." and _dead(rel.split(os.sep)[0]):
            unmount(Path(point))
            mounts += 1
    cgroups = 0
    found = find_cgroup_parents()
    if found is not None:
        for base in dict.fromkeys(d for d in (found.memory, found.pids, found.freezer) if d):
            try:
                children = [d for d in base.iterdir() if d.is_dir() and _dead(d.name)]
            except OSError:
                continue
            for d in children:
                remove_cgroup(found.version, d)
                cgroups += not d.exists()
    kinds: dict[str, int] = {}
    failed = 0
    for name in names:
        if remove_tree(parent / name):
            failed += 1
        else:
            kind = kind_of(name)
            kinds[kind] = kinds.get(kind, 0) + 1
    if not (kinds or mounts or cgroups or failed):
        return None
    parts = [f"{n} {kind} folder(s)" for kind, n in sorted(kinds.items())]
    parts += [f"{mounts} mount(s)", f"{cgroups} cgroup(s)"]
    line = f"sandbox: removed what stopped runs left under {parent}: {', '.join(parts)}"
    owners = sorted({owner_of(n)[0] for n in names})
    if owners:
        line += f" (of pids {', '.join(map(str, owners[:5]))}{' ...' if len(owners) > 5 else ''})"
    if failed:
        line += f"; {failed} folder(s) could not be removed"
    print(line, file=sys.stderr, flush=True)
    return line


@contextlib.contextmanager
def held_dir(kind: str, parent: str | Path | None = None) -> Iterator[Path]:
    """``with held_dir("task") as path:`` a `make_dir` folder that is removed at the end of the block, or by a stop
    signal before it (for host folders that live while a task is built)."""
    path = make_dir(kind, parent)
    key = None
    try:
        key = hold(lambda: force_rmtree(path))
        yield path
    finally:
        let_go(key)
        force_rmtree(path)
