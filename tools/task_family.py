"""A generated family of easy, verifiable sandboxed tasks in the Harbor layout, sized for a tiny model.

Eight kinds in four tiers (`TIERS`; `CHANCE`: the pass rate of a policy that guesses every slot from its pool),
each parameterised by file names, folders and words drawn from small vocabularies of one-token words:

1. ``create_empty``: create an empty file (one slot);
2. ``write_word``: create a file holding one word (two slots);
3. ``fix_test``: a one-line bug (the wrong operator) makes a unittest fail; fix the function (a lookup);
4. ``create_file``: create a file in a folder with a two-word line; ``rename_file`` / ``move_file``: rename a
   file, or move it into a folder; ``replace_word``: replace every occurrence of a word in a file;
   ``command_output``: run a command and write its output to a file.

Every value a reference call copies from the instruction is written there as the same tokens as in the call
(`TaskSpec.values`; `copy_mismatches` checks it against a tokenizer): a JSON string value in double quotes
(its tokens follow a quote in both), a command's word after a space (as inside the command).

Every task is a plain Harbor folder (instruction.md, task.toml, environment/Dockerfile and its files,
tests/test.sh, solution/solve.sh), so `rl.envs.load_harbor_task`, `check_task` and the RL loader read it like
any other. Its reference solution exists twice: ``solution/solve.sh`` (what `check_task --oracle` runs) and,
in task.toml's free-form ``[metadata]``, ``solution_turns``: the same solution as the agent's tool calls, turn
by turn (a JSON string), which `solution_episode` replays through the real agent protocol (`run_episode`, the
sandbox, the verifier) to make SFT transcripts in exactly the format rollouts parse.

`generate_splits` shares each kind's distinct instances among named splits in proportion to their sizes, so no
instance is in two splits (SFT, RL train and held-out evaluation differ) and every split has every kind.
``tools/make_agent_tasks.py`` is the command line.
"""

from __future__ import annotations

import json
import random
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

KINDS = ("create_empty", "write_word", "create_file", "rename_file", "move_file", "replace_word", "fix_test",
         "command_output")

# Small vocabularies of common code words: a tiny model sees each value often enough in SFT to pick it out of
# the instruction, and each is one token of the demo's tokenizer (BPE on Python sources) both bare (after '"',
# "/" or a newline) and after a space, so copying a value is copying one token.
NAMES = ("data", "config", "index", "cache", "table", "result", "info", "event")
FOLDERS = ("build", "src", "lib", "temp")
WORDS = ("tree", "star", "color", "left", "right", "top", "group", "order")
# fix_test: function name -> the operator it should use; the bug is another operator of the table
FUNCTIONS = {"add": "+", "subtract": "-", "multiply": "*", "plus": "+", "minus": "-", "times": "*"}
MODULES = ("util", "base", "main")
SLOT_NAMES = NAMES + FOLDERS + WORDS + MODULES  # the one-slot tiers draw a file name from all 23

# Difficulty tiers and each kind's chance rate: the pass probability of a policy that knows the kind's format and
# pools but copies nothing, guessing every slot uniformly from its pool (what a group's reward variance rests on
# before the model copies). 1: one slot; 2: two slots; 3: a lookup (the operator follows from the function's
# name) and a copy from a tool's output; 4: the multi-value kinds.
TIERS = {"create_empty": 1, "write_word": 2, "fix_test": 3, "create_file": 4, "rename_file": 4, "move_file": 4,
         "replace_word": 4, "command_output": 4}
CHANCE = {
    "create_empty": 1 / len(SLOT_NAMES),
    "write_word": 1 / (len(SLOT_NAMES) * (len(WORDS) - 1)),
    "fix_test": 1 / (len(MODULES) * 3),  # the module to read, one of three operators
    "create_file": 1 / (len(FOLDERS) * len(NAMES) * len(WORDS) * (len(WORDS) - 1)),
    "rename_file": 1 / (len(NAMES) * (len(NAMES) - 1)),
    "move_file": 1 / (len(NAMES) * len(FOLDERS)),
    "replace_word": 1 / (len(NAMES) * len(WORDS) * (len(WORDS) - 1)),
    "command_output": 1 / (len(NAMES) * 3 * 98 * 98),  # the output file, the command, two operands of 2-99
}

