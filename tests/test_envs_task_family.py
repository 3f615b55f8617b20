"""The generated agent task family: Harbor folders that check_task scores 0 untouched and 1 after their
solution, disjoint splits, and reference tool calls that replay through the real agent protocol into SFT
conversations whose assistant turns parse back to the same calls (summarised where the trigger is reached)."""

from pathlib import Path

import pytest

from megatron_composer.data.chat_format import ChatMLFormat
from megatron_composer.data.chat_template import structured_tool_calls
from rl.envs.agent import AGENT_TOOLS
from rl.envs.check_task import check_task
from rl.envs.harbor import load_harbor_task
from rl.envs.task_family import KINDS, generate_splits, sample_specs, solution_transcripts, solution_turns
from rl.sandbox.local import LocalBackend, bwrap_problem

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
        assert "- run(command: str, timeout: int (optional))" in segments[0][0]  # the tools, listed in the system prompt
    # a trigger below the fix-test episodes' third context (but above every first context) summarises them only
    fix = [d for d in dirs if d.name.startswith("fix-test")]
    first = max(_approx_tokens(ChatMLFormat().render(c["messages"][:2], tools=AGENT_TOOLS)) for c in convs)
    chained = solution_transcripts(fix, _approx_tokens, backend=backend, summary_trigger_tokens=first + 60)
    assert len(chained) == 2 * len(fix)
    head, tail = chained[0]["messages"], chained[1]["messages"]
    assert head[-2]["content"].startswith("Your context is full") and head[-1]["content"].startswith("Done: read_file")
    assert "Summary of your work so far" in tail[1]["content"]
