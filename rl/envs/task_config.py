"""A task folder's configuration read into one typed description, before anything is built.

Two formats, each read in one place:
- **Harbor's task.toml**, every key up to schema 1.4 with Harbor's defaults and its deprecated spellings
  (`version` for `schema_version`, `memory` / `storage` as "2G" for `memory_mb` / `storage_mb`, `allow_internet`
  for `network_mode`, the pre-1.3 `multi_step_reward_mode`), into `HarborConfig`;
- **Terminal-Bench 1's task.yaml** into `TB1Config`.

Each key is read into a field, or refused here in one line naming the key and why (a GPU, a Windows container, a
network allowlist). Keys the schema does not have are ignored, as Harbor ignores them, and each is named in a note.
rl/envs/harbor.py assembles a Task from these in one pass.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import yaml

from rl.envs.task import TaskError, read_utf8

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

NETWORK_MODES = ("public", "no-network", "allowlist")
MAIN_SERVICE = "main"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_SIZE_MB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
_STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SERVICE_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*")
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


@dataclass(frozen=True)
class Healthcheck:
    """[environment.healthcheck] / [steps.healthcheck]: Docker's HEALTHCHECK semantics with Harbor's defaults."""

    command: str
    interval_s: float = 5.0
    timeout_s: float = 30.0
    start_period_s: float = 0.0  # failures in it do not count
    start_interval_s: float = 5.0  # the interval while in the start period
    retries: int = 3  # consecutive failures after the start period that fail the check


@dataclass(frozen=True)
class McpServer:
    """[[environment.mcp_servers]]: an MCP server offered to the agent (stdio: a command it starts; sse or
    streamable-http: a URL, usually a compose service beside the task)."""

    name: str
    transport: str  # stdio | sse | streamable-http
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Artifact:
    """One `artifacts` entry: a path of the sandbox copied into the run folder after the agent's phase."""

    source: str
    destination: str | None = None  # relative to the run's artifacts folder (default: the source's path)
    exclude: tuple[str, ...] = ()
    service: str | None = None  # None or "main": the task's own container


@dataclass(frozen=True)
class CollectHook:
    """[[verifier.collect]]: a command run in a service after the agent's phase, before artifacts are collected."""

    command: str
    service: str = MAIN_SERVICE
    timeout_s: float = 60.0
    user: str | int | None = None


@dataclass
class EnvironmentConfig:
    """[environment] (and [verifier.environment], which has the same schema)."""

    build_timeout_s: float = 600.0
    docker_image: str | None = None
    os: str = "linux"
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    network: str = "public"  # Harbor's baseline: public unless the task says otherwise
    env: dict[str, str] = field(default_factory=dict)
    skills_dir: str | None = None
    healthcheck: Healthcheck | None = None
    workdir: str | None = None  # overrides the Dockerfile's WORKDIR
    mcp_servers: tuple[McpServer, ...] = ()


@dataclass
class PhaseConfig:
    """[agent] or [verifier] (and their [steps.*] overrides)."""

    timeout_s: float = 600.0
    user: str | int | None = None  # None: the image's user
    network: str | None = None  # None: the environment's
    env: dict[str, str] = field(default_factory=dict)  # [verifier].env
    max_turns: int = 50  # [agent].max_turns, an extension of this project


@dataclass
class VerifierConfig(PhaseConfig):
    mode: str = "shared"  # shared | separate (a container of its own; the machinery is the sandbox's)
    environment: EnvironmentConfig | None = None  # [verifier.environment], for the separate mode
    collect: tuple[CollectHook, ...] = ()
    reward_range: tuple[float, float] = (0.0, 1.0)  # extension: the rewards the verifier may give
    judge_reads: tuple[str, ...] = ()  # extension: files of tests/ the code under test may read inside `judge`


@dataclass
class StepConfig:
    name: str
    agent: PhaseConfig
    verifier: VerifierConfig
    min_reward: float | dict[str, float] | None = None
    healthcheck: Healthcheck | None = None
    artifacts: tuple[Artifact, ...] = ()


