"""Load Harbor (Terminal-Bench 2, schema up to 1.4, multi-step) and Terminal-Bench 1 task folders, unmodified.

    task/                          Harbor                            Terminal-Bench 1
      instruction.md               what the agent is asked           (task.yaml's instruction)
      task.toml | task.yaml        configuration (rl/envs/task_config.py reads every key)
      environment/Dockerfile       the machine; context environment/ Dockerfile, context the task folder
      environment/docker-compose.yaml   containers beside the task's own (rl/envs/task_folder.py)
      tests/test.sh                verifier, writes /logs/verifier/reward.txt or reward.json
                                                                     run-tests.sh (pytest -rA summary)
      solution/solve.sh            reference solution                solution.sh | solution.yaml
      steps/<name>/                a multi-step task's steps: instruction.md, tests/, solution/, workdir/

Reading comes before building: `read_task_folder` reads the folder into a `TaskFolder` (its format, its typed
configuration, the files the task has); `assemble` turns it into a `Task` in one pass (the Dockerfile's plan,
the stand-in, the verifier, the solution, the steps). A file or folder of the task that resolves outside the task
folder (a symlink to the host) is refused. The working tree is /app unless the Dockerfile's WORKDIR or
[environment].workdir says otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from rl.envs.dockerfile import parse_dockerfile
from rl.envs.task import EmptyTree, ScriptSolution, ScriptVerifier, Task, TaskError, TaskLimits, TaskStep, read_utf8
from rl.envs.task_config import HarborConfig, TB1Config, read_harbor_config, read_tb1_config
from rl.envs.task_folder import check_inside, read_compose, verifier_requirements
from rl.envs.terminal_bench import DEFAULT_RUN_TESTS, CommandSolution, PytestLogVerifier

HARBOR, TB1 = "Harbor", "Terminal-Bench 1"
NETWORK = {"public": "public", "no-network": "none"}  # Harbor's network_mode -> the sandbox's network


class TaskFormatWarning(UserWarning):
    """A task file holds something this loader does not honour; the task still loads."""


@dataclass
class StepFolder:
    name: str
    folder: Path
    instruction: str
    tests: Path
    solution: Path | None
    workdir_files: Path | None


@dataclass
class TaskFolder:
    """What a task folder holds, read and checked, before anything is built."""

    root: Path
    format: str  # HARBOR | TB1
    config: HarborConfig | TB1Config
    instruction: str
    context: Path | None  # the Dockerfile's build context
    dockerfile: Path | None
    tests: Path | None
    verifier_scripts: dict[str, str]  # name -> text: what the verifier runs (test.sh, run-tests.sh, each step's)
    solution: Path | None  # Harbor's solution/ (with solve.sh), TB1's solution.sh / solution.yaml
    steps: list[StepFolder] = field(default_factory=list)


def read_task_folder(task_dir: str | Path) -> TaskFolder:
    """The folder's format, configuration and files; TaskError in one line naming what is missing."""
    root = Path(task_dir)
    if not root.is_dir():
        raise TaskError(f"{root} does not exist or is not a task folder")
    toml, yaml_path, instruction = root / "task.toml", root / "task.yaml", root / "instruction.md"
    if not toml.is_file() and yaml_path.is_file():
        check_inside(root)
        cfg = read_tb1_config(yaml_path)
        run_tests = root / "run-tests.sh"
        solution = next((p for p in (root / "solution.sh", root / "solution.yaml") if p.is_file()), None)
        return TaskFolder(root, TB1, cfg, cfg.instruction, root, root / "Dockerfile" if (
            root / "Dockerfile").is_file() else None, root / "tests" if (root / "tests").is_dir() else None,
            {"run-tests.sh": run_tests.read_text(errors="replace") if run_tests.is_file() else DEFAULT_RUN_TESTS},
            solution)
    if not toml.is_file():
        raise TaskError(f"{root} has no task.toml (Harbor) or task.yaml (Terminal-Bench 1)")
    check_inside(root)
    cfg = read_harbor_config(toml)
    if not instruction.is_file() and not cfg.steps:
        raise TaskError(f"{root} has no instruction.md: a Harbor task states its instruction there")
    tests, scripts = root / "tests", {}
    if not cfg.steps and not (tests / "test.sh").is_file():
        raise TaskError(f"{root} has no verifier: expected tests/test.sh (it runs as `bash /tests/test.sh` and writes "
                        "/logs/verifier/reward.txt)")
    if (tests / "test.sh").is_file():
        scripts["tests/test.sh"] = (tests / "test.sh").read_text(errors="replace")
    steps = []
    for step in cfg.steps:
        folder = root / "steps" / step.name
        for need in ("instruction.md", "tests/test.sh"):
            if not (folder / need).is_file():
                raise TaskError(f"{toml}: step {step.name!r} has no steps/{step.name}/{need}")
        scripts[f"steps/{step.name}/tests/test.sh"] = (folder / "tests" / "test.sh").read_text(errors="replace")
        steps.append(StepFolder(step.name, folder, read_utf8(folder / "instruction.md"), folder / "tests",
                                folder / "solution" if (folder / "solution" / "solve.sh").is_file() else None,
                                folder / "workdir" if (folder / "workdir").is_dir() else None))
    environment = root / "environment"
    dockerfile = environment / "Dockerfile"
    return TaskFolder(root, HARBOR, cfg, read_utf8(instruction) if instruction.is_file() else "",
                      environment if environment.is_dir() else None, dockerfile if dockerfile.is_file() else None,
                      tests if tests.is_dir() else None, scripts,
                      root / "solution" if (root / "solution" / "solve.sh").is_file() else None, steps)