TASK_TOML = """version = "1.0"

[metadata]
author_name = "megatron-composer"
difficulty = "easy"
category = "generated"
family = "{kind}"
tier = {tier}
solution_turns = {turns}

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0
max_turns = 8

[environment]
allow_internet = false
build_timeout_sec = 60.0
cpus = 1
memory_mb = 512
storage_mb = 64
"""

TEST_SH = """#!/bin/bash
# Verifier: 1 when the check passes, 0 otherwise. Code under test runs inside `judge` (the local backend's
# sandbox nested in this one: rl/sandbox/local.py), out of reach of this script and its reward folder.
mkdir -p /logs/verifier
cd /app
judge=/opt/verifier/bin/judge; [ -x "$judge" ] || judge=
if {check}; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@dataclass
class TaskSpec:
    """One generated task: everything its folder holds."""

    kind: str
    key: tuple  # identifies the instance (dedup across splits)
    instruction: str
    files: dict[str, str]  # starting files of /app (relative path -> content)
    check: str  # bash condition the verifier evaluates in /app
    solve: str  # solve.sh body
    turns: list[list[dict]]  # reference solution: per turn, tool calls {"name", "arguments"} (submit last)
    test_files: dict[str, str] = field(default_factory=dict)  # extra files of tests/
    values: tuple[str, ...] = ()  # what the solution copies from the instruction, rendered there as in the call

    @property
    def tier(self) -> int:
        return TIERS[self.kind]

    @property
    def name(self) -> str:
        ops = {"+": "plus", "-": "minus", "*": "times"}
        return "-".join([self.kind.replace("_", "-"), *(ops.get(str(k), str(k)) for k in self.key)])


def _submit() -> list[dict]:
    return [{"name": "submit", "arguments": {"summary": "done"}}]


def _lines(rng: random.Random, must: str, avoid: str, n: int) -> str:
    words = [w for w in WORDS if w not in (must, avoid)]
    rows = []
    for i in range(n):
        row = rng.sample(words, 3)
        if i == 0 or rng.random() < 0.5:
            row.insert(rng.randrange(4), must)
        rows.append(" ".join(row))
    return "\n".join(rows) + "\n"


def _create_file(rng: random.Random) -> TaskSpec:
    folder, name = rng.choice(FOLDERS), rng.choice(NAMES)
    w1, w2 = rng.sample(WORDS, 2)
    path, text = f"{folder}/{name}.txt", f"{w1} {w2}"
    return TaskSpec(
        "create_file", (folder, name, w1, w2),
        f'Create the file "{path}" containing "{text}".\n', {},
        f'[ -f {path} ] && [ "$(cat {path})" = {shlex.quote(text)} ]',
        f"mkdir -p {folder}\nprintf '%s\\n' {shlex.quote(text)} > {path}\n",
        [[{"name": "write_file", "arguments": {"path": path, "content": text}}], _submit()], values=(path, text))


def _create_empty(rng: random.Random) -> TaskSpec:
    name = rng.choice(SLOT_NAMES)
    path = f"{name}.txt"
    return TaskSpec(
        "create_empty", (name,),
        f'Create an empty file "{path}".\n', {},
        f"[ -f {path} ] && [ ! -s {path} ]",
        f": > {path}\n",
        [[{"name": "write_file", "arguments": {"path": path, "content": ""}}], _submit()], values=(path,))


def _write_word(rng: random.Random) -> TaskSpec:
    name = rng.choice(SLOT_NAMES)
    word = rng.choice([w for w in WORDS if w != name])
    path = f"{name}.txt"
    return TaskSpec(
        "write_word", (name, word),
        f'Create the file "{path}" containing "{word}".\n', {},
        f'[ "$(cat {path} 2>/dev/null)" = {word} ]',
        f"printf '%s\\n' {word} > {path}\n",
        [[{"name": "write_file", "arguments": {"path": path, "content": word}}], _submit()], values=(path, word))


def _rename_file(rng: random.Random) -> TaskSpec:
    a, b = rng.sample(NAMES, 2)
    word = rng.choice(WORDS)
    content = f"{word}\n"
    return TaskSpec(
        "rename_file", (a, b, word),
        f"Rename the file {a}.txt to {b}.txt.\n", {f"{a}.txt": content},
        f'[ ! -e {a}.txt ] && [ "$(cat {b}.txt)" = {word} ]',
        f"mv {a}.txt {b}.txt\n",
        [[{"name": "run", "arguments": {"command": f"mv {a}.txt {b}.txt"}}], _submit()],
        values=(f"{a}.txt", f"{b}.txt"))


def _move_file(rng: random.Random) -> TaskSpec:
    name, folder, word = rng.choice(NAMES), rng.choice(FOLDERS), rng.choice(WORDS)
    return TaskSpec(
        "move_file", (name, folder, word),
        f"Move the file {name}.txt into the folder {folder} (create the folder).\n", {f"{name}.txt": f"{word}\n"},
        f'[ ! -e {name}.txt ] && [ "$(cat {folder}/{name}.txt)" = {word} ]',
        f"mkdir -p {folder} && mv {name}.txt {folder}/\n",
        [[{"name": "run", "arguments": {"command": f"mkdir -p {folder} && mv {name}.txt {folder}/"}}], _submit()],
        values=(f"{name}.txt", folder))


def _replace_word(rng: random.Random) -> TaskSpec:
    name = rng.choice(NAMES)
    old, new = rng.sample(WORDS, 2)
    content = _lines(rng, old, new, rng.randint(2, 3))
    expected = content.replace(old, new)
    return TaskSpec(
        "replace_word", (name, old, new, len(content)),
        f'In the file "{name}.txt", replace every "{old}" with "{new}".\n', {f"{name}.txt": content},
        f"[ -f {name}.txt ] && [ ! -L {name}.txt ] && cmp -s {name}.txt /tests/expected.txt",
        f"sed -i 's/{old}/{new}/g' {name}.txt\n",
        [[{"name": "edit_file", "arguments": {"path": f"{name}.txt", "old_string": old, "new_string": new,
                                               "replace_all": True}}], _submit()],
        test_files={"expected.txt": expected}, values=(f"{name}.txt", old, new))


def _fix_test(rng: random.Random) -> TaskSpec:
    fn = rng.choice(sorted(FUNCTIONS))
    module = rng.choice(MODULES)
    op = FUNCTIONS[fn]
    wrong = rng.choice([o for o in "+-*" if o != op])
    x, y = rng.randint(2, 9), rng.randint(2, 9)
    while eval(f"{x} {op} {y}") == eval(f"{x} {wrong} {y}"):
        x, y = rng.randint(2, 9), rng.randint(2, 9)
    source = f"def {fn}(a, b):\n    return a {wrong} b\n"
    test = (f"import unittest\n\nfrom {module} import {fn}\n\n\nclass Test(unittest.TestCase):\n"
            f"    def test_{fn}(self):\n        self.assertEqual({fn}({x}, {y}), {eval(f'{x} {op} {y}')})\n\n\n"
            "if __name__ == \"__main__\":\n    unittest.main()\n")
    return TaskSpec(
        "fix_test", (module, fn, wrong, x, y),
        f'The test test_{module}.py fails. Fix the bug in the function {fn} of "{module}.py" so that '
        f"python3 -m unittest test_{module} passes.\n",
        {f"{module}.py": source, f"test_{module}.py": test},
        # The verdict is taken outside the code under test: each case runs in its own `judge` child, which prints
        # the function's result and sees no expected value, and this shell compares. The second case is not in
        # the test the agent sees, so answering the visible case alone does not pass.
        " && ".join(f'[ "$($judge python3 -I -c {shlex.quote(_call(module, fn, a, b))} 2>/dev/null)" = '
                    f'"{eval(f"{a} {op} {b}")}" ]' for a, b in ((x, y), _hidden_case(module, fn, x, y))),
        # sed's regex: * repeats, \\* is a star
        f"sed -i 's/return a {wrong.replace('*', chr(92) + '*')} b/return a {op} b/' {module}.py\n",
        [[{"name": "read_file", "arguments": {"path": f"{module}.py"}}],
         [{"name": "edit_file", "arguments": {"path": f"{module}.py", "old_string": f"a {wrong} b",
                                               "new_string": f"a {op} b"}}], _submit()],
        values=(f"{module}.py",))


def _call(module: str, fn: str, a: int, b: int) -> str:
    """Python that prints fn(a, b) of the work tree's module (-I, /app last on the path: nothing there shadows the
    standard library)."""
    return f'import sys; sys.path.append("/app"); from {module} import {fn}; print({fn}({a}, {b}))'


def _hidden_case(module: str, fn: str, x: int, y: int) -> tuple[int, int]:
    """Arguments of the case the agent's test does not show, fixed by the instance (its own generator)."""
    rng = random.Random(f"{module}:{fn}:{x}:{y}")
    while True:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        if (a, b) != (x, y):
            return a, b