@dataclass
class HarborConfig:
    """A task.toml, every key of schema 1.4 read (defaults filled, deprecated spellings normalised)."""

    path: str
    schema_version: str = "1.0"
    name: str | None = None  # [task].name (org/name)
    description: str = ""
    metadata: dict = field(default_factory=dict)
    source: str | None = None
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    agent: PhaseConfig = field(default_factory=PhaseConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    solution_env: dict[str, str] = field(default_factory=dict)
    steps: list[StepConfig] = field(default_factory=list)
    step_reward: str = "mean"
    artifacts: tuple[Artifact, ...] = ()
    notes: list[str] = field(default_factory=list)  # what is read but has no effect here, and unknown keys


class _Table:
    """A TOML table being read: each key taken is marked, so that what is left over can be named."""

    def __init__(self, data, file: str, name: str, notes: list[str]):
        self.file, self.name, self.notes, self.taken = file, name, notes, set()
        if not isinstance(data, dict):
            raise TaskError(f"{self.where} must be a table, got {data!r}")
        self.data = data

    @property
    def where(self) -> str:
        return f"{self.file}: [{self.name}]" if self.name else f"{self.file}:"

    def get(self, key: str, default=None):
        self.taken.add(key)
        return self.data.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.data

    def inner(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def sub(self, key: str) -> "_Table":
        return _Table(self.get(key) or {}, self.file, self.inner(key), self.notes)

    def done(self) -> None:
        for key in sorted(set(self.data) - self.taken):
            name = f"[{self.name}].{key}" if self.name else key
            self.notes.append(f"{self.file}: unknown key {name} is ignored (Harbor ignores it too)")

    # typed values -------------------------------------------------------------------------------------------
    def number(self, key: str, default: float, positive: bool = True) -> float:
        value = self.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                positive and value <= 0):
            raise TaskError(f"{self.where}.{key} must be a {'positive ' if positive else ''}number, got {value!r}")
        return float(value)

    def whole(self, key: str, default: int, minimum: int = 0) -> int:
        value = self.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise TaskError(f"{self.where}.{key} must be a whole number of at least {minimum}, got {value!r}")
        return value

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.get(key, default)
        if value is not None and not isinstance(value, str):
            raise TaskError(f"{self.where}.{key} must be a string, got {value!r}")
        return value

    def user(self, key: str) -> str | int | None:
        value = self.get(key)
        if value is None or (isinstance(value, str) and value) or (isinstance(value, int) and not
                                                                   isinstance(value, bool) and value >= 0):
            return value
        raise TaskError(f"{self.where}.{key} must be a user name or uid, got {value!r}")

    def env(self, key: str = "env") -> dict[str, str]:
        """A table of variables; a value that is a whole `${VAR}` or `${VAR:-default}` is read from this host's
        environment, as Harbor resolves it when the task starts."""
        env = self.get(key, {}) or {}
        if not isinstance(env, dict) or not all(isinstance(v, (str, int, float, bool)) for v in env.values()):
            raise TaskError(f"{self.where}.{key} must be a table of strings, got {env!r}")
        out = {}
        for k, v in env.items():
            value = str(v).lower() if isinstance(v, bool) else str(v)
            if (m := _TEMPLATE.fullmatch(value)) is not None:
                if m.group(1) not in os.environ and m.group(2) is None:
                    raise TaskError(f"{self.where}.{key}: {k} = {value} needs the variable {m.group(1)} in this host's "
                                    "environment (Harbor reads it from there): export it, or give a default "
                                    f"(${{{m.group(1)}:-...}})")
                value = os.environ.get(m.group(1), m.group(2))
            out[str(k)] = value
        return out

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key, []) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TaskError(f"{self.where}.{key} must be a list of strings, got {value!r}")
        return tuple(value)

    def network(self, key: str = "network_mode") -> str | None:
        mode = self.get(key)
        hosts = self.get("allowed_hosts")
        if mode is None:
            if hosts:
                raise TaskError(f"{self.where}.allowed_hosts is only valid with network_mode = \"allowlist\"")
            return None
        if mode not in NETWORK_MODES:
            raise TaskError(f"{self.where}.{key} must be one of {', '.join(NETWORK_MODES)}, got {mode!r}")
        if mode == "allowlist":
            raise TaskError(f"{self.where}.{key} = \"allowlist\" ({', '.join(hosts or []) or 'no hosts'}) cannot be "
                            "honoured: a sandbox's network here is none or public (through the host's proxy); "
                            "declare \"public\" or \"no-network\"")
        if hosts:
            raise TaskError(f"{self.where}.allowed_hosts is only valid with network_mode = \"allowlist\"")
        return mode


