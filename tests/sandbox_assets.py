"""What a process left on the host of its sandboxes (rl/sandbox/leftovers.py names each with its owner): its folders
under a parent, the mounts under them and its cgroups."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rl.sandbox.owners import owner_of


def _pid_of(name: str) -> int:
    return (owner_of(name) or (0,))[0]


def left_by(parent: Path, pid: int) -> dict:
    from rl.sandbox.limits import find_cgroup_parents

    mounts = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True).stdout.split()
    found = find_cgroup_parents()
    cgroups = [] if found is None else [d.name for base in {found.memory, found.pids} for d in base.iterdir()
                                        if _pid_of(d.name) == pid]
    return {"folders": sorted(n for n in os.listdir(parent) if _pid_of(n) == pid),
            "mounts": [m for m in mounts if m.startswith(f"{parent}/") and _pid_of(m[len(str(parent)) + 1:]) == pid],
            "cgroups": cgroups}


NOTHING = {"folders": [], "mounts": [], "cgroups": []}
