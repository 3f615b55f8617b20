"""SFT packing: only assistant tokens carry loss, documents restart positions, in multi-conversation rows."""

import json

import pytest

from megatron_composer.data.chat_template import IM_END, render_text
from megatron_composer.data.pretrain_data import DataConfig, DataError
from megatron_composer.data.sft import PackedSFTDataset, build_sft_datasets, tokenize_conversation


class CharTokenizer:
    """One token per character: makes 'which characters carry loss' directly checkable."""

    vocab_size = 300
    eod = 0
    pad = 1
    special_tokens = {}

    def encode(self, text):
        return [ord(c) % 250 + 2 for c in text]


def conv(i):
    return [
        {"role": "system", "content": f"sys{i}"},
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "run", "arguments": {"cmd": f"ls {i}"}}]},
        {"role": "tool", "content": f"file{i}.py"},
        {"role": "assistant", "content": f"answer {i}"},
    ]


def test_only_assistant_tokens_carry_loss_in_packed_rows():
    tok = CharTokenizer()
    convs = [conv(i) for i in range(6)]
    ds = PackedSFTDataset(convs, tok, seq_length=700, seed=0)
    assert len(ds) < len(convs)  # several conversations share a row
    expected = []
    for i in range(6):
        expected.append(f'<tool_call>{{"name": "run", "arguments": {{"cmd": "ls {i}"}}}}</tool_call>{IM_END}')
        expected.append(f"answer {i}{IM_END}")
    runs, multi_doc_rows = [], 0
    for r in range(len(ds)):
        s = ds[r]
        multi_doc_rows += int((s["position_ids"] == 0).sum()) > 1
        text, prev = "", False
        for target, m in zip(s["labels"].tolist(), s["loss_mask"].tolist()):
            if m > 0:
                text += chr(target - 2)
            elif prev:
                runs.append(text)
                text = ""
            prev = m > 0
        if text:
            runs.append(text)
    assert multi_doc_rows > 0
    assert sorted(runs) == sorted(expected)  # exactly the assistant turns (+ their <|im_end|>), nothing else


def test_positions_restart_and_padding_has_no_loss():
    tok = CharTokenizer()
    ds = PackedSFTDataset([conv(0), conv(1)], tok, seq_length=800, seed=0)
    s = ds[0]
    ((ids, train),) = tokenize_conversation(conv(0), tok)
    n = len(ids)
    assert s["position_ids"][n] == 0 and s["position_ids"][n - 1] == n - 1
    pad_pos = (s["tokens"] == tok.pad).nonzero().flatten()
    assert len(pad_pos) > 0 and s["loss_mask"][pad_pos[0]:].sum() == 0
    assert len(ids) == len(render_text(conv(0))) + 1  # +EOD


def test_sft_split_and_errors(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conv(i)}) for i in range(20)) + "\n")
    cfg = DataConfig(kind="sft", tokenizer="x", paths=[str(path)], split="90,10,0", seq_length=256)
    train, valid = build_sft_datasets(cfg, CharTokenizer(), seed=0)
    assert len(valid) >= 1 and len(train) >= 1
    path.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n' * 3)
    with pytest.raises(DataError, match="role"):
        build_sft_datasets(cfg, CharTokenizer(), seed=0)
    with pytest.raises(DataError, match="missing"):
        build_sft_datasets(DataConfig(kind="sft", tokenizer="x", paths=[str(tmp_path / "no.jsonl")]),
                           CharTokenizer(), 0)


def test_sft_with_the_models_own_template(tmp_path):
    """data.chat_format=auto on a checkpoint directory with a chat template (Kimi K2's format): conversations with
    tools render with it, and the tokens with loss are exactly the assistant turns as the template writes them."""
    from megatron_composer.data.chat_format import load_chat_format
    from megatron_composer.data.tokenizer import load_tokenizer
    from tests.chat_assets import write_family_tokenizer

    directory = write_family_tokenizer(tmp_path, "kimi_k2")
    tok = load_tokenizer(directory)
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": conv(i), "tools": tools}) for i in range(4)) + "\n")
    cfg = DataConfig(kind="sft", tokenizer=str(directory), paths=[str(path)], split="1,0,0", seq_length=2048)
    train, _ = build_sft_datasets(cfg, tok, seed=0)
    fmt = load_chat_format("auto", tok)
    row = train[0]
    trained = tok.decode([t for t, m in zip(row["labels"].tolist(), row["loss_mask"].tolist()) if m])
    assert trained.count("<|im_end|>") == 2 * 4  # two assistant turns per conversation, each with its end of turn
    assert trained.count("<|tool_calls_section_begin|><|tool_call_begin|>functions.run:0"
                         "<|tool_call_argument_begin|>") == 4
    assert "tool_declare" not in trained and "question" not in trained and "file0.py" not in trained
    first_turn = next(text for text, train in fmt.render_segments(conv(0), tools=tools)[0] if train)
    assert fmt.parse(first_turn).tool_calls == [{"name": "run", "arguments": {"cmd": "ls 0"}}]
    bad = DataConfig(kind="sft", tokenizer=str(directory), paths=[str(path)], chat_format="deepseek_v3")
    with pytest.raises(DataError, match="data.chat_format: .*no '<｜end▁of▁sentence｜>' token"):
        build_sft_datasets(bad, tok, seed=0)
