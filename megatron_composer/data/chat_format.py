"""How conversations become text and sampled text becomes tool calls: one interface for SFT data, the RL agent
and the OpenAI server (the `chat_format` config key).

* ``chatml``: the project's own format (`chat_template`), for models without a template of their own (the
  tiny demo).
* a model's own template: the checkpoint's chat_template.jinja (or tokenizer_config.json's "chat_template")
  rendered with jinja2 exactly as transformers' ``apply_chat_template`` renders it (same sandbox, filters,
  globals and special-token variables), with the tool-call syntax of its family parsed by a `ToolCallParser`
  named as the serving stacks name them: ``kimi_k2`` (Kimi K2 / K2 Thinking / K2.5), ``deepseek_v3``,
  ``deepseek_v31`` and ``hermes`` (Qwen3 and other Hermes-style templates).

Token-in, token-out: a rollout never re-renders what is already in its context. After a sampled assistant turn,
`ChatFormat.continuation` gives only the text that follows it (the rest of the turn's closing, the new messages
and the next generation prompt), which the rollout tokenises and appends. Where a template would render an
earlier turn differently later (Kimi and Qwen3 drop the reasoning of turns before the last user message), the
trainer sees the turn as it was sampled, which is the context the model actually had.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from megatron_composer.data import chat_template as chatml
from megatron_composer.data.chat_template import ChatFormatError, ParsedAssistant, structured_tool_calls

CHAT_FORMATS = ("auto", "chatml", "kimi_k2", "deepseek_v3", "deepseek_v31", "hermes")

Segments = list[tuple[str, bool]]  # (text, trainable)


@dataclass
class ParsedTurn(ParsedAssistant):
    """A sampled assistant turn: reasoning, free text, well-formed tool calls ({"name", "arguments", "id"?}) and
    the errors of malformed ones."""

    reasoning: str = ""
    ids: list[Optional[str]] = field(default_factory=list)  # the call ids the model wrote (Kimi), else None


def openai_tool_calls(calls: list[dict], ids: list[str]) -> list[dict]:
    """{"name", "arguments"} calls as OpenAI message `tool_calls` (arguments as a JSON string, as the API sends
    them)."""
    return [{"id": i, "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c, i in zip(calls, ids)]


class ChatFormat(ABC):
    """Renders messages (OpenAI schema: role, content, tool_calls, tool_call_id, reasoning_content) and parses
    what the model samples."""

    name: str
    end_of_turn: str  # the token that closes an assistant turn; sampling stops there

    @abstractmethod
    def render(self, messages: list[dict], *, tools: Optional[list[dict]] = None,
               add_generation_prompt: bool = False) -> str:
        ...

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """A sampled assistant turn (what follows the generation prompt) as reasoning, content and tool calls."""

    def call_id(self, name: str, index: int) -> str:
        """The id of the `index`-th tool call of a conversation when the model wrote none."""
        return f"call_{index}"

    # -- derived from render -------------------------------------------------------------------------------
    def render_segments(self, messages: list[dict], *, tools: Optional[list[dict]] = None) -> list[Segments]:
        """SFT samples of a conversation: each a list of (text, trainable) segments where exactly the assistant's
        own tokens (what follows its generation prompt, up to and including its end of turn) are trainable.

        Every assistant turn is trained once, as the template renders it when it is the newest message (as it
        was generated: Kimi and Qwen3 show reasoning only there) and after the text of the prompt it answers
        (the messages before it, rendered with the generation prompt). Usually that is one sample, the
        template's rendering of the whole conversation. A template that renders earlier turns differently once
        later messages exist (drops their reasoning) gives more: the longest rendering in which the turn and its
        prompt are intact, and as a last resort a sample of its own."""
        _check_messages(messages)
        turns = {i: self._turn(messages, i, tools) for i, m in enumerate(messages) if m["role"] == "assistant"}
        pending = sorted(turns)
        samples = []
        end = len(messages)
        while True:
            text = self.render(messages[:end], tools=tools)
            spans = []
            for i in [i for i in pending if i < end]:
                prompt, body = turns[i]
                if text.startswith(prompt + body):
                    spans.append((len(prompt), len(prompt) + len(body)))
                    pending.remove(i)
            if spans or not samples and not pending:  # a conversation without assistant turns is all context
                samples.append(_cut(text, spans))
            if pending and end == pending[-1] + 1:  # not intact even as the last message: a sample of its own
                prompt, body = turns[pending.pop()]
                samples.append([(prompt, False), (body, True)])
            if not pending:
                return samples
            end = pending[-1] + 1

    def _turn(self, messages: list[dict], i: int, tools: Optional[list[dict]]) -> tuple[str, str]:
        """(prompt, turn) of assistant message i: the messages before it with the generation prompt, and its own
        rendering up to and including its end of turn, read from render(messages[:i + 1])."""
        prompt = self.render(messages[:i], tools=tools, add_generation_prompt=True)
        whole = self.render(messages[:i + 1], tools=tools)
        if whole.startswith(prompt):
            start = len(prompt)
        else:  # adding the turn re-rendered earlier ones: it starts after as many ends of turn as precede it
            before = self.render(messages[:i], tools=tools)
            n = before.count(self.end_of_turn)
            at = (_nth(whole, self.end_of_turn, n) + len(self.end_of_turn)) if n else 0
            last_turn = before[before.rfind(self.end_of_turn) + len(self.end_of_turn):] if n else before
            header = last_turn + prompt[len(before):]
            if (not prompt.startswith(before) or at < len(self.end_of_turn) * bool(n)
                    or not whole.startswith(header, at)):
                raise ChatFormatError(f"{self.name}: cannot find assistant message {i} in the template's rendering "
                                      "after its generation prompt; this template cannot be trained turn by turn")
            start = at + len(header)
        stop = whole.find(self.end_of_turn, start)
        if stop < 0:
            raise ChatFormatError(f"{self.name}: assistant message {i} renders without its end of turn "
                                  f"{self.end_of_turn!r}; the template and the chat_format do not match")
        return prompt, whole[start:stop + len(self.end_of_turn)]

    def assistant_text(self, content: str = "", tool_calls: Optional[list[dict]] = None, reasoning: str = "",
                       first_call_index: int = 0) -> str:
        """What the model writes for an assistant turn with this content and {"name", "arguments"} calls, up to
        its end of turn (where sampling stops): the template's own rendering of such a turn (scripted policies
        and tests)."""
        message = self.assistant_message(ParsedTurn(content=content, tool_calls=list(tool_calls or []),
                                                    reasoning=reasoning), first_call_index)
        _, turn = self._turn([{"role": "user", "content": "."}, message], 1, None)
        return turn[:-len(self.end_of_turn)]

    def assistant_message(self, parsed: ParsedTurn, first_call_index: int = 0) -> dict:
        """The OpenAI message of a parsed turn; calls without an id of the model's get `call_id`s."""
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            ids = [(parsed.ids[j] if j < len(parsed.ids) and parsed.ids[j]
                    else self.call_id(c["name"], first_call_index + j))
                   for j, c in enumerate(parsed.tool_calls)]
            message["tool_calls"] = openai_tool_calls(parsed.tool_calls, ids)
        if parsed.errors:
            message["tool_call_errors"] = list(parsed.errors)
        return message

    def continuation(self, history: list[dict], new: list[dict], *, tools: Optional[list[dict]] = None,
                     closed: bool = True) -> str:
        """The text that follows the sampled assistant turn `history[-1]` when the messages `new` arrive: the
        rest of the turn's closing as the template writes it, `new` and the next generation prompt. `closed`:
        the sampled tokens ended with the end of turn (else it is part of the continuation). Nothing before it
        is re-rendered: the rollout appends the tokens of this text to those it already holds."""
        if not history or history[-1].get("role") != "assistant":
            raise ChatFormatError("continuation() needs a history that ends with the sampled assistant message")
        before = self.render(history, tools=tools)
        after = self.render(history + new, tools=tools, add_generation_prompt=True)
        prompt = self.render(history[:-1], tools=tools, add_generation_prompt=True)
        if after.startswith(prompt) and before.startswith(prompt):
            # the sampled turn's end of turn is the first one after its generation prompt in both renderings
            stop = after.find(self.end_of_turn, len(prompt))
        else:
            # the template re-renders earlier turns once `new` arrives (e.g. drops their reasoning): count turns
            stop = _nth(after, self.end_of_turn, before.count(self.end_of_turn))
        if stop < 0:
            raise ChatFormatError(f"{self.name}: cannot find where the sampled assistant turn ends in the template's "
                                  f"rendering (no {self.end_of_turn!r}); the template and the chat_format do not match")
        tail = after[stop + len(self.end_of_turn):]
        return tail if closed else self.end_of_turn + tail

    def continuation_segments(self, history: list[dict], new: list[dict], *, tools: Optional[list[dict]] = None,
                              closed: bool = True) -> list[tuple[str, bool]]:
        """`continuation` as (text, is_outside_text) pieces: the content of each `tool` message in `new` (what
        the environment returned, verbatim as every supported template renders it) is outside text, for the
        tokenizer's `encode_plain`, so an observation that spells a control token cannot inject it."""
        text = self.continuation(history, new, tools=tools, closed=closed)
        pieces, at = [], 0
        for message in new:
            content = message.get("content") if message.get("role") == "tool" else None
            if not content:
                continue
            i = text.find(content, at)
            if i < 0:
                continue
            if i > at:
                pieces.append((text[at:i], False))
            pieces.append((content, True))
            at = i + len(content)
        if at < len(text):
            pieces.append((text[at:], False))
        return pieces

    def stop_token_ids(self, tokenizer) -> list[int]:
        ids = [tokenizer.token_to_id(self.end_of_turn), tokenizer.eod]
        return list(dict.fromkeys(i for i in ids if i is not None))