def _size_mb(t: _Table, key_mb: str, key_str: str, default: int) -> int:
    if t.has(key_str):
        value = t.get(key_str)
        m = _SIZE_RE.match(str(value))
        if not m:
            raise TaskError(f"{t.where}.{key_str} must look like '2G' or '512M', got {value!r}")
        from_str = max(1, int(float(m.group(1)) * _SIZE_MB[m.group(2).upper()]))
        if t.has(key_mb) and t.get(key_mb) != from_str:
            raise TaskError(f"{t.where}: {key_str} = {value!r} ({from_str} MB) and {key_mb} = {t.get(key_mb)!r} "
                            "disagree; keep one")
        t.get(key_mb)
        return from_str
    return int(t.number(key_mb, default))


def _healthcheck(t: _Table) -> Healthcheck | None:
    if not t.data:
        t.taken.update(t.data)
        return None
    command = t.text("command")
    if not command:
        raise TaskError(f"{t.where}.command must be a shell command (exit 0: healthy)")
    check = Healthcheck(command, interval_s=t.number("interval_sec", 5.0),
                        timeout_s=t.number("timeout_sec", 30.0),
                        start_period_s=t.number("start_period_sec", 0.0, positive=False),
                        start_interval_s=t.number("start_interval_sec", 5.0),
                        retries=t.whole("retries", 3, minimum=1))
    t.done()
    return check


def _mcp_servers(value, file: str, name: str, notes: list[str]) -> tuple[McpServer, ...]:
    if not isinstance(value, list):
        raise TaskError(f"{file}: [[{name}]] must be tables, got {value!r}")
    servers = []
    for n, item in enumerate(value, 1):
        t = _Table(item, file, f"{name}[{n}]", notes)
        name = t.text("name")
        transport = t.text("transport", "sse")
        transport = "streamable-http" if transport == "http" else transport
        if not name:
            raise TaskError(f"{t.where}.name is required")
        if transport not in ("stdio", "sse", "streamable-http"):
            raise TaskError(f"{t.where}.transport must be stdio, sse or streamable-http, got {transport!r}")
        url, command = t.text("url"), t.text("command")
        if transport != "stdio" and not url:
            raise TaskError(f"{t.where}: transport {transport} needs a url")
        if transport == "stdio" and not command:
            raise TaskError(f"{t.where}: transport stdio needs a command")
        headers = t.env("headers")
        servers.append(McpServer(name, transport, url, command, t.strings("args"), tuple(sorted(headers.items()))))
        t.done()
    return tuple(servers)


def _artifacts(value, file: str, name: str, notes: list[str]) -> tuple[Artifact, ...]:
    if not isinstance(value, list):
        raise TaskError(f"{file}: {name} must be a list of paths or {{ source = ... }} tables, got {value!r}")
    out = []
    for n, item in enumerate(value, 1):
        if isinstance(item, str):
            item = {"source": item}
        t = _Table(item, file, f"{name}[{n}]", notes)
        source, destination, service = t.text("source"), t.text("destination"), t.text("service")
        if not source or ".." in PurePosixPath(source).parts:
            raise TaskError(f"{t.where}.source must be a path without '..', got {source!r}")
        if destination is not None and (destination.startswith("/") or "\\" in destination
                                        or ".." in PurePosixPath(destination).parts
                                        or destination.rstrip("/") == "manifest.json"):
            raise TaskError(f"{t.where}.destination must be a relative path without '..' (not manifest.json), "
                            f"got {destination!r}")
        if service is not None and not _SERVICE_NAME.fullmatch(service):
            raise TaskError(f"{t.where}.service {service!r} is not a compose service name")
        if service not in (None, MAIN_SERVICE) and not source.startswith("/"):
            raise TaskError(f"{t.where}.source must be absolute when collected from service {service!r}")
        out.append(Artifact(source, destination or None, t.strings("exclude"),
                            None if service == MAIN_SERVICE else service))
        t.done()
    return tuple(out)


