"""One agentic episode: the model talks, its tool calls run in a sandbox, the task's verifier gives the reward.

The conversation is rendered and parsed by the run's chat format (megatron_composer.data.chat_format: the
project's ChatML or the model's own template): the policy sees OpenAI-style messages and returns the assistant's
generated text; the format parses its reasoning, text and tool calls, which join the conversation as an
assistant message with `tool_calls` (call ids as the model wrote them, else the format's), and each tool result
follows as a `tool` message answering its call id. The tools are declared to the template as `AGENT_TOOLS`.
Budgets: turns, generated tokens and wall-clock time. Self-summarisation: when the context passes a token
trigger, the `summarize` hook (the rollout, which asks the model) returns a summary and the episode continues
in a new segment that holds only the system prompt, the task and that summary. The episode's reward applies to
every segment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from megatron_composer.data.chat_format import ChatFormat, ChatMLFormat
from rl.envs.episode import after_agent, start_episode
from rl.envs.task import Task, VerifyResult
from rl.envs.tools import TOOL_SPECS, ToolBox, tool_schemas
from rl.sandbox.base import Sandbox

SYSTEM_PROMPT = """You are a software engineering agent working in an isolated Linux sandbox without network.
The task's files are in {workdir}, your working directory. When the task is done, call submit.
Use the tools; you may call several per turn."""


@dataclass(frozen=True)
class AgentProfile:
    """What the agent is told before the task: a system prompt (with {workdir}) and the tools it may call,
    declared as `schemas` (what the chat template lists)."""

    name: str
    system_prompt: str
    tools: tuple[str, ...]
    brief: dict | None = None  # tool -> short description: declared with its required arguments only

    @property
    def schemas(self) -> list[dict]:
        return tool_schemas(self.tools, brief=self.brief)


# `compact`: the file tools, run and submit in a few words each; its episodes of the generated task family fit in
# about 256 tokens (the full profile's system prompt alone takes ~400 tokens of the demo's tokenizer), what a
# tiny model with a 1k context trains on and still attends over.
PROFILES = {
    "full": AgentProfile("full", SYSTEM_PROMPT, tuple(TOOL_SPECS)),
    "compact": AgentProfile(
        "compact", "You are a coding agent. Files are in {workdir}. Use the tools, then call submit.",
        ("read_file", "write_file", "edit_file", "run", "submit"),
        brief={"read_file": "read a file", "write_file": "write a file", "edit_file": "replace text in a file",
               "run": "run a bash command", "submit": "finish the task"}),
}


AGENT_TOOLS = PROFILES["full"].schemas  # what the full profile declares


def agent_profile(name: str) -> AgentProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown agent profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name]

SUMMARY_REQUEST = ("Your context is full. Summarise the task, what you have done, what you learned about the code "
                   "and what remains, so that you can continue from the summary alone.")


class Policy(Protocol):
    def __call__(self, messages: list[dict]) -> str:
        """Return the assistant's generated text for the conversation so far."""


def approx_tokens(text: str) -> int:
    """Rough token count (4 bytes per token) for budgets when the rollout passes no tokenizer."""
    return (len(text.encode()) + 3) // 4


@dataclass
class EpisodeConfig:
    max_turns: int = 50
    max_generated_tokens: int = 1 << 16
    max_observation_chars: int = 8000
    command_timeout_s: float = 120.0
    time_budget_s: float | None = None  # default: the task's agent timeout
    summary_trigger_tokens: int | None = None  # context size that starts self-summarisation (needs a hook)
    profile: str = "full"  # the system prompt and tools (PROFILES)


@dataclass
class EpisodeResult:
    reward: float
    verify: VerifyResult | None
    segments: list[list[dict]]  # each segment's messages; the last one is where the episode ended
    summaries: list[str]
    turns: int
    generated_tokens: int
    tool_calls: dict[str, int]
    malformed_tool_calls: int
    tool_errors: int
    open_todos: int
    submitted: bool
    stop_reason: str  # submitted | no_tool_call | max_turns | token_budget | time_budget
    duration_s: float

    @property
    def messages(self) -> list[dict]:
        return self.segments[-1]


def initial_messages(task: Task, workdir: str, profile: str = "full") -> list[dict]:
    return [
        {"role": "system", "content": agent_profile(profile).system_prompt.format(workdir=workdir)},
        {"role": "user", "content": task.instruction},
    ]


