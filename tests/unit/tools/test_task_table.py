"""tools/task_table.py: real task folders in a table, each untouched and with its oracle, its build and second
prepare, and for a task that cannot run here its one-line reason; the exit status says whether every task that
loads gives 0 and 1."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl.sandbox.local import bwrap_problem
from tests.unit.envs.test_envs_real_tasks import hello_world, tb1_task

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


def table(tasks: list[Path], tmp_path: Path) -> tuple[int, list[dict], str]:
    rows = tmp_path / "rows.jsonl"
    res = subprocess.run([sys.executable, "tools/task_table.py", *map(str, tasks), "--json", str(rows),
                          "--out", str(tmp_path / "table.md")], cwd=REPO, capture_output=True, text=True, timeout=600)
    return res.returncode, [json.loads(line) for line in rows.read_text().splitlines()], res.stdout


def test_tasks_that_run_and_tasks_that_cannot_are_rows(tmp_path):
    harbor = hello_world(tmp_path / "harbor")
    tb1 = tb1_task(tmp_path / "tb1")
    gpu = hello_world(tmp_path / "gpu")
    (gpu / "task.toml").write_text((gpu / "task.toml").read_text().replace("[environment]", "[environment]\ngpus = 1"))
    code, rows, text = table([harbor, tb1, gpu], tmp_path)
    assert code == 0, text
    by_format = {r["format"]: r for r in rows if r["runs"]}
    assert set(by_format) == {"Harbor", "Terminal-Bench 1"}
    for row in by_format.values():
        assert (row["unsolved"], row["oracle"], row["reason"]) == (0.0, 1.0, "")
        assert row["environment"] == "host system" and row["build_s"] is None and row["second_prepare_s"] > 0
    (refused,) = [r for r in rows if not r["runs"]]
    assert refused["unsolved"] is None and "needs 1 GPU(s)" in refused["reason"] and "\n" not in refused["reason"]
    assert "2 of 3 tasks give 0 untouched and 1 with the oracle" in text
    assert (tmp_path / "table.md").read_text() == text


def test_a_task_that_loads_but_does_not_give_0_and_1_fails_the_table(tmp_path):
    wrong = hello_world(tmp_path / "wrong")
    (wrong / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'Goodbye' > hello.txt\n")
    code, (row,), _ = table([wrong], tmp_path)
    assert code == 1 and (row["unsolved"], row["oracle"], row["runs"]) == (0.0, 0.0, False)