def _check_messages(messages: list[dict], parts: bool = False) -> None:
    """Roles, tool calls and contents; `parts`: a content may also be a list of {"type": "text", "text"} parts
    (OpenAI's multi-part content, which model templates render)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in chatml.ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ChatFormatError(f"message {i} has role {role!r}; use one of {list(chatml.ROLES)}")
        content = message.get("content")
        if message["role"] == "assistant":
            _, errors = structured_tool_calls(message)
            if errors:
                raise ChatFormatError(f"message {i}: {errors[0]}")
        elif not (isinstance(content, str) or parts and isinstance(content, list)
                  and all(isinstance(c, dict) and isinstance(c.get("text", ""), str) for c in content)):
            raise ChatFormatError(f"message {i} ({message['role']}) needs a string 'content'"
                                  + (" or a list of text parts" if parts else ""))


def _cut(text: str, spans: list[tuple[int, int]]) -> Segments:
    segments, at = [], 0
    for start, stop in sorted(spans):
        if start > at:
            segments.append((text[at:start], False))
        segments.append((text[start:stop], True))
        at = stop
    if at < len(text):
        segments.append((text[at:], False))
    return segments


def _nth(text: str, needle: str, n: int) -> int:
    """Index of the n-th (1-based) occurrence of needle, -1 if fewer."""
    at = -1
    for _ in range(n):
        at = text.find(needle, at + 1)
        if at < 0:
            return -1
    return at


# ---- the project's own format ----------------------------------------------------------------------------

def describe_tools(tools: list[dict]) -> str:
    """OpenAI tool schemas as the ChatML format lists them in the system prompt."""
    types = {"string": "str", "integer": "int", "boolean": "bool", "number": "float", "array": "list", "object": "dict"}
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {}
        required = set(params.get("required") or [])
        args = ", ".join(f"{a}: {types.get(p.get('type'), p.get('type', 'any'))}"
                         f"{'' if a in required else ' (optional)'}"
                         for a, p in (params.get("properties") or {}).items())
        lines.append(f"- {fn['name']}({args}): {fn.get('description', '')}")
    example = chatml.format_tool_call(tools[0].get("function", tools[0])["name"], {}) if tools else ""
    return "\n".join(lines) + f"\nCall a tool by writing, for example: {example}"


class ChatMLFormat(ChatFormat):
    """The project's ChatML turns with JSON calls between <tool_call> tags (`data.chat_template`); tool schemas
    are listed at the end of the system message."""

    name = "chatml"
    end_of_turn = chatml.IM_END

    def render(self, messages, *, tools=None, add_generation_prompt=False):
        _check_messages(messages)
        return chatml.render_text(_with_tool_list(messages, tools), add_generation_prompt)

    def render_segments(self, messages, *, tools=None):
        _check_messages(messages)
        return [chatml.render_segments(_with_tool_list(messages, tools))]

    def parse(self, text):
        parsed = chatml.parse_assistant(text)
        return ParsedTurn(content=parsed.content, tool_calls=parsed.tool_calls, errors=parsed.errors)


def _with_tool_list(messages: list[dict], tools: Optional[list[dict]]) -> list[dict]:
    if not tools:
        return messages
    listing = describe_tools(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n{listing}"}] + messages[1:]
    return [{"role": "system", "content": listing}] + messages


# ---- tool-call parsers of model families -----------------------------------------------------------------

def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest) of a turn that may open with <think>...</think>."""
    if "</think>" not in text:
        return "", text
    head, rest = text.split("</think>", 1)
    return head.split("<think>", 1)[-1].strip("\n"), rest


