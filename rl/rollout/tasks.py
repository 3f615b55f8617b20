"""RL prompt sets: single-turn verifiable prompts and agentic sandbox tasks behind one list.

A task directory holds either or both of:

* ``tasks.jsonl``: one single-turn prompt per line, ``{"id": str, "prompt": str, "check": {...}}``. The
  response (the assistant's text up to its end-of-turn marker) is scored by the check:
  ``{"regex": PATTERN}`` -> 1 if ``re.fullmatch`` accepts the stripped response, else 0;
  ``{"prefix": TEXT}`` -> 1 if the stripped response starts with TEXT;
  ``{"python_output": TEXT}`` -> the response is a Python program run in a sandbox (``rl.sandbox``), 1 if its
  stdout (stripped) equals TEXT.
* sub-directories that are Harbor tasks (``task.toml`` + ``instruction.md``) or Terminal-Bench 1 tasks
  (``task.yaml``): agent episodes in a sandbox, rewarded by the task's verifier.

`load_rl_tasks(dir)` returns them in a fixed order (jsonl lines first, then task folders by name), so prompt
indices, and therefore the sampler's permutation, are stable across runs and resumes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_composer.config import ConfigError


@dataclass
class RLTask:
    name: str
    kind: str  # "single_turn" | "agent"
    prompt: str = ""
    check: Optional[dict] = None
    harbor: object = None  # rl.envs.Task for agent tasks

    def score(self, response: str, sandbox_factory=None) -> tuple[float, str]:
        """(reward, reason) of a single-turn response."""
        text = response.strip()
        if "regex" in self.check:
            ok = re.fullmatch(self.check["regex"], text, flags=re.DOTALL) is not None
            return float(ok), "regex matched" if ok else "regex did not match"
        if "prefix" in self.check:
            ok = text.startswith(self.check["prefix"])
            return float(ok), "prefix matched" if ok else "prefix did not match"
        if "python_output" in self.check:
            if sandbox_factory is None:
                raise ValueError(f"task {self.name}: python_output checks need a sandbox")
            with sandbox_factory() as sandbox:
                sandbox.write_file("answer.py", response.encode())
                res = sandbox.exec("python3 answer.py", timeout=15)
            ok = res.ok and res.output.strip() == str(self.check["python_output"]).strip()
            return float(ok), res.describe() if not ok else "output matched"
        raise ValueError(f"task {self.name}: unknown check {sorted(self.check)}")


_CHECK_KINDS = ("regex", "prefix", "python_output")


def load_rl_tasks(path: str | Path) -> list[RLTask]:
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"rl task directory '{root}' does not exist; point data.tasks at a folder with tasks.jsonl "
                          "or Harbor task folders")
    tasks: list[RLTask] = []
    jsonl = root / "tasks.jsonl"
    if jsonl.is_file():
        for n, line in enumerate(jsonl.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{jsonl}:{n}: not valid JSON ({e.msg}); one JSON object per line") from None
            check = d.get("check")
            if not isinstance(d.get("prompt"), str) or not isinstance(check, dict) or \
                    len([k for k in _CHECK_KINDS if k in check]) != 1:
                raise ConfigError(f"{jsonl}:{n}: needs 'prompt' (string) and 'check' with exactly one of "
                                  f"{list(_CHECK_KINDS)}")
            if "regex" in check:
                try:
                    re.compile(check["regex"])
                except re.error as e:
                    raise ConfigError(f"{jsonl}:{n}: check.regex does not compile: {e}") from None
            tasks.append(RLTask(name=str(d.get("id", f"line{n}")), kind="single_turn", prompt=d["prompt"], check=check))
    from rl.envs import load_harbor_task

    for sub in sorted(p for p in root.iterdir() if p.is_dir() and ((p / "task.toml").is_file()
                                                                     or (p / "task.yaml").is_file())):
        task = load_harbor_task(sub)
        if task.steps:
            raise ConfigError(f"{sub} is a multi-step task ([[steps]]); RL rollouts run single-step tasks: check it "
                              "with tools/check_task.py, or train on its steps as tasks of their own")
        tasks.append(RLTask(name=task.name, kind="agent", prompt=task.instruction, harbor=task))
    if not tasks:
        raise ConfigError(f"'{root}' holds no tasks.jsonl and no task folders (Harbor's task.toml, Terminal-Bench's "
                          "task.yaml)")
    return tasks
