"""First on PYTHONPATH in every Python a verifier runs, which runs with PYTHONSAFEPATH=1 (Python puts no folder of
the work tree first on sys.path): the folder Python would have put first (the script's, or the working directory
for -m and -c) goes last instead, so the repository's modules still import, but what the agent left in the work
tree (a `pytest.py`, a `unittest/` package) shadows neither the standard library nor an installed distribution.
Distribution metadata found only through that folder (a `*.dist-info` with a pytest11 entry point, which pytest
would load as a plugin) is not an installed distribution either: `importlib.metadata` does not list it.
Bytecode the agent left in a `__pycache__` counts only where it matches its source: hash-based bytecode, which
Python otherwise may load without looking at the source at all, is always checked (as `--check-hash-based-pycs
always` does). (Pythons before 3.11 ignore PYTHONSAFEPATH and put that folder first themselves; nothing here can
change that.)"""

import _imp
import os
import sys

_imp.check_hash_based_pycs = "always"

_argv0 = sys.argv[0] if sys.argv else ""
try:
    _first = os.getcwd() if _argv0 in ("", "-c", "-m") else os.path.dirname(os.path.realpath(_argv0))
except OSError:  # a working directory that no longer exists
    _first = None
if _first is not None and _first not in sys.path:
    sys.path.append(_first)

    from importlib.machinery import PathFinder

    _find_distributions = PathFinder.find_distributions

    def _installed_only(context=None, **kwargs):
        """PathFinder.find_distributions over sys.path without the folder appended above."""
        from importlib.metadata import DistributionFinder  # loaded already: only importlib.metadata calls this

        context = context if context is not None else DistributionFinder.Context(**kwargs)
        path = [p for p in context.path if os.path.realpath(p or ".") != os.path.realpath(_first)]
        return _find_distributions(DistributionFinder.Context(name=context.name, path=path))

    PathFinder.find_distributions = staticmethod(_installed_only)