def _collect(value, file: str, name: str, notes: list[str]) -> tuple[CollectHook, ...]:
    if not isinstance(value, list):
        raise TaskError(f"{file}: [[{name}]] must be tables, got {value!r}")
    hooks = []
    for n, item in enumerate(value, 1):
        t = _Table(item, file, f"{name}[{n}]", notes)
        command, service = t.text("command"), t.text("service", MAIN_SERVICE)
        if not command:
            raise TaskError(f"{t.where}.command is required")
        if not _SERVICE_NAME.fullmatch(service or ""):
            raise TaskError(f"{t.where}.service {service!r} is not a compose service name")
        hooks.append(CollectHook(command, service, t.number("timeout_sec", 60.0), t.user("user")))
        t.done()
    return tuple(hooks)


def _environment(t: _Table) -> EnvironmentConfig:
    cfg = EnvironmentConfig(build_timeout_s=t.number("build_timeout_sec", 600.0))
    cfg.docker_image = t.text("docker_image")
    if cfg.docker_image is not None and not cfg.docker_image.strip():
        cfg.docker_image = None
    os_name = (t.text("os", "linux") or "linux").lower()
    if os_name != "linux":
        raise TaskError(f"{t.where}.os = {os_name!r}: the sandboxes here are Linux; a {os_name} task needs a "
                        f"{os_name} container host")
    cpus = t.get("cpus")
    cfg.cpus = 1.0 if cpus is None else t.number("cpus", 1.0)
    cfg.memory_mb = _size_mb(t, "memory_mb", "memory", 2048)
    cfg.storage_mb = _size_mb(t, "storage_mb", "storage", 10240)
    gpus = t.whole("gpus", 0)
    if gpus:
        raise TaskError(f"{t.where}: the task needs {gpus} GPU(s) ([environment].gpus); the sandboxes here have none")
    types = t.strings("gpu_types")
    if types:  # acceptable GPU types for gpus > 0; with none asked for they change nothing
        t.notes.append(f"{t.where}.gpu_types {list(types)} has no effect: the task asks for no GPU")
    if t.get("tpu"):
        raise TaskError(f"{t.where}.tpu: the task needs a TPU slice; the sandboxes here have none")
    allow = t.get("allow_internet")
    if allow is not None and not isinstance(allow, bool):
        raise TaskError(f"{t.where}.allow_internet must be true or false, got {allow!r}")
    mode = t.network()
    cfg.network = mode or ("no-network" if allow is False else "public")
    cfg.env = t.env()
    cfg.skills_dir = t.text("skills_dir")
    cfg.healthcheck = _healthcheck(t.sub("healthcheck"))
    workdir = t.text("workdir")
    if workdir is not None and not workdir.startswith("/"):
        raise TaskError(f"{t.where}.workdir must be an absolute path, got {workdir!r}")
    cfg.workdir = workdir and str(PurePosixPath(workdir))
    cfg.mcp_servers = _mcp_servers(t.get("mcp_servers", []) or [], t.file, t.inner("mcp_servers"), t.notes)
    t.done()
    return cfg


def _reward_range(t: _Table) -> tuple[float, float]:
    value = t.get("reward_range", [0.0, 1.0])
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
          and value[0] < value[1])
    if not ok:
        raise TaskError(f"{t.where}.reward_range must be [low, high] with finite low < high, got {value!r}")
    return float(value[0]), float(value[1])


def _judge_reads(t: _Table) -> tuple[str, ...]:
    paths = t.strings("judge_reads")
    for path in paths:
        if not path or path.startswith("/") or ".." in PurePosixPath(path).parts or ":" in path:
            raise TaskError(f"{t.where}.judge_reads: {path!r} must be a path relative to tests/, without '..' or ':'")
    return paths