def _command_output(rng: random.Random) -> TaskSpec:
    out = rng.choice(NAMES)
    choice = rng.randrange(3)
    files: dict[str, str] = {}
    if choice == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        command, expected, key = f"expr {a} + {b}", f"{a + b}\n", (a, b)
    elif choice == 1:
        words = rng.sample(WORDS, rng.randint(2, 4))
        command, expected, key = f"echo {' '.join(words)}", " ".join(words) + "\n", tuple(words)
    else:
        src = rng.choice([n for n in NAMES if n != out])
        rows = rng.sample(WORDS, rng.randint(2, 4))
        files[f"{src}.txt"] = "\n".join(rows) + "\n"
        command, expected, key = f"sort {src}.txt", "\n".join(sorted(rows)) + "\n", (src, *rows)
    return TaskSpec(
        "command_output", (out, choice, *key),
        f'Run the command "{command}" and write its output to the file {out}.txt.\n', files,
        f"[ -f {out}.txt ] && [ ! -L {out}.txt ] && cmp -s {out}.txt /tests/expected.txt",
        f"{command} > {out}.txt\n",
        [[{"name": "run", "arguments": {"command": f"{command} > {out}.txt"}}], _submit()],
        test_files={"expected.txt": expected}, values=(command, f"{out}.txt"))


