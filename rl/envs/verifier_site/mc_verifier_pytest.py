"""A pytest plugin in every pytest a verifier runs (its entry point is this folder's dist-info, found through
PYTHONPATH): it says on the run's output when the run starts (as pytest loads its plugins, before any conftest or
test module is imported) and, at the interpreter's normal exit, what it collected and how the tests ended. A run
whose process ended some other way (`os._exit` or `exec` in the code under test, a signal) has no end line: the
host's verdict rules (rl.envs.verdict.parse_test_runs) read these lines and let no such run, nor one that collected
no test, pass. The lines go to the output the process started with, whatever pytest's capture did to it since:

    [megatron-composer verifier] pytest run PID started
    [megatron-composer verifier] pytest run PID ended: session 1 collected 3 passed 2 failed 1 errors 0 ...
"""

import atexit
import os
import sys

_PREFIX = "[megatron-composer verifier] pytest run"
_PID = os.getpid()
_COUNTS = dict.fromkeys(("session", "collected", "reported", "passed", "failed", "errors", "skipped", "xfailed",
                         "xpassed"), 0)
_REPORTED: set = set()
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # an xdist worker: its controller speaks for the run
try:
    _OUT = os.dup(1)
except OSError:
    _OUT = None


def _say(text: str) -> None:
    if _WORKER or _OUT is None or os.getpid() != _PID:  # a forked child of the run is not the run
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream: the marker goes out on the descriptor anyway
            pass
    try:
        os.write(_OUT, f"\n{_PREFIX} {_PID} {text}\n".encode())
    except OSError:
        pass


def _ended() -> None:
    _COUNTS["reported"] = len(_REPORTED)
    _say("ended: " + " ".join(f"{k} {v}" for k, v in _COUNTS.items()))


_say("started")
atexit.register(_ended)


def pytest_sessionstart(session):
    _COUNTS["session"] = 1


def pytest_collection_finish(session):
    _COUNTS["collected"] = max(_COUNTS["collected"], len(getattr(session, "items", None) or ()))


def pytest_collectreport(report):
    if report.failed:
        _COUNTS["errors"] += 1


def pytest_runtest_logreport(report):
    _REPORTED.add(report.nodeid)
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            _COUNTS["xpassed" if xfail else "passed"] += 1
        elif report.failed:
            _COUNTS["failed"] += 1
        else:
            _COUNTS["xfailed" if xfail else "skipped"] += 1
    elif report.failed:  # setup or teardown
        _COUNTS["errors"] += 1
    elif report.skipped and report.when == "setup":
        _COUNTS["xfailed" if xfail else "skipped"] += 1