def _json_arguments(raw: str, name: str, errors: list[str]) -> Optional[dict]:
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        errors.append(f"tool call '{name}' arguments are not valid JSON ({e.msg} at char {e.pos}): {raw[:120]}")
        return None
    if not isinstance(args, dict):
        errors.append(f"tool call '{name}' needs its arguments as a JSON object: {raw[:120]}")
        return None
    return args


class ToolCallParser(ABC):
    name: str
    end_of_turn: str
    marker: str  # a string only this family's templates contain (detection)

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        ...

    def call_id(self, name: str, index: int) -> str:
        return f"call_{index}"


class SectionParser(ToolCallParser):
    """Families whose calls sit in one section after the turn's text: SECTION_BEGIN, calls matched by _CALL (each
    opened by CALL_BEGIN), SECTION_END; `_call` reads one match. A turn may open with LEAD (dropped) and with
    <think> reasoning."""

    SECTION_BEGIN: str
    SECTION_END: str
    CALL_BEGIN: str
    LEAD = ""
    _CALL: re.Pattern
    unterminated: str  # the error of a section without its end
    malformed: str  # the error of a call _CALL does not match

    @abstractmethod
    def _call(self, match: re.Match, errors: list[str]) -> Optional[tuple[dict, Optional[str]]]:
        """({"name", "arguments"}, the id the model wrote or None) of one matched call; None (and an error) if bad."""

    def parse(self, text):
        text = text.split(self.end_of_turn, 1)[0]
        if self.LEAD and text.startswith(self.LEAD):
            text = text[len(self.LEAD):]
        reasoning, text = _split_reasoning(text)
        content, calls, ids, errors = text, [], [], []
        if self.SECTION_BEGIN in text:
            content, section = text.split(self.SECTION_BEGIN, 1)
            if self.SECTION_END not in section:
                errors.append(self.unterminated)
            section = section.split(self.SECTION_END, 1)[0]
            for match in self._CALL.finditer(section):
                got = self._call(match, errors)
                if got is not None:
                    calls.append(got[0])
                    ids.append(got[1])
            if self.CALL_BEGIN in self._CALL.sub("", section):
                errors.append(self.malformed)
        return ParsedTurn(content=content.strip(), tool_calls=calls, errors=errors, reasoning=reasoning,
                          ids=ids if any(ids) else [])