MAKERS: dict[str, Callable[[random.Random], TaskSpec]] = {
    "create_empty": _create_empty, "write_word": _write_word, "create_file": _create_file,
    "rename_file": _rename_file, "move_file": _move_file,
    "replace_word": _replace_word, "fix_test": _fix_test, "command_output": _command_output,
}


def sample_specs(n: int, seed: int, kinds: tuple[str, ...] = KINDS, exclude: Optional[set] = None, *,
                 at_most: bool = False) -> list[TaskSpec]:
    """n distinct instances (kinds in rotation; a kind whose instances run out leaves the rotation), none of
    whose (kind, key) is in `exclude`; fewer when that many do not exist and `at_most`, else an error."""
    unknown = [k for k in kinds if k not in MAKERS]
    if unknown:
        raise ValueError(f"unknown task kind(s) {unknown}; choose from {list(KINDS)}")
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[TaskSpec] = []
    live, misses, turn = list(kinds), dict.fromkeys(kinds, 0), 0
    while len(out) < n:
        if not live:
            if at_most:
                break
            raise ValueError(f"only {len(out)} distinct tasks of kinds {list(kinds)} could be drawn; ask for fewer")
        kind = live[turn % len(live)]
        spec = MAKERS[kind](rng)
        if (spec.kind, spec.key) in seen:
            misses[kind] += 1
            if misses[kind] > 500:  # 500 draws in a row without a new instance: this kind is used up
                live.remove(kind)
            continue
        misses[kind] = 0
        turn += 1
        seen.add((spec.kind, spec.key))
        out.append(spec)
    return out


