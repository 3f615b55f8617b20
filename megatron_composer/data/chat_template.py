"""The project's one chat template and tool-call format, shared by SFT data, the inference server and the RL agent.

A conversation renders as ChatML-style turns::

  <|im_start|>system\n...<|im_end|>\n
  <|im_start|>user\n...<|im_end|>\n
  <|im_start|>assistant\nthinking and text<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call><|im_end|>\n
  <|im_start|>tool\n...observation...<|im_end|>\n

Tool calls are JSON objects with "name" and "arguments" between <tool_call> and </tool_call>. Only the
assistant's content and its closing <|im_end|> are trained on (SFT) or sampled (RL); everything else is
context.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)
ROLES = ("system", "user", "assistant", "tool")

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


class ChatFormatError(ValueError):
    """A message list does not follow the chat schema."""


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"{TOOL_CALL_START}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{TOOL_CALL_END}"


def structured_tool_calls(message: dict) -> tuple[list[dict[str, Any]], list[str]]:
    """A message's OpenAI-style `tool_calls` ({"function": {"name", "arguments"}} or {"name", "arguments"},
    arguments as an object or a JSON string) as ({"name", "arguments"} calls, errors of malformed ones)."""
    calls, errors = [], []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                errors.append(f"tool call '{fn.get('name')}' arguments are not valid JSON: {args[:80]!r}")
                continue
        calls.append({"name": fn.get("name"), "arguments": args})
    return calls, errors


def _assistant_body(message: dict) -> str:
    calls, errors = structured_tool_calls(message)
    if errors:
        raise ChatFormatError(errors[0])
    text = message.get("content") or ""
    for call in calls:
        text += format_tool_call(call["name"], call["arguments"])
    return text


def render_segments(messages: list[dict], add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
    """Render messages to (text, trainable) segments; trainable marks the assistant's own tokens."""
    segments: list[tuple[str, bool]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"message {i} has role {role!r}; use one of {list(ROLES)}")
        if role == "assistant":
            segments.append((f"{IM_START}assistant\n", False))
            segments.append((_assistant_body(message) + IM_END, True))
            segments.append(("\n", False))
        else:
            content = message.get("content")
            if not isinstance(content, str):
                raise ChatFormatError(f"message {i} ({role}) needs a string 'content'")
            segments.append((f"{IM_START}{role}\n{content}{IM_END}\n", False))
    if add_generation_prompt:
        segments.append((f"{IM_START}assistant\n", False))
    return segments


def render_text(messages: list[dict], add_generation_prompt: bool = False) -> str:
    return "".join(text for text, _ in render_segments(messages, add_generation_prompt))


@dataclass
class ParsedAssistant:
    """An assistant turn split into free text, well-formed tool calls and the errors of malformed ones."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_assistant(text: str) -> ParsedAssistant:
    """Parse generated assistant text (without the leading role header) into content and tool calls."""
    text = text.split(IM_END, 1)[0]
    calls, errors = [], []
    for match in _TOOL_CALL_RE.finditer(text):
        raw = match.group(1).strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {raw[:120]}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f"tool call must be an object with a string 'name': {raw[:120]}")
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            errors.append(f"tool call '{obj['name']}' needs 'arguments' as an object: {raw[:120]}")
            continue
        calls.append({"name": obj["name"], "arguments": args})
    rest = _TOOL_CALL_RE.sub("", text)
    if TOOL_CALL_START in rest:
        errors.append("unterminated <tool_call> (missing </tool_call>)")
        rest = rest.split(TOOL_CALL_START, 1)[0]
    return ParsedAssistant(content=rest.strip(), tool_calls=calls, errors=errors)
