"""One tokenizer interface over sentencepiece models (trained by tools/train_tokenizer.py) and Hugging Face
tokenizer.json files shipped with real checkpoints.

Both expose ``encode``/``decode``, ``vocab_size``, ``eod`` (end-of-document id appended between packed
documents), ``pad`` and ``special_tokens`` (name -> id, including the chat template's markers), which is
also what megatron-core's GPTDataset reads from a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from megatron_composer.data.chat_template import SPECIAL_TOKENS as CHAT_SPECIAL_TOKENS

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
# End-of-document spellings used by common HF tokenizers, tried in order when tokenizer_config.json is silent.
_HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or does not fit the model/dataset."""


class Tokenizer:
    """Common interface; subclasses wrap one backend."""

    vocab_size: int
    eod: int
    pad: int
    special_tokens: dict[str, int]
    path: str

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)

    # megatron-core's dataset code reads these names.
    @property
    def eos(self) -> int:
        return self.eod

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        return {"eod_token": self.eod, **{k: v for k, v in self.special_tokens.items() if v != self.pad}}

    def check_fits_model(self, model_vocab_size: int) -> None:
        """Raise if token ids could index past the model's embedding table."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerError(
                f"tokenizer '{self.path}' has {self.vocab_size} tokens but the model's vocab_size is "
                f"{model_vocab_size}; use the tokenizer the data was built with or set model.vocab_size>={self.vocab_size}"
            )

    def describe(self) -> dict:
        return {"path": self.path, "kind": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        self.path = str(model_file)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"cannot read sentencepiece model '{self.path}': {e}") from None
        self.vocab_size = self._sp.GetPieceSize()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(f"sentencepiece model '{self.path}' has no end-of-document (eos) piece; retrain with tools/train_tokenizer.py")
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod
        self.special_tokens = {EOD_TOKEN: self.eod}
        for piece in CHAT_SPECIAL_TOKENS:
            idx = self._sp.PieceToId(piece)
            if idx != self._sp.unk_id():
                self.special_tokens[piece] = idx

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (tokenizer.json), with eod/pad read from tokenizer_config.json when present."""

    def __init__(self, tokenizer_json: str | Path):
        from tokenizers import Tokenizer as _HFTok

        tokenizer_json = Path(tokenizer_json)
        self.path = str(tokenizer_json)
        try:
            self._tok = _HFTok.from_file(self.path)
        except Exception as e:  # the tokenizers library raises a plain Exception on parse errors
            raise TokenizerError(f"cannot read HF tokenizer '{self.path}': {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = {}
        cfg_path = tokenizer_json.parent / "tokenizer_config.json"
        if cfg_path.is_file():
            config = json.loads(cfg_path.read_text())

        def _name(entry):
            return entry.get("content") if isinstance(entry, dict) else entry

        candidates = [_name(config.get("eos_token"))] + list(_HF_EOD_CANDIDATES)
        eod = next((self._tok.token_to_id(c) for c in candidates if c and self._tok.token_to_id(c) is not None), None)
        if eod is None:
            raise TokenizerError(f"HF tokenizer '{self.path}' has no end-of-document token; set eos_token in tokenizer_config.json")
        self.eod = eod
        pad_name = _name(config.get("pad_token"))
        pad = self._tok.token_to_id(pad_name) if pad_name else None
        self.pad = pad if pad is not None else self.eod
        self.special_tokens = {self._tok.id_to_token(self.eod): self.eod}
        for piece in CHAT_SPECIAL_TOKENS:
            idx = self._tok.token_to_id(piece)
            if idx is not None:
                self.special_tokens[piece] = idx

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a sentencepiece .model file, a tokenizer.json, or a checkpoint directory holding either."""
    path = Path(path)
    if path.is_dir():
        for name, cls in (("tokenizer.json", HFTokenizer), ("tokenizer.model", SentencePieceTokenizer)):
            if (path / name).is_file():
                return cls(path / name)
        raise TokenizerError(f"directory '{path}' has no tokenizer.json or tokenizer.model; point tokenizer.path at a tokenizer file")
    if not path.is_file():
        raise TokenizerError(f"tokenizer '{path}' does not exist; train one with tools/train_tokenizer.py or point at a checkpoint directory")
    if path.suffix == ".json":
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
