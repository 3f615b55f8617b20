"""Agentic coding environments: tasks (Harbor/Terminal-Bench folders, SWE-bench instances), the agent's tool
protocol and episodes.

    from rl.envs import load_harbor_task, run_episode, prepare_task
    from rl.sandbox import LocalBackend, SandboxPool

    task = load_harbor_task("examples/tasks/python-lru-cache-bug")
    with SandboxPool(LocalBackend(), prepare_task, concurrency=4) as pool:
        results = pool.run_group(task, lambda sandbox, i: run_episode(task, sandbox, policy), group_size=8)
    rewards = [r.reward for r in results]
"""

from rl.envs.agent import EpisodeConfig, EpisodeResult, ScriptedPolicy, noop_policy, oracle_policy, run_episode
from rl.envs.harbor import load_harbor_task
from rl.envs.swebench import load_swebench, swebench_task
from rl.envs.task import Task, TaskError, TaskLimits, VerifyResult, prepare_task
from rl.envs.tools import TOOL_SPECS, ToolBox

__all__ = ["EpisodeConfig", "EpisodeResult", "ScriptedPolicy", "noop_policy", "oracle_policy", "run_episode",
           "load_harbor_task", "load_swebench", "swebench_task", "Task", "TaskError", "TaskLimits",
           "VerifyResult", "prepare_task", "TOOL_SPECS", "ToolBox"]
