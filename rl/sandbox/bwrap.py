"""bubblewrap, as the sandboxes and the image builds start it: where it is, and what it says about the process it
started (--info-fd)."""

from __future__ import annotations

import json
import os
import select
import shutil
import time

from rl.sandbox.base import SandboxError


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


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