class KimiK2Parser(SectionParser):
    """Kimi K2 / K2 Thinking / K2.5: <think>..</think>, then text, then
    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>...
    <|tool_calls_section_end|>, closed by <|im_end|>."""

    name = "kimi_k2"
    end_of_turn = "<|im_end|>"
    marker = "<|tool_call_argument_begin|>"
    SECTION_BEGIN, SECTION_END, CALL_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                              "<|tool_call_begin|>")
    _CALL = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>"
                       r"(.*?)<\|tool_call_end\|>", re.DOTALL)
    _ID = re.compile(r"functions\.(.+):(\d+)")
    unterminated = f"unterminated tool-calls section (missing {SECTION_END})"
    malformed = "unterminated tool call (missing <|tool_call_argument_begin|> or <|tool_call_end|>)"

    def _call(self, match, errors):
        call_id = match.group(1)
        named = self._ID.fullmatch(call_id)
        if named is None:
            errors.append(f"tool call id {call_id[:80]!r} is not functions.NAME:INDEX")
            return None
        args = _json_arguments(match.group(2).strip(), named.group(1), errors)
        return None if args is None else ({"name": named.group(1), "arguments": args}, call_id)

    def call_id(self, name, index):
        return f"functions.{name}:{index}"


class DeepSeekV3Parser(SectionParser):
    """DeepSeek-V3 / R1: text, then <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    \\n```json\\n{json}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>, closed by <｜end▁of▁sentence｜>. A turn
    after tool outputs opens with <｜tool▁outputs▁end｜> (the model writes it)."""

    name = "deepseek_v3"
    end_of_turn = "<｜end▁of▁sentence｜>"
    marker = "<｜tool▁sep｜>"
    SECTION_BEGIN, SECTION_END, CALL_BEGIN = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>"
    LEAD = "<｜tool▁outputs▁end｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)"
                       r"\n```json\n(.*?)\n```<｜tool▁call▁end｜>", re.DOTALL)
    unterminated = f"unterminated tool calls (missing {SECTION_END})"
    malformed = "malformed tool call (expected TYPE<｜tool▁sep｜>NAME, a ```json block and <｜tool▁call▁end｜>)"
    NAME_GROUP, ARGS_GROUP = 2, 3  # _CALL's groups holding the function name and its JSON arguments

    def _call(self, match, errors):
        name = match.group(self.NAME_GROUP).strip()
        args = _json_arguments(match.group(self.ARGS_GROUP), name, errors)
        return None if args is None else ({"name": name, "arguments": args}, None)


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1 / V3.2-Exp: calls as <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜> (no type,
    no fenced block); reasoning after <think> when thinking is on."""

    name = "deepseek_v31"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
    malformed = "malformed tool call (expected NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>)"
    NAME_GROUP, ARGS_GROUP = 1, 2


class HermesParser(ToolCallParser):
    """Hermes / Qwen3: <think>..</think>, text, then <tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>
    blocks, closed by <|im_end|>."""

    name = "hermes"
    end_of_turn = "<|im_end|>"
    marker = "<tool_call>"

    def parse(self, text):
        text = text.split(self.end_of_turn, 1)[0]
        reasoning, text = _split_reasoning(text)
        parsed = chatml.parse_assistant(text)
        content = text.split("<tool_call>", 1)[0] if parsed.tool_calls or parsed.errors else text
        return ParsedTurn(content=content.strip(), tool_calls=parsed.tool_calls, errors=parsed.errors,
                          reasoning=reasoning)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (KimiK2Parser, DeepSeekV3Parser, DeepSeekV31Parser,
                                                                 HermesParser)}


# ---- a model's own template ------------------------------------------------------------------------------

@lru_cache(maxsize=16)
def _compile(template: str):
    """The template compiled in the environment transformers' apply_chat_template uses."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %} blocks (assistant masks) render their body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"templates cannot set {name!r} on a namespace")
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatFormatError(f"chat template does not compile (line {e.lineno}: {e.message})") from None


