"""tools/task_table.py: real task folders in a table, each untouched and with its oracle, its build and second
prepare, and every row right, refused or flagged with its one-line reason, or wrong (no reason): the closing count
says how many of each and the exit status whether any is wrong."""

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
    by_format = {r["format"]: r for r in rows if r["verdict"] == "right"}
    assert set(by_format) == {"Harbor", "Terminal-Bench 1"}
    for row in by_format.values():
        assert (row["unsolved"], row["oracle"], row["reason"]) == (0.0, 1.0, "")
        assert row["environment"] == "host system" and row["build_s"] is None and row["second_prepare_s"] > 0
    (refused,) = [r for r in rows if r["verdict"] != "right"]
    assert refused["unsolved"] is None and "needs 1 GPU(s)" in refused["reason"] and "\n" not in refused["reason"]
    assert refused["verdict"] == "refused"
    assert ("3 tasks: 2 right (0 untouched, 1 with the oracle), 1 refused with their reason, 0 flagged with their "
            "reason, 0 wrong (a verdict without a reason)") in text
    assert (tmp_path / "table.md").read_text() == text


def test_a_reference_solution_its_verifier_rejects_is_flagged_with_the_test_that_failed(tmp_path):
    """A reference solution that runs without an error and scores 0 is no verdict on the agent's work: the row says
    so with the test that failed, and check_task --oracle exits 1 with the same line."""
    broken = hello_world(tmp_path / "broken")
    (broken / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'Goodbye' > hello.txt\n")
    code, (row,), text = table([broken], tmp_path)
    assert code == 0 and (row["unsolved"], row["oracle"], row["verdict"]) == (0.0, 0.0, "flagged"), text
    assert row["reason"] == ("the reference solution ran without an error and scores 0 of 1: the verifier rejects "
                             "the task's own solution (FAILED test_hello_file_content)"), row["reason"]
    assert "1 flagged with their reason, 0 wrong (a verdict without a reason)" in text
    res = subprocess.run([sys.executable, "tools/check_task.py", str(broken), "--oracle"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1 and res.stdout.splitlines()[-1] == "0", res.stdout + res.stderr
    assert "error: the reference solution ran without an error and scores 0 of 1" in res.stderr


def test_a_verifier_that_ignores_the_agent_s_work_is_flagged(tmp_path):
    """An untouched task that scores 1 (tests that run the canonical solution, not the agent's file) is flagged
    with its reason, as is an untouched task's partial credit; neither fails the table."""
    always = hello_world(tmp_path / "always")
    (always / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    partial = hello_world(tmp_path / "partial")
    (partial / "tests" / "test.sh").write_text(
        "h=0; [ -f /app/hello.txt ] && h=1; echo \"{\\\"style\\\": 1, \\\"hello\\\": $h}\" > "
        "/logs/verifier/reward.json\n")
    code, rows, text = table([always, partial], tmp_path)
    assert code == 0 and [r["verdict"] for r in rows] == ["flagged", "flagged"], text
    assert rows[0]["reason"] == ("the verifier does not depend on the agent's work: the untouched task scores 1, as "
                                 "much as the reference solution (1)")
    assert rows[1]["reason"].startswith("partial credit: the untouched task scores 0.5 (style 1, hello 0)")
