"""Tokenizer directories of the chat-template families, as a checkpoint ships them: tokenizer.json (a small
byte-level BPE with the family's special tokens), tokenizer_config.json (bos/eos) and chat_template.jinja (the
fixtures in tests/chat_templates, written from each family's published format)."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"

FAMILIES = {
    "kimi_k2": {
        "template": "kimi_k2.jinja", "bos": "[BOS]", "eos": "[EOS]",
        "specials": ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                     "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                     "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"],
    },
    "deepseek_v3": {
        "template": "deepseek_v3.jinja", "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<think>", "</think>"],
    },
    "deepseek_v31": {
        "template": "deepseek_v31.jinja", "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<think>", "</think>"],
    },
    "hermes": {
        "template": "qwen3.jinja", "bos": None, "eos": "<|im_end|>",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                     "</tool_response>", "<think>", "</think>"],
    },
}


def write_family_tokenizer(root: Path, family: str, corpus: list[str] = (), vocab_size: int = 600) -> Path:
    """root/<family>/ with tokenizer.json, tokenizer_config.json and chat_template.jinja; returns the directory."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = list(corpus) or ["def f(x):\n    return x\n", '{"path": ".", "command": "ls"}', "Return of functions.run:0"]
    tok.train_from_iterator(text * 4, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in spec["specials"]])
    out = root / family
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": spec["eos"], "tokenizer_class": "PreTrainedTokenizerFast"}
    if spec["bos"]:
        config["bos_token"] = spec["bos"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    template = (TEMPLATES / spec["template"]).read_text(encoding="utf-8")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


def hf_tokenizer(directory: Path):
    """The transformers tokenizer of such a directory (the peer whose apply_chat_template we must equal)."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                   chat_template=(directory / "chat_template.jinja").read_text(encoding="utf-8"),
                                   **{k: v for k, v in config.items() if k in ("bos_token", "eos_token")})


KIMI_ARGS = json.dumps({"path": "hello.py", "old_string": "hello", "new_string": "goodbye"})
KIMI_REASONING = "Edit hello.py."


def kimi_tokenizer(root: Path):
    """A Kimi-format tokenizer directory where the scripted turn's id, arguments and reasoning are one token each."""
    from tokenizers import Tokenizer

    from megatron_composer.data.tokenizer import load_tokenizer

    directory = write_family_tokenizer(root, "kimi_k2", corpus=["print('hello')\n", "Make hello.py say goodbye."])
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    # one token each, so one logit row scripts them
    tok.add_tokens(["functions.edit_file:0", KIMI_ARGS, KIMI_REASONING])
    tok.save(str(directory / "tokenizer.json"))
    return load_tokenizer(directory)


def scripted_model(vocab_size: int, ids: list[int], weight: float):
    """A real tiny MoE model whose attention and FFN outputs are zeroed, so each logit depends on the current token
    only, and whose head maps ids[i] to ids[i + 1] with logit weight x the final norm's scale (~8 x weight)."""
    import torch

    from megatron_composer.model import Transformer, get_preset

    torch.manual_seed(0)
    cfg = get_preset("tiny-qwen3-moe").replace(vocab_size=vocab_size, hidden_size=64, num_layers=2, head_dim=16,
                                               intermediate_size=64, moe_intermediate_size=32)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.zero_()
            ff = layer.feed_forward
            (ff.experts.w2 if hasattr(ff, "experts") else ff.w2.weight).zero_()
        for i, (a, b) in enumerate(zip(ids, ids[1:])):
            model.tok_embeddings.weight[a] = 0.0
            model.tok_embeddings.weight[a, i] = 1.0
            model.output.weight[:, i] = 0.0
            model.output.weight[b, i] = weight
    return model


def kimi_scripted_model(tok):
    """`scripted_model` writing one Kimi turn (reasoning, an edit_file call) after the generation prompt; returns
    (model, the turn's token ids, ending with <|im_end|>)."""
    script = ["<|im_middle|>", "<think>", KIMI_REASONING, "</think>", "<|tool_calls_section_begin|>",
              "<|tool_call_begin|>", "functions.edit_file:0", "<|tool_call_argument_begin|>", KIMI_ARGS,
              "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>"]
    ids = [tok.token_to_id(t) for t in script]
    assert None not in ids
    # ~48 after the final norm: sampling at temperature 1 follows the script
    return scripted_model(tok.vocab_size, ids, 6.0), ids[1:]