def _template_messages(messages: list[dict], call_id) -> list[dict]:
    """As transformers hands them to the template: keys with None dropped, reasoning under every name templates
    read; tool calls written in the short {"name", "arguments"} form become OpenAI calls (with the format's ids)."""
    out, calls = [], 0
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [c if "function" in c else
                                     {"id": c.get("id") or call_id(c.get("name"), calls + j), "type": "function",
                                      "function": {"name": c.get("name"), "arguments": c.get("arguments", {})}}
                                     for j, c in enumerate(message["tool_calls"])]
            calls += len(message["tool_calls"])
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class TemplateChatFormat(ChatFormat):
    """A model's own jinja chat template with its family's tool-call parser."""

    def __init__(self, template: str, parser: ToolCallParser, special_tokens: Optional[dict[str, str]] = None,
                 source: str = "chat template", template_kwargs: Optional[dict] = None):
        self.template, self.parser, self.source = template, parser, source
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as the template reads them
        self.template_kwargs = dict(template_kwargs or {})  # e.g. thinking / enable_thinking
        self.name = parser.name
        self.end_of_turn = parser.end_of_turn
        _compile(template)

    def render(self, messages, *, tools=None, add_generation_prompt=False):
        import jinja2

        _check_messages(messages, parts=True)
        try:
            return _compile(self.template).render(
                messages=_template_messages(messages, self.call_id), tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **self.template_kwargs})
        except jinja2.TemplateError as e:
            raise ChatFormatError(f"{self.source}: {e}") from None

    def parse(self, text):
        return self.parser.parse(text)

    def call_id(self, name, index):
        return self.parser.call_id(name, index)


