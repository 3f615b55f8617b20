"""One tokenizer interface over sentencepiece models (trained by tools/train_tokenizer.py) and Hugging Face
tokenizer.json files shipped with real checkpoints.

Both expose ``encode``/``decode``, ``vocab_size``, ``eod`` (end-of-document id appended between packed
documents), ``pad`` and ``special_tokens`` (name -> id, including the chat template's markers), which is
also what megatron-core's GPTDataset reads from a tokenizer.
"""

from __future__ import annotations

import ast
import base64
import json
import re
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
        """The id of a single token (a chat template's markers, e.g. <|im_end|>), None if the vocabulary lacks it."""
        return self.special_tokens.get(token)

    def control_tokens(self) -> list[str]:
        """The strings `encode` turns into one control token wherever they appear (chat markers, EOD)."""
        return list(self.special_tokens)

    def encode_plain(self, text: str) -> list[int]:
        """`encode` for text from outside (a tool's output): a control token's spelling inside it is encoded as
        ordinary text, never as the control token, so an observation cannot close a turn or open a tool call."""
        controls = sorted((t for t in self.control_tokens() if t and t in text), key=len, reverse=True)
        if not controls:
            return self.encode(text)
        ids: list[int] = []
        at = 0
        for match in re.finditer("|".join(map(re.escape, controls)), text):  # longest first at each position
            ids += self.encode(text[at:match.start()]) if match.start() > at else []
            token = match.group()
            ids += self.encode(token[:1]) + self.encode_plain(token[1:])  # split: no longer the control token
            at = match.end()
        return ids + (self.encode(text[at:]) if at < len(text) else [])

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
                f"{model_vocab_size}; use the tokenizer the data was built with "
                f"or set model.vocab_size>={self.vocab_size}"
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
            raise TokenizerError(f"sentencepiece model '{self.path}' has no end-of-document (eos) piece; "
                                 "retrain with tools/train_tokenizer.py")
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod
        self.special_tokens = {EOD_TOKEN: self.eod}
        for piece in CHAT_SPECIAL_TOKENS:
            idx = self._sp.PieceToId(piece)
            if idx != self._sp.unk_id():
                self.special_tokens[piece] = idx

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def token_to_id(self, token: str) -> int | None:
        idx = self._sp.PieceToId(token)
        return None if idx == self._sp.unk_id() and token != self._sp.IdToPiece(idx) else idx

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
            raise TokenizerError(f"HF tokenizer '{self.path}' has no end-of-document token; "
                                 "set eos_token in tokenizer_config.json")
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

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def control_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _pattern_from_python(directory: Path) -> str | None:
    """The pre-tokenizer regex `pat_str` of a tiktoken tokenizer's tokenization_*.py, read with ast (never run).

    Accepts `pat_str = "..."` and `pat_str = "|".join([...])` as Kimi's tokenization_kimi.py writes it.
    """
    for py in sorted(directory.glob("tokenization*.py")):
        for node in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            targets = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", None)
                       for t in getattr(node, "targets", [])]
            if not isinstance(node, ast.Assign) or "pat_str" not in targets:
                continue
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join"
                    and isinstance(value.func.value, ast.Constant) and len(value.args) == 1):
                return value.func.value.value.join(ast.literal_eval(value.args[0]))
    return None


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (one "base64(token) rank" per line, e.g. Kimi K2's tiktoken.model) run through the
    Hugging Face `tokenizers` BPE with the same merges, byte-level alphabet and split regex.

    The regex comes from tokenizer_config.json ("pat_str") or the checkpoint's tokenization_*.py; special
    tokens and the end-of-document token from tokenizer_config.json (added_tokens_decoder, eos_token).
    """

    def __init__(self, model_file: str | Path):
        from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
        from tokenizers import Tokenizer as _HFTok
        from tokenizers.models import BPE

        model_file = Path(model_file)
        self.path = str(model_file)
        ranks: dict[bytes, int] = {}
        try:
            for lineno, line in enumerate(model_file.read_text().splitlines(), 1):
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        except (ValueError, OSError) as e:
            raise TokenizerError(f"'{model_file}' is not a tiktoken BPE file (line {lineno}: {e})") from None
        directory = model_file.parent
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        pattern = config.get("pat_str") or _pattern_from_python(directory)
        if not pattern:
            raise TokenizerError(
                f"tiktoken tokenizer '{model_file}' needs its split regex: "
                f"add \"pat_str\" to {directory / 'tokenizer_config.json'} "
                "(as in the model's tokenization_*.py)"
            )
        byte_chars = _bytes_to_unicode()

        def to_str(b: bytes) -> str:
            return "".join(byte_chars[x] for x in b)

        vocab = {to_str(t): r for t, r in ranks.items()}
        merges = []
        for token, rank in ranks.items():  # each multi-byte token is the merge of two lower-ranked tokens
            splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
            merges.extend((ranks[l], ranks[r], rank, l, r) for l, r in splits)
        merges.sort(key=lambda m: (m[2], m[0], m[1]))
        tok = _HFTok(BPE(vocab, [(to_str(m[3]), to_str(m[4])) for m in merges], fuse_unk=False, ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        specials = {int(i): v["content"] for i, v in (config.get("added_tokens_decoder") or {}).items()}
        for idx in sorted(specials):
            tok.add_special_tokens([AddedToken(specials[idx], normalized=False, special=True)])
            if tok.token_to_id(specials[idx]) != idx:
                raise TokenizerError(f"special token {specials[idx]!r} of '{model_file}' would get id "
                                     f"{tok.token_to_id(specials[idx])}, not {idx}; "
                                     "the added_tokens_decoder ids must follow the BPE ranks")
        self._tok = tok
        self.vocab_size = max([len(ranks)] + [i + 1 for i in specials])
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        candidates = [eos] + list(_HF_EOD_CANDIDATES) + ["[EOS]", "<|im_end|>"]
        eod = next((tok.token_to_id(c) for c in candidates if c and tok.token_to_id(c) is not None), None)
        if eod is None:
            raise TokenizerError(f"tiktoken tokenizer '{model_file}' has no end-of-document token; "
                                 "set eos_token in tokenizer_config.json")
        self.eod = eod
        pad = config.get("pad_token")
        pad = pad.get("content") if isinstance(pad, dict) else pad
        self.pad = tok.token_to_id(pad) if pad and tok.token_to_id(pad) is not None else self.eod
        self.special_tokens = {tok.id_to_token(self.eod): self.eod}
        for piece in CHAT_SPECIAL_TOKENS:
            if tok.token_to_id(piece) is not None:
                self.special_tokens[piece] = tok.token_to_id(piece)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def control_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a sentencepiece .model file, a tokenizer.json, a tiktoken BPE file, or a checkpoint directory
    holding one of them (tokenizer.json preferred)."""
    path = Path(path)
    if path.is_dir():
        for name, cls in (("tokenizer.json", HFTokenizer), ("tiktoken.model", TiktokenTokenizer),
                          ("tokenizer.model", SentencePieceTokenizer)):
            if (path / name).is_file():
                return cls(path / name)
        raise TokenizerError(f"directory '{path}' has no tokenizer.json, tiktoken.model or tokenizer.model; "
                             "point data.tokenizer at a tokenizer file")
    if not path.is_file():
        raise TokenizerError(f"tokenizer '{path}' does not exist; "
                             "train one with tools/train_tokenizer.py or point at a checkpoint directory")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.name == "tiktoken.model" or path.suffix == ".tiktoken":
        return TiktokenTokenizer(path)
    return SentencePieceTokenizer(path)
