"""Reward shaping: the nonlinear length penalty and behaviour rewards over an agent transcript.

A transcript is the episode's chat message list in the project's format
(`megatron_composer.data.chat_template`): dicts with ``role`` and ``content``; assistant ``content`` is the
raw generated text with inline ``<tool_call>{...}</tool_call>`` blocks (already-parsed calls may instead be
given as ``tool_calls``). Each behaviour function maps a transcript to a number measuring the behaviour
(a count or a fraction, documented per function); the config maps importable paths of such functions to
signed weights, and `shaped_reward` adds sum_i weight_i * f_i(transcript) to the task reward. Any function
with the signature ``f(transcript) -> float`` can be plugged in by its ``module:function`` path.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable, Optional, Union

import torch

from megatron_composer.config import resolve_function
from megatron_composer.data.chat_template import parse_assistant, structured_tool_calls

Number = Union[float, int, torch.Tensor]
Transcript = list[dict[str, Any]]


# ---- length penalty -------------------------------------------------------------------------------------

def _expm1_over_x(z: torch.Tensor) -> torch.Tensor:
    """(e^z - 1) / z with its limit 1 at z = 0."""
    safe = torch.where(z == 0, torch.ones_like(z), z)
    return torch.where(z == 0, torch.ones_like(z), torch.expm1(safe) / safe)


def _log1p_over_x(z: torch.Tensor) -> torch.Tensor:
    """log(1 + z) / z with its limit 1 at z = 0."""
    safe = torch.where(z == 0, torch.ones_like(z), z)
    return torch.where(z == 0, torch.ones_like(z), torch.log1p(safe) / safe)


def length_penalty(x: Number, k: float, q: float) -> Number:
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)), the Composer 2 length cost (x >= 0, k >= 0).

    C(0) = 0 and C'(x) = (1 + k x)^(-q): linear (C = x) for q = 0 or k = 0, log(1 + k x) / k at q = 1,
    saturating towards 1 / (k (q - 1)) for q > 1. Evaluated as
    C = x * [log1p(k x) / (k x)] * [expm1((1 - q) u) / ((1 - q) u)], u = log1p(k x),
    which is exact at q = 1 and k = 0 and accurate near them. Returns a float for float input, else a tensor.
    """
    as_float = not isinstance(x, torch.Tensor)
    x_t = torch.as_tensor(x, dtype=torch.float64) if as_float else x
    if not x_t.is_floating_point():
        x_t = x_t.double()
    k_t = torch.as_tensor(k, dtype=x_t.dtype, device=x_t.device)
    q_t = torch.as_tensor(q, dtype=x_t.dtype, device=x_t.device)
    if (k_t < 0).any():
        raise ValueError(f"length_penalty k must be >= 0, got {k}")
    if (x_t < 0).any():
        raise ValueError("length_penalty x must be >= 0 (a count or a budget fraction)")
    kx = k_t * x_t
    u = torch.log1p(kx)
    out = x_t * _log1p_over_x(kx) * _expm1_over_x((1 - q_t) * u)
    return out.item() if as_float else out


def length_measure(transcript: Transcript, measure: str, num_output_tokens: Optional[int] = None) -> float:
    """x before budget normalisation: ``output_tokens`` (given by the caller), ``turns`` (assistant
    messages) or ``tool_calls`` (well-formed and malformed calls in assistant messages)."""
    if measure == "output_tokens":
        if num_output_tokens is None:
            raise ValueError("length_measure=output_tokens needs num_output_tokens from the rollout")
        return float(num_output_tokens)
    if measure == "turns":
        return float(sum(1 for m in transcript if m.get("role") == "assistant"))
    if measure == "tool_calls":
        return float(sum(len(calls) + len(errors) for calls, errors in _assistant_tool_calls(transcript)))
    raise ValueError(f"length measure is {measure!r}; choose output_tokens, turns or tool_calls")


# ---- behaviour rewards ------------------------------------------------------------------------------------

def _assistant_tool_calls(transcript: Transcript) -> Iterable[tuple[list[dict], list[str]]]:
    """Per assistant message: (well-formed calls as {"name", "arguments"}, errors of malformed ones). Calls are
    read from the message's `tool_calls` (and `tool_call_errors`, as the agent records a turn its chat format
    parsed) and from ChatML <tool_call> markup left in its content (SFT data written that way)."""
    for message in transcript:
        if message.get("role") != "assistant":
            continue
        parsed = parse_assistant(message.get("content") or "")
        structured, structured_errors = structured_tool_calls(message)
        recorded = list(message.get("tool_call_errors") or [])
        yield list(parsed.tool_calls) + structured, list(parsed.errors) + structured_errors + recorded


def malformed_tool_calls(transcript: Transcript) -> float:
    """Number of malformed tool calls (invalid JSON, missing name/arguments, unterminated tag)."""
    return float(sum(len(errors) for _, errors in _assistant_tool_calls(transcript)))


_DONE_STATUSES = ("completed", "cancelled", "canceled", "done")


