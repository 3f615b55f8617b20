"""Who owns a host resource of a sandbox: every folder a sandbox takes (and the tmpfs and cgroup named after it) is
called `mc-<kind>-<pid>.<start time>-XXXX`, the pid and start time of the process that made it, so that whoever
finds it later can tell whether its owner still runs (rl/sandbox/leftovers.py sweeps those whose owner is gone)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

KINDS = ("sandbox", "verifier", "snapshot", "task", "add", "probe", "build")
_NAME = re.compile(r"^mc-(" + "|".join(KINDS) + r")-(\d+)\.(\d+)-")


def _start_time(pid: int) -> int:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22): with the pid, it names one
    process for the life of the host (a pid may be reused, not with the same start time)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[19])


def owner_tag() -> str:
    """`<pid>.<start time>` of this process (computed per call: a forked child is another owner)."""
    pid = os.getpid()
    return f"{pid}.{_start_time(pid)}"


def owner_of(name: str) -> tuple[int, int] | None:
    """(pid, start time) a host resource's name carries, or None when it is not named by `make_dir`."""
    m = _NAME.match(name)
    return (int(m.group(2)), int(m.group(3))) if m else None


def kind_of(name: str) -> str | None:
    m = _NAME.match(name)
    return m.group(1) if m else None


def owner_alive(owner: tuple[int, int]) -> bool:
    try:
        return _start_time(owner[0]) == owner[1]
    except (OSError, IndexError, ValueError):
        return False


def make_dir(kind: str, parent: str | Path | None = None) -> Path:
    """A new private directory `mc-<kind>-<owner>-XXXX` under `parent` (the temporary directory by default)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")
    return Path(tempfile.mkdtemp(prefix=f"mc-{kind}-{owner_tag()}-", dir=parent))
