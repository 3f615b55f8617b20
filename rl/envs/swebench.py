"""Load SWE-bench instances (one JSON object per line) as Tasks, given local clones of their repositories.

Fields used: instance_id, repo ("owner/name"), base_commit, problem_statement, test_patch, FAIL_TO_PASS,
PASS_TO_PASS (lists, or JSON strings of lists as in the published dataset), and optionally patch (the gold
patch, used as the reference solution) and test_cmd (this project's extension: the command that runs the
tests; default `python3 -m pytest -rA`). An instance is resolved when every FAIL_TO_PASS test passes and every
PASS_TO_PASS test still passes after the test patch is applied to the agent's tree.

Test results are read from the log of pytest (`-rA` lines such as `PASSED tests/test_x.py::test_y`) or of
unittest/Django (`test_y (module.Class) ... ok`), the two formats SWE-bench's Python repositories use.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rl.envs.task import (
    GitTree,
    PatchSolution,
    RunStep,
    Task,
    TaskError,
    TaskLimits,
    VerifyResult,
    missing_tool,
    verifier_anomaly,
    void_on_failure,
)
from rl.envs.verdict import VERIFIER_SITE, final_run_log, site_files, verifier_env, why_runs_cannot_pass
from rl.sandbox.base import Sandbox

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
_PYTEST_RE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)")
_UNITTEST_RE = re.compile(r"^(\S+ \([^)]*\))(?: \.\.\. |.*\.\.\. )(ok|FAIL|ERROR|skipped|expected failure)")
PASSING = {"PASSED", "XPASS", "ok", "XFAIL", "expected failure"}


def parse_test_log(log: str) -> dict[str, str]:
    """Test name -> status from pytest -rA or unittest -v output; later lines win."""
    status: dict[str, str] = {}
    for line in log.splitlines():
        m = _PYTEST_RE.match(line)
        if m:
            status[m.group(2)] = m.group(1)
            continue
        m = _UNITTEST_RE.match(line)
        if m:
            status[m.group(1)] = m.group(2)
    return status


def _test_files(patch: str) -> list[str]:
    """Every path the test patch touches (added, changed or deleted)."""
    found = re.finditer(r"^(?:\+\+\+ b/|--- a/)(\S+)", patch, re.MULTILINE)
    return sorted({m.group(1) for m in found})


def _host_git(args: list[str], cwd: Path, home: str, **kw) -> subprocess.CompletedProcess:
    """git on the host with nothing configurable from outside this call: no replace refs, no system or global
    config, no system attributes, no prompts (the instance's clone and our own scratch repositories only)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "GIT_NO_REPLACE_OBJECTS": "1",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1",
           "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", *args], cwd=cwd,
                          env=env, capture_output=True, **kw)


def final_test_files(repo: Path, base_commit: str, test_patch: str, out: Path) -> list[str]:
    """The test files as the verifier needs them -- each file the test patch touches, at base_commit in the
    host's own clone, with the test patch applied -- written under out/ (a file the patch deletes is absent);
    returns the touched paths. Nothing of the agent's repository is read: its history (replace refs), config,
    attributes and hooks play no part."""
    paths = _test_files(test_patch)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch) / "work"
        _host_git(["init", "-q", str(work)], Path(scratch), scratch)
        for path in paths:
            blob = _host_git(["cat-file", "blob", f"{base_commit}:{path}"], Path(repo), scratch)
            if blob.returncode == 0:  # absent at base: a file the patch adds
                (work / path).parent.mkdir(parents=True, exist_ok=True)
                (work / path).write_bytes(blob.stdout)
        (Path(scratch) / "test.patch").write_text(test_patch)
        applied = _host_git(["apply", "--whitespace=nowarn", str(Path(scratch) / "test.patch")], work, scratch)
        if applied.returncode != 0:
            raise TaskError(f"the test patch does not apply to {repo} at {base_commit}: "
                            f"{applied.stderr.decode(errors='replace').strip()[:300]}")
        for path in paths:
            if (work / path).is_file():
                (out / path).parent.mkdir(parents=True, exist_ok=True)
                (out / path).write_bytes((work / path).read_bytes())
    return paths