def detect_parser(template: str) -> Optional[str]:
    """The tool-call family a template writes, from the markers only that family's calls contain."""
    for name in ("kimi_k2", "deepseek_v3", "hermes"):
        if PARSERS[name].marker in template:
            if name == "deepseek_v3" and "```json" not in template:
                return "deepseek_v31"  # V3.1 writes the arguments straight after the separator
            return name
    return None


def read_chat_template(directory: str | Path, tools: bool = True) -> Optional[str]:
    """A checkpoint directory's chat template: chat_template.jinja, else tokenizer_config.json's "chat_template"
    (a string, or a list of named templates: "tool_use" when tools are used, else "default")."""
    directory = Path(directory)
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = (named.get("tool_use") if tools else None) or named.get("default")
    return template if isinstance(template, str) else None


def _special_token_strings(directory: Path) -> dict[str, str]:
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    found: dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / file
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            for name in names:
                value = data.get(name)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str) and name not in found:
                    found[name] = value
    return found


def load_chat_format(spec: str, tokenizer=None, template_kwargs: Optional[dict] = None) -> ChatFormat:
    """The run's chat format. `spec`: ``auto`` (the tokenizer directory's template with its detected parser,
    else chatml), ``chatml``, or a parser name (``kimi_k2``, ``deepseek_v3``, ``deepseek_v31``, ``hermes``: the
    tokenizer directory's template, parsed as that family)."""
    if spec not in CHAT_FORMATS:
        raise ChatFormatError(f"chat_format={spec!r} is not known; use one of {list(CHAT_FORMATS)}")
    if spec == "chatml":
        return ChatMLFormat()
    raw = getattr(tokenizer, "path", "") or ""
    path = Path(raw)
    directory = path if path.is_dir() else path.parent
    template = read_chat_template(directory) if raw else None
    if template is None:
        if spec == "auto":
            return ChatMLFormat()
        raise ChatFormatError(f"chat_format={spec} needs the model's chat template, but '{directory}' has no "
                              "chat_template.jinja and no chat_template in tokenizer_config.json; point data.tokenizer "
                              "at the checkpoint directory or use chat_format=chatml")
    name = detect_parser(template) if spec == "auto" else spec
    if name is None:
        raise ChatFormatError(f"the chat template in '{directory}' writes no tool-call syntax this project parses; set "
                              f"chat_format to one of {list(PARSERS)} (its family) or chatml")
    parser = PARSERS[name]()
    fmt = TemplateChatFormat(template, parser, _special_token_strings(directory), source=str(directory),
                             template_kwargs=template_kwargs)
    if tokenizer is not None and tokenizer.token_to_id(parser.end_of_turn) is None:
        raise ChatFormatError(f"chat_format={name}: the tokenizer '{tokenizer.path}' has no "
                              f"{parser.end_of_turn!r} token that ends an assistant turn; "
                              "the template and the tokenizer do not belong together")
    return fmt


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
