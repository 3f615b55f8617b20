"""Multi-step tasks (Harbor's [[steps]]): each step's agent work, then its verifier, in order in one sandbox.

Before a step's agent: its workdir/ files go into the work dir (their setup.sh runs once from there and is then
removed), and its health check must pass (as docker runs a HEALTHCHECK: rl/envs/episode.py). After its agent: its
collect hooks, and its artifacts (the task's and its own) into the run folder's steps/<name>/artifacts/. After its
verifier the sandbox goes back to the agent phase. A step
whose reward is below its min_reward (a number, or one per key of reward.json) stops the task. The task's reward is
the mean over every step, a step not reached counting 0, or with "final" the last step's (0 when it was not
reached).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from rl.envs.episode import EpisodeStartError, after_agent, wait_healthy
from rl.envs.task import Task, TaskStep, VerifyResult
from rl.sandbox.base import Sandbox

STRATEGIES = ("mean", "final")


def _passes(result: VerifyResult, need: float | dict[str, float] | None) -> bool:
    if need is None:
        return True
    if isinstance(need, dict):
        rewards = result.details.get("rewards") or {"reward": result.reward}
        return all(rewards.get(key, result.reward if key == "reward" else float("-inf")) >= value
                   for key, value in need.items())
    return result.reward >= need


def _before_agent(step: TaskStep, sandbox: Sandbox) -> str | None:
    """Place the step's files and run its setup.sh and health check; why the step cannot start, or None."""
    workdir = step.task.workdir
    if step.workdir_files is not None:
        sandbox.copy_in(step.workdir_files, workdir, merge=True)
        if (step.workdir_files / "setup.sh").is_file():
            res = sandbox.exec("bash ./setup.sh; status=$?; rm -f setup.sh; exit $status", cwd=workdir,
                               timeout=step.task.limits.setup_timeout_s)
            if not res.ok:
                return f"its workdir/setup.sh failed ({res.describe()}): {res.output.strip()[-200:]}"
    if step.healthcheck is not None:
        try:
            wait_healthy(sandbox, step.healthcheck, workdir, "its health check")
        except EpisodeStartError as e:
            return str(e)
    return None


def run_steps(task: Task, sandbox: Sandbox, act: Callable[[Task, Sandbox], None],
              artifacts_dir: Path | None = None) -> VerifyResult:
    """Run `task`'s steps in `sandbox`: `act(step_task, sandbox)` is the agent's work on a step (an agent, the
    reference solution, or nothing). Returns the task's verdict; details["steps"] holds each step's. The task's own
    health check has passed before (rl/envs/episode.py start_episode)."""
    per_step: list[dict] = []
    rewards: list[float] = []
    outputs: list[str] = []
    for step in task.steps:
        why = _before_agent(step, sandbox)
        if why is not None:
            per_step.append({"step": step.name, "reward": 0.0, "error": f"step {step.name}: {why}"})
            rewards.append(0.0)
            break
        act(step.task, sandbox)
        problems = after_agent(step.task, sandbox, None if artifacts_dir is None else
                               artifacts_dir / "steps" / step.name / "artifacts")
        result = step.task.verifier.verify(sandbox, step.task)
        if problems:
            result.details["collect"] = problems
        sandbox.leave_verifier()
        rewards.append(result.reward)
        outputs.append(f"## step {step.name}\n{result.output}")
        per_step.append({"step": step.name, "reward": result.reward, **result.details})
        if not _passes(result, step.min_reward):
            per_step[-1]["stopped"] = f"below its min_reward {step.min_reward}"
            break
    reached_all = len(rewards) == len(task.steps)
    if task.step_reward == "final":
        reward = rewards[-1] if reached_all else 0.0
    else:
        reward = sum(rewards) / len(task.steps)
    details: dict = {"steps": per_step}
    errors = [s["error"] for s in per_step if "error" in s]
    if errors:
        details["error"] = "; ".join(errors)
    return VerifyResult(reward, "\n".join(outputs), details)