def load_harbor_task(task_dir: str | Path) -> Task:
    """A Harbor or Terminal-Bench 1 task folder as a Task (notes say what has no effect here; each is also a
    TaskFormatWarning)."""
    return assemble(read_task_folder(task_dir))


# The Python modules a verifier may import that the stand-in does not carry, and the package that has each (the
# task's own image had it): a verifier of Harbor's rubric format imports `rewardkit`.
VERIFIER_MODULES = {"rewardkit": "harbor-rewardkit"}
_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)


def imported_modules(source: str) -> set[str]:
    """The top-level modules a Python file imports (`import a, b.c`, `from d import e`)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # not Python 3 this parser reads: its import lines
        return set(_IMPORT.findall(source))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def verifier_packages(folder: TaskFolder) -> list[str]:
    """What the verifier needs installed: what its scripts have uv or pip install, and the packages of the modules
    its Python files import that the stand-in lacks."""
    wanted = [r for text in folder.verifier_scripts.values() for r in verifier_requirements(text)]
    test_dirs = [d for d in [folder.tests] + [s.tests for s in folder.steps] if d is not None]
    for path in (p for d in test_dirs for p in sorted(d.rglob("*.py"))):
        for module in sorted(imported_modules(path.read_text(errors="replace"))):
            if module in VERIFIER_MODULES and not any(w.split("=")[0].split("[")[0].strip() == VERIFIER_MODULES[
                    module] for w in wanted):
                wanted.append(VERIFIER_MODULES[module])
    return list(dict.fromkeys(wanted))


def solution_scripts(folder: TaskFolder) -> dict[str, str]:
    """The reference solution's scripts (name -> text): what they call, the image must have."""
    paths = [folder.solution] + [s.solution for s in folder.steps]
    files = [p / "solve.sh" if p.is_dir() else p for p in paths if p is not None]
    return {str(f.relative_to(folder.root)): f.read_text(errors="replace") for f in files if f.is_file()}


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


