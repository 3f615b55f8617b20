"""The tiny agent base (tools/make_base.py, `make base`): its copy rows, and the shipped base that the agentic chain
starts from (models/tiny-agent-base): it copies, it carries its tokenizer and recipe, and transformers reads it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
BASE = ROOT / "models" / "tiny-agent-base"


@pytest.fixture(scope="module")
def base_tokenizer():
    from megatron_composer.data.tokenizer import load_tokenizer

    return load_tokenizer(BASE)


@pytest.mark.parametrize("which", ["open", "task-family"])
def test_copy_rows_repeat_one_list_of_distinct_words_from_varying_starts(base_tokenizer, which):
    from tools.copy_eval import default_pool
    from tools.make_base import copy_documents, copy_words

    words = copy_words(base_tokenizer, which)
    if which == "task-family":
        assert sorted(base_tokenizer.decode(list(w)).strip() for w in words) == sorted(default_pool())
    docs = [ids for ids, _ in copy_documents(base_tokenizer, words, 300, 47, 2, 8, seed=3, repeat="shifted")]
    assert docs == [ids for ids, _ in copy_documents(base_tokenizer, words, 300, 47, 2, 8, seed=3,
                                                     repeat="shifted")]  # pure
    by_first = {w[0]: w for w in words}
    assert len(by_first) == len(words)  # a word is known by its first token
    starts, sizes = set(), set()
    for ids in docs:
        assert len(ids) == 48 and ids[-1] == base_tokenizer.eod
        body, seq = ids[:-1], []
        while body and body[0] in by_first and tuple(body[:len(by_first[body[0]])]) == by_first[body[0]]:
            seq.append(by_first[body[0]])  # the row as words (the last one may be cut at the row's end)
            body = body[len(by_first[body[0]]):]
        assert len(body) < max(map(len, words))  # nothing but words, up to a cut last word
        k = next(i for i in range(1, len(seq) + 1) if i == len(seq) or seq[i] in seq[:i])  # the first list
        row = seq[:k]
        sizes.add(k)
        assert len(set(row)) == k and 2 <= k <= 8
        nxt = dict(zip(row, row[1:]))
        i = k
        while i < len(seq):  # every later word continues a run of the list or restarts one
            starts.add(row.index(seq[i]))
            j = i + 1
            while j < len(seq) and nxt.get(seq[j - 1]) == seq[j]:
                j += 1
            i = j
    assert sizes == set(range(2, 9)) and len(starts) >= 6  # repeats start at many places, not at one offset


def test_whole_repeats_are_the_list_again_from_its_first_word(base_tokenizer):
    from tools.make_base import copy_documents, copy_words

    words = copy_words(base_tokenizer, "open")
    sizes = set()
    for ids, _ in copy_documents(base_tokenizer, words, 200, 31, 4, 15, seed=1):
        assert len(ids) == 32 and ids[-1] == base_tokenizer.eod
        body = ids[:-1]
        k = next(i for i in range(1, len(body) + 1) if i == len(body) or body[i] in body[:i])
        assert len(set(body[:k])) == k and 4 <= k <= 15
        assert body == (body[:k] * (len(body) // k + 1))[:len(body)]  # the list, then itself again from the start
        sizes.add(k)
    assert sizes == set(range(4, 16))
    with pytest.raises(ValueError, match="repeat 'sideways': use whole or shifted"):
        next(copy_documents(base_tokenizer, words, 1, 31, 4, 15, seed=1, repeat="sideways"))


def test_rows_written_bare_hold_the_same_lists_as_tool_calls_write_them(base_tokenizer):
    """The task family's rows are written after a space, or bare (quoted, slashed), as the agent's tool calls write
    the values they copy; a bare word is other tokens than the word after a space."""
    from tools.make_base import LIST_FORMATS, copy_documents, copy_words

    words = copy_words(base_tokenizer, "task-family")
    names = {base_tokenizer.decode(list(w)).strip() for w in words}
    seen = set()
    for ids, _ in copy_documents(base_tokenizer, words, 300, 31, 4, 15, seed=2, repeat="shifted",
                                 formats=("space", "quoted", "slash")):
        assert len(ids) == 32 and ids[-1] == base_tokenizer.eod
        text = base_tokenizer.decode(ids[:-1])
        if text.startswith('"'):
            kind, parts = "quoted", [w.strip().strip('"') for w in text.split(",")]
        elif "/" in text:
            kind, parts = "slash", text.split("/")
        else:
            kind, parts = "space", text.split()
        seen.add(kind)
        assert set(parts[:-1]) <= names  # every word but a cut last one is one of the family's
    assert seen == {"space", "quoted", "slash"}
    quoted = base_tokenizer.encode(LIST_FORMATS["quoted"](["event", "tree"]))
    assert base_tokenizer.encode('"event"')[1:2] == quoted[1:2] != base_tokenizer.encode(" event")[:1]
    with pytest.raises(ValueError, match=r"formats \['sideways'\]: choose from \['lines', 'quoted', 'slash', "):
        next(copy_documents(base_tokenizer, words, 1, 31, 4, 15, seed=1, formats=("sideways",)))


def test_a_tokenizer_with_too_few_words_is_refused(rl_assets):
    from megatron_composer.data.tokenizer import load_tokenizer
    from tools.make_base import word_token_ids

    with pytest.raises(ValueError, match="one-token words; copy rows need at least 64"):
        word_token_ids(load_tokenizer(rl_assets / "tok"))
    from tools.make_base import copy_documents

    with pytest.raises(ValueError, match="lists of up to 8 distinct words need at least as many words; there are 3"):
        next(copy_documents(load_tokenizer(rl_assets / "tok"), [(5,), (6,), (7,)], 1, 16, 2, 8, seed=0))


def test_the_copy_corpus_is_reused_only_for_the_same_numbers(base_tokenizer, tmp_path):
    from tools.make_base import write_copy_corpus

    prefix = tmp_path / "copy"
    first = write_copy_corpus(prefix, base_tokenizer, "open", 50, 31, 2, 6, seed=0)
    stamp = Path(f"{prefix}.bin").stat().st_mtime_ns
    assert write_copy_corpus(prefix, base_tokenizer, "open", 50, 31, 2, 6, seed=0) == first
    assert Path(f"{prefix}.bin").stat().st_mtime_ns == stamp
    other = write_copy_corpus(prefix, base_tokenizer, "open", 60, 31, 2, 6, seed=0)
    assert other["documents"] == 60 and other["tokens"] == 60 * 32


def test_the_base_is_built_with_the_shipped_tokenizer_on_every_machine(tmp_path, monkeypatch):
    """make base encodes its corpora with the tokenizer that ships with the base (not one trained on this machine's
    standard library); corpora an earlier tokenizer encoded are removed, and a missing one is named."""
    from tools import make_base

    data = tmp_path / "data"
    tok = make_base.shipped_tokenizer(data)
    assert (tok / "tokenizer.model").read_bytes() == (BASE / "tokenizer.model").read_bytes()
    (data / "stdlib.idx").write_text("encoded by this tokenizer")
    assert make_base.shipped_tokenizer(data) == tok and (data / "stdlib.idx").exists()  # kept: same tokenizer
    (tok / "tokenizer.model").write_bytes(b"another machine's tokenizer")
    make_base.shipped_tokenizer(data)
    assert not (data / "stdlib.idx").exists()
    assert (tok / "tokenizer.model").read_bytes() == (BASE / "tokenizer.model").read_bytes()
    monkeypatch.setattr(make_base, "SHIPPED", tmp_path / "models" / "gone")
    monkeypatch.setattr(make_base, "ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match="models/gone/tokenizer.model is missing.*git checkout models/gone"):
        make_base.shipped_tokenizer(data)


def test_the_shipped_base_measures_what_its_gate_file_says(base_tokenizer):
    """The copy probe on the shipped weights gives the numbers gate.json and the model card state, and its verdict:
    the base copies the task family's words (< 1 nat per word on the second copy) and words the task family never
    uses (< 1.5: the open copy, an induction circuit)."""
    from tools.copy_eval import GATE_NATS, OPEN_GATE_NATS, copy_probe
    from tools.eval_perplexity import load_hf

    gate = json.loads((BASE / "gate.json").read_text())
    model, tokenizer, _ = load_hf(str(BASE))
    probe = copy_probe(model, tokenizer)
    for key, value in probe.items():
        assert value == pytest.approx(gate[key], abs=1e-3), key
    assert gate["passes"] == (probe["copy_pool_second"] < GATE_NATS and probe["copy_open_second"] < OPEN_GATE_NATS)
    assert gate["passes"] and gate["formed_step"] is not None and gate["forming_step"] <= gate["formed_step"]
    card = (BASE / "README.md").read_text()
    assert f"{gate['copy_pool_first']:.2f} -> {gate['copy_pool_second']:.2f}" in card
    assert f"{gate['copy_open_first']:.2f} -> {gate['copy_open_second']:.2f}" in card


def test_copy_eval_reports_both_gates_of_a_model(tmp_path):
    """`python tools/copy_eval.py --hf DIR`: the task family's words and words it never uses, each with its gate."""
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "tools" / "copy_eval.py"), "--hf", str(BASE), "--trials", "16",
                          "--json"], capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["pool"] == 23 and result["gate"] == 1.0 and result["open"]["pool"] == 512
    assert result["open"]["gate"] == 1.5 and result["passes"] and result["open"]["passes"]
    assert result["open"]["first_copy_nats_per_word"] > result["open"]["second_copy_nats_per_word"] + 5


