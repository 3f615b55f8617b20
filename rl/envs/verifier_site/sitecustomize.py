"""On PYTHONPATH for the SWE-bench verifier's tests, which run with PYTHONSAFEPATH=1 (Python puts no folder of the
work tree first on sys.path): the folder Python would have put first (the script's, or the working directory for
-m and -c) goes last instead. The repository's modules still import, but what the agent left in the work tree
(a `pytest.py`, a `unittest/` package) shadows neither the standard library nor the test runner."""

import os
import sys

_argv0 = sys.argv[0] if sys.argv else ""
_first = os.getcwd() if _argv0 in ("", "-c", "-m") else os.path.dirname(os.path.realpath(_argv0))
if _first not in sys.path:
    sys.path.append(_first)
