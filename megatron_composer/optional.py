"""Optional dependencies, imported where their feature is used so the rest of the project imports without them.

megatron-core (indexed pretraining datasets), zstandard (weight-sync delta compression), s3fs (the `s3://`
object store) and torchao (a benchmark baseline) are needed only by those features: `require` imports one
when the feature first runs and, when it is missing, raises a one-line error naming the feature and the fix.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType


class MissingDependency(ImportError):
    """An optional package a feature needs is not installed; the message names the feature and the install."""


def require(module: str, feature: str, package: str | None = None) -> ModuleType:
    """Import `module` for `feature`, or raise MissingDependency saying which package to install."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core warns at import about optional GPU libraries
            return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own dependencies is missing: show that error as it is
        pkg = package or module.split(".")[0]
        raise MissingDependency(f"{feature} needs the '{pkg}' package, which is not installed: "
                                f"pip install {pkg}") from None
