"""What every task folder format shares (Harbor, Terminal-Bench 1): nothing of it resolves outside it, the compose
file beside its Dockerfile (the containers beside the task's own), and what its verifier installs for itself."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import yaml

from rl.envs.dockerfile import UnsupportedDockerfile, parse_dockerfile
from rl.envs.task import TaskError, read_utf8
from rl.sandbox.base import HealthCheck, Service

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


# The compose keys a service beside the task's container may use here; the task's own service (Harbor's `main`,
# Terminal-Bench's `client`) is built from the task's Dockerfile, and its other settings are Harbor's to make.
SERVICE_KEYS = {"build", "image", "environment", "command", "entrypoint", "healthcheck", "expose", "ports",
                "depends_on", "container_name", "restart", "init", "labels", "hostname"}
MAIN_SERVICES = ("main", "client")
_COMPOSE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _interpolate(text: str) -> str:
    """${VAR}, ${VAR:-default} and $VAR from this host's environment, as compose reads its file."""
    return _COMPOSE_VAR.sub(lambda m: os.environ.get(m.group(1) or m.group(3)) or (m.group(2) or ""), text)


def _duration(value, where: str) -> float:
    """A compose duration (`2s`, `1m30s`, `500ms`, or seconds) in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?"
                         r"(?:(\d+(?:\.\d+)?)ms)?", str(value).strip())
    if not parts or not any(parts.groups()):
        raise TaskError(f"{where}: {value!r} is not a duration (e.g. 2s, 1m30s)")
    h, m, sec, ms = (float(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + sec + ms / 1000


def _argv(value, where: str) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return [str(v) for v in value]
    raise TaskError(f"{where} must be a string or a list of strings")


def _healthcheck(data, where: str) -> HealthCheck | None:
    if not isinstance(data, dict) or data.get("disable"):
        return None
    test = data.get("test")
    if isinstance(test, str):
        argv = ["sh", "-c", test]
    elif isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"):
        argv = _argv(test[1:], f"{where}.test") if test[0] == "CMD" else ["sh", "-c", " ".join(map(str, test[1:]))]
    elif test in (["NONE"], None):
        return None
    else:
        raise TaskError(f"{where}.test must be a string or a list starting with CMD or CMD-SHELL")
    return HealthCheck(argv, interval_s=_duration(data.get("interval", "30s"), f"{where}.interval"),
                       timeout_s=_duration(data.get("timeout", "30s"), f"{where}.timeout"),
                       retries=int(data.get("retries", 3)),
                       start_period_s=_duration(data.get("start_period", "0s"), f"{where}.start_period"))


def _service(name: str, spec: dict, folder: Path, path: Path) -> Service:
    where = f"{path}: services.{name}"
    if not isinstance(spec, dict):
        raise TaskError(f"{where} must be a mapping")
    unknown = sorted(set(spec) - SERVICE_KEYS)
    if unknown:
        raise TaskError(f"{where}.{unknown[0]} is not supported here (a service may use "
                        f"{', '.join(sorted(SERVICE_KEYS))})")
    service = Service(name=name)
    build = spec.get("build")
    if build is not None:
        build = {"context": build} if isinstance(build, str) else build
        if not isinstance(build, dict) or set(build) - {"context", "dockerfile"}:
            raise TaskError(f"{where}.build must be a context path or a mapping of context and dockerfile")
        context = (folder / _interpolate(str(build.get("context", ".")))).resolve()
        if not str(context).startswith(str(folder.resolve())) or not context.is_dir():
            raise TaskError(f"{where}.build.context {build.get('context')!r} is not a folder of the task")
        dockerfile = context / str(build.get("dockerfile", "Dockerfile"))
        if not dockerfile.is_file():
            raise TaskError(f"{where}: its build has no {dockerfile.name} in {context}")
        service.build_context, service.dockerfile = context, dockerfile
        try:  # the same build on the local Debian base (podman --local-base)
            _, service.recipe = parse_dockerfile(dockerfile, context).task_parts(dockerfile, 1800.0)
        except UnsupportedDockerfile as e:
            service.recipe_problem = str(e)
    elif isinstance(spec.get("image"), str):
        service.image = _interpolate(spec["image"])
    else:
        raise TaskError(f"{where} needs a build or an image")
    env = spec.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in map(str, env))
    if not isinstance(env, dict):
        raise TaskError(f"{where}.environment must be a list of KEY=VALUE or a mapping")
    service.env = {str(k): _interpolate("" if v is None else str(v)) for k, v in env.items()}
    if "command" in spec:
        service.command = _argv(spec["command"], f"{where}.command")
    if "entrypoint" in spec:
        service.entrypoint = _argv(spec["entrypoint"], f"{where}.entrypoint")
    service.healthcheck = _healthcheck(spec.get("healthcheck"), f"{where}.healthcheck")
    return service


def read_compose(folder: Path) -> tuple[list[str], list[Service]]:
    """A compose file beside the task's Dockerfile: (notes, the services beside the task's own container). The task's
    own service (`main`, Terminal-Bench's `client`, or a single one) is built from its Dockerfile; its settings beyond
    the build (ports, volumes, environment) are Harbor's to make and are not applied, which a note says. Every other
    service is read into a Service for a container backend's pod."""
    for name in COMPOSE_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            services = (yaml.safe_load(read_utf8(path)) or {}).get("services") or {}
        except (yaml.YAMLError, AttributeError) as e:
            raise TaskError(f"{path} is not a compose file: {str(e).splitlines()[0][:120]}") from None
        if not isinstance(services, dict):
            raise TaskError(f"{path}: services must be a mapping of service names")
        main = next((n for n in MAIN_SERVICES if n in services), None) or (
            next(iter(services)) if len(services) == 1 else None)
        if main is None and services:
            raise TaskError(f"{path}: none of the services ({', '.join(sorted(services))}) is the task's own "
                            f"container (named {' or '.join(MAIN_SERVICES)})")
        others = [_service(n, spec, folder, path) for n, spec in services.items() if n != main]
        notes = [f"{path}: the compose file's settings of the task's own container beyond the build (ports, volumes, "
                 "environment) are not applied; the task runs as one sandbox"
                 + (f" beside {', '.join(s.name for s in others)}" if others else "")]
        return notes, others
    return [], []


def check_inside(task_dir: Path) -> None:
    """Refuse any file or folder of the task that resolves outside it (symlinks to the host's files)."""
    root = os.path.realpath(task_dir)
    for dirpath, dirnames, filenames in os.walk(task_dir):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            real = os.path.realpath(path)
            if real != root and not real.startswith(root + os.sep):
                raise TaskError(f"{path} resolves outside the task folder (to {real}); a task may only use its "
                                "own files: replace the symlink with the files themselves")


# What a verifier script installs for itself: `uvx [--with R] TOOL`, `uv tool run`, `uv add R`, `uv pip install R`,
# `pip install R` (its options with a value, whose value is not a requirement).
_INSTALLERS = (("uvx",), ("uv", "tool", "run"), ("uv", "tool", "install"), ("uv", "add"), ("uv", "pip", "install"),
               ("pip", "install"), ("pip3", "install"), ("python", "-m", "pip", "install"),
               ("python3", "-m", "pip", "install"))
_VALUED = {"--with", "-w", "--from", "--python", "-p", "-r", "--requirement", "-c", "--constraint", "--index-url",
           "-i", "--extra-index-url", "--find-links", "-f", "--target", "-t", "--directory", "--project", "--group",
           "--cache-dir", "--prefix", "--root", "--upgrade-strategy", "--timeout"}
_SHELL_SPLIT = re.compile(r"&&|\|\||[;|&\n()]")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def verifier_requirements(script: str) -> list[str]:
    """The packages a verifier script has uv or pip install for it (e.g. ['pytest==8.4.1', 'pytest-json-ctrf']),
    so that an image can carry them and the verifier run offline. Words that are no requirement (paths, variables)
    are left out."""
    found: list[str] = []
    for line in script.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0] if not line.lstrip().startswith("#!") else ""
        for part in _SHELL_SPLIT.split(line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            while words and (words[0] in ("sudo", "exec", "env") or _ASSIGNMENT.match(words[0])):
                words = words[1:]  # VAR=value, sudo, env before the command
            for prefix in _INSTALLERS:
                if tuple(words[:len(prefix)]) == prefix:
                    found += _named(words[len(prefix):], tool=prefix[0] == "uvx" or prefix[1:2] == ("tool",))
    return list(dict.fromkeys(found))


def _named(args: list[str], tool: bool) -> list[str]:
    names, i, source = [], 0, False
    while i < len(args):
        word = args[i]
        key, eq, value = word.partition("=")
        if key in ("--with", "-w", "--from") and (eq or i + 1 < len(args)):
            names.append(value if eq else args[i + 1])
            source = source or key == "--from"
            i += 1 if eq else 2
            continue
        if word.startswith("-"):
            i += 1 + (key in _VALUED and not eq)
            continue
        if not (tool and source):  # `uvx --from PACKAGE COMMAND`: the command is no package
            names.append(word)
        if tool:  # the tool's own arguments follow its name
            break
        i += 1
    return [n for n in names if _REQUIREMENT.fullmatch(n)]


_VERSION = r"\s*(?:===|==|>=|<=|~=|!=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_REQUIREMENT = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[A-Za-z0-9,._-]+\])?(?:{_VERSION}(?:\s*,{_VERSION})*)?")
