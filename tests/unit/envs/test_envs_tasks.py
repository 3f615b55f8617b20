"""The bundled Harbor tasks: untouched they score 0, after their reference solution 1, through the sandbox and
the agent tool protocol; loaders reject broken task folders with messages naming the file and field."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl.envs.agent import noop_policy, oracle_policy, run_episode
from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import TaskError, prepare_task
from rl.sandbox.local import LocalBackend, bwrap_problem
from rl.sandbox.pool import SandboxPool
from tools import case_harness

REPO = Path(__file__).resolve().parents[3]
# What the host system (standing in for the task images) needs for each kind of bundled task.
TOOLS = {"python": ["python3"], "shell": ["bash"], "c": ["gcc", "make"], "js": ["node"]}
TASKS = sorted(p for p in (REPO / "examples" / "tasks").iterdir() if (p / "task.toml").is_file())
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(LocalBackend(), prepare_task, concurrency=2) as p:
        yield p


def test_bundled_tasks_take_their_verdict_from_the_case_harness():
    """Each bundled task's harness is the project's (tools/case_harness.py), and each case has its expected
    output (tools/make_task_cases.py) and a program to print what the code computes."""
    canonical = (REPO / "tools" / "case_harness.py").read_text()
    for task in TASKS:
        assert (task / "tests" / "harness.py").read_text() == canonical, task.name
        cases = json.loads((task / "tests" / "cases.json").read_text())["cases"]
        assert cases and all(c["argv"] and c["expect"] for c in cases), task.name
        assert "harness.py /tests/cases.json" in (task / "tests" / "test.sh").read_text(), task.name


def test_the_case_harness_passes_only_exact_output_and_success(tmp_path):
    """Run here without `judge` (it runs the children directly where there is none): a case passes on exit 0 and
    exactly the expected text; a wrong value, a failing exit and a flood do not; nor does an empty file."""
    py = [sys.executable, "-c"]
    cases = {"right": (py + ["print(42)"], "42\n", True),
             "no trailing newline": (py + ["print(42, end='')"], "42\n", True),
             "wrong": (py + ["print(41)"], "42", False),
             "exits 1": (py + ["print(42); raise SystemExit(1)"], "42", False),
             "exits 0 early": (py + ["import os; os._exit(0)"], "42", False),
             "flood": (py + ["import sys; sys.stdout.write('42' * 10**6)"], "42", False),
             "stdin": (py + ["print(input()[::-1])"], "cba", True)}
    for name, (argv, expect, want) in cases.items():
        case = {"name": name, "argv": argv, "expect": expect, **({"stdin": "abc"} if name == "stdin" else {})}
        assert case_harness.run_case(case, [])[0] is want, name
    path = tmp_path / "cases.json"
    for listed, code in (([], 1), (["right", "stdin"], 0), (["right", "wrong"], 1)):
        path.write_text(json.dumps({"cases": [{"name": n, "argv": cases[n][0], "expect": cases[n][1],
                                               "stdin": "abc"} for n in listed]}))
        assert subprocess.run([sys.executable, "-I", str(REPO / "tools" / "case_harness.py"), str(path)],
                              capture_output=True).returncode == code, listed


def test_bundled_tasks_cover_three_languages():
    assert len(TASKS) >= 12
    kinds = {p.name.split("-")[0] for p in TASKS}
    assert {"python", "shell", "c", "js"} <= kinds


@needs_bwrap
@pytest.mark.parametrize("task_dir", TASKS, ids=[p.name for p in TASKS])
def test_task_untouched_zero_oracle_one_scripted_agent_one(task_dir, pool):
    missing = [t for t in TOOLS[task_dir.name.split("-")[0]] if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{task_dir.name} needs {', '.join(missing)} on this machine")
    task = load_harbor_task(task_dir)
    noop = pool.submit(task, lambda sbx: run_episode(task, sbx, noop_policy()))
    scripted = pool.submit(task, lambda sbx: run_episode(task, sbx, oracle_policy(task)))

    def harbor_oracle(sbx):  # what `check_task --oracle` does: solution/ at /solution, bash solve.sh
        assert task.solution.apply(sbx, task).exit_code == 0
        return task.verifier.verify(sbx, task)

    oracle = pool.submit(task, harbor_oracle)
    noop, scripted, oracle = noop.result(), scripted.result(), oracle.result()
    assert oracle.reward == 1.0, oracle.output[-3000:]
    assert noop.reward == 0.0 and noop.submitted and noop.stop_reason == "submitted"
    assert scripted.reward == 1.0, scripted.verify.output[-3000:]
    assert scripted.malformed_tool_calls == 0 and scripted.open_todos == 0
    assert scripted.tool_calls["run"] >= 1 and scripted.tool_calls["list_dir"] == 1
    pool.release(task)


@needs_bwrap
def test_check_task_cli_prints_reward_last(tmp_path):
    task = REPO / "examples" / "tasks" / "python-roman-numerals"
    for flag, want in (([], "0"), (["--oracle"], "1")):
        res = subprocess.run([sys.executable, "tools/check_task.py", str(task), *flag], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().splitlines()[-1] == want


@needs_bwrap
def test_check_task_function_harbor_oracle():
    task = load_harbor_task(REPO / "examples" / "tasks" / "shell-config-lookup")
    backend = LocalBackend()
    assert check_task(task, backend, oracle=False, log=lambda s: None).reward == 0.0
    result = check_task(task, backend, oracle=True, log=lambda s: None)
    assert result.reward == 1.0, result.output


# Bad task folders ---------------------------------------------------------------------------------------------
def _copy_task(tmp_path, name="python-lru-cache-bug"):
    dest = tmp_path / name
    shutil.copytree(REPO / "examples" / "tasks" / name, dest)
    return dest


def test_missing_verifier_is_named(tmp_path):
    task = _copy_task(tmp_path)
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"has no verifier: expected tests/test.sh"):
        load_harbor_task(task)
    res = subprocess.run([sys.executable, "tools/check_task.py", str(task)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "no verifier" in res.stderr


def test_malformed_task_toml_names_file_and_line(tmp_path):
    task = _copy_task(tmp_path)
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = \n')
    with pytest.raises(TaskError, match=r"task.toml is not valid TOML.*line 2"):
        load_harbor_task(task)


def test_bad_task_toml_field_is_named(tmp_path):
    task = _copy_task(tmp_path)
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n')
    with pytest.raises(TaskError, match=r"task.toml: \[verifier\].timeout_sec must be a positive number"):
        load_harbor_task(task)
    (task / "task.toml").write_text('[environment]\nmemory = "lots"\n')
    with pytest.raises(TaskError, match=r"\[environment\].memory must look like"):
        load_harbor_task(task)


def test_task_toml_limits_are_read(tmp_path):
    task = _copy_task(tmp_path)
    (task / "task.toml").write_text('[verifier]\ntimeout_sec = 12.0\n[agent]\ntimeout_sec = 34\n'
                                    '[environment]\nmemory = "1G"\nstorage_mb = 300\n[verifier.env]\nX = "1"\n')
    t = load_harbor_task(task)
    assert (t.limits.verifier_timeout_s, t.limits.agent_timeout_s) == (12.0, 34.0)
    assert (t.limits.memory_mb, t.limits.storage_mb) == (1024, 300)
    assert t.verifier.env == {"X": "1"}
