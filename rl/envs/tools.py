"""The agent's tools: read_file, write_file, edit_file, list_dir, search, run, todo, submit.

Every file tool runs as a command inside the sandbox and first resolves its path there (symlinks included);
a path that resolves outside the task tree is refused, and even a mistake here could only reach what the
sandbox itself can see. Calls arrive parsed by the run's chat format (megatron_composer.data.chat_format); calls with
an unknown tool or wrong arguments become error observations and are counted as malformed.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from rl.sandbox.base import Sandbox

# name -> (description, {argument: (type, required, description)})
TOOL_SPECS: dict[str, tuple[str, dict[str, tuple[type, bool, str]]]] = {
    "read_file": ("Read a text file of the task tree.", {
        "path": (str, True, "file path, relative to the working directory"),
        "start_line": (int, False, "first line to show (1-based)"),
        "end_line": (int, False, "last line to show"),
    }),
    "write_file": ("Create or overwrite a file (parent directories are created).", {
        "path": (str, True, "file path"),
        "content": (str, True, "the complete new content"),
    }),
    "edit_file": ("Replace an exact string in a file; it must occur exactly once unless replace_all is true.", {
        "path": (str, True, "file path"),
        "old_string": (str, True, "text to replace, copied exactly"),
        "new_string": (str, True, "replacement text"),
        "replace_all": (bool, False, "replace every occurrence"),
    }),
    "list_dir": ("List a directory of the task tree.", {
        "path": (str, False, "directory (default: the working directory)"),
        "depth": (int, False, "levels to descend, 1-3 (default 1)"),
    }),
    "search": ("Search file contents with an extended regular expression (grep -E).", {
        "pattern": (str, True, "regular expression"),
        "path": (str, False, "file or directory to search (default: the working directory)"),
        "glob": (str, False, "only files whose name matches, e.g. *.py"),
        "ignore_case": (bool, False, "case-insensitive match"),
    }),
    "run": ("Run a bash command in the working directory; output and exit code are returned.", {
        "command": (str, True, "bash command line"),
        "timeout": (int, False, "seconds before the command is killed"),
    }),
    "todo": ("Keep a todo list: add an item, complete one by id, or list them.", {
        "action": (str, True, "add, complete or list"),
        "text": (str, False, "item text (add)"),
        "id": (int, False, "item id (complete)"),
    }),
    "submit": ("Finish the episode; the task's tests then decide the reward.", {
        "summary": (str, False, "what was done"),
    }),
}

TRUNCATION_MARKER = "[... {n} characters truncated ...]"

# Resolve $1 inside the sandbox and refuse anything outside the tree root $W.
_RESOLVE = r"""
W={root}
p=$(realpath {mode} -- "$1" 2>/dev/null) || {{ echo "no such file or directory: $1"; exit 2; }}
case "$p" in "$W"|"$W"/*) ;; *) echo "refused: $1 resolves to $p, outside the task tree $W"; exit 3;; esac
"""


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """Keep the head and tail of a long observation with a marker in between."""
    if len(text) <= limit:
        return text, False
    head = limit * 2 // 3
    tail = limit - head
    cut = len(text) - head - tail
    return text[:head] + "\n" + TRUNCATION_MARKER.format(n=cut) + "\n" + text[len(text) - tail:], True


def tool_schemas(names: tuple[str, ...] | None = None, *, brief: dict[str, str] | None = None) -> list[dict]:
    """The tools `names` (default: all) as OpenAI function schemas: what a chat template declares (ChatML lists
    them in the system prompt). `brief`: tool -> short description; such a tool declares its required
    arguments only (the tool still accepts the optional ones), for a model whose context is small."""
    json_types = {str: "string", int: "integer", bool: "boolean", float: "number"}
    out = []
    for name in names or tuple(TOOL_SPECS):
        desc, params = TOOL_SPECS[name]
        if brief is not None and name in brief:
            desc, params = brief[name], {a: spec for a, spec in params.items() if spec[1]}
        out.append({"type": "function", "function": {
            "name": name, "description": desc,
            "parameters": {"type": "object",
                           "properties": {a: {"type": json_types[t], "description": d}
                                          for a, (t, _, d) in params.items()},
                           "required": [a for a, (_, req, _) in params.items() if req]}}})
    return out


@dataclass
class Observation:
    text: str
    error: bool = False
    malformed: bool = False
    truncated: bool = False


@dataclass
class ToolStats:
    calls: dict[str, int] = field(default_factory=dict)
    malformed: int = 0
    errors: int = 0


class ToolBox:
    """Executes tool calls against one sandbox and keeps the episode's todo list and submission."""

    def __init__(self, sandbox: Sandbox, *, max_observation_chars: int = 8000, command_timeout_s: float = 120.0,
                 tools: tuple[str, ...] | None = None):
        unknown = sorted(set(tools or ()) - set(TOOL_SPECS))
        if unknown:
            raise ValueError(f"unknown tool(s) {unknown}; the tools are {', '.join(TOOL_SPECS)}")
        self.tools = tuple(tools or TOOL_SPECS)  # the tools the agent was told about: the only ones it may call
        self.sandbox = sandbox
        self.root = getattr(sandbox, "tree_root", "/app")
        self.max_observation_chars = max_observation_chars
        self.command_timeout_s = command_timeout_s
        self.todos: list[dict] = []
        self.submitted = False
        self.submission: str | None = None
        self.stats = ToolStats()

    @property
    def open_todos(self) -> int:
        return sum(not t["done"] for t in self.todos)

    def malformed(self, message: str) -> Observation:
        self.stats.malformed += 1
        return Observation(f"error: {message}", error=True, malformed=True)

    def call(self, name: str, arguments: dict) -> Observation:
        spec = TOOL_SPECS.get(name) if name in self.tools else None
        if spec is None:
            return self.malformed(f"unknown tool {name!r}; available: {', '.join(self.tools)}")
        _, params = spec
        for arg, value in arguments.items():
            if arg not in params:
                return self.malformed(f"{name} has no argument {arg!r}; it takes {', '.join(params)}")
            tp = params[arg][0]
            if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
                return self.malformed(f"{name} argument {arg!r} must be {tp.__name__}, got {type(value).__name__}")
        missing = [a for a, (_, req, _) in params.items() if req and a not in arguments]
        if missing:
            return self.malformed(f"{name} needs argument(s) {', '.join(missing)}")
        self.stats.calls[name] = self.stats.calls.get(name, 0) + 1
        obs = getattr(self, f"_tool_{name}")(**arguments)
        if obs.error and not obs.malformed:
            self.stats.errors += 1
        obs.text, obs.truncated = truncate(obs.text, self.max_observation_chars)
        return obs

    # File tools
    def _script(self, mode: str, body: str, path: str, stdin: bytes | None = None):
        script = _RESOLVE.format(root=shlex.quote(self.root), mode=mode) + body
        return self.sandbox.exec(f"bash -c {shlex.quote(script)} file-tool {shlex.quote(path)}", stdin=stdin,
                                 timeout=60)

    def _read(self, path: str):
        body = '[ -f "$p" ] || { echo "not a regular file: $1"; exit 4; }\nexec cat -- "$p"\n'
        return self._script("-e", body, path)

    def _write(self, path: str, content: str):
        body = ('[ -d "$p" ] && { echo "is a directory: $1"; exit 4; }\n'
                'mkdir -p -- "$(dirname -- "$p")" && cat > "$p" && echo "wrote $(wc -c < "$p") bytes to $p"\n')
        return self._script("-m", body, path, stdin=content.encode())

    def _tool_read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> Observation:
        res = self._read(path)
        if res.exit_code != 0:
            return Observation(res.output.strip() or res.describe(), error=True)
        if start_line is None and end_line is None:
            return Observation(res.output)
        lines = res.output.splitlines(keepends=True)
        lo = max(1, start_line or 1)
        hi = min(len(lines), end_line or len(lines))
        return Observation("".join(lines[lo - 1:hi]))

    def _tool_write_file(self, path: str, content: str) -> Observation:
        res = self._write(path, content)
        return Observation(res.output.strip() or res.describe(), error=res.exit_code != 0)

    def _tool_edit_file(self, path: str, old_string: str, new_string: str, replace_all: bool = False) -> Observation:
        if old_string == new_string:
            return Observation("error: old_string and new_string are identical", error=True)
        if not old_string:
            return Observation("error: old_string is empty; use write_file to create a file", error=True)
        res = self._read(path)
        if res.exit_code != 0:
            return Observation(res.output.strip(), error=True)
        if res.output_truncated:
            return Observation(f"error: {path} is too large to edit ({res.output_bytes} bytes)", error=True)
        text = res.output
        count = text.count(old_string)
        if count == 0:
            return Observation(f"error: old_string not found in {path}", error=True)
        if count > 1 and not replace_all:
            return Observation(f"error: old_string occurs {count} times in {path}; give more context or set "
                               "replace_all", error=True)
        new_text = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
        res = self._write(path, new_text)
        if res.exit_code != 0:
            return Observation(res.output.strip(), error=True)
        return Observation(f"replaced {count if replace_all else 1} occurrence(s) in {path}")

    def _tool_list_dir(self, path: str = ".", depth: int = 1) -> Observation:
        depth = min(max(depth, 1), 3)
        body = ('[ -d "$p" ] || { echo "not a directory: $1"; exit 4; }\n'
                f'cd "$p" && find . -mindepth 1 -maxdepth {depth} -name .git -prune -o '
                r"""-printf '%P%y\n' | sed -e 's/d$/\//' -e 's/[fl]$//' | sort | head -n 500""" "\n")
        res = self._script("-e", body, path)
        if res.exit_code != 0:
            return Observation(res.output.strip(), error=True)
        return Observation(res.output or "(empty directory)\n")

    def _tool_search(self, pattern: str, path: str = ".", glob: str | None = None,
                     ignore_case: bool = False) -> Observation:
        flags = "-rnIE" + ("i" if ignore_case else "")
        include = f" --include={shlex.quote(glob)}" if glob else ""
        body = (f'grep {flags}{include} --exclude-dir=.git -e {shlex.quote(pattern)} -- "$p" | head -n 200; '
                'rc=${PIPESTATUS[0]}; [ $rc -le 1 ] || exit 5; exit 0\n')
        res = self._script("-e", body, path)
        if res.exit_code != 0:
            return Observation(res.output.strip() or f"search failed: {res.describe()}", error=True)
        return Observation(res.output or "no matches\n")

    def _tool_run(self, command: str, timeout: int | None = None) -> Observation:
        limit = self.command_timeout_s if timeout is None else min(max(timeout, 1), self.command_timeout_s)
        res = self.sandbox.exec(command, timeout=limit)
        text = res.output + ("" if res.output.endswith("\n") or not res.output else "\n") + f"[{res.describe()}]"
        return Observation(text, error=not res.ok)

    # Bookkeeping tools
    def _tool_todo(self, action: str, text: str | None = None, id: int | None = None) -> Observation:
        if action == "add":
            if not text:
                return self.malformed("todo add needs 'text'")
            self.todos.append({"id": len(self.todos) + 1, "text": text, "done": False})
        elif action == "complete":
            match = [t for t in self.todos if t["id"] == id]
            if not match:
                return Observation(f"error: no todo with id {id!r}", error=True)
            match[0]["done"] = True
        elif action != "list":
            return self.malformed(f"todo action must be add, complete or list, got {action!r}")
        listing = "\n".join(f"[{'x' if t['done'] else ' '}] {t['id']}. {t['text']}" for t in self.todos)
        return Observation(listing or "(no todos)")

    def _tool_submit(self, summary: str = "") -> Observation:
        self.submitted = True
        self.submission = summary
        return Observation("submitted")
