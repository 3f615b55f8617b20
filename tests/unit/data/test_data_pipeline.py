"""Tokenizer training, preprocessing into indexed datasets, and packed pretraining samples."""

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from megatron_composer.data.pretrain_data import DataConfig, DataError, build_pretrain_datasets, check_indexed_dataset
from megatron_composer.data.tokenizer import TokenizerError, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402


class _Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def _tool(name, *args, capsys=None):
    main = {"train_tokenizer.py": train_tokenizer.main, "preprocess_data.py": preprocess_data.main}[name]
    rc = main([str(a) for a in args])
    return _Result(rc, capsys.readouterr().err if capsys else "")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    r = _tool("train_tokenizer.py", "--input", STDLIB / "json", STDLIB / "email", "--output", d / "tok",
              "--vocab-size", 1024)
    assert r.returncode == 0, r.stderr
    r = _tool("preprocess_data.py", "--input", STDLIB / "json", STDLIB / "email", "--tokenizer", d / "tok",
              "--output-prefix", d / "code", "--workers", 2)
    assert r.returncode == 0, r.stderr
    return d


def test_tokenizer_roundtrip_and_special_tokens(corpus):
    tok = load_tokenizer(corpus / "tok")
    assert tok.vocab_size == 1024
    text = "def f(x):\n    return x  # é 😀 \t\n"
    assert tok.decode(tok.encode(text)) == text  # byte fallback + exact whitespace
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert tok.encode(special) == [tok.special_tokens[special]]
    assert tok.eod not in tok.encode("<|endoftext|> text")  # EOD is a control symbol, never produced from text
    # segments tokenized separately concatenate to the same text (no dummy-prefix spaces)
    assert tok.decode(tok.encode("<|im_start|>user\n") + tok.encode("hi")) == "<|im_start|>user\nhi"
    with pytest.raises(TokenizerError, match="vocab_size"):
        tok.check_fits_model(512)


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "a": 2, "b": 3, "ab": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.eod) == (5, 0)
    assert tok.encode("ab a") == [4, 2]
    assert tok.special_tokens["<|im_start|>"] == 1


def test_preprocess_refuses_overwrite_and_reports_missing(corpus, tmp_path, capsys):
    before = (corpus / "code.bin").read_bytes()
    r = _tool("preprocess_data.py", "--input", STDLIB / "json", "--tokenizer", corpus / "tok",
              "--output-prefix", corpus / "code", capsys=capsys)
    assert r.returncode != 0 and "--overwrite" in r.stderr
    assert (corpus / "code.bin").read_bytes() == before
    r = _tool("preprocess_data.py", "--input", tmp_path / "nope.jsonl", "--tokenizer", corpus / "tok",
              "--output-prefix", tmp_path / "x", capsys=capsys)
    assert r.returncode != 0 and "does not exist" in r.stderr
    assert not list(tmp_path.glob("x*"))


def test_jsonl_input(corpus, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"print({i})\n"}) for i in range(5)) + "\n")
    r = _tool("preprocess_data.py", "--input", src, "--tokenizer", corpus / "tok", "--output-prefix", tmp_path / "j",
              "--workers", 1)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "j.meta.json").read_text())
    assert meta["documents"] == 5
    tok = load_tokenizer(corpus / "tok")
    assert meta["tokens"] == sum(len(tok.encode(f"print({i})\n")) + 1 for i in range(5))


def test_packed_samples_restart_positions_at_documents(corpus, tmp_path):
    tok = load_tokenizer(corpus / "tok")
    cfg = DataConfig(tokenizer=str(corpus / "tok"), paths=[str(corpus / "code")], split="90,10,0", seq_length=64)
    train, valid = build_pretrain_datasets(cfg, tok, 200, 20, seed=3, cache_dir=str(tmp_path / "cache"))
    seen_boundary = False
    for i in range(len(train)):
        s = train[i]
        assert torch.equal(s["labels"][:-1], s["tokens"][1:])
        eods = (s["tokens"] == tok.eod).nonzero().flatten().tolist()
        for e in eods:
            if e + 1 < 64:
                assert s["position_ids"][e + 1] == 0  # next document starts at position 0
                seen_boundary = True
    assert seen_boundary
    # same seed -> same order (cached indices reused), different seed -> different order
    again, _ = build_pretrain_datasets(cfg, tok, 200, 20, seed=3, cache_dir=str(tmp_path / "cache2"))
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(0, 200, 17))
    other, _ = build_pretrain_datasets(cfg, tok, 200, 20, seed=4, cache_dir=str(tmp_path / "cache"))
    assert any(not torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(10))


def test_blend_of_two_sources(corpus, tmp_path):
    tok = load_tokenizer(corpus / "tok")
    cfg = DataConfig(tokenizer="x", paths=[str(corpus / "code"), str(corpus / "code")], weights=[0.7, 0.3],
                     split="90,10,0", seq_length=32)
    train, valid = build_pretrain_datasets(cfg, tok, 100, 10, seed=1, cache_dir=str(tmp_path / "cache"))
    assert len(train) == 100 and len(valid) == 10
    counts = torch.bincount(torch.as_tensor(train.dataset_index[:100].astype("int64")), minlength=2)
    assert counts[0] > counts[1]


def test_missing_and_corrupt_dataset(corpus, tmp_path):
    tok = load_tokenizer(corpus / "tok")
    with pytest.raises(DataError, match="missing"):
        check_indexed_dataset(str(tmp_path / "absent"), tok.vocab_size, tok.eod)
    for suffix in (".bin", ".idx", ".meta.json"):
        (tmp_path / f"bad{suffix}").write_bytes((corpus / f"code{suffix}").read_bytes())
    with open(tmp_path / "bad.bin", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(DataError, match="rebuild"):
        check_indexed_dataset(str(tmp_path / "bad"), tok.vocab_size, tok.eod)
    (tmp_path / "bad.idx").write_bytes(b"garbage" * 10)
    with pytest.raises(DataError, match="corrupt"):
        check_indexed_dataset(str(tmp_path / "bad"), tok.vocab_size, tok.eod)
    with pytest.raises(DataError, match="vocabulary"):
        check_indexed_dataset(str(corpus / "code"), 512, tok.eod)


def test_tiktoken_file_matches_the_bpe_it_was_exported_from(tmp_path):
    """A byte-level BPE exported as a tiktoken rank file (as Kimi K2 ships) tokenizes identically."""
    import base64

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_composer.data.tokenizer import TiktokenTokenizer, _bytes_to_unicode

    pattern = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
    from tokenizers import Regex

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    corpus = [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))]
    hf.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    lines = [f"{base64.b64encode(bytes(inverse[c] for c in tok)).decode()} {i}"
             for tok, i in sorted(hf.get_vocab().items(), key=lambda kv: kv[1])]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = hf.get_vocab_size()
    (tmp_path / "tokenization_demo.py").write_text(f"class T:\n    pat_str = '|'.join({pattern.split('|')!r})\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[EOS]"}, str(n + 1): {"content": "<|im_start|>"}},
        "eos_token": "[EOS]"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == n + 2 and tok.eod == n
    text = 'def decode(self, s):\n    """Return the Python object."""\n    return {"a": 1.5e3}  # ünïcode\n'
    assert tok.encode(text) == hf.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>x")[0] == n + 1
