"""An agent episode in Kimi K2.5's own chat format, end to end on a tiny model: the rollout worker renders the
prompt with the checkpoint's template (tools declared in its tool_declare turn), the model writes Kimi tool calls
(<think>, functions.NAME:IDX ids, the argument token), they run in the sandbox, the verifier rewards the fix, and
the trainer's token sequence is exactly the concatenation, turn by turn, of what was sampled and of what the
environment appended (no re-rendering, no re-tokenisation).

The tiny model is real but scripted (tests.chat_assets.kimi_scripted_model): each logit depends on the current
token only, and the head maps each token of one Kimi turn to the next."""

from __future__ import annotations

import json

import pytest

from megatron_composer.data.chat_format import load_chat_format
from tests.chat_assets import KIMI_ARGS as ARGS
from tests.chat_assets import KIMI_REASONING as REASONING
from tests.chat_assets import kimi_scripted_model, kimi_tokenizer


@pytest.fixture
def hello_task(tmp_path):
    from rl.envs.task import DirectoryTree, ScriptVerifier, Task, TaskLimits

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "hello.py").write_text("print('hello')\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text("mkdir -p /logs/verifier\n"
                                   "grep -q goodbye /app/hello.py && echo 1 > /logs/verifier/reward.txt "
                                   "|| echo 0 > /logs/verifier/reward.txt\n")
    return Task(name="hello", instruction="Make hello.py say goodbye.", tree=DirectoryTree(tree),
                verifier=ScriptVerifier(tests), limits=TaskLimits(max_turns=3))


@pytest.mark.usefixtures("one_thread")
def test_kimi_format_episode_is_token_in_token_out(tmp_path, hello_task):
    from rl.envs.agent import AGENT_TOOLS, initial_messages
    from rl.orchestrator import WorkItem
    from rl.rollout.config import RolloutConfig
    from rl.rollout.episodes import continuation_ids
    from rl.rollout.tasks import RLTask
    from rl.rollout.worker import RolloutWorker
    from rl.sandbox import LocalBackend, SandboxError

    try:
        LocalBackend()
    except SandboxError as e:
        pytest.skip(f"no isolated sandbox on this host: {e}")
    tok = kimi_tokenizer(tmp_path)
    fmt = load_chat_format("auto", tok)
    assert fmt.name == "kimi_k2"
    model, turn_ids = kimi_scripted_model(tok)
    cfg = RolloutConfig(group_size=1, agent_max_turns=3, agent_max_new_tokens=32, max_seq_len=4096,
                        cache_memory_mb=64, sandbox_concurrency=1).validate()
    worker = RolloutWorker("kimi", cfg, model, tok, [RLTask("hello", "agent", harbor=hello_task)], queue=None,
                           subscriber=None, chat_format=fmt)
    sampled = []  # what the engine returned, turn by turn
    generate = worker.generate
    worker.generate = lambda *a, **k: sampled.extend(out := generate(*a, **k)) or out
    (episode,) = worker.run_group(WorkItem(0, 0))["episodes"]
    worker._pool.close()

    meta = episode["meta"]
    assert episode["verifier_reward"] == 1.0, meta["verdict"]  # the Kimi tool call edited the file
    assert meta["turns"] == 3 and meta["tool_calls"] == 3 and meta["malformed_tool_calls"] == 0
    transcript = meta["transcript"]
    assistants = [i for i, m in enumerate(transcript) if m["role"] == "assistant"]
    first = transcript[assistants[0]]
    assert first["reasoning_content"] == REASONING and first["tool_calls"][0]["id"] == "functions.edit_file:0"
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == json.loads(ARGS)
    tool_msgs = [m for m in transcript if m["role"] == "tool"]
    assert all(m["tool_call_id"] == "functions.edit_file:0" for m in tool_msgs)
    assert "not found" in tool_msgs[1]["content"]  # the second identical edit finds nothing to replace

    (seg,) = episode["segments"]
    # the prompt is the template's rendering of the start, tools declared in Kimi's tool_declare turn
    prompt_text = fmt.render(initial_messages(hello_task, "/app"), tools=AGENT_TOOLS, add_generation_prompt=True)
    assert seg["prompt_ids"] == tok.encode(prompt_text)
    assert tok.decode(seg["prompt_ids"]).startswith("<|im_system|>tool_declare<|im_middle|>[")
    # token in, token out: sampled tokens (mask 1), then the tokens of what the environment appended (mask 0)
    ids, mask = [], []
    for k, result in enumerate(sampled):
        assert result.token_ids == turn_ids  # the scripted Kimi turn, ending with <|im_end|>
        ids += result.token_ids
        mask += [1] * len(result.token_ids)
        if k + 1 < len(sampled):
            i, nxt = assistants[k], assistants[k + 1]
            text = fmt.continuation(transcript[:i + 1], transcript[i + 1:nxt], tools=AGENT_TOOLS)
            appended = continuation_ids(worker, transcript[:i + 1], transcript[i + 1:nxt], AGENT_TOOLS, ids)
            assert tok.decode(appended) == text  # the text the template appends, tool outputs encoded as plain text
            assert tok.decode(appended).startswith("<|im_system|>tool<|im_middle|>## Return of functions.edit_file:0\n")
            ids += appended
            mask += [0] * len(appended)
    assert seg["response_ids"] == ids and seg["response_mask"] == mask
    assert seg["response_logprobs"][:len(turn_ids)] == pytest.approx(list(sampled[0].sampling_logprobs))
    # the trainer's sequence keeps every sampled turn's reasoning in its context; a re-render of the transcript
    # once a plain answer closes it would drop them (Kimi's template shows reasoning only after the last answer)
    held = tok.decode(seg["prompt_ids"] + seg["response_ids"])
    assert held.count(REASONING) == 3
    closed = transcript + [{"role": "assistant", "content": "Done."}]
    assert fmt.render(closed, tools=AGENT_TOOLS).count(REASONING) == 0
