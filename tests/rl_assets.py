"""Assets the RL system tests share: a tiny byte-level BPE tokenizer with the chat markers, and a task set of
single-turn prompts the tiny model can be scored on (each checked by a regex)."""

from __future__ import annotations

import json
from pathlib import Path


def write_rl_assets(root: Path, prompts: list[tuple[str, str]]) -> Path:
    """root/tok/tokenizer.json trained on the prompts plus some code, and root/tasks/tasks.jsonl."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    code = "def f(x):\n    return x\nimport os\nclass A:\n    pass\nfor i in range(3):"
    corpus = [p for p, _ in prompts] * 20 + [code] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tasks").mkdir()
    (root / "tasks" / "tasks.jsonl").write_text(
        "".join(json.dumps({"id": f"t{i}", "prompt": p, "check": {"regex": r}}) + "\n"
                for i, (p, r) in enumerate(prompts)))
    return root