def _agent(t: _Table, base: PhaseConfig | None = None) -> PhaseConfig:
    base = base or PhaseConfig()
    user = t.user("user")
    cfg = PhaseConfig(timeout_s=t.number("timeout_sec", base.timeout_s), user=base.user if user is None else user,
                      network=t.network() or base.network, max_turns=t.whole("max_turns", base.max_turns, 1))
    setup = t.get("setup_timeout_sec")  # the agent's own installation: nothing is installed here
    if setup is not None:
        t.number("setup_timeout_sec", 1.0)
    t.done()
    return cfg


def _verifier(t: _Table, base: VerifierConfig | None = None) -> VerifierConfig:
    base = base or VerifierConfig()
    mode = t.text("environment_mode")
    if mode not in (None, "shared", "separate"):
        raise TaskError(f"{t.where}.environment_mode must be \"shared\" or \"separate\", got {mode!r}")
    environment = _environment(t.sub("environment")) if t.get("environment") is not None else base.environment
    if mode == "shared" and t.get("environment") is not None:
        raise TaskError(f"{t.where}: environment_mode = \"shared\" and a [verifier.environment] contradict each "
                        "other; drop one")
    user = t.user("user")
    cfg = VerifierConfig(timeout_s=t.number("timeout_sec", base.timeout_s), user=base.user if user is None else user,
                         network=t.network() or base.network, env={**base.env, **t.env()},
                         mode=mode or ("separate" if environment is not None else base.mode), environment=environment,
                         collect=base.collect + _collect(t.get("collect", []) or [], t.file, t.inner("collect"),
                                                         t.notes),
                         reward_range=_reward_range(t) if t.has("reward_range") else base.reward_range,
                         judge_reads=_judge_reads(t) if t.has("judge_reads") else base.judge_reads)
    t.done()
    return cfg


