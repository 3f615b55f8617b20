"""The generated agent task family: Harbor folders that check_task scores 0 untouched and 1 after their
solution, disjoint splits, and reference tool calls that replay through the real agent protocol into SFT
conversations whose assistant turns parse back to the same calls (summarised where the trigger is reached)."""

from pathlib import Path

import pytest

from megatron_composer.data.chat_format import ChatMLFormat
from megatron_composer.data.chat_template import format_tool_call, structured_tool_calls
from rl.envs.agent import AGENT_TOOLS, ScriptedPolicy, run_episode
from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task import prepare_task
from rl.sandbox.local import LocalBackend, bwrap_problem
from tools.task_family import KINDS, generate_splits, sample_specs, solution_transcripts, solution_turns, write_task

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap: {bwrap_problem()}")


def _approx_tokens(text: str) -> int:
    return (len(text.encode()) + 3) // 4


def test_splits_are_disjoint_and_seeded(tmp_path):
    a = generate_splits(tmp_path / "a", {"train": 30, "heldout": 12}, seed=3)
    b = generate_splits(tmp_path / "b", {"train": 30, "heldout": 12}, seed=3)
    names = {s: {p.name for p in dirs} for s, dirs in a.items()}
    assert not names["train"] & names["heldout"]
    assert names == {s: {p.name for p in dirs} for s, dirs in b.items()}  # same seed, same tasks
    other = {p.name for p in generate_splits(tmp_path / "c", {"train": 30}, seed=4)["train"]}
    assert other != names["train"]
    assert {s.kind for s in sample_specs(len(KINDS), 0)} == set(KINDS)
    for d in a["train"]:
        task = load_harbor_task(d)  # a plain Harbor folder
        assert task.solution is not None and task.instruction.strip()
        assert solution_turns(task)[-1] == [{"name": "submit", "arguments": {"summary": "done"}}]


@needs_bwrap
def test_every_kind_scores_0_untouched_and_1_solved_and_replays_as_sft(tmp_path):
    dirs = generate_splits(tmp_path, {"t": len(KINDS)}, seed=1)["t"]  # one task of each kind
    backend = LocalBackend()
    for d in dirs:
        task = load_harbor_task(d)
        assert check_task(task, backend, oracle=False, log=lambda *_: None).reward == 0.0, d.name
        assert check_task(task, backend, oracle=True, log=lambda *_: None).reward == 1.0, d.name
    convs = solution_transcripts(dirs, _approx_tokens, backend=backend)  # raises unless each replay scores 1
    assert len(convs) == len(dirs)
    for d, record in zip(dirs, convs):
        want = solution_turns(load_harbor_task(d))
        conv = record["messages"]
        got = [structured_tool_calls(m)[0] for m in conv if m["role"] == "assistant"]
        assert got == want
        assert [m["role"] for m in conv[:2]] == ["system", "user"] and conv[-1]["content"] == "submitted"
        assert record["tools"] == AGENT_TOOLS
        (segments,) = ChatMLFormat().render_segments(conv, tools=record["tools"])
        trained = "".join(text for text, train in segments if train)
        assert trained.count("<tool_call>") == sum(len(t) for t in want)  # loss only on the assistant's turns
        # the tools, listed in the system prompt
        assert "- run(command: str, timeout: int (optional))" in segments[0][0]
    # a trigger below the fix-test episodes' third context (but above every first context) summarises them only
    fix = [d for d in dirs if d.name.startswith("fix-test")]
    first = max(_approx_tokens(ChatMLFormat().render(c["messages"][:2], tools=AGENT_TOOLS)) for c in convs)
    chained = solution_transcripts(fix, _approx_tokens, backend=backend, summary_trigger_tokens=first + 60)
    assert len(chained) == 2 * len(fix)
    head, tail = chained[0]["messages"], chained[1]["messages"]
    assert head[-2]["content"].startswith("Your context is full") and head[-1]["content"].startswith("Done: read_file")
    assert "Summary of your work so far" in tail[1]["content"]


def test_splits_share_every_kind_and_record_tiers(tmp_path):
    from tools.task_family import CHANCE, TIERS

    splits = generate_splits(tmp_path, {"sft": 120, "train": 80, "heldout": 16}, seed=2)
    for name, dirs in splits.items():
        kinds = {load_harbor_task(d).metadata["family"] for d in dirs}
        assert kinds == set(KINDS), name  # the small one-slot kind is in every split, not used up by the first
        for d in dirs:
            meta = load_harbor_task(d).metadata
            assert meta["tier"] == TIERS[meta["family"]]
    assert sorted(set(TIERS.values())) == [1, 2, 3, 4] and set(CHANCE) == set(KINDS)
    assert all(0 < CHANCE[k] < 0.2 for k in KINDS)
    assert CHANCE["create_empty"] > CHANCE["write_word"] > CHANCE["create_file"]


