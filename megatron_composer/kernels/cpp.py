"""C++ CPU kernels, compiled on first use.

`load(name)` builds `csrc/<name>.cpp` (ATen + pybind11 only, ~20 s once per source version; the build is
cached by torch.utils.cpp_extension under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, and
guarded by a file lock, so concurrent ranks build it once) and returns the module. Where it cannot be built
(no C++ compiler, MEGATRON_COMPOSER_CPP=0) it returns None after one warning naming the reason, and the
caller runs its Python reference instead: every C++ kernel here has a Python implementation of the same
function next to its caller, and the tests compare the two.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

_CSRC = Path(__file__).resolve().parent / "csrc"
_modules: dict[str, Optional[ModuleType]] = {}


def enabled() -> bool:
    return os.environ.get("MEGATRON_COMPOSER_CPP", "1") not in ("0", "false", "no")


def load(name: str, extra_cflags: tuple[str, ...] = ()) -> Optional[ModuleType]:
    """The compiled module for csrc/<name>.cpp, or None (Python fallback) when disabled or unbuildable."""
    if not enabled():
        return None
    if name in _modules:
        return _modules[name]
    module = None
    try:
        from torch.utils.cpp_extension import load as build

        module = build(f"megatron_composer_{name}", [str(_CSRC / f"{name}.cpp")],
                       extra_cflags=["-O3", *extra_cflags], verbose=False)
    except Exception as e:  # no compiler or headers: the Python path computes the same function
        warnings.warn(f"C++ kernel '{name}' could not be built ({type(e).__name__}: {str(e)[-600:]}); "
                      "using the Python implementation (set MEGATRON_COMPOSER_CPP=0 to skip the attempt)")
    _modules[name] = module
    return module


__all__ = ["enabled", "load"]
