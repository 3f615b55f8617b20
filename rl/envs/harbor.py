"""Load Harbor / Terminal-Bench 2 task folders, unmodified.

    task/
      instruction.md          what the agent is asked to do
      task.toml               limits: [agent].timeout_sec, [verifier].timeout_sec, env, reward_range
                              ([low, high], default [0, 1]) and judge_reads (files of tests/ the code under
                              test may read inside `judge`),
                              [environment] build_timeout_sec, memory_mb (or memory = "2G"), cpus,
                              storage_mb (or storage), docker_image, env
      environment/Dockerfile  the machine; build context environment/ (optional: empty /app otherwise)
      tests/test.sh           verifier; copied to /tests after the agent finished, writes
                              /logs/verifier/reward.txt
      solution/solve.sh       reference solution (optional)

The working tree is /app. `[agent].max_turns` is read as an extension (default 50). Keys this loader does not
know are named in a TaskFormatWarning (and the task's notes): they have no effect here. A file or folder of the
task that resolves outside the task folder (a symlink to the host) is refused. A compose file beside the
Dockerfile is a note with one service and refused with several. A Terminal-Bench 1 folder (task.yaml, no
instruction.md) is read by rl/envs/terminal_bench.py into the same Task.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path

from rl.envs.dockerfile import parse_dockerfile
from rl.envs.steps import STRATEGIES
from rl.envs.task import EmptyTree, ScriptSolution, ScriptVerifier, Task, TaskError, TaskLimits, TaskStep
from rl.envs.task_folder import check_inside, positive_number, read_compose, verifier_requirements
from rl.envs.terminal_bench import load_terminal_bench_task

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_SIZE_MB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def _number(table: dict, key: str, where: str, default: float) -> float:
    return positive_number(table.get(key, default), f"{where}.{key}")


def _size_mb(table: dict, key_mb: str, key_str: str, where: str, default: int) -> int:
    if key_mb in table:
        return int(_number(table, key_mb, where, default))
    if key_str in table:
        value = table[key_str]
        m = _SIZE_RE.match(str(value))
        if not m:
            raise TaskError(f"{where}.{key_str} must look like '2G' or '512M', got {value!r}")
        return max(1, int(float(m.group(1)) * _SIZE_MB[m.group(2).upper()]))
    return default


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise TaskError(f"{where}: [{key}] must be a table, got {value!r}")
    return value


def _reward_range(table: dict, where: str) -> tuple[float, float]:
    """[verifier].reward_range = [low, high]: the rewards the verifier may give (default [0, 1])."""
    value = table.get("reward_range", [0.0, 1.0])
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
          and value[0] < value[1])
    if not ok:
        raise TaskError(f"{where}.reward_range must be [low, high] with finite low < high, got {value!r}")
    return float(value[0]), float(value[1])


def _judge_reads(table: dict, where: str, tests_dir: Path) -> tuple[str, ...]:
    """[verifier].judge_reads = ["file", ...]: files of tests/ that the code under test may read inside `judge`
    (where /tests is otherwise empty); each a relative path to a file the task has."""
    value = table.get("judge_reads", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskError(f"{where}.judge_reads must be a list of paths under tests/, got {value!r}")
    for path in value:
        parts = Path(path).parts
        if not path or path.startswith("/") or ".." in parts or ":" in path or not (tests_dir / path).is_file():
            raise TaskError(f"{where}.judge_reads: {path!r} is not a file of {tests_dir} (give paths relative to "
                            "tests/, without '..' or ':')")
    return tuple(value)


def _env(table: dict, where: str) -> dict[str, str]:
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, (str, int, float, bool)) for v in env.values()):
        raise TaskError(f"{where}.env must be a table of strings, got {env!r}")
    return {str(k): str(v) for k, v in env.items()}


# task.toml keys this loader reads or knowingly ignores ([metadata] is free-form); others get a warning.
KNOWN_KEYS = {
    "": {"version", "schema_version", "task", "metadata", "verifier", "agent", "environment", "solution", "source",
         "steps", "multi_step_reward_strategy", "artifacts"},
    "verifier": {"timeout_sec", "env", "reward_range", "judge_reads"},
    "agent": {"timeout_sec", "max_turns"},
    "environment": {"build_timeout_sec", "docker_image", "cpus", "memory", "memory_mb", "storage", "storage_mb",
                    "allow_internet", "env", "gpus", "gpu_types"},
    "solution": {"env"},
}


class TaskFormatWarning(UserWarning):
    """A task file holds something this loader does not honour; the task still loads."""


def unknown_keys(data: dict, toml_path: Path) -> list[str]:
    out = []
    for table, known in KNOWN_KEYS.items():
        values = data if not table else data.get(table, {})
        if isinstance(values, dict):
            for key in values:
                if key not in known:
                    name = f"[{table}].{key}" if table else key
                    out.append(f"{toml_path}: unknown key {name} is ignored (known here: {', '.join(sorted(known))})")
    return out


AGENT_WRITABLE = ("/app", "/tmp", "/logs", "/var", "/run", "/dev/shm")


def writable_search_paths(envs: dict[str, dict[str, str]], task_dir: Path) -> list[str]:
    """A warning for each search path (PATH, PYTHONPATH, ...) that names a folder the agent can write: a program
    or module the agent plants there runs in place of the one the verifier means."""
    out = []
    for what, env in envs.items():
        for var in ("PATH", "PYTHONPATH", "NODE_PATH", "PERL5LIB", "RUBYLIB", "LD_LIBRARY_PATH"):
            bad = [d for d in env.get(var, "").split(":")
                   if d and any(d == w or d.startswith(w + "/") for w in AGENT_WRITABLE)]
            if bad:
                out.append(f"{task_dir}: the {what} puts {', '.join(bad)} on {var}, which the agent can write: what it "
                           f"plants there runs in the verifier instead of what the verifier means; call programs by "
                           "absolute path in tests/test.sh and keep work-tree folders off search paths")
    return out


def read_task_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{path} is not valid TOML: {e}") from None


def load_harbor_task(task_dir: str | Path) -> Task:
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        raise TaskError(f"task folder {task_dir} does not exist")
    instruction_path = task_dir / "instruction.md"
    toml_path = task_dir / "task.toml"
    test_sh = task_dir / "tests" / "test.sh"
    if not instruction_path.is_file() and (task_dir / "task.yaml").is_file():
        return load_terminal_bench_task(task_dir)  # a Terminal-Bench 1 folder
    multi_step = toml_path.is_file() and "steps" in read_task_toml(toml_path)
    if not instruction_path.is_file() and not multi_step:
        raise TaskError(f"{task_dir} has no instruction.md: a Harbor task states its instruction there")
    if not toml_path.is_file():
        raise TaskError(f"{task_dir} has no task.toml: a Harbor task declares its limits there")
    if not test_sh.is_file() and not multi_step:
        raise TaskError(f"{task_dir} has no verifier: expected {test_sh.relative_to(task_dir)} "
                        "(it runs as `bash /tests/test.sh` and writes /logs/verifier/reward.txt)")
    check_inside(task_dir)
    data = read_task_toml(toml_path)
    verifier_t = _table(data, "verifier", str(toml_path))
    agent_t = _table(data, "agent", str(toml_path))
    env_t = _table(data, "environment", str(toml_path))
    where = f"{toml_path}: [verifier]"
    limits = TaskLimits(
        agent_timeout_s=_number(agent_t, "timeout_sec", f"{toml_path}: [agent]", 600.0),
        verifier_timeout_s=_number(verifier_t, "timeout_sec", where, 600.0),
        setup_timeout_s=_number(env_t, "build_timeout_sec", f"{toml_path}: [environment]", 600.0),
        memory_mb=_size_mb(env_t, "memory_mb", "memory", f"{toml_path}: [environment]", 2048),
        storage_mb=_size_mb(env_t, "storage_mb", "storage", f"{toml_path}: [environment]", 10240),
        cpus=_number(env_t, "cpus", f"{toml_path}: [environment]", 1.0),
        max_turns=int(_number(agent_t, "max_turns", f"{toml_path}: [agent]", 50)),
    )
    docker_image = env_t.get("docker_image")
    if docker_image is not None and not isinstance(docker_image, str):
        raise TaskError(f"{toml_path}: [environment].docker_image must be a string, got {docker_image!r}")
    env = _env(env_t, f"{toml_path}: [environment]")
    environment_dir = task_dir / "environment"
    dockerfile = environment_dir / "Dockerfile"
    setup, image, workdir, notes, entrypoint = [], None, "/app", [], ()
    if dockerfile.is_file():
        plan = parse_dockerfile(dockerfile, environment_dir)
        scripts = [test_sh] + sorted((task_dir / "steps").glob("*/tests/test.sh"))
        wanted = [r for script in scripts if script.is_file()
                  for r in verifier_requirements(script.read_text(errors="replace"))]
        setup, image = plan.task_parts(dockerfile, limits.setup_timeout_s,
                                       ("tests/test.sh", list(dict.fromkeys(wanted))))
        workdir, notes, entrypoint = plan.workdir, plan.notes, plan.entrypoint
        env = {**plan.env, **env}
    for note in unknown_keys(data, toml_path) + writable_search_paths(
            {"task environment": env, "verifier environment": _env(verifier_t, where)}, task_dir):
        warnings.warn(note, TaskFormatWarning, stacklevel=2)
        notes.append(note)
    compose_notes, services = read_compose(environment_dir)
    notes += compose_notes
    gpus = env_t.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise TaskError(f"{toml_path}: [environment].gpus must be a whole number, got {gpus!r}")
    if gpus:
        raise TaskError(f"{toml_path}: the task needs {gpus} GPU(s) ([environment].gpus); the sandboxes here have none")
    if data.get("artifacts"):
        notes.append(f"{toml_path}: artifacts are not collected here; what the verifier needs it reads in the sandbox")
    if env_t.get("allow_internet"):
        notes.append(f"{toml_path}: allow_internet=true is not granted; sandboxes have no network")
    solution_dir = task_dir / "solution"
    solution_env = _env(_table(data, "solution", str(toml_path)), f"{toml_path}: [solution]")
    solution = ScriptSolution(solution_dir, solution_env) if (solution_dir / "solve.sh").is_file() else None
    task = Task(
        name=task_dir.name,
        instruction=instruction_path.read_text() if instruction_path.is_file() else "",
        tree=EmptyTree(),
        verifier=ScriptVerifier(task_dir / "tests", env=_env(verifier_t, where),
                                reward_range=_reward_range(verifier_t, where),
                                judge_reads=_judge_reads(verifier_t, where, task_dir / "tests")),
        workdir=workdir,
        env=env,
        setup=setup,
        image=image,
        entrypoint=entrypoint,
        services=services,
        solution=solution,
        limits=limits,
        source=task_dir,
        environment_dir=environment_dir if dockerfile.is_file() else None,
        docker_image=docker_image,
        notes=notes,
        metadata=dict(data.get("metadata") or {}),
    )
    return with_steps(task, data, toml_path) if multi_step else task


def with_steps(task: Task, data: dict, toml_path: Path) -> Task:
    """The task with Harbor 1.1's [[steps]]: each steps/<name>/ holds instruction.md, tests/test.sh (over the
    task's shared tests/), solution/solve.sh and workdir/; [steps.agent]/[steps.verifier] timeouts and env,
    [steps.healthcheck] command and min_reward come from task.toml (rl/envs/steps.py runs them)."""
    task_dir, where = task.source, str(toml_path)
    tables = data.get("steps")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise TaskError(f"{where}: steps must be [[steps]] tables, each with a name")
    strategy = data.get("multi_step_reward_strategy", "mean")
    if strategy not in STRATEGIES:
        raise TaskError(f"{where}: multi_step_reward_strategy {strategy!r} is not one of {list(STRATEGIES)}")
    shared = task_dir / "tests"
    steps = []
    for n, table in enumerate(tables, 1):
        name = table.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise TaskError(f"{where}: step {n} needs a name (a folder under steps/), got {name!r}")
        folder, at = task_dir / "steps" / name, f"{where}: step {name!r}"
        for need in ("instruction.md", "tests/test.sh"):
            if not (folder / need).is_file():
                raise TaskError(f"{at} has no steps/{name}/{need}")
        agent_t, verifier_t = _table(table, "agent", at), _table(table, "verifier", at)
        base = task.limits
        limits = dataclasses.replace(
            base, agent_timeout_s=_number(agent_t, "timeout_sec", f"{at} [agent]", base.agent_timeout_s),
            verifier_timeout_s=_number(verifier_t, "timeout_sec", f"{at} [verifier]", base.verifier_timeout_s))
        check = _table(table, "healthcheck", at).get("command")
        if check is not None and not isinstance(check, str):
            raise TaskError(f"{at}: [steps.healthcheck].command must be a shell command, got {check!r}")
        need = table.get("min_reward")
        if need is not None and not (isinstance(need, (int, float)) and not isinstance(need, bool)) and not (
                isinstance(need, dict) and all(isinstance(v, (int, float)) for v in need.values())):
            raise TaskError(f"{at}: min_reward must be a number or a table of numbers, got {need!r}")
        solve = folder / "solution"
        verifier = dataclasses.replace(task.verifier, tests_dir=folder / "tests",
                                       env={**task.verifier.env, **_env(verifier_t, f"{at} [verifier]")},
                                       shared_tests_dir=shared if shared.is_dir() else None)
        step_task = dataclasses.replace(
            task, name=f"{task.name}/{name}", instruction=(folder / "instruction.md").read_text(), verifier=verifier,
            solution=ScriptSolution(solve, task.solution.env if task.solution else {})
            if (solve / "solve.sh").is_file() else None, limits=limits)
        steps.append(TaskStep(name, step_task, folder / "workdir" if (folder / "workdir").is_dir() else None, check,
                              float(need) if isinstance(need, (int, float)) else need))
    first = steps[0].task
    return dataclasses.replace(task, instruction=first.instruction, verifier=first.verifier, solution=first.solution,
                               steps=steps, step_reward=strategy)
