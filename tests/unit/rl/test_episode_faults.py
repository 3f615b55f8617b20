"""Faults of the infrastructure apart from failures of the policy (#57), in the rollout's episode runner: a sandbox
that cannot start before the agent acts, the host short of disk or memory, or the engine failing is retried and
counted in ``infra_faults``; an episode that ends in an error its own actions caused (a command that broke its
sandbox, a verifier phase that could not run) scores 0 with the reason, is kept, and counts in ``policy_errors``.
A scripted engine and scripted sandboxes: no model, no bubblewrap."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from megatron_composer.data.chat_template import format_tool_call
from rl.envs.task import EmptyTree, ScriptVerifier, Task, TaskLimits
from rl.metrics import group_metrics
from rl.orchestrator import WorkItem
from rl.rollout.config import RolloutConfig
from rl.rollout.episodes import EpisodeCrash, EpisodeRunner
from rl.rollout.tasks import RLTask
from rl.sandbox.base import ExecResult, SandboxError

BROKEN = "cannot make the verifier's directories: [Errno 17] File exists: '/var/log/entrypoint.log'"


@dataclass
class Generated:
    token_ids: list[int]
    sampling_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"

    def routing_for_training(self):
        return None


class ScriptedEngine:
    """Every turn: one `run` tool call (or, with `fail`, an engine error)."""

    def __init__(self, tokenizer, fail: bool = False):
        text = format_tool_call("run", {"command": "ls"}) + "<|im_end|>"
        self.ids, self.fail = tokenizer.encode(text), fail

    def generate(self, prompts, params):
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [Generated(self.ids, [0.0] * len(self.ids), [0] * len(self.ids)) for _ in prompts]


class ScriptedSandbox:
    """A sandbox whose `breaks` step raises: "start" (the no-op before the agent), "agent" (the agent's command),
    "verifier" (entering the verifier phase); its verifier writes reward 0."""

    workdir = "/app"

    def __init__(self, breaks: str | None = None):
        self.breaks, self.started = breaks, False

    def exec(self, command: str, **kw) -> ExecResult:
        if not self.started:
            self.started = True
            if self.breaks == "start":
                raise SandboxError("cannot start the sandbox's episode: bwrap: Creating new namespace failed")
        elif command == "ls" and self.breaks == "agent":
            raise SandboxError("the sandbox's keeper is gone (the episode's processes were killed)")
        return ExecResult(0, "", 0, 0.01)

    def enter_verifier(self, services: bool = True) -> None:
        if self.breaks == "verifier":
            raise SandboxError(BROKEN)

    def copy_in(self, *args, **kw) -> None:
        pass

    def end_episode(self):
        return None

    def read_file(self, path: str, max_bytes: int):
        return b"0\n" if path.endswith("reward.txt") else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class ScriptedPool:
    """Forks the scripted sandboxes in order (a string is a fork that fails, as the host's)."""

    def __init__(self, plan: list):
        self.plan, self.lock = list(plan), threading.Lock()
        self._executor = ThreadPoolExecutor(1)

    @contextmanager
    def fork(self, task):
        with self.lock:
            step = self.plan.pop(0)
        if isinstance(step, str):
            raise SandboxError(step)
        yield step


@pytest.fixture
def runner(rl_assets, tmp_path):
    from megatron_composer.data.tokenizer import load_tokenizer

    (tmp_path / "tests").mkdir()
    task = Task("t", "List the files.", tree=EmptyTree(), verifier=ScriptVerifier(tmp_path / "tests"),
                limits=TaskLimits(max_turns=2))
    cfg = RolloutConfig(group_size=2, agent_max_turns=2, agent_max_new_tokens=64, max_seq_len=2048,
                        episode_retries=2).validate()
    tok = load_tokenizer(rl_assets / "tok")
    return EpisodeRunner("w", cfg, tok, [RLTask("t", "agent", harbor=task)], ScriptedEngine(tok))


def test_errors_of_the_episode_score_0_and_faults_of_the_host_are_retried(runner, monkeypatch):
    task = runner.tasks[0]
    broke_itself = runner.run_agent_episode(task, ScriptedSandbox("agent"), seed=1)
    assert broke_itself["verifier_reward"] == 0.0 and broke_itself["segments"]
    assert "ended in an error of its own: SandboxError: the sandbox's keeper is gone" in broke_itself["meta"]["error"]
    assert broke_itself["meta"]["stop_reason"] == "error" and broke_itself["meta"]["tool_calls"] == 1
    void = runner.run_agent_episode(task, ScriptedSandbox("verifier"), seed=1)
    assert void["verifier_reward"] == 0.0 and BROKEN in void["meta"]["error"], void["meta"]
    with pytest.raises(EpisodeCrash, match="the sandbox could not start"):
        runner.run_agent_episode(task, ScriptedSandbox("start"), seed=1)
    monkeypatch.setattr("rl.envs.verdict.host_shortage", lambda folder=None: "the host has 12 MiB of memory available")
    with pytest.raises(EpisodeCrash, match="the host has 12 MiB of memory available"):
        runner.run_agent_episode(task, ScriptedSandbox("agent"), seed=1)


def test_an_engine_failure_is_not_the_episodes(runner):
    runner.engines = ScriptedEngine(runner.tokenizer, fail=True)
    with pytest.raises(EpisodeCrash, match="CUDA error"):
        runner.run_agent_episode(runner.tasks[0], ScriptedSandbox(), seed=1)


def test_a_group_keeps_its_failed_episodes_and_counts_both_kinds(runner):
    """The first fork fails (the host's: retried), one episode's verifier phase cannot run (its own: kept as 0):
    the group completes with both counted, and nothing is handed back to the queue."""
    runner._pool = ScriptedPool(["injected: cannot fork the snapshot (No space left on device)",
                                 ScriptedSandbox("verifier"), ScriptedSandbox()])
    group = runner.run_group(WorkItem(0, 0))
    assert len(group["episodes"]) == 2 and group["infra_faults"] == 1
    metrics = group_metrics([group])
    assert metrics["infra_faults"] == 1.0 and metrics["policy_errors"] == 1.0 and metrics["episodes"] == 2.0
    runner._pool = ScriptedPool(["cannot fork"] * 6)  # a host that keeps failing: the group goes back
    with pytest.raises(EpisodeCrash, match="failed 3 times"):
        runner.run_group(WorkItem(1, 0))
