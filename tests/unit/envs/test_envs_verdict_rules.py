"""One verdict rule set for every verifier (rl/envs/verdict.py): a killed run is void, a failure in the verifier phase
is a void verdict rather than an exception, only the final pytest summary counts, a run that ended early or collected
nothing cannot pass, and no module of the work tree shadows what the verifier's Python imports. Fast: pytest runs
here with this Python and the verifier's site, the verifiers against a scripted sandbox."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from rl.envs.swebench import SWEBenchVerifier, parse_test_log
from rl.envs.task import ScriptVerifier, Task, TaskLimits, VerifyResult
from rl.envs.terminal_bench import PytestLogVerifier
from rl.envs.verdict import (
    SITE_DIR,
    HostFault,
    final_run_log,
    parse_test_runs,
    verifier_env,
    why_runs_cannot_pass,
)
from rl.sandbox.base import ExecResult, SandboxError

TESTS = "import mod\n\n\ndef test_one():\n    assert mod.f() == 1\n\n\ndef test_two():\n    assert True\n"


@pytest.fixture
def tree(tmp_path):
    """A work tree (the agent's) and a tests folder (the verifier's) whose tests import the work tree's module."""
    (tmp_path / "app").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "app" / "mod.py").write_text("def f():\n    return 1\n")
    (tmp_path / "tests" / "test_a.py").write_text(TESTS)
    return tmp_path


