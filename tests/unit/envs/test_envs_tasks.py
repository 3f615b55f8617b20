"""The bundled Harbor tasks: untouched they score 0, after their reference solution 1, through the sandbox and
the agent tool protocol; loaders reject broken task folders with messages naming the file and field."""

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

REPO = Path(__file__).resolve().parents[3]
# What the host system (standing in for the task images) needs for each kind of bundled task.
TOOLS = {"python": ["python3"], "shell": ["bash"], "c": ["gcc", "make"], "js": ["node"]}
TASKS = sorted(p for p in (REPO / "examples" / "tasks").iterdir() if (p / "task.toml").is_file())
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(LocalBackend(), prepare_task, concurrency=2) as p:
        yield p


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