def unfinished_todos(transcript: Transcript, tool_names: tuple[str, ...] = ("todo", "todo_write")) -> float:
    """Number of todo items not completed (or cancelled) at the end of the transcript.

    Two tool shapes are read: the project's agent tool ``todo`` (rl.envs.tools: ``{"action": "add", "text"}``
    appends an item with the next id 1, 2, ...; ``{"action": "complete", "id"}`` closes one), and a
    ``todo_write`` tool whose arguments are ``{"todos": [{"id", "content", "status"}], "merge": bool}``:
    ``merge=false`` replaces the list, ``merge=true`` updates items by id.
    """
    todos: dict[str, str] = {}
    added = 0
    for calls, _ in _assistant_tool_calls(transcript):
        for call in calls:
            if call["name"] not in tool_names:
                continue
            args = call["arguments"]
            if "action" in args:  # the agent's own `todo` tool
                if args["action"] == "add" and args.get("text"):
                    added += 1
                    todos[str(added)] = "pending"
                elif args["action"] == "complete" and str(args.get("id")) in todos:
                    todos[str(args["id"])] = "completed"
                continue
            items = args.get("todos") or []
            if not args.get("merge", False):
                todos = {}
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    continue
                key = str(item.get("id", item.get("content", i)))
                status = item.get("status", todos.get(key, "pending"))
                todos[key] = str(status).lower()
    return float(sum(1 for status in todos.values() if status not in _DONE_STATUSES))


_COMMENT_RE = re.compile(r"(?:^|\s)(?:#|//)\s?([^\n]*)|/\*(.*?)\*/", re.DOTALL)
# First-person deliberation and self-correction: text that belongs in the reasoning, not in the code.
_REASONING_RE = re.compile(
    r"\b(?:let me|let's|i think|i need|i'll|i will|i should|we need to|we should|wait\b|hmm|actually,|"
    r"on second thought|maybe we|not sure|i guess|i wonder|the user (?:wants|asked))",
    re.IGNORECASE,
)


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def reasoning_in_code_comments(transcript: Transcript) -> float:
    """Number of code comments (``#``, ``//``, ``/* */`` in tool-call arguments) that read as the model's
    deliberation ("let me", "I think", "wait", "hmm", "we need to", ...). A heuristic by design: replace
    it with a classifier by pointing the config at another function."""
    count = 0
    for calls, _ in _assistant_tool_calls(transcript):
        for call in calls:
            for text in _strings(call["arguments"]):
                for match in _COMMENT_RE.finditer(text):
                    comment = match.group(1) if match.group(1) is not None else match.group(2)
                    if comment and _REASONING_RE.search(comment):
                        count += 1
    return float(count)


def single_tool_collapse(transcript: Transcript, min_calls: int = 5, max_share: float = 0.9) -> float:
    """How far the agent collapsed onto one tool: with n >= min_calls well-formed calls and s the share of
    the most used tool, max(0, s - max_share) / (1 - max_share) (0 for a healthy mix, 1 when every call
    uses one tool); 0 when there are fewer than min_calls calls."""
    names = [call["name"] for calls, _ in _assistant_tool_calls(transcript) for call in calls]
    if len(names) < min_calls:
        return 0.0
    share = Counter(names).most_common(1)[0][1] / len(names)
    return max(0.0, share - max_share) / (1.0 - max_share)


# ---- combination ------------------------------------------------------------------------------------------

def shaped_reward(
    task_reward: float,
    transcript: Transcript,
    behaviour_weights: dict[str, float],
    length_weight: float = 0.0,
    length_k: float = 1.0,
    length_q: float = 1.0,
    length_measure_name: str = "output_tokens",
    length_budget: float = 1.0,
    num_output_tokens: Optional[int] = None,
) -> tuple[float, dict[str, float]]:
    """R = task_reward + sum_i w_i f_i(transcript) - length_weight * C(x / length_budget; k, q).

    Returns (R, components) with each behaviour value and the length cost, for logging.
    """
    total = float(task_reward)
    components: dict[str, float] = {}
    for path, weight in behaviour_weights.items():
        value = float(resolve_function(path)(transcript))
        components[path] = value
        total += weight * value
    if length_weight != 0:
        x = length_measure(transcript, length_measure_name, num_output_tokens) / length_budget
        cost = length_penalty(x, length_k, length_q)
        components["length_cost"] = cost
        total -= length_weight * cost
    return total, components


def shaped_reward_from_config(task_reward: float, transcript: Transcript, cfg,
                              num_output_tokens: Optional[int] = None) -> tuple[float, dict[str, float]]:
    """`shaped_reward` with the weights and length-penalty settings of an `RLObjectiveConfig`."""
    return shaped_reward(task_reward, transcript, cfg.behaviour_rewards, cfg.length_penalty_weight,
                         cfg.length_penalty_k, cfg.length_penalty_q, cfg.length_measure, cfg.length_budget,
                         num_output_tokens)


def reward_term_name(path: str) -> str:
    """The metric name of a behaviour function path: its function name (``pkg.mod:malformed_tool_calls`` ->
    ``malformed_tool_calls``)."""
    return path.rpartition(":")[2].rpartition(".")[2] if ":" in path else path.rpartition(".")[2]


def episode_reward(verifier_reward: float, transcript: Transcript, cfg,
                   num_output_tokens: Optional[int] = None) -> tuple[float, dict[str, float]]:
    """The training reward of one episode under an `RLObjectiveConfig`, and its signed parts.

    R = verifier_reward + sum_i w_i f_i(transcript) - length_penalty_weight * C(x / length_budget; k, q), the
    sum `shaped_reward` forms, computed once per episode (a summarisation chain is one episode: its transcript is
    every segment's messages and x counts the whole chain). Returns (R, terms) with terms = {name: signed
    contribution to R}: one entry per behaviour function (named by `reward_term_name`) and ``length_penalty``
    (<= 0) when the penalty is on, so R = verifier_reward + sum(terms.values()).
    """
    total, components = shaped_reward_from_config(verifier_reward, transcript, cfg, num_output_tokens)
    terms = {reward_term_name(path): cfg.behaviour_rewards[path] * components[path] for path in cfg.behaviour_rewards}
    if "length_cost" in components:
        terms["length_penalty"] = -cfg.length_penalty_weight * components["length_cost"]
    return total, terms
