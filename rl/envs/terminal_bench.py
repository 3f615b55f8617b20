"""Terminal-Bench 1 task folders, read into the same Task as Harbor's (rl/envs/harbor.py reads the folder,
rl/envs/task_config.py its task.yaml); here, how such a task is verified and solved.

    task.yaml             instruction (or descriptions: [{key: base, description: ...}]), max_agent_timeout_sec,
                          max_test_timeout_sec, parser_name (pytest, the only parser its tasks use)
    Dockerfile            the environment, its build context the task folder (read as Harbor's, rl/envs/dockerfile.py)
    docker-compose.yaml   the task's one container: a note (several services are refused)
    run-tests.sh          the verifier: run as `bash /tests/run-tests.sh` with TEST_DIR=/tests once tests/ is at
                          /tests; without one, `python3 -m pytest $TEST_DIR/test_outputs.py -rA`
    solution.sh | solution.yaml   the reference solution: a script, or a list of {command: ...}

The verdict is Terminal-Bench's: the run's pytest -rA summary, resolved (reward 1) when it names at least one
test and every test passed, under the rules every verifier follows (rl/envs/verdict.py): only the final pytest run's
summary is read, a run that ended early or collected no test decides nothing, a killed run is void, and Python runs
with PYTHONSAFEPATH and the verifier's site (the default `python3 -m pytest` from the WORKDIR finds no `pytest` the
agent left there). Like SWE-bench's, that log is written where the code under test runs (docs/SANDBOX.md).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rl.envs.swebench import PASSING, parse_test_log
from rl.envs.task import Task, VerifyResult, missing_tool, verifier_anomaly, verifier_phase, void_on_failure
from rl.envs.verdict import VERIFIER_SITE, final_run, final_run_log, site_files, verifier_env, why_runs_cannot_pass
from rl.sandbox.base import ExecResult, Sandbox

DEFAULT_RUN_TESTS = "#!/bin/bash\npython3 -m pytest \"$TEST_DIR/test_outputs.py\" -rA\n"


@dataclass
class PytestLogVerifier:
    """tests/ and run-tests.sh at /tests, `bash /tests/run-tests.sh`, the verdict from its pytest -rA summary."""

    tests_dir: Path | None
    run_tests: str = DEFAULT_RUN_TESTS
    env: dict[str, str] = field(default_factory=dict)

    @void_on_failure
    def verify(self, sandbox: Sandbox, task: Task) -> VerifyResult:
        sandbox.enter_verifier(**verifier_phase(task))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "tests"
            if self.tests_dir is not None:
                shutil.copytree(self.tests_dir, folder)
            folder.mkdir(exist_ok=True)
            (folder / "run-tests.sh").write_text(self.run_tests)
            sandbox.copy_in(folder, "/tests")
            sandbox.copy_in(site_files(Path(tmp) / "site"), VERIFIER_SITE)
        res = sandbox.exec("bash /tests/run-tests.sh", cwd=task.workdir,
                           env=verifier_env(task.env, {"TEST_DIR": "/tests"}, self.env),
                           timeout=task.limits.verifier_timeout_s)
        details: dict = {"tests": res.describe()}
        services = sandbox.end_episode()
        if services:
            details["background_processes"] = services
        # Only the final pytest run's summary counts; a run that ended early or collected nothing decides nothing.
        status = parse_test_log(final_run_log(res.output))
        final = final_run(res.output)
        missing = missing_tool(res.output, "the test script")
        why = (verifier_anomaly(res, task.limits.verifier_timeout_s) or why_runs_cannot_pass(res.output)
               or (None if status or (res.exit_code != 0 and not missing) else
                   "the tests printed no pytest -rA summary line (PASSED/FAILED name)"))
        if why:
            details["error"] = f"{why}; {missing}" if missing else why
            return VerifyResult(0.0, res.output, details, res)
        if not status:  # they failed before naming a test (the code under test does not build): Terminal-Bench's
            details["failing"] = ["(no test ran)"]  # parse failure, which it counts unresolved
            return VerifyResult(0.0, res.output, details, res)
        details["failing"] = sorted(name for name, s in status.items() if s not in PASSING)
        if final is not None and final.counts.get("failed", 0) + final.counts.get("errors", 0) > 0 \
                and not details["failing"]:  # the run counted failures its summary lines do not show
            details["failing"] = [f"({final.counts.get('failed', 0)} failed, {final.counts.get('errors', 0)} "
                                  "errors by the run's own count)"]
        if details["failing"] and missing:  # a failure because the tests could not run says nothing of the work
            details["error"] = missing
        return VerifyResult(float(not details["failing"]), res.output, details, res)


@dataclass
class CommandSolution:
    """Shell commands run one after another from the task's working directory (solution.sh as one command, or
    the commands of solution.yaml); what they start in the background keeps running, as in the episode."""

    commands: list[str]

    def as_commands(self) -> list[str]:
        return list(self.commands)

    def apply(self, sandbox: Sandbox, task: Task) -> ExecResult:
        results = [sandbox.exec(c, cwd=task.workdir, timeout=task.limits.agent_timeout_s) for c in self.commands]
        return next((r for r in results if r.exit_code != 0), results[-1])