def copy_mismatches(spec: TaskSpec, tokenizer) -> list[str]:
    """The values of `spec` that a copy head could not copy token for token: those whose tokens in the reference
    tool calls (as ChatML writes them) are not the same token ids somewhere in the instruction, or that do not
    start and end on token boundaries in the call. Empty for a well-rendered task."""
    from megatron_composer.data.chat_template import format_tool_call

    def contains(ids: list[int], part: list[int]) -> bool:
        return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))

    instruction = tokenizer.encode(spec.instruction)
    call = tokenizer.encode("".join(format_tool_call(c["name"], c["arguments"]) for turn in spec.turns for c in turn))
    pieces = [tokenizer.decode([i]) for i in call]
    bad = []
    for value in spec.values:
        spans = [call[i:j] for i in range(len(call)) for j in range(i + 1, len(call) + 1)
                 if "".join(pieces[i:j]) in (value, " " + value)]
        if not any(contains(instruction, span) for span in spans):
            bad.append(value)
    return bad


def write_task(spec: TaskSpec, root: Path) -> Path:
    d = root / spec.name
    (d / "environment").mkdir(parents=True, exist_ok=True)
    (d / "tests").mkdir(exist_ok=True)
    (d / "solution").mkdir(exist_ok=True)
    (d / "instruction.md").write_text(spec.instruction)
    (d / "task.toml").write_text(TASK_TOML.format(kind=spec.kind, tier=spec.tier,
                                                  turns=json.dumps(json.dumps(spec.turns))))
    copies = "".join(f"COPY {shlex.quote(p)} /app/{shlex.quote(p)}\n" for p in sorted(spec.files))
    (d / "environment" / "Dockerfile").write_text(f"FROM python:3.11-slim-bookworm\n\nWORKDIR /app\n{copies}")
    for rel, content in spec.files.items():
        (d / "environment" / rel).write_text(content)
    (d / "tests" / "test.sh").write_text(TEST_SH.format(check=spec.check))
    for rel, content in spec.test_files.items():
        (d / "tests" / rel).write_text(content)
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\ncd /app\n" + spec.solve)
    return d