def assemble(folder: TaskFolder) -> Task:
    """The Task a read folder describes, in one pass."""
    cfg, root = folder.config, folder.root
    harbor = isinstance(cfg, HarborConfig)
    notes = list(cfg.notes)
    if harbor:
        env_cfg = cfg.environment
        limits = TaskLimits(agent_timeout_s=cfg.agent.timeout_s, verifier_timeout_s=cfg.verifier.timeout_s,
                            setup_timeout_s=env_cfg.build_timeout_s, memory_mb=env_cfg.memory_mb,
                            storage_mb=env_cfg.storage_mb, cpus=env_cfg.cpus, max_turns=cfg.agent.max_turns)
        env, workdir_override = dict(env_cfg.env), env_cfg.workdir
    else:
        limits = TaskLimits(agent_timeout_s=cfg.agent_timeout_s, verifier_timeout_s=cfg.verifier_timeout_s)
        env, workdir_override = {}, None
    setup, image, workdir, entrypoint, image_user = [], None, workdir_override or "/app", (), None
    docker_image = cfg.environment.docker_image if harbor else None
    if folder.dockerfile is not None:
        plan = parse_dockerfile(folder.dockerfile, folder.context)
        if workdir_override:
            plan.set_workdir(workdir_override, f"{cfg.path}: [environment].workdir")
        setup, image = plan.task_parts(folder.dockerfile, limits.setup_timeout_s,
                                       (" and ".join(folder.verifier_scripts), verifier_packages(folder)),
                                       {**folder.verifier_scripts, **solution_scripts(folder)})
        workdir, entrypoint, image_user = plan.workdir, plan.entrypoint, plan.user
        env = {**plan.env, **env}
        notes += plan.notes
        if docker_image:  # as Harbor's --force-build: the Dockerfile beside a prebuilt image's name is built
            notes.append(f"{cfg.path}: [environment].docker_image {docker_image} is built from "
                         f"{folder.dockerfile.relative_to(root)} here (as Harbor builds it with --force-build)")
    elif docker_image is None and workdir not in ("/app",):
        raise TaskError(f"{cfg.path}: [environment].workdir {workdir} needs a Dockerfile to be built from (the "
                        "host's system stands in only for /app)")
    compose_notes, services = read_compose(folder.context) if folder.context is not None else ([], [])
    notes += compose_notes
    if harbor:
        task = _harbor_task(folder, cfg, limits, env, workdir, setup, image, entrypoint, services, notes, image_user)
    else:
        task = Task(name=root.name, instruction=folder.instruction, tree=EmptyTree(),
                    verifier=PytestLogVerifier(folder.tests, folder.verifier_scripts["run-tests.sh"]),
                    workdir=workdir, env=env, setup=setup, image=image, entrypoint=entrypoint, services=services,
                    solution=_tb1_solution(folder.solution), limits=limits, source=root,
                    environment_dir=folder.context if folder.dockerfile is not None else None, notes=notes,
                    metadata=dict(cfg.metadata), agent_user=image_user, verifier_user=image_user)
    for note in writable_search_paths({"task environment": task.env,
                                       "verifier environment": getattr(task.verifier, "env", {})}, root):
        task.notes.append(note)
    for note in task.notes:
        if "unknown key" in note or "which the agent can write" in note:
            warnings.warn(note, TaskFormatWarning, stacklevel=2)
    return task