def _min_reward(value, where: str) -> float | dict[str, float] | None:
    number = (int, float)
    if value is None or (isinstance(value, number) and not isinstance(value, bool)):
        return None if value is None else float(value)
    if isinstance(value, dict) and all(isinstance(v, number) and not isinstance(v, bool) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise TaskError(f"{where}.min_reward must be a number or a table of numbers, got {value!r}")


def read_harbor_config(path) -> HarborConfig:
    """task.toml read into a HarborConfig (TaskError in one line for what is malformed or cannot be honoured)."""
    try:
        data = tomllib.loads(read_utf8(path))
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{path} is not valid TOML: {e}") from None
    cfg = HarborConfig(path=str(path))
    top = _Table(data, str(path), "", cfg.notes)
    table = top.sub

    version = top.get("schema_version")
    legacy = top.get("version")
    cfg.schema_version = str(version if version is not None else legacy if legacy is not None else "1.0")
    task = table("task")
    if task.data:
        cfg.name, cfg.description = task.text("name"), task.text("description", "") or ""
        for key in ("version", "authors", "keywords"):  # the package's registry identity: informational
            task.get(key)
        task.done()
    meta = top.get("metadata") or {}
    if not isinstance(meta, dict):
        raise TaskError(f"{path}: [metadata] must be a table, got {meta!r}")
    cfg.metadata = dict(meta)
    cfg.source = top.text("source")
    cfg.environment = _environment(table("environment"))
    cfg.agent = _agent(table("agent"))
    cfg.verifier = _verifier(table("verifier"))
    solution = table("solution")
    cfg.solution_env = solution.env()
    solution.done()
    cfg.artifacts = _artifacts(top.get("artifacts", []) or [], str(path), "artifacts", cfg.notes)
    strategy = top.get("multi_step_reward_strategy")
    if top.get("multi_step_reward_mode") is not None:  # before schema 1.3; Harbor accepts and drops it
        cfg.notes.append(f"{path}: multi_step_reward_mode (before schema 1.3) is dropped, as Harbor drops it; "
                         "multi_step_reward_strategy decides")
    if strategy not in (None, "mean", "final"):
        raise TaskError(f"{path}: multi_step_reward_strategy {strategy!r} is not one of ['mean', 'final']")
    cfg.step_reward = strategy or "mean"
    steps = top.get("steps")
    if steps is not None:
        if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
            raise TaskError(f"{path}: steps must be [[steps]] tables, each with a name")
        seen: set[str] = set()
        for n, item in enumerate(steps, 1):
            t = _Table(item, str(path), f"steps[{n}]", cfg.notes)
            name = t.get("name")
            if not isinstance(name, str) or not _STEP_NAME.fullmatch(name) or name in (".", ".."):
                raise TaskError(f"{path}: step {n} needs a name (a folder under steps/), got {name!r}")
            if name.lower() in seen:
                raise TaskError(f"{path}: step name {name!r} is used twice")
            seen.add(name.lower())
            cfg.steps.append(StepConfig(
                name=name, agent=_agent(t.sub("agent"), cfg.agent),
                verifier=_verifier(t.sub("verifier"), _step_verifier_base(cfg.verifier)),
                min_reward=_min_reward(t.get("min_reward"), t.where),
                healthcheck=_healthcheck(t.sub("healthcheck")),
                artifacts=_artifacts(t.get("artifacts", []) or [], str(path), t.inner("artifacts"), cfg.notes)))
            t.done()
    top.done()
    return cfg


def _step_verifier_base(task: VerifierConfig) -> VerifierConfig:
    """What a step's [steps.verifier] falls back to: the task's [verifier] (its collect hooks run once per step
    only when the step names them itself)."""
    return VerifierConfig(timeout_s=task.timeout_s, user=task.user, network=task.network, env=dict(task.env),
                          mode=task.mode, environment=task.environment, reward_range=task.reward_range,
                          judge_reads=task.judge_reads, collect=task.collect)


# Terminal-Bench 1 -----------------------------------------------------------------------------------------------
TB1_KEYS = {"instruction", "descriptions", "author_name", "author_email", "difficulty", "category", "tags",
            "parser_name", "max_agent_timeout_sec", "max_test_timeout_sec", "run_tests_in_same_shell",
            "disable_asciinema", "estimated_duration_sec", "expert_time_estimate_min", "junior_time_estimate_min"}


@dataclass
class TB1Config:
    """A Terminal-Bench 1 task.yaml."""

    path: str
    instruction: str
    agent_timeout_s: float = 360.0
    verifier_timeout_s: float = 60.0
    metadata: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_tb1_config(path) -> TB1Config:
    try:
        data = yaml.safe_load(read_utf8(path))
    except yaml.YAMLError as e:
        raise TaskError(f"{path} is not YAML: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(data, dict):
        raise TaskError(f"{path} must be a mapping of task fields")
    parser = data.get("parser_name", "pytest")
    if parser != "pytest":
        hint = ("; Terminal-Bench's SWE-bench adapter runs in its instance's swebench/sweb.eval image (the repository "
                "and its environment): run SWE-bench instances from their JSONL (tools/check_task.py INSTANCES.jsonl "
                "--instance ID)") if parser == "swebench" else ""
        raise TaskError(f"{path}: parser_name {parser!r} is not supported; Terminal-Bench tasks here use pytest" + hint)
    instruction = data.get("instruction")
    if not (isinstance(instruction, str) and instruction.strip()):
        instruction = next((item["description"] for item in data.get("descriptions") or []
                            if isinstance(item, dict) and item.get("key", "base") == "base"
                            and isinstance(item.get("description"), str)), None)
    if instruction is None:
        raise TaskError(f"{path} has no instruction (an `instruction:` text, or a `descriptions:` entry with key base)")
    where = _Table(data, str(path), "", [])
    cfg = TB1Config(path=str(path), instruction=instruction,
                    agent_timeout_s=where.number("max_agent_timeout_sec", 360.0),
                    verifier_timeout_s=where.number("max_test_timeout_sec", 60.0),
                    metadata={k: data[k] for k in ("difficulty", "category", "tags") if k in data})
    if data.get("run_tests_in_same_shell"):
        cfg.notes.append(f"{path}: run_tests_in_same_shell is read as false: the tests run in the verifier's own "
                         "shell, after the agent's")
    cfg.notes += [f"{path}: unknown key {k} is ignored" for k in sorted(set(data) - TB1_KEYS)]
    return cfg
