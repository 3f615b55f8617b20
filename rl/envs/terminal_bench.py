"""Terminal-Bench 1 task folders, read into the same Task as Harbor's.

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

import yaml

from rl.envs.dockerfile import parse_dockerfile
from rl.envs.swebench import PASSING, parse_test_log
from rl.envs.task import (
    EmptyTree,
    Task,
    TaskError,
    TaskLimits,
    VerifyResult,
    missing_tool,
    verifier_anomaly,
    void_on_failure,
)
from rl.envs.task_folder import check_inside, positive_number, read_compose, verifier_requirements
from rl.envs.verdict import VERIFIER_SITE, final_run, final_run_log, site_files, verifier_env, why_runs_cannot_pass
from rl.sandbox.base import ExecResult, Sandbox

DEFAULT_RUN_TESTS = "#!/bin/bash\npython3 -m pytest \"$TEST_DIR/test_outputs.py\" -rA\n"
KNOWN_KEYS = {"instruction", "descriptions", "author_name", "author_email", "difficulty", "category", "tags",
              "parser_name", "max_agent_timeout_sec", "max_test_timeout_sec", "run_tests_in_same_shell",
              "disable_asciinema", "estimated_duration_sec", "expert_time_estimate_min",
              "junior_time_estimate_min"}


@dataclass
class PytestLogVerifier:
    """tests/ and run-tests.sh at /tests, `bash /tests/run-tests.sh`, the verdict from its pytest -rA summary."""

    tests_dir: Path | None
    run_tests: str = DEFAULT_RUN_TESTS
    env: dict[str, str] = field(default_factory=dict)

    @void_on_failure
    def verify(self, sandbox: Sandbox, task: Task) -> VerifyResult:
        sandbox.enter_verifier()
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


def _instruction(data: dict, where: str) -> str:
    if isinstance(data.get("instruction"), str) and data["instruction"].strip():
        return data["instruction"]
    for item in data.get("descriptions") or []:
        if isinstance(item, dict) and item.get("key", "base") == "base" and isinstance(item.get("description"), str):
            return item["description"]
    raise TaskError(f"{where} has no instruction (an `instruction:` text, or a `descriptions:` entry with key base)")


def _solution(task_dir: Path) -> CommandSolution | None:
    script, listed = task_dir / "solution.sh", task_dir / "solution.yaml"
    if script.is_file():
        return CommandSolution([script.read_text()])
    if not listed.is_file():
        return None
    try:
        items = yaml.safe_load(listed.read_text())
    except yaml.YAMLError as e:
        raise TaskError(f"{listed} is not YAML: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) and isinstance(i.get("command"), str)
                                                            for i in items):
        raise TaskError(f"{listed} must be a list of entries with a `command:` text")
    return CommandSolution([i["command"] for i in items])


def load_terminal_bench_task(task_dir: str | Path) -> Task:
    """A Terminal-Bench 1 task folder (task.yaml, Dockerfile, run-tests.sh, tests/, solution.sh or .yaml)."""
    task_dir = Path(task_dir)
    where = task_dir / "task.yaml"
    check_inside(task_dir)
    try:
        data = yaml.safe_load(where.read_text())
    except yaml.YAMLError as e:
        raise TaskError(f"{where} is not YAML: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(data, dict):
        raise TaskError(f"{where} must be a mapping of task fields")
    parser = data.get("parser_name", "pytest")
    if parser != "pytest":
        hint = ("; Terminal-Bench's SWE-bench adapter runs in its instance's swebench/sweb.eval image (the repository "
                "and its environment): run SWE-bench instances from their JSONL (tools/check_task.py INSTANCES.jsonl "
                "--instance ID)") if parser == "swebench" else ""
        raise TaskError(f"{where}: parser_name {parser!r} is not supported; Terminal-Bench tasks here use pytest"
                        + hint)
    notes = [f"{where}: unknown key {k} is ignored" for k in sorted(set(data) - KNOWN_KEYS)]
    limits = TaskLimits(
        agent_timeout_s=positive_number(data.get("max_agent_timeout_sec", 360.0), f"{where}: max_agent_timeout_sec"),
        verifier_timeout_s=positive_number(data.get("max_test_timeout_sec", 60.0), f"{where}: max_test_timeout_sec"))
    dockerfile = task_dir / "Dockerfile"
    run_tests = task_dir / "run-tests.sh"
    run_tests_text = run_tests.read_text(errors="replace") if run_tests.is_file() else DEFAULT_RUN_TESTS
    setup, image, workdir, env, entrypoint = [], None, "/app", {}, ()
    if dockerfile.is_file():
        plan = parse_dockerfile(dockerfile, task_dir)
        wanted = ("run-tests.sh", verifier_requirements(run_tests_text))
        setup, image = plan.task_parts(dockerfile, limits.setup_timeout_s, wanted)
        workdir, env, entrypoint = plan.workdir, dict(plan.env), plan.entrypoint
        notes += plan.notes
    compose_notes, services = read_compose(task_dir)
    notes += compose_notes
    tests_dir = task_dir / "tests"
    return Task(
        name=task_dir.name,
        instruction=_instruction(data, str(where)),
        tree=EmptyTree(),
        verifier=PytestLogVerifier(tests_dir if tests_dir.is_dir() else None,
                                   run_tests_text),
        workdir=workdir,
        env=env,
        setup=setup,
        image=image,
        entrypoint=entrypoint,
        services=services,
        solution=_solution(task_dir),
        limits=limits,
        source=task_dir,
        environment_dir=task_dir if dockerfile.is_file() else None,
        notes=notes,
        metadata={k: data[k] for k in ("difficulty", "category", "tags") if k in data},
    )
