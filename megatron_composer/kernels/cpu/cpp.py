"""C++ CPU kernels, compiled on first use.

`load(name)` builds `csrc/<name>.cpp` (ATen + pybind11 only, ~20 s once per source version, with the flags
listed in _FLAGS) and returns the module. The build is cached by torch.utils.cpp_extension under
$TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) in a directory named after a hash of the source,
the flags and the torch version, so checkouts and versions never rebuild or load each other's module.
Concurrent processes build it once: each holds an flock on the build directory while torch builds or checks
the module (`_build_dir_lock`). The kernel drops an flock when its holder dies, whereas torch's own lock file
stays behind when a process is SIGKILLed holding it (mid-build, or in the up-to-date check every first load in
a process runs) and would make every later process wait on it forever; with the flock held, such a file is
known to be stale and is removed. Where it
cannot be built (no C++ compiler or ninja, MEGATRON_COMPOSER_CPP=0) it returns None after one warning naming
the reason (`failure(name)` keeps it), and the caller runs its Python reference instead: every C++ kernel here
has a Python implementation of the same function next to its caller, and the tests compare the two.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
# extension code that calls at::parallel_for needs OpenMP, or its loops silently run on one thread
_FLAGS = {name: ("-fopenmp",) for name in ("causal_attention", "cross_entropy", "grouped_mm", "rms_norm", "rope")}
_modules: dict[str, Optional[ModuleType]] = {}
_failures: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get("MEGATRON_COMPOSER_CPP", "1") not in ("0", "false", "no")


def _put_ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja` from PATH; the pip package's binary sits beside this interpreter,
    which is not on PATH when .venv/bin/python is run without activating the environment."""
    try:
        import ninja

        where = ninja.BIN_DIR
    except Exception:
        where = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and Path(where, "ninja").exists():
        os.environ["PATH"] = where + os.pathsep + os.environ.get("PATH", "")


def toolchain_present() -> bool:
    """A C++ compiler and ninja are on PATH (what torch.utils.cpp_extension needs)."""
    _put_ninja_on_path()
    return shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None


@contextlib.contextmanager
def _build_dir_lock(extension: str):
    """Hold the extension's build directory exclusively (an flock: released by the kernel if this process dies)
    and remove a torch lock file left there by a process killed while holding it."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(extension, False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        left = build_dir / "lock"
        if left.exists():  # no process of ours holds it: its holder died
            warnings.warn(f"removing the build lock {left} left by a process that did not finish")
            left.unlink(missing_ok=True)
        yield


def failure(name: str) -> Optional[str]:
    """Why load(name) returned None in this process (None if it loaded or was not tried)."""
    return _failures.get(name)


def load(name: str) -> Optional[ModuleType]:
    """The compiled module for csrc/<name>.cpp, or None (Python fallback) when disabled or unbuildable."""
    if not enabled():
        return None
    if name in _modules:
        return _modules[name]
    module = None
    source = _CSRC / f"{name}.cpp"
    flags = ["-O3", *_FLAGS.get(name, ())]
    headers = b"".join(h.read_bytes() for h in sorted(_CSRC.glob("*.h")))  # shared by the kernels' sources
    key = hashlib.sha1(source.read_bytes() + headers + " ".join(flags).encode()
                       + torch.__version__.encode()).hexdigest()
    _put_ninja_on_path()
    try:
        from torch.utils.cpp_extension import load as build

        extension = f"megatron_composer_{name}_{key[:12]}"
        with _build_dir_lock(extension):
            module = build(extension, [str(source)], extra_cflags=flags, verbose=False)
    except Exception as e:  # no compiler, ninja or headers: the Python path computes the same function
        _failures[name] = f"{type(e).__name__}: {str(e)[-600:]}"
        warnings.warn(f"C++ kernel '{name}' could not be built ({_failures[name]}); using the Python "
                      "implementation (set MEGATRON_COMPOSER_CPP=0 to skip the attempt)")
    _modules[name] = module
    return module


__all__ = ["enabled", "failure", "load", "toolchain_present"]