def shadows(path: str) -> str:
    """Shell words for the test file at `path` and what Python would import in its place from the same folder: a
    package or namespace folder of the same name, an extension module (found before source), a sourceless or
    cached bytecode file (the patterns are left for the sandbox's shell to expand)."""
    words = [shlex.quote(path)]
    if path.endswith(".py"):
        stem = path[:-3]
        folder, name = os.path.split(stem)
        cached = os.path.join(folder, "__pycache__", name)
        words += [shlex.quote(stem + suffix) for suffix in ("", ".so", ".pyd", ".pyc")]
        words += [shlex.quote(stem) + ".*.so", shlex.quote(cached) + ".*.pyc"]
    return " ".join(words)


@dataclass
class SWEBenchVerifier:
    repo: Path  # the host's clone of the instance's repository
    base_commit: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_cmd: str

    @void_on_failure
    def verify(self, sandbox: Sandbox, task: Task) -> VerifyResult:
        # The test files the patch touches are put in place from the host's own copy of the instance (base_commit
        # plus the test patch), replacing whatever the agent left there; no git command runs in the agent's
        # repository, whose history (git replace), attributes (filters) and config the agent controls. Nothing the
        # agent started runs on: the verifier places its test files in the work tree, which the episode shares.
        sandbox.enter_verifier(services=False)
        with tempfile.TemporaryDirectory() as tmp:
            files = Path(tmp) / "tests" / "files"
            files.mkdir(parents=True)
            paths = final_test_files(self.repo, self.base_commit, self.test_patch, files)
            site_files(files.parent / VERIFIER_SITE.removeprefix("/tests/"))
            sandbox.copy_in(files.parent, "/tests")
            place = "".join(
                f"rm -rf -- {shadows(p)}; "
                + (f"mkdir -p -- {shlex.quote(str(Path(p).parent))} && "
                   f"cp -- {shlex.quote('/tests/files/' + p)} {shlex.quote(p)} || exit 1; "
                   if (files / p).is_file() else "")
                for p in paths)
        put = sandbox.exec(place or "true", cwd=task.workdir, timeout=120)
        if put.exit_code != 0:
            return VerifyResult(0.0, put.output, {"error": f"cannot put the test files in place: {put.output[-500:]}"},
                                put)
        tests = " ".join(shlex.quote(t) for t in self._selectors())
        res = sandbox.exec(f"{self.test_cmd} {tests}", cwd=task.workdir, env=verifier_env(task.env),
                           timeout=task.limits.verifier_timeout_s)
        # Only the final pytest run's summary counts (the whole log for unittest's).
        status = parse_test_log(final_run_log(res.output))
        f2p_failed = [t for t in self.fail_to_pass if status.get(t) not in PASSING]
        p2p_failed = [t for t in self.pass_to_pass if status.get(t) not in PASSING]
        details = {"FAIL_TO_PASS failing": f2p_failed, "PASS_TO_PASS failing": p2p_failed,
                   "tests": res.describe()}
        if why := verifier_anomaly(res, task.limits.verifier_timeout_s) or why_runs_cannot_pass(res.output):
            details["error"] = why
            return VerifyResult(0.0, res.output, details, res)
        missing = missing_tool(res.output, "the test command") if f2p_failed or p2p_failed else None
        if missing:  # nothing ran: this zero says nothing about the agent's work
            details["error"] = missing
        return VerifyResult(float(not f2p_failed and not p2p_failed), res.output, details, res)

    def _selectors(self) -> list[str]:
        """Arguments naming the tests: pytest node ids as given, unittest names as module.Class.method."""
        out = []
        for t in self.fail_to_pass + self.pass_to_pass:
            m = re.match(r"^(\S+) \(([^)]*)\)$", t)
            if m:  # unittest names print as "test (module.Class)" or "test (module.Class.test)" (Python 3.11+)
                dotted = m.group(2)
                out.append(dotted if dotted.endswith("." + m.group(1)) else f"{dotted}.{m.group(1)}")
            else:
                out.append(t)
        return list(dict.fromkeys(out))