def verifier_python(tree: Path, *argv: str, site: bool = True, safe_path: bool = True) -> str:
    """`python -m ...` from the work tree as a verifier runs it (its environment, with the site at SITE_DIR), the
    merged output. Without `site`: a script replaced PYTHONPATH; without `safe_path` either: Python as it is."""
    env = {**verifier_env({"PATH": os.environ["PATH"]}), "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = str(SITE_DIR) if site else ""
    if not safe_path:
        del env["PYTHONSAFEPATH"]
    res = subprocess.run([sys.executable, *argv], cwd=tree / "app", env=env, capture_output=True, text=True,
                         timeout=120)
    return res.stdout + res.stderr


def pytest_run(tree: Path, *args: str, **how) -> str:
    return verifier_python(tree, "-m", "pytest", "-p", "no:cacheprovider", *args, str(tree / "tests"), **how)


def test_an_honest_pytest_run_passes_and_its_final_summary_is_read(tree):
    out = pytest_run(tree, "-rA")
    (run,) = parse_test_runs(out)
    assert run.end is not None and run.counts["passed"] == 2 and run.counts["collected"] == 2, out
    assert why_runs_cannot_pass(out) is None
    assert parse_test_log(final_run_log(out)) == {"../tests/test_a.py::test_one": "PASSED",
                                                  "../tests/test_a.py::test_two": "PASSED"}, out


@pytest.mark.parametrize("flags", [["-rA"], ["-q"]])
def test_a_module_that_ends_the_process_as_it_loads_cannot_pass(tree, flags):
    (tree / "app" / "mod.py").write_text("import os\nos._exit(0)\n")
    out = pytest_run(tree, *flags)
    assert "started and printed no final summary" in (why_runs_cannot_pass(out) or ""), out


def test_a_run_that_collected_no_tests_cannot_pass(tree):
    """The namespace-package trick: the test module's name is a folder, so 0 tests run and pytest's exit is not 1."""
    (tree / "tests" / "test_a.py").unlink()
    (tree / "tests" / "test_a.py").mkdir()
    for site in (True, False):  # the site's own lines, or pytest's final line where a script replaced PYTHONPATH
        out = pytest_run(tree, "-rA", site=site)
        assert "collected no tests" in (why_runs_cannot_pass(out) or ""), out
    ran_zero = "test_x (m.T) ... ok\n\n----\nRan 1 test in 0.001s\n\nOK\nRan 0 tests in 0.000s\n\nOK\n"
    assert why_runs_cannot_pass(ran_zero) == "a unittest run collected no tests"
    assert "started and printed no final summary" in why_runs_cannot_pass("test_x (m.T) ... ok\n")
    assert why_runs_cannot_pass("test_x (m.T) ... ok\n\n----\nRan 1 test in 0.001s\n\nOK\n") is None


def test_an_error_collecting_is_a_failed_run_not_an_empty_one(tree):
    (tree / "app" / "mod.py").write_text("raise ImportError('broken')\n")
    out = pytest_run(tree, "-rA")
    assert why_runs_cannot_pass(out) is None and "ERROR ../tests/test_a.py" in final_run_log(out), out


def test_lines_printed_outside_the_final_summary_do_not_count(tree):
    """The code under test prints passing lines while the tests run (-s) and, from an atexit hook, after pytest's
    summary: only the final summary's lines are read."""
    (tree / "app" / "mod.py").write_text(
        "import atexit\nprint('PASSED ../tests/test_a.py::test_one')\n"
        "atexit.register(lambda: print('PASSED ../tests/test_a.py::test_one'))\n\ndef f():\n    return 2\n")
    out = pytest_run(tree, "-rA", "-s")
    assert out.count("PASSED ../tests/test_a.py::test_one") == 2, out
    assert parse_test_log(out)["../tests/test_a.py::test_one"] == "PASSED"  # read whole, the last line wins
    assert parse_test_log(final_run_log(out))["../tests/test_a.py::test_one"] == "FAILED", out


def test_no_module_of_the_work_tree_shadows_the_runner_or_the_standard_library(tree):
    """`python3 -m pytest` from the work tree (Terminal-Bench 1's default run-tests.sh, `cd /app && python3 -m
    pytest /tests`): the installed pytest and unittest run, the agent's are not imported; the work tree's own modules
    still import (last on sys.path)."""
    for plant in ("pytest.py", "unittest/__init__.py", "sitecustomize.py"):
        (tree / "app" / plant).parent.mkdir(parents=True, exist_ok=True)
        (tree / "app" / plant).write_text("import os\nos.write(1, b'THE AGENT RAN')\nos._exit(0)\n")
    assert "THE AGENT RAN" in verifier_python(tree, "-m", "pytest", site=False, safe_path=False)  # without the rule
    out = pytest_run(tree, "-rA")
    assert "THE AGENT RAN" not in out and why_runs_cannot_pass(out) is None and "2 passed" in out, out
    out = verifier_python(tree, "-m", "unittest", "-h")
    assert "THE AGENT RAN" not in out and "usage:" in out, out


def test_a_pytest_plugin_declared_in_the_work_tree_is_not_loaded(tree):
    """A *.dist-info in the work tree with a pytest11 entry point: pytest would load the agent's plugin (which could
    turn every failure into a pass) were the work tree's metadata an installed distribution."""
    app = tree / "app"
    (app / "evil-1.dist-info").mkdir()
    (app / "evil-1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1\n")
    (app / "evil-1.dist-info" / "entry_points.txt").write_text("[pytest11]\nevil = evilplugin\n")
    (app / "evilplugin.py").write_text("print('THE AGENT PLUGIN LOADED')\n")
    assert "THE AGENT PLUGIN LOADED" in pytest_run(tree, "-rA", site=False, safe_path=False)  # without the rule
    out = pytest_run(tree, "-rA")
    assert "THE AGENT PLUGIN LOADED" not in out and "2 passed" in out, out


def test_bytecode_the_agent_planted_for_a_placed_file_does_not_run(tree):
    """The verifier puts a file into the work tree and imports it; the agent left an unchecked hash-based .pyc for
    that name in __pycache__ (which Python would load without reading the source)."""
    app = tree / "app"
    (app / "forged.py").write_text("import os\nos.write(1, b'THE AGENT RAN')\n")
    py_compile.compile(str(app / "forged.py"), cfile=importlib.util.cache_from_source(str(app / "placed.py")),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    (app / "placed.py").write_text("print('the verifier ran')\n")
    assert "THE AGENT RAN" in verifier_python(tree, "-c", "import placed", site=False, safe_path=False)
    out = verifier_python(tree, "-c", "import placed")
    assert "THE AGENT RAN" not in out and "the verifier ran" in out, out


def test_a_script_that_sets_pythonpath_keeps_the_site_first():
    env = verifier_env({"PYTHONPATH": "/opt/lib", "PATH": "/bin"}, {"TEST_DIR": "/tests"})
    assert env["PYTHONPATH"] == "/tests/.verifier/site:/opt/lib" and env["PYTHONSAFEPATH"] == "1"
    assert env["UV_OFFLINE"] == "1" and env["TEST_DIR"] == "/tests" and env["PATH"] == "/bin"


# Every verifier, against a sandbox that plays a scripted verifier phase ---------------------------------------------
class ScriptedSandbox:
    """Enough of a Sandbox for a verifier: its command gives `result`; `fail` names an operation that raises."""

    workdir = "/app"

    def __init__(self, result: ExecResult, reward: bytes | None = b"1\n", fail: str | None = None):
        self.result, self.reward, self.fail = result, reward, fail

    def _maybe_fail(self, what: str) -> None:
        if self.fail == what:
            raise SandboxError(f"cannot make the verifier's directories under /x: [Errno 17] File exists: "
                               f"'/var/log/entrypoint.log' ({what})")

    def enter_verifier(self, services: bool = True) -> None:
        self._maybe_fail("enter_verifier")

    def copy_in(self, host_path, dest: str, merge: bool = False) -> None:
        self._maybe_fail("copy_in")

    def exec(self, command: str, **kw) -> ExecResult:
        self._maybe_fail("exec")
        if command.startswith(("cd /logs/verifier", "rm -rf", "true")):  # the reward folder check, placing files
            return ExecResult(0, "", 0, 0.0)
        return self.result

    def read_file(self, path: str, max_bytes: int) -> bytes | None:
        return self.reward if path.endswith("reward.txt") else None

    def end_episode(self):
        return None


@pytest.fixture
def verifiers(tmp_path):
    """The three verifier formats, as their loaders make them."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "test_calc.py").write_text("def test_add():\n    assert True\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
                   check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "tests").mkdir()
    patch = ("diff --git a/test_calc.py b/test_calc.py\n--- a/test_calc.py\n+++ b/test_calc.py\n@@ -1,2 +1,2 @@\n"
             " def test_add():\n-    assert True\n+    assert 1 + 1 == 2\n")
    return {"harbor": ScriptVerifier(tmp_path / "tests"), "terminal-bench-1": PytestLogVerifier(None),
            "swe-bench": SWEBenchVerifier(repo, head, patch, ["test_calc.py::test_add"], [], "python3 -m pytest -rA")}


PASSING_LOG = "PASSED test_calc.py::test_add\n"
TASK = Task("t", "do it", tree=None, verifier=None, limits=TaskLimits(verifier_timeout_s=30))


@pytest.mark.parametrize("kind", ["harbor", "terminal-bench-1", "swe-bench"])
def test_every_verifier_passes_an_honest_run_and_voids_a_killed_one(verifiers, kind):
    honest = verifiers[kind].verify(ScriptedSandbox(ExecResult(0, PASSING_LOG, 30, 0.1)), TASK)
    assert honest.reward == 1.0 and "error" not in honest.details, honest.details
    for killed in (ExecResult(137, PASSING_LOG, 30, 0.1, events=["killed (SIGKILL)"]),
                   ExecResult(124, PASSING_LOG, 30, 30.0, timed_out=True)):
        result = verifiers[kind].verify(ScriptedSandbox(killed), TASK)
        assert result.reward == 0.0 and ("killed before it finished" in result.details["error"]
                                         or "timed out after 30 s" in result.details["error"]), result.details


@pytest.mark.parametrize("kind", ["harbor", "terminal-bench-1", "swe-bench"])
@pytest.mark.parametrize("log", [
    "[megatron-composer verifier] pytest run 7 started\nPASSED test_calc.py::test_add\n",
    "[megatron-composer verifier] pytest run 7 started\nPASSED test_calc.py::test_add\n"
    "[megatron-composer verifier] pytest run 7 ended: session 1 collected 0 reported 0 passed 0 errors 0\n",
], ids=["ended-early", "collected-nothing"])
def test_every_verifier_lets_no_unfinished_or_empty_run_pass(verifiers, kind, log):
    result = verifiers[kind].verify(ScriptedSandbox(ExecResult(0, log, len(log), 0.1)), TASK)
    assert result.reward == 0.0 and ("printed no final summary" in result.details["error"]
                                     or "collected no tests" in result.details["error"]), result.details


@pytest.mark.parametrize("kind", ["harbor", "terminal-bench-1", "swe-bench"])
@pytest.mark.parametrize("fail", ["enter_verifier", "copy_in", "exec"])
def test_a_failure_in_the_verifier_phase_is_a_void_verdict_not_an_exception(verifiers, kind, fail):
    """Class 9 of #57: a folder the agent put where the phase's machinery writes made `verify` raise, which RL took
    for a broken sandbox (retried, then the group dropped); now it is the episode's 0 with the reason."""
    result = verifiers[kind].verify(ScriptedSandbox(ExecResult(0, PASSING_LOG, 30, 0.1), fail=fail), TASK)
    assert isinstance(result, VerifyResult) and result.reward == 0.0
    assert result.details["error"].startswith("the verifier phase failed, no verdict: cannot make the verifier's") \
        and "\n" not in result.details["error"], result.details


def test_a_failure_while_the_host_is_short_is_the_hosts(verifiers, monkeypatch):
    monkeypatch.setattr("rl.envs.task.host_shortage", lambda: "the host's disk at /tmp has 3 MiB free")
    with pytest.raises(HostFault, match="the host's disk at /tmp has 3 MiB free"):
        verifiers["harbor"].verify(ScriptedSandbox(ExecResult(0, "", 0, 0.1), fail="copy_in"), TASK)
