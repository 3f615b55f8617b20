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

import math
import re
import warnings
from pathlib import Path

from rl.envs.dockerfile import parse_dockerfile
from rl.envs.task import EmptyTree, ScriptSolution, ScriptVerifier, Task, TaskError, TaskLimits
from rl.envs.task_folder import check_inside, compose_notes, positive_number, verifier_requirements
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
    "": {"version", "schema_version", "task", "metadata", "verifier", "agent", "environment", "solution", "source"},
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
    steps = read_task_toml(toml_path).get("steps") if toml_path.is_file() else None
    if steps:
        names = [str(s.get("name", "?")) for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []
        raise TaskError(f"{toml_path}: a multi-step task ([[steps]]: {', '.join(names) or '?'}) runs "
                        "its steps' instructions, tests and solutions in order in one container; this loader does not "
                        "run multi-step tasks: run them with Harbor, or split them into one task per step")
    if not instruction_path.is_file():
        raise TaskError(f"{task_dir} has no instruction.md: a Harbor task states its instruction there")
    if not toml_path.is_file():
        raise TaskError(f"{task_dir} has no task.toml: a Harbor task declares its limits there")
    if not test_sh.is_file():
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
    setup, image, workdir, notes = [], None, "/app", []
    if dockerfile.is_file():
        plan = parse_dockerfile(dockerfile, environment_dir)
        test_sh = task_dir / "tests" / "test.sh"
        wanted = verifier_requirements(test_sh.read_text(errors="replace")) if test_sh.is_file() else []
        setup, image = plan.task_parts(dockerfile, limits.setup_timeout_s, ("tests/test.sh", wanted))
        workdir, notes = plan.workdir, plan.notes
        env = {**plan.env, **env}
    for note in unknown_keys(data, toml_path) + writable_search_paths(
            {"task environment": env, "verifier environment": _env(verifier_t, where)}, task_dir):
        warnings.warn(note, TaskFormatWarning, stacklevel=2)
        notes.append(note)
    notes += compose_notes(environment_dir)
    gpus = env_t.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise TaskError(f"{toml_path}: [environment].gpus must be a whole number, got {gpus!r}")
    if gpus:
        raise TaskError(f"{toml_path}: the task needs {gpus} GPU(s) ([environment].gpus); the sandboxes here have none")
    if env_t.get("allow_internet"):
        notes.append(f"{toml_path}: allow_internet=true is not granted; sandboxes have no network")
    solution_dir = task_dir / "solution"
    solution_env = _env(_table(data, "solution", str(toml_path)), f"{toml_path}: [solution]")
    solution = ScriptSolution(solution_dir, solution_env) if (solution_dir / "solve.sh").is_file() else None
    return Task(
        name=task_dir.name,
        instruction=instruction_path.read_text(),
        tree=EmptyTree(),
        verifier=ScriptVerifier(task_dir / "tests", env=_env(verifier_t, where),
                                reward_range=_reward_range(verifier_t, where),
                                judge_reads=_judge_reads(verifier_t, where, task_dir / "tests")),
        workdir=workdir,
        env=env,
        setup=setup,
        image=image,
        solution=solution,
        limits=limits,
        source=task_dir,
        environment_dir=environment_dir if dockerfile.is_file() else None,
        docker_image=docker_image,
        notes=notes,
        metadata=dict(data.get("metadata") or {}),
    )