def _list_field(record: dict, key: str, where: str) -> list[str]:
    value = record[key]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskError(f"{where}: field {key!r} must be a list of test names or a JSON string of one") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskError(f"{where}: field {key!r} must be a list of test names, got {value!r:.100}")
    return value


def swebench_task(record: dict, repo_dir: str | Path, where: str = "SWE-bench instance") -> Task:
    """A Task from one instance. repo_dir is a local clone of record['repo'] that contains base_commit."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise TaskError(f"{where}: missing field(s) {', '.join(repr(k) for k in missing)} "
                        f"(an instance needs {', '.join(REQUIRED)})")
    for key in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
        if not isinstance(record[key], str) or not record[key]:
            raise TaskError(f"{where}: field {key!r} must be a non-empty string")
    repo_dir = Path(repo_dir)
    if not (repo_dir / ".git").exists():
        raise TaskError(f"{where}: {repo_dir} is not a git clone of {record['repo']}")
    f2p = _list_field(record, "FAIL_TO_PASS", where)
    p2p = _list_field(record, "PASS_TO_PASS", where)
    if not f2p:
        raise TaskError(f"{where}: field 'FAIL_TO_PASS' is empty; an instance needs at least one failing test")
    test_cmd = record.get("test_cmd", "python3 -m pytest -rA")
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise TaskError(f"{where}: field 'test_cmd' must be a non-empty string")
    setup_cmd = record.get("setup_cmd")
    if setup_cmd is not None and (not isinstance(setup_cmd, str) or not setup_cmd.strip()):
        raise TaskError(f"{where}: field 'setup_cmd' must be a non-empty string")
    patch = record.get("patch")
    with tempfile.TemporaryDirectory() as tmp:  # the test patch must apply to base_commit: said now, not per episode
        final_test_files(repo_dir, record["base_commit"], record["test_patch"], Path(tmp))
    return Task(
        name=record["instance_id"],
        instruction=(f"Resolve this issue in the repository {record['repo']} (checked out at /app):\n\n"
                     f"{record['problem_statement']}"),
        tree=GitTree(repo_dir, record["base_commit"]),
        verifier=SWEBenchVerifier(repo_dir, record["base_commit"], record["test_patch"], f2p, p2p, test_cmd),
        setup=[RunStep(setup_cmd, "/app", {}, f"{where}: setup_cmd")] if setup_cmd else [],
        solution=PatchSolution(patch) if isinstance(patch, str) and patch else None,
        limits=TaskLimits(agent_timeout_s=1800.0, verifier_timeout_s=900.0),
    )


def load_swebench(path: str | Path, repos_dir: str | Path, only: str | None = None) -> list[Task]:
    """Tasks from a JSONL file; the clone of "owner/name" is repos_dir/owner__name (SWE-bench's naming) or
    repos_dir/name. With `only`, just the instance of that instance_id."""
    path, repos_dir = Path(path), Path(repos_dir)
    tasks = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise TaskError(f"{where}: each line must be a JSON object")
        if only is not None and record.get("instance_id") != only:
            continue
        repo = record.get("repo")
        if not isinstance(repo, str):
            raise TaskError(f"{where}: missing field 'repo' (an instance needs {', '.join(REQUIRED)})")
        candidates = [repos_dir / repo.replace("/", "__"), repos_dir / repo.split("/")[-1]]
        clone = next((c for c in candidates if (c / ".git").exists()), None)
        if clone is None:
            raise TaskError(f"{where}: no local clone of {repo}; expected {candidates[0]} or {candidates[1]}")
        tasks.append(swebench_task(record, clone, where))
    return tasks
