"""Checks every task folder format shares (Harbor, Terminal-Bench 1): nothing of it resolves outside it, what a
compose file beside its Dockerfile asks for, and positive numbers in its config."""

from __future__ import annotations

import os
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