def test_instruction_values_are_the_calls_tokens(tmp_path):
    """A copy head copies token ids: every value a reference call copies from the instruction is the same token
    sequence in both (a quoted JSON string value is quoted in the instruction, a command's word follows a space)."""
    import sys
    import sysconfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    from train_tokenizer import main as train_tokenizer

    from megatron_composer.data.tokenizer import load_tokenizer
    from tools.task_family import copy_mismatches

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert train_tokenizer(["--input", str(stdlib / "json"), str(stdlib / "email"), str(stdlib / "unittest"),
                            "--output", str(tmp_path / "tok"), "--vocab-size", "2048"]) == 0
    tok = load_tokenizer(tmp_path / "tok")
    specs = sample_specs(160, 0)
    assert {s.kind for s in specs} == set(KINDS)
    assert all(s.values for s in specs)
    assert {s.kind: copy_mismatches(s, tok) for s in specs if copy_mismatches(s, tok)} == {}
    # the check can fail: a JSON string value written after a space in the instruction is another token (" tree"
    # against the call's "tree" after its quote)
    spec = next(s for s in specs if s.kind == "write_word")
    unquoted = spec.__class__(**{**spec.__dict__, "instruction": spec.instruction.replace('"', "")})
    assert copy_mismatches(unquoted, tok) == list(unquoted.values)


def test_compact_profile_fits_small_contexts_and_limits_the_tools(tmp_path):
    from rl.envs.agent import PROFILES, agent_profile
    from rl.envs.tools import ToolBox

    dirs = generate_splits(tmp_path, {"t": len(KINDS)}, seed=1)["t"]
    for d in dirs:
        task = load_harbor_task(d)
        full, compact = (ChatMLFormat().render(
            [{"role": "system", "content": agent_profile(p).system_prompt.format(workdir="/app")},
             {"role": "user", "content": task.instruction}], tools=agent_profile(p).schemas)
            for p in ("full", "compact"))
        assert _approx_tokens(compact) < 0.4 * _approx_tokens(full)
        assert _approx_tokens(compact) <= 150, d.name  # the prompt; an episode's two turns add ~60-120 tokens
    assert [t["function"]["name"] for t in PROFILES["compact"].schemas] == list(PROFILES["compact"].tools)
    box = ToolBox(sandbox=None, tools=PROFILES["compact"].tools)
    obs = box.call("search", {"pattern": "x"})
    assert obs.malformed and "available: read_file, write_file" in obs.text
    with pytest.raises(ValueError, match="unknown agent profile"):
        agent_profile("tiny")
    with pytest.raises(ValueError, match="unknown tool"):
        ToolBox(sandbox=None, tools=("read_file", "teleport"))


# The verdicts hold against the agent's shortcuts ---------------------------------------------------------------
def _spec(kind: str):
    return sample_specs(1, seed=5, kinds=(kind,))[0]


def _fix_test_attacks(spec) -> dict[str, str]:
    module, fn, _, x, y = spec.key
    visible = [line for line in spec.files[f"test_{module}.py"].splitlines() if "assertEqual" in line][0]
    value = visible.rsplit(",", 1)[1].strip(" )")
    return {
        # a namespace package of the test's and of the module's names: imports find nothing, 0 tests run
        "namespace-packages": f"rm {module}.py test_{module}.py && mkdir test_{module}.py test_{module} {module}",
        # the module ends the process with success as it loads
        "exit-zero-on-load": f"printf 'import os\\nos._exit(0)\\n' > {module}.py",
        # the module answers the case the agent can see, whatever the arguments
        "answer-the-visible-case": f"printf 'def {fn}(a, b):\\n    return {value}\\n' > {module}.py",
    }


@needs_bwrap
@pytest.mark.parametrize("attack", ["namespace-packages", "exit-zero-on-load", "answer-the-visible-case"])
def test_fix_test_verdict_is_taken_outside_the_code_under_test(tmp_path, attack):
    spec = _spec("fix_test")
    d = write_task(spec, tmp_path)
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + _fix_test_attacks(spec)[attack] + "\n")
    _both_paths_score_zero(d)


@needs_bwrap
@pytest.mark.parametrize("kind", ["command_output", "replace_word"])
def test_a_link_to_the_expected_file_is_not_the_answer(tmp_path, kind):
    spec = _spec(kind)
    d = write_task(spec, tmp_path)
    target = spec.values[1] if kind == "command_output" else spec.values[0]
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\nrm -f {target}; ln -s /tests/expected.txt {target}\n")
    _both_paths_score_zero(d)


def _both_paths_score_zero(task_dir: Path) -> None:
    """The shortcut, as `check_task --oracle` plays solve.sh and as a rollout's agent sends it through `run`."""
    task, backend = load_harbor_task(task_dir), LocalBackend()
    assert check_task(task, backend, oracle=True, log=lambda *_: None).reward == 0.0
    snapshot = prepare_task(task, backend)
    try:
        with backend.fork(snapshot) as sandbox:
            turns = [format_tool_call("run", {"command": task.solution.as_commands()[0]})
                     + format_tool_call("submit", {})]
            assert run_episode(task, sandbox, ScriptedPolicy(turns)).reward == 0.0
    finally:
        snapshot.discard()
