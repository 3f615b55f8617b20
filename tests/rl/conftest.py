"""Shared assets of the RL system tests: a tiny byte-level BPE tokenizer with the chat markers and a task set
of single-turn prompts the tiny model can be scored on."""

from __future__ import annotations

import json

import pytest

PROMPTS = [("Start a function.", r"[\s\S]*def[\s\S]*"), ("Write an import.", r"[\s\S]*import[\s\S]*"),
           ("Return a value.", r"[\s\S]*return[\s\S]*"), ("Say hi.", r"[\s\S]*hi[\s\S]*"),
           ("Name a loop keyword.", r"[\s\S]*(for|while)[\s\S]*"), ("Write a class.", r"[\s\S]*class[\s\S]*")]


@pytest.fixture(scope="session")
def rl_assets(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("rl_assets")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    corpus = [p for p, _ in PROMPTS] * 20 + ["def f(x):\n    return x\nimport os\nclass A:\n    pass\nfor i in range(3):"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tasks").mkdir()
    (root / "tasks" / "tasks.jsonl").write_text(
        "".join(json.dumps({"id": f"t{i}", "prompt": p, "check": {"regex": r}}) + "\n" for i, (p, r) in enumerate(PROMPTS)))
    return root
