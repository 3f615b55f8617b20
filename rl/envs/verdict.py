"""The rules every verifier's verdict follows, whatever its format (Harbor's test.sh, Terminal-Bench 1's pytest log,
SWE-bench's FAIL_TO_PASS lists): what the verifier's Pythons run with, which test runs in its output can make a pass,
and which failures are the host's (the episode is run again) rather than the episode's (a void verdict).

* **Its Pythons** (`verifier_env`): PYTHONSAFEPATH=1 with `verifier_site/` first on PYTHONPATH, so that a module in
  the work tree shadows neither the standard library nor an installed distribution (pytest, unittest); hash-based
  bytecode always checked against its source; uv offline, from a cache the image's build warmed. Every verifier
  phase gets the site at `VERIFIER_DIR/site` inside /tests, which only the host writes before the verifier starts.
* **Its test runs** (`parse_test_runs`): every pytest run announces its start and end on the output (the site's plugin,
  `verifier_site/mc_verifier_pytest.py`; pytest's own session header and final line where that plugin is not loaded),
  unittest ends with "Ran N tests". A run that started and printed no final summary (the code under test ended the
  process as it loaded: `os._exit(0)`) or that collected no test (a namespace package in place of the test module)
  cannot pass (`why_runs_cannot_pass`), and only the final run's summary is read for the verdict (`final_run_log`).
* **Faults**: `host_shortage` says when the host itself ran short of disk or memory; a failure then is a `HostFault`
  (retried), any other failure in the verifier phase is the episode's: a void verdict with its reason.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SITE_DIR = Path(__file__).parent / "verifier_site"
VERIFIER_DIR = "/tests/.verifier"  # the verifier's own files: a dot folder, which `pytest /tests` does not collect
VERIFIER_SITE = f"{VERIFIER_DIR}/site"  # read-only to the verifier, as all of /tests


def verifier_env(*envs: dict[str, str]) -> dict[str, str]:
    """The environment of a verifier's command: `envs` (the task's, then the verifier's own; later ones win) with
    the verifier's Python and uv settings over them. A PYTHONPATH they set follows the verifier's site. uv's cache,
    tools and Pythons go to a folder of /tmp whose name is drawn anew for each call, so that nothing the agent left in
    /tmp or HOME is taken for them (the cache is made on first use by rl/sandbox/image_tools/uv.py, from the one the
    image's build warmed)."""
    merged: dict[str, str] = {}
    for env in envs:
        merged.update(env)
    own_path = merged.get("PYTHONPATH", "")
    scratch = f"/tmp/.mc-verifier-{secrets.token_hex(8)}"
    return {**merged,
            "PYTHONSAFEPATH": "1",  # no folder of the work tree first on sys.path (Python >= 3.11)
            "PYTHONPATH": VERIFIER_SITE + (f":{own_path}" if own_path else ""),
            "PYTHONNOUSERSITE": "1",
            "UV_OFFLINE": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": f"{scratch}/uv-cache",
            "UV_NO_PROGRESS": "1", "UV_LINK_MODE": "copy",  # the cache and the work tree are different mounts
            # uv's tools and Pythons of the verifier's own, not those of HOME (an installed tool would answer `uvx`)
            "UV_TOOL_DIR": f"{scratch}/uv-tools", "UV_TOOL_BIN_DIR": f"{scratch}/uv-tools/bin",
            "UV_PYTHON_INSTALL_DIR": f"{scratch}/uv-python", "UV_PYTHON_BIN_DIR": f"{scratch}/uv-python/bin",
            # `uv venv DIR` replaces what is at DIR (as the uv releases these scripts fetch did), so a folder the
            # agent made there, with a `bin/activate` or `bin/pytest` of its own, is gone before the verifier uses it
            "UV_VENV_CLEAR": "1"}


def site_files(dest: Path) -> Path:
    """The verifier's site (sitecustomize and the pytest plugin with its entry point) copied to `dest`, for the
    host to put at VERIFIER_SITE."""
    shutil.copytree(SITE_DIR, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


# Test runs in a verifier's output ----------------------------------------------------------------------------------
_MARK = re.compile(r"^\[megatron-composer verifier\] pytest run (\d+) (started|ended: (.*))$", re.MULTILINE)
_PYTEST_HEADER = re.compile(r"^=+ test session starts =+$", re.MULTILINE)
# pytest's final line: "=== 3 passed, 1 failed in 0.12s ===", "=== no tests ran in 0.01s ===" ("-q": no '=')
_PYTEST_FINAL = re.compile(r"^(?:=+ )?((?:\d+ [a-z]+(?:, )?)+|no tests ran) in [\d.]+s(?: \([^)\n]*\))?(?: =+)?$",
                           re.MULTILINE)
_SHORT_SUMMARY = re.compile(r"^=+ short test summary info =+$", re.MULTILINE)
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s$", re.MULTILINE)
_UNITTEST_STATUS = re.compile(r"^\S+ \([^)]*\)(?: \.\.\. |.*\.\.\. )(?:ok|FAIL|ERROR|skipped|expected failure)",
                              re.MULTILINE)


@dataclass
class TestRun:
    """One test run in a verifier's output: where it started and ended (character offsets; end None: it printed no
    final summary) and what it counted (for pytest: session, collected, reported, passed, failed, errors, ...)."""

    __test__ = False  # not a test class, for pytest's collection of the project's own tests

    runner: str  # "pytest" or "unittest"
    start: int
    end: int | None
    counts: dict[str, int] = field(default_factory=dict)
    pid: int | None = None

    @property
    def ran_nothing(self) -> bool:
        if self.runner == "unittest":
            return self.counts.get("ran", 0) == 0
        # a run that never reached a session (`pytest --version`) tested nothing and claims nothing; an error in
        # collecting (the code under test does not import) is a failed run, not an empty one
        return (bool(self.counts.get("session", 1)) and self.counts.get("collected", 0) == 0
                and self.counts.get("reported", 0) == 0 and self.counts.get("errors", 0) == 0)


def _pytest_counts(summary: str) -> dict[str, int]:
    """pytest's final line as counts ("3 passed, 1 error" -> {"passed": 3, "errors": 1, "collected": 4})."""
    counts = {"session": 1}
    for number, word in re.findall(r"(\d+) ([a-z]+)", summary):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = counts.get(key, 0) + int(number)
    counts["collected"] = sum(counts.get(k, 0) for k in ("passed", "failed", "errors", "skipped", "xfailed",
                                                         "xpassed", "deselected"))
    return counts


def parse_test_runs(output: str) -> list[TestRun]:
    """Every pytest and unittest run in `output`, in the order they started. pytest runs come from the verifier
    site's start and end lines; where there are none (a script that replaced PYTHONPATH), from pytest's own session
    header and final line. unittest runs end at "Ran N tests"; one whose per-test lines ("test (mod.C) ... ok") are
    not followed by that line has no end."""
    runs: list[TestRun] = []
    open_runs: dict[int, TestRun] = {}
    for m in _MARK.finditer(output):
        pid = int(m.group(1))
        if m.group(2) == "started":
            open_runs[pid] = TestRun("pytest", m.start(), None, {}, pid)
            runs.append(open_runs[pid])
        elif pid in open_runs:
            run = open_runs.pop(pid)
            run.end = m.start()
            run.counts = {k: int(v) for k, v in re.findall(r"([a-z]+) (\d+)", m.group(3))}
    if not runs:
        headers = [m.start() for m in _PYTEST_HEADER.finditer(output)]
        for i, start in enumerate(headers):
            stop = headers[i + 1] if i + 1 < len(headers) else len(output)
            final = None
            for final in _PYTEST_FINAL.finditer(output, start, stop):
                pass  # the last one of the session
            runs.append(TestRun("pytest", start, final.start() if final else None,
                                _pytest_counts(final.group(1)) if final else {}))
    last_end = 0
    for m in _UNITTEST_RAN.finditer(output):
        runs.append(TestRun("unittest", last_end, m.start(), {"ran": int(m.group(1))}))
        last_end = m.end()
    trailing = _UNITTEST_STATUS.search(output, last_end)
    if trailing:
        runs.append(TestRun("unittest", trailing.start(), None))
    return sorted(runs, key=lambda r: r.start)


def why_runs_cannot_pass(output: str) -> str | None:
    """Why the test runs in a verifier's output cannot make a pass, in one line, or None: one started and printed no
    final summary (its process ended early: the code under test ends it as it loads, `os._exit(0)`), or one
    collected no test (a namespace package or an empty module in place of the test file)."""
    for run in parse_test_runs(output):
        who = f"a {run.runner} run" + (f" (pid {run.pid})" if run.pid else "")
        if run.end is None:
            return (f"{who} started and printed no final summary: its process ended before the tests did (the code "
                    "under test ended it?)")
        if run.ran_nothing:
            return f"{who} collected no tests"
    return None


def final_run_log(output: str) -> str:
    """The part of `output` a log verdict is read from: the final pytest run's short test summary (the `-rA` lines
    pytest prints last; the whole run where it printed none), else the whole output. Lines the code under test
    printed before the summary, or in another run, do not count."""
    final = final_run(output)
    if final is None:
        return output
    summaries = list(_SHORT_SUMMARY.finditer(output, final.start, final.end))
    if not summaries:
        return output[final.start:final.end]
    tail = _PYTEST_FINAL.search(output, summaries[-1].end(), final.end)
    return output[summaries[-1].end():tail.start() if tail else final.end]


def final_run(output: str) -> TestRun | None:
    """The pytest run whose summary a log verdict reads (the one that ended last), or None."""
    ended = [r for r in parse_test_runs(output) if r.runner == "pytest" and r.end is not None]
    return max(ended, key=lambda r: r.end) if ended else None


# Faults of the host ------------------------------------------------------------------------------------------------
HOST_MIN_FREE_MB = 256  # below this (or 1% of the disk, 2% of memory) the host, not an episode, is short


class HostFault(RuntimeError):
    """The host failed an episode (its disk or memory ran short, a sandbox could not start): nothing the episode's
    actions caused, so the episode is run again rather than scored."""


def host_shortage(folder: str | None = None) -> str | None:
    """What the host is short of, in words, or None: free disk where sandboxes live (`folder`, default the
    temporary folder) or available memory (tmpfs sandboxes are memory too) below HOST_MIN_FREE_MB or 1% / 2%."""
    folder = folder or tempfile.gettempdir()
    try:
        disk = shutil.disk_usage(folder)
        if disk.free < max(HOST_MIN_FREE_MB << 20, disk.total // 100):
            return f"the host's disk at {folder} has {disk.free >> 20} MiB free"
    except OSError:
        pass
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available, total = (int(info[k].split()[0]) << 10 for k in ("MemAvailable", "MemTotal"))
    except (OSError, KeyError, ValueError):
        return None
    if available < max(HOST_MIN_FREE_MB << 20, total // 50):
        return f"the host has {available >> 20} MiB of memory available"
    return None


def one_line(text: str, limit: int = 300) -> str:
    """`text` as one line of at most `limit` characters."""
    line = re.sub(r"\s+", " ", text).strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."
