"""Checks every task folder format shares (Harbor, Terminal-Bench 1): nothing of it resolves outside it, what a
compose file beside its Dockerfile asks for, and positive numbers in its config."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import yaml

from rl.envs.task import TaskError


def positive_number(value, name: str) -> float:
    """value as a float when it is a positive number (not a bool); else a TaskError naming the field `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskError(f"{name} must be a positive number, got {value!r}")
    return float(value)


COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


def compose_notes(environment_dir: Path) -> list[str]:
    """A compose file beside the Dockerfile: one service (the task's own container, as Terminal-Bench writes it)
    is a note, since its settings beyond the build are not applied; several services (a multi-container task) are
    refused in one line."""
    for name in COMPOSE_FILES:
        path = environment_dir / name
        if not path.is_file():
            continue
        try:
            services = (yaml.safe_load(path.read_text()) or {}).get("services") or {}
        except (yaml.YAMLError, AttributeError) as e:
            raise TaskError(f"{path} is not a compose file: {str(e).splitlines()[0][:120]}") from None
        if not isinstance(services, dict):
            raise TaskError(f"{path}: services must be a mapping of service names")
        if len(services) > 1:
            raise TaskError(f"{path}: a multi-container task ({', '.join(sorted(services))}) is not supported: "
                            "every backend here runs one container per sample")
        return [f"{path}: the compose file's settings beyond the build (ports, volumes, environment) are not "
                "applied; the task runs as one sandbox"]
    return []


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
    names, i = [], 0
    while i < len(args):
        word = args[i]
        key, eq, value = word.partition("=")
        if key in ("--with", "-w", "--from") and (eq or i + 1 < len(args)):
            names.append(value if eq else args[i + 1])
            i += 1 if eq else 2
            continue
        if word.startswith("-"):
            i += 1 + (key in _VALUED and not eq)
            continue
        names.append(word)
        if tool:  # the tool's own arguments follow its name
            break
        i += 1
    return [n for n in names if _REQUIREMENT.fullmatch(n)]


_VERSION = r"\s*(?:===|==|>=|<=|~=|!=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_REQUIREMENT = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[A-Za-z0-9,._-]+\])?(?:{_VERSION}(?:\s*,{_VERSION})*)?")