def test_the_shipped_base_is_what_the_agent_chain_configures_and_transformers_reads_it():
    """The agentic chain's SFT and RL configs name the base's architecture and tokenizer; its recipe is a stage
    config; transformers' Qwen3-MoE class computes the same logits from the files."""
    transformers = pytest.importorskip("transformers")
    from megatron_composer.checkpoint.hf import HFReader
    from megatron_composer.config import load_config
    from megatron_composer.training.config import model_config
    from pretrain.trainer import PretrainConfig
    from rl.config import RLConfig
    from tools.eval_perplexity import load_hf

    recipe = load_config(PretrainConfig, BASE / "recipe.yaml")
    assert recipe.train.eval_hooks == ["tools.copy_eval:copy_probe"]
    shipped = HFReader(str(BASE)).config
    sft = load_config(PretrainConfig, ROOT / "examples/tiny/agent/sft.yaml")
    rl = load_config(RLConfig, ROOT / "examples/tiny/rl_agent.yaml")
    assert sft.checkpoint.init_from == rl.data.tokenizer == sft.data.tokenizer == "models/tiny-agent-base"
    from megatron_composer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(BASE)
    for cfg in (sft, rl):
        assert model_config(cfg, tok) == shipped
    ours, _, _ = load_hf(str(BASE))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32).eval()
    ids = torch.randint(3, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=2e-4, rtol=1e-4)


def test_the_agent_chain_without_its_base_stops_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    import argparse
    import time

    from tools import demo

    monkeypatch.setattr(demo, "AGENT_BASE", tmp_path / "gone")
    args = argparse.Namespace(run_dir=str(tmp_path / "run"), nproc=1, overrides=[])
    assert demo.agent_chain(args, sys.executable, time.time()) == 1
    err = capsys.readouterr().err
    assert "the tiny agent base" in err and "make base" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
