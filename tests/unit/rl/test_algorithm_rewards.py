"""Length penalty and behaviour rewards with hand-computed values."""

import math

import pytest
import torch

from megatron_composer.config import ConfigError, load_config
from megatron_composer.data.chat_template import format_tool_call
from rl.algorithm import (
    RLObjectiveConfig,
    length_measure,
    length_penalty,
    malformed_tool_calls,
    reasoning_in_code_comments,
    resolve_function,
    shaped_reward,
    single_tool_collapse,
    unfinished_todos,
)
from rl.algorithm.rewards import shaped_reward_from_config

# ---- length penalty ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("x,k,q,expected", [
    (3.0, 1.0, 0.0, 3.0),                      # q = 0: linear
    (3.0, 1.0, 1.0, math.log(4.0)),            # q = 1: log(1 + k x) / k
    (3.0, 2.0, 1.0, math.log(7.0) / 2),
    (3.0, 1.0, 2.0, 0.75),                     # (4^-1 - 1) / (1 * -1)
    (3.0, 1.0, 3.0, (1 / 16 - 1) / -2),        # 0.46875
    (1.5, 2.0, 0.5, 1.0),                      # (4^0.5 - 1) / (2 * 0.5)
    (2.0, 1.0, -1.0, 4.0),                     # q < 0: superlinear, (3^2 - 1) / 2
    (0.0, 1.0, 2.0, 0.0),                      # C(0) = 0
    (5.0, 0.0, 2.0, 5.0),                      # k = 0: linear limit
])
def test_length_penalty_hand_values(x, k, q, expected):
    assert length_penalty(x, k, q) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_length_penalty_limits_are_continuous():
    for eps in (1e-4, 1e-8, 1e-12):
        for q in (1 - eps, 1 + eps):
            assert length_penalty(3.0, 1.0, q) == pytest.approx(math.log(4.0), rel=2 * eps + 1e-14)
    assert length_penalty(5.0, 1e-12, 2.0) == pytest.approx(5.0, rel=1e-10)
    # q > 1 saturates at 1 / (k (q - 1))
    assert length_penalty(1e12, 1.0, 2.0) == pytest.approx(1.0, rel=1e-9)
    assert length_penalty(1e12, 0.5, 3.0) == pytest.approx(1.0, rel=1e-9)


def test_length_penalty_tensor_and_derivative():
    x = torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64, requires_grad=True)
    c = length_penalty(x, 1.0, 1.0)
    torch.testing.assert_close(c, torch.log1p(x.detach()))
    # C'(x) = (1 + k x)^(-q)
    x = torch.tensor([1.0, 4.0], dtype=torch.float64, requires_grad=True)
    length_penalty(x, 2.0, 0.5).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([3.0 ** -0.5, 9.0 ** -0.5], dtype=torch.float64))
    assert length_penalty(torch.tensor([2, 3]), 1.0, 0.0).tolist() == pytest.approx([2.0, 3.0])  # integer counts


def test_length_penalty_rejects_bad_input():
    with pytest.raises(ValueError, match="k must be >= 0"):
        length_penalty(1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="x must be >= 0"):
        length_penalty(torch.tensor([1.0, -2.0]), 1.0, 1.0)


# ---- behaviour rewards --------------------------------------------------------------------------------------

def call(name, **args):
    return format_tool_call(name, args)


def test_malformed_tool_calls():
    transcript = [
        {"role": "user", "content": "fix it <tool_call>{bad</tool_call>"},  # user text is not counted
        {"role": "assistant", "content": "ok " + call("run", cmd="ls") + "<tool_call>{not json}</tool_call>"},
        {"role": "tool", "content": "a.py"},
        {"role": "assistant", "content": '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "run"'},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "run", "arguments": "{oops"}}]},
    ]
    assert malformed_tool_calls(transcript) == 4.0
    assert malformed_tool_calls([{"role": "assistant", "content": call("run", cmd="ls")}]) == 0.0
    assert malformed_tool_calls([]) == 0.0


def test_unfinished_todos_replace_and_merge():
    todos = [{"id": "1", "content": "read", "status": "completed"},
             {"id": "2", "content": "fix", "status": "in_progress"},
             {"id": "3", "content": "test", "status": "pending"}]
    transcript = [{"role": "assistant", "content": call("todo_write", todos=todos, merge=False)}]
    assert unfinished_todos(transcript) == 2.0
    transcript.append({"role": "assistant", "content": call("todo_write", todos=[
        {"id": "2", "status": "completed"}, {"id": "3", "status": "cancelled"}], merge=True)})
    assert unfinished_todos(transcript) == 0.0
    transcript.append({"role": "assistant", "content": call("todo_write", todos=[
        {"id": "9", "content": "new", "status": "pending"}])})  # merge defaults to false: replaces the list
    assert unfinished_todos(transcript) == 1.0
    assert unfinished_todos([{"role": "assistant", "content": call("run", cmd="ls")}]) == 0.0


