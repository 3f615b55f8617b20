"""The per-command launcher (launcher.c, `mc-enter`), compiled on first use.

Each command of an episode used to cross a chain of programs (a shell to join the cgroup, prlimit, nsenter, setpriv,
a nested bubblewrap), about 28 ms a command, where a container runtime's `exec` pays one process. mc-enter does what
that chain did in one process: join the cgroup, set rlimits, join the episode's namespaces, take the command's user
with no capabilities, no_new_privs, the seccomp filter, exec. It is compiled with the host's C compiler into a cache
folder (root: /var/cache/megatron-composer/bin; else ~/.cache/megatron-composer/bin), named by a digest of its
source, once per host.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from rl.sandbox.base import SandboxError

SOURCE = Path(__file__).with_name("launcher.c")


def _bin_dir() -> Path:
    if os.environ.get("MC_BIN_CACHE"):
        return Path(os.environ["MC_BIN_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/cache/megatron-composer/bin")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-composer" / "bin"


@functools.lru_cache(maxsize=1)
def launcher_path() -> str:
    """The compiled mc-enter (built now if this host has none of this source). Raises SandboxError in one line when
    it cannot be built."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    folder = _bin_dir()
    exe = folder / f"mc-enter-{digest}"
    if os.access(exe, os.X_OK):
        return str(exe)
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SandboxError("the local sandbox builds its launcher (rl/sandbox/launcher.c) with a C compiler, which "
                           "this host lacks: apt-get install gcc (or dnf install gcc)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o755)
    except OSError:  # no cache of ours to keep it in (a HOME we cannot write): this process's own folder
        folder = Path(tempfile.mkdtemp(prefix="mc-bin-"))
        exe = folder / f"mc-enter-{digest}"
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(exe, os.X_OK):
            return str(exe)
        fd, tmp = tempfile.mkstemp(prefix=".mc-enter-", dir=folder)
        os.close(fd)
        try:
            errors = ""
            for static in (["-static"], []):  # static where the C library allows: no dynamic loader per command
                res = subprocess.run([compiler, "-O2", "-Wall", *static, "-o", tmp, str(SOURCE)], capture_output=True,
                                     text=True)
                if res.returncode == 0:
                    break
                errors = res.stderr.strip().splitlines()[-1:] or ["no output"]
            else:
                raise SandboxError(f"cannot build the sandbox's launcher with {compiler}: {errors[0]}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, exe)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return str(exe)


def launcher_problem() -> str | None:
    try:
        launcher_path()
        return None
    except (SandboxError, OSError) as e:
        return str(e)