def generate_splits(out: str | Path, splits: dict[str, int], seed: int = 0,
                    kinds: tuple[str, ...] = KINDS) -> dict[str, list[Path]]:
    """Write out/<split>/<task>/ for each split, no instance in two splits. Each kind's distinct instances are
    shared among the splits in proportion to their sizes (each split gets at least one of every kind that has
    an instance per split), so a kind with few instances (the one-slot tier) is in every split, not used up by
    the first; the rest of each split is filled in kind rotation. Seeded: the same call writes the same tasks."""
    out = Path(out)
    total = sum(splits.values())
    pools = {k: sample_specs(total, seed + i, (k,), at_most=True) for i, k in enumerate(kinds)}
    chosen: dict[str, list[TaskSpec]] = {name: [] for name in splits}
    for kind, pool in pools.items():
        start = 0
        for name, n in splits.items():
            share = max(1, len(pool) * n // total) if len(pool) >= len(splits) else 0
            share = min(share, max(1, n // len(kinds)), len(pool) - start)
            chosen[name] += pool[start:start + share]
            start += share
        pools[kind] = pool[start:]
    for name, n in splits.items():  # fill up in rotation from what is left
        order = [k for k in kinds if pools[k]]
        while len(chosen[name]) < n and order:
            kind = order[len(chosen[name]) % len(order)]
            chosen[name].append(pools[kind].pop(0))
            order = [k for k in kinds if pools[k]]
        if len(chosen[name]) < n:
            raise ValueError(f"only {len(chosen[name])} distinct tasks left for split {name!r}; ask for fewer")
    written = {}
    for name, specs in chosen.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        rng = random.Random(f"{seed}:{name}")
        rng.shuffle(specs)
        written[name] = [write_task(spec, out / name) for spec in specs[:splits[name]]]
    return written


def solution_turns(task) -> list[list[dict]]:
    """The reference solution of a generated task (an `rl.envs.Task` loaded from its folder) as tool calls."""
    meta = task.metadata
    if "solution_turns" not in meta:
        raise ValueError(f"{task.source}: task.toml [metadata] has no solution_turns (not a generated task)")
    return json.loads(meta["solution_turns"])


def progress_summary(messages: list[dict]) -> str:
    """The summary the reference episodes give when asked to summarise: the task's tool calls so far."""
    from megatron_composer.data.chat_template import structured_tool_calls

    done = [f"{c['name']} {c['arguments'].get('path') or c['arguments'].get('command', '')}".strip()
            for m in messages if m["role"] == "assistant" for c in structured_tool_calls(m)[0]]
    return "Done: " + "; ".join(done) + ". Remaining: check the result and submit."


def solution_episode(task, sandbox, *, count_tokens: Callable[[str], int], summary_trigger_tokens: Optional[int] = None,
                     chat_format=None, profile: str = "full"):
    """Replay the task's reference tool calls through `run_episode` in `sandbox` (the real protocol: parser,
    tools, observations, verifier). With a summary trigger, a context that reaches it is summarised by
    `progress_summary` and the episode continues in a new segment, as rollouts do."""
    from rl.envs.agent import EpisodeConfig, ScriptedPolicy, run_episode

    turns = [{"tool_calls": calls} for calls in solution_turns(task)]
    cfg = EpisodeConfig(max_turns=len(turns), summary_trigger_tokens=summary_trigger_tokens, profile=profile)
    return run_episode(task, sandbox, ScriptedPolicy(turns, chat_format), cfg, count_tokens=count_tokens,
                       summarize=progress_summary if summary_trigger_tokens else None, chat_format=chat_format)


def sft_conversations(episode, profile: str = "full") -> list[dict]:
    """The SFT records ({"messages", "tools"}) of a solved episode: one per segment; a segment that ended in a
    summary ends with the summary request and the summary as the assistant's turn (what a rollout samples and
    trains). The tools are the agent profile's, declared as the rollouts declare them."""
    from rl.envs.agent import SUMMARY_REQUEST, agent_profile

    tools = agent_profile(profile).schemas
    out = []
    for i, seg in enumerate(episode.segments):
        conv = list(seg)
        if i < len(episode.summaries):
            conv += [{"role": "user", "content": SUMMARY_REQUEST},
                     {"role": "assistant", "content": episode.summaries[i]}]
        out.append({"messages": conv, "tools": tools})
    return out


def solution_transcripts(task_dirs: list[Path], count_tokens: Callable[[str], int], *,
                         summary_trigger_tokens: Optional[int] = None, backend=None, workers: int = 2,
                         chat_format=None, profile: str = "full") -> list[dict]:
    """SFT conversations of the reference solutions of generated tasks, each replayed in its own sandbox by
    `solution_episode`; a replay the verifier does not reward 1 is an error (the task family is broken)."""
    from concurrent.futures import ThreadPoolExecutor

    from rl.envs.harbor import load_harbor_task
    from rl.envs.task import prepare_task

    if backend is None:
        from rl.sandbox import LocalBackend

        backend = LocalBackend()

    def one(d: Path) -> list[dict]:
        task = load_harbor_task(d)
        snapshot = prepare_task(task, backend)
        try:
            with backend.fork(snapshot) as sandbox:
                ep = solution_episode(task, sandbox, count_tokens=count_tokens,
                                      summary_trigger_tokens=summary_trigger_tokens, chat_format=chat_format,
                                      profile=profile)
        finally:
            snapshot.discard()
        if ep.reward != 1.0 or ep.stop_reason != "submitted":
            raise RuntimeError(f"{d}: the reference tool calls scored {ep.reward} ({ep.stop_reason}); "
                               f"verifier said: {ep.verify.output[-300:] if ep.verify else ''}")
        return sft_conversations(ep, profile)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return [conv for convs in pool.map(one, task_dirs) for conv in convs]


__all__ = ["solution_transcripts", "CHANCE", "KINDS", "TIERS", "TaskSpec", "copy_mismatches", "generate_splits",
           "progress_summary", "sample_specs", "sft_conversations", "solution_episode", "solution_turns", "write_task"]