def test_unfinished_todos_reads_the_agents_todo_tool():
    """The agent's own `todo` tool (rl.envs.tools): add gives ids 1, 2, ...; complete closes one by id."""
    msgs = [call("todo", action="add", text="read the failing test"),
            call("todo", action="add", text="fix the parser"),
            call("todo", action="add"),                      # malformed: no text, adds nothing
            call("todo", action="complete", id=1),
            call("todo", action="complete", id=7),           # no such id: nothing changes
            call("todo", action="list"),
            call("todo", action="add", text="run the tests")]
    transcript = [{"role": "assistant", "content": m} for m in msgs]
    assert unfinished_todos(transcript) == 2.0  # items 2 and 3 are open
    transcript.append({"role": "assistant", "content": call("todo", action="complete", id=3)})
    assert unfinished_todos(transcript) == 1.0


def test_reasoning_in_code_comments():
    code = ("def f(x):\n"
            "    # Let me handle the empty case first\n"
            "    if not x:  # returns None for empty input\n"
            "        return None\n"
            "    /* hmm, wait, maybe we should sort */\n"
            "    return x  // I think this is right\n")
    transcript = [{"role": "assistant", "content": call("write_file", path="a.py", content=code)},
                  {"role": "assistant", "content": call("run", cmd="python -c 'print(1)'  # actually, retry")},
                  {"role": "assistant", "content": "# Let me think about this (prose, not code)"}]
    assert reasoning_in_code_comments(transcript) == 4.0
    clean = "url = 'http://example.com'  # the docs page\n"
    assert reasoning_in_code_comments([{"role": "assistant", "content": call("write_file", content=clean)}]) == 0.0


def test_single_tool_collapse():
    def transcript(names):
        return [{"role": "assistant", "content": "".join(call(n) for n in names)}]
    assert single_tool_collapse(transcript(["run"] * 10)) == 1.0
    assert single_tool_collapse(transcript(["run"] * 9 + ["read"])) == pytest.approx(0.0)
    assert single_tool_collapse(transcript(["run"] * 19 + ["read"])) == pytest.approx(0.5)
    assert single_tool_collapse(transcript(["run"] * 4)) == 0.0  # too few calls to judge
    assert single_tool_collapse(transcript(["run", "read", "edit"] * 3)) == 0.0


def test_length_measures():
    t = [{"role": "user", "content": "go"},
         {"role": "assistant", "content": call("run") + call("read") + "<tool_call>{x}</tool_call>"},
         {"role": "tool", "content": "out"},
         {"role": "assistant", "content": "done"}]
    assert length_measure(t, "turns") == 2.0
    assert length_measure(t, "tool_calls") == 3.0
    assert length_measure(t, "output_tokens", num_output_tokens=120) == 120.0
    with pytest.raises(ValueError, match="num_output_tokens"):
        length_measure(t, "output_tokens")


def test_shaped_reward_combines_weights_and_length():
    t = [{"role": "assistant", "content": "<tool_call>{x}</tool_call>" + call("todo_write", todos=[
        {"id": "1", "content": "a", "status": "pending"}, {"id": "2", "content": "b", "status": "pending"}])}]
    weights = {"rl.algorithm.rewards:malformed_tool_calls": -0.1, "rl.algorithm.rewards.unfinished_todos": -0.05}
    # 1 - 0.1 * 1 - 0.05 * 2 - 0.5 * log(1 + 2 * (300 / 100)) / 2
    total, parts = shaped_reward(1.0, t, weights, length_weight=0.5, length_k=2.0, length_q=1.0,
                                 length_measure_name="output_tokens", length_budget=100.0, num_output_tokens=300)
    assert total == pytest.approx(1 - 0.1 - 0.1 - 0.5 * math.log(7.0) / 2)
    assert parts["rl.algorithm.rewards:malformed_tool_calls"] == 1.0
    assert parts["length_cost"] == pytest.approx(math.log(7.0) / 2)
    cfg = load_config(RLObjectiveConfig, None, [
        "behaviour_rewards={rl.algorithm.rewards:malformed_tool_calls: -1.0}", "length_penalty_weight=1.0",
        "length_measure=turns", "length_penalty_q=0.0"])
    total, _ = shaped_reward_from_config(0.0, t, cfg)
    assert total == pytest.approx(-1.0 - 1.0)


def test_resolve_function_errors():
    assert resolve_function("rl.algorithm.rewards:length_penalty") is length_penalty
    with pytest.raises(ValueError, match="cannot import"):
        resolve_function("no_such_pkg.mod:f")
    with pytest.raises(ValueError, match="no function"):
        resolve_function("rl.algorithm.rewards:nope")
    with pytest.raises(ConfigError, match="cannot import"):
        load_config(RLObjectiveConfig, None, ["behaviour_rewards={nope.mod:f: 1.0}"])