def _harbor_task(folder: TaskFolder, cfg: HarborConfig, limits: TaskLimits, env, workdir, setup, image, entrypoint,
                 services, notes, image_user) -> Task:
    root, env_cfg = folder.root, cfg.environment
    if env_cfg.docker_image is not None and folder.dockerfile is None:
        notes.append(f"{cfg.path}: [environment].docker_image {env_cfg.docker_image} is a prebuilt image: a container "
                     "backend uses it where its engine has it; elsewhere the task is refused naming it")
    mcp_hosts = {s.name for s in services} | {"localhost", "127.0.0.1", "::1"}
    for server in env_cfg.mcp_servers:
        if server.url is not None:
            host = re.sub(r"^[a-z+]+://", "", server.url).split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
            if host not in mcp_hosts:
                raise TaskError(f"{cfg.path}: MCP server {server.name!r} is at {server.url}, which is neither a "
                                "service of the task's compose file nor local: the sandbox cannot reach it")
    if env_cfg.mcp_servers:
        notes.append(f"{cfg.path}: MCP servers {', '.join(s.name for s in env_cfg.mcp_servers)} are offered to the "
                     "agent (Task.mcp_servers); a stdio server's command is checked to exist as each episode starts")
    if env_cfg.skills_dir:
        notes.append(f"{cfg.path}: [environment].skills_dir {env_cfg.skills_dir} is offered to the agent "
                     "(Task.skills_dir), as Harbor copies it into an agent's skills folder")
    hooks = cfg.verifier.collect + tuple(h for s in cfg.steps for h in s.verifier.collect)
    sidecar = sorted({h.service for h in hooks if h.service != "main"} | {
        a.service for a in cfg.artifacts + tuple(a for s in cfg.steps for a in s.artifacts) if a.service})
    missing = [s for s in sidecar if s not in {svc.name for svc in services}]
    if missing:
        raise TaskError(f"{cfg.path}: a collect hook or artifact names service {missing[0]!r}, which the compose file "
                        "does not have")
    if sidecar:
        raise TaskError(f"{cfg.path}: collect hooks or artifacts in the services {', '.join(sidecar)} need a command "
                        "run in a container beside the task's own, which the backends here do not offer")
    verifier_env = cfg.verifier.env
    solution = ScriptSolution(folder.solution, cfg.solution_env) if folder.solution is not None else None
    verifier = ScriptVerifier(folder.tests if folder.tests is not None else root / "tests", env=verifier_env,
                              reward_range=cfg.verifier.reward_range,
                              judge_reads=_judge_reads(cfg.verifier.judge_reads, folder.tests, cfg.path))
    task = Task(
        name=root.name, instruction=folder.instruction, tree=EmptyTree(), verifier=verifier, workdir=workdir, env=env,
        setup=setup, image=image, entrypoint=entrypoint, services=services, solution=solution, limits=limits,
        source=root, environment_dir=folder.context if folder.dockerfile is not None else None,
        docker_image=env_cfg.docker_image, notes=notes, metadata=dict(cfg.metadata),
        agent_user=_or(cfg.agent.user, image_user), verifier_user=_or(cfg.verifier.user, image_user),
        agent_network=NETWORK[cfg.agent.network or env_cfg.network],
        verifier_network=NETWORK[cfg.verifier.network or env_cfg.network], verifier_mode=cfg.verifier.mode,
        verifier_environment=cfg.verifier.environment, collect=cfg.verifier.collect, artifacts=cfg.artifacts,
        healthcheck=env_cfg.healthcheck, mcp_servers=env_cfg.mcp_servers, skills_dir=env_cfg.skills_dir)
    if not cfg.steps:
        return task
    shared = root / "tests"
    steps = []
    for step_cfg, step in zip(cfg.steps, folder.steps):
        step_verifier = dataclasses.replace(
            verifier, tests_dir=step.tests, env=step_cfg.verifier.env, reward_range=step_cfg.verifier.reward_range,
            judge_reads=_judge_reads(step_cfg.verifier.judge_reads, step.tests, cfg.path),
            shared_tests_dir=shared if shared.is_dir() else None)
        step_limits = dataclasses.replace(limits, agent_timeout_s=step_cfg.agent.timeout_s,
                                          verifier_timeout_s=step_cfg.verifier.timeout_s)
        step_task = dataclasses.replace(
            task, name=f"{task.name}/{step.name}", instruction=step.instruction, verifier=step_verifier,
            solution=ScriptSolution(step.solution, cfg.solution_env) if step.solution is not None else None,
            limits=step_limits, agent_user=_or(step_cfg.agent.user, image_user),
            verifier_user=_or(step_cfg.verifier.user, image_user),
            agent_network=NETWORK[step_cfg.agent.network or env_cfg.network],
            verifier_network=NETWORK[step_cfg.verifier.network or env_cfg.network], collect=step_cfg.verifier.collect,
            artifacts=cfg.artifacts + step_cfg.artifacts)
        steps.append(TaskStep(step.name, step_task, step.workdir_files, step_cfg.healthcheck, step_cfg.min_reward))
    first = steps[0].task
    return dataclasses.replace(task, instruction=first.instruction, verifier=first.verifier, solution=first.solution,
                               steps=steps, step_reward=cfg.step_reward)


def _or(value, default):
    return default if value is None else value


def _judge_reads(paths: tuple[str, ...], tests: Path | None, where: str) -> tuple[str, ...]:
    for path in paths:
        if tests is None or not (tests / path).is_file():
            raise TaskError(f"{where}: [verifier].judge_reads: {path!r} is not a file of {tests}")
    return paths


def _tb1_solution(path: Path | None) -> CommandSolution | None:
    if path is None:
        return None
    if path.name == "solution.sh":
        return CommandSolution([read_utf8(path)])
    import yaml

    try:
        items = yaml.safe_load(read_utf8(path))
    except yaml.YAMLError as e:
        raise TaskError(f"{path} is not YAML: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) and isinstance(i.get("command"), str)
                                                            for i in items):
        raise TaskError(f"{path} must be a list of entries with a `command:` text")
    return CommandSolution([i["command"] for i in items])