def run_episode(task: Task, sandbox: Sandbox, policy: Policy, config: EpisodeConfig | None = None, *,
                count_tokens: Callable[[str], int] = approx_tokens,
                summarize: Callable[[list[dict]], str] | None = None, verify: bool = True,
                context_tokens: Callable[[list[dict]], int] | None = None,
                chat_format: ChatFormat | None = None) -> EpisodeResult:
    """`context_tokens(messages)`: the context size the summary trigger compares (default: count_tokens of the
    rendered conversation; a policy that holds the token stream answers without re-tokenising it).
    `chat_format`: parses the policy's turns (default ChatML); the policy renders with the same one."""
    config = config or EpisodeConfig()
    fmt = chat_format or ChatMLFormat()
    t0 = time.monotonic()
    budget_s = config.time_budget_s if config.time_budget_s is not None else task.limits.agent_timeout_s
    max_turns = min(config.max_turns, task.limits.max_turns)
    profile = agent_profile(config.profile)
    start_episode(task, sandbox)  # the task's health check (and its stdio MCP servers' commands) before the agent
    tools = ToolBox(sandbox, max_observation_chars=config.max_observation_chars,
                    command_timeout_s=config.command_timeout_s, tools=profile.tools)
    messages = initial_messages(task, sandbox.workdir, profile.name)
    segments, summaries = [messages], []
    generated = turns = calls_made = 0
    stop = "max_turns"
    while turns < max_turns:
        if time.monotonic() - t0 > budget_s:
            stop = "time_budget"
            break
        if generated >= config.max_generated_tokens:
            stop = "token_budget"
            break
        text = policy(messages)
        turns += 1
        generated += count_tokens(text)
        parsed = fmt.parse(text)
        reply = fmt.assistant_message(parsed, first_call_index=calls_made)
        calls_made += len(parsed.tool_calls)
        messages.append(reply)
        for error in parsed.errors:
            messages.append({"role": "tool", "content": tools.malformed(error).text})
        if not parsed.tool_calls and not parsed.errors:
            stop = "no_tool_call"
            break
        for call, sent in zip(parsed.tool_calls, reply.get("tool_calls", [])):
            if tools.submitted:
                break
            obs = tools.call(call["name"], call["arguments"])
            messages.append({"role": "tool", "tool_call_id": sent["id"], "content": obs.text})
        if tools.submitted:
            stop = "submitted"
            break
        more_turns = turns < max_turns and generated < config.max_generated_tokens  # a summary nobody reads is waste
        if (summarize is not None and config.summary_trigger_tokens is not None and more_turns
                and (context_tokens(messages) if context_tokens
                     else count_tokens(fmt.render(messages, tools=profile.schemas)))
                >= config.summary_trigger_tokens):
            summary = summarize(messages + [{"role": "user", "content": SUMMARY_REQUEST}])
            generated += count_tokens(summary)
            summaries.append(summary)
            messages = initial_messages(task, sandbox.workdir, profile.name)
            messages[-1] = {"role": "user", "content": f"{task.instruction}\n\nSummary of your work so far:\n"
                                                       f"{summary}"}
            segments.append(messages)
    if verify:
        after_agent(task, sandbox)  # its collect hooks, as Harbor runs them before the verifier
    result = task.verifier.verify(sandbox, task) if verify else None
    return EpisodeResult(
        reward=result.reward if result else 0.0, verify=result, segments=segments, summaries=summaries,
        turns=turns, generated_tokens=generated, tool_calls=dict(tools.stats.calls),
        malformed_tool_calls=tools.stats.malformed, tool_errors=tools.stats.errors, open_todos=tools.open_todos,
        submitted=tools.submitted, stop_reason=stop, duration_s=time.monotonic() - t0)


class ScriptedPolicy:
    """Replays fixed assistant turns (then submits). Used for oracle replays, tests and benchmarks.

    A turn is the text the model would write, or {"content", "tool_calls": [{"name", "arguments"}]}, written
    in `chat_format` (default ChatML) as that format's template renders such a turn."""

    def __init__(self, turns: list, chat_format: ChatFormat | None = None):
        self.turns = list(turns)
        self.format = chat_format or ChatMLFormat()
        self.i = 0

    def __call__(self, messages: list[dict]) -> str:
        self.i += 1
        turn = self.turns[self.i - 1] if self.i <= len(self.turns) else {"tool_calls": [call("submit")]}
        if isinstance(turn, str):
            return turn
        made = sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant")
        return self.format.assistant_text(turn.get("content", ""), turn.get("tool_calls"), first_call_index=made)


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def oracle_policy(task: Task, chat_format: ChatFormat | None = None) -> ScriptedPolicy:
    """An agent that looks around, then replays the task's reference solution through the `run` tool."""
    if task.solution is None:
        raise ValueError(f"task {task.name} has no reference solution to replay")
    turns = [{"content": "Let me look at the task tree.", "tool_calls": [call("list_dir", path=".")]},
             {"tool_calls": [call("todo", action="add", text="apply the fix")]}]
    turns += [{"tool_calls": [call("run", command=cmd)]} for cmd in task.solution.as_commands()]
    turns += [{"tool_calls": [call("todo", action="complete", id=1)]},
              {"content": "Done.", "tool_calls": [call("submit", summary="applied the reference solution")]}]
    return ScriptedPolicy(turns, chat_format)


def noop_policy(chat_format: ChatFormat | None = None) -> ScriptedPolicy:
    return ScriptedPolicy([{"tool_calls": [call("submit", summary="nothing")]}], chat_format)
