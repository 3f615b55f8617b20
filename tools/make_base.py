"""`make base`: train the tiny agent base, the model the agentic chain starts from, until it copies.

    python tools/make_base.py                 # train (or resume) runs/tiny_base, export it, check the copy gate
    python tools/make_base.py --ship          # ... and replace the shipped base (models/tiny-agent-base)

A tool-calling agent must copy: file names, words and values from the task into its arguments. A model copies an
arbitrary list it has just read through an induction circuit (a previous-token head feeding a head that attends
to the token after the earlier occurrence of the current one), which small models trained on code alone do not
form in a CPU budget. The base is therefore pretrained on a blend (examples/tiny/base.yaml):
- the Python standard library's code (the demo's corpus), for the language the agent's transcripts are in;
- copy rows: a list of 2..N distinct words, then the same list again and again, each repeat starting at a random
  word of it, so the distance between two occurrences varies and only "the word after the last occurrence of this
  one" predicts the next (not a fixed offset). The words are either the tokenizer's one-token words (open: what
  needs the induction circuit) or the agent task family's own values (a closed set, which the model can learn
  to copy word by word).
The stage logs the copy probe (tools.copy_eval:copy_probe: both kinds of words) at every evaluation and stops when
the gate passes with a margin (train.stop_below), so its metrics show where copying forms. It resumes exactly.

The export (Hugging Face layout: config.json, model.safetensors) carries its tokenizer, the stage config that
made it (recipe.yaml), its metrics, the copy-gate curve and gate.json. The tokenizer ships with the base because the
demo's tokenizer is trained on this machine's standard library, which differs between machines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from tools.copy_eval import GATE_NATS, LAW_T  # noqa: E402

CONFIG = "examples/tiny/base.yaml"
COPY_CORPORA = {"open": "data/tiny_base/copy_open", "task-family": "data/tiny_base/copy_task_family"}
SHIPPED = ROOT / "models" / "tiny-agent-base"


def word_token_ids(tokenizer) -> list[int]:
    """The ids of the tokenizer's one-token words (tools/copy_eval.py: one_token_words): what open copy rows are
    made of, so that a row's text is a plain list of words."""
    from tools.copy_eval import one_token_words

    ids = sorted(tokenizer.encode(" " + w)[0] for w in one_token_words(tokenizer))
    if len(ids) < 64:
        raise ValueError(f"the tokenizer has only {len(ids)} one-token words; copy rows need at least 64")
    return ids


def copy_words(tokenizer, which: str) -> list[tuple[int, ...]]:
    """The words of copy rows, each as its tokens after a space: `open`, the tokenizer's one-token words; or
    `task-family`, the closed set of values the agent task family's tool calls copy (tools/copy_eval.py's pool)."""
    if which == "open":
        return [(i,) for i in word_token_ids(tokenizer)]
    if which == "task-family":
        from tools.copy_eval import default_pool

        return [tuple(tokenizer.encode(" " + w)) for w in default_pool()]
    raise ValueError(f"copy words {which!r}: use open or task-family")


def copy_documents(tokenizer, words: list[tuple[int, ...]], n_docs: int, doc_tokens: int, min_words: int,
                   max_words: int, seed: int):
    """Copy rows as documents of `doc_tokens` tokens (+ end of document): a list of K distinct words, K uniform
    in [min_words, max_words], then repeats of it, each from a random start (a whole repeat half of the time)."""
    if max_words > len(words):
        raise ValueError(f"lists of up to {max_words} distinct words need at least as many words; there are "
                         f"{len(words)}")
    rng = random.Random(seed)
    for _ in range(n_docs):
        k = rng.randint(min_words, max_words)
        row = rng.sample(words, k)
        out = list(row)
        while sum(map(len, out)) < doc_tokens:
            start = rng.randrange(k - 1) if rng.random() < 0.5 else 0
            out += row if start == 0 else row[start: start + rng.randint(2, k - start)]
        ids = [t for word in out for t in word]
        yield ids[:doc_tokens] + [tokenizer.eod], 0


def write_copy_corpus(prefix: Path, tokenizer, which: str, n_docs: int, doc_tokens: int, min_words: int,
                      max_words: int, seed: int) -> dict:
    from tools.preprocess_data import write_indexed_dataset

    what = f"copy rows of {which} words: {n_docs} x {doc_tokens} tokens, {min_words}-{max_words} words, seed {seed}"
    meta_path = Path(f"{prefix}.meta.json")
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("inputs") == [what]:
        return json.loads(meta_path.read_text())  # made already (the rows are a pure function of these numbers)
    docs = copy_documents(tokenizer, copy_words(tokenizer, which), n_docs, doc_tokens, min_words, max_words, seed)
    return write_indexed_dataset(prefix, tokenizer, tqdm(docs, total=n_docs, desc=f"{which} copy rows", unit="row"),
                                 [what])


def _run(cmd: list[str], env=None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


def model_card(cfg, gate: dict) -> str:
    """What the shipped directory is, how it was made and what it measured."""
    formed = "not within this run"
    if gate["formed_step"] is not None:
        formed = f"step {gate['formed_step']} ({gate['formed_tokens'] / 1e6:.2f}M tokens)"
    overrides = ", ".join(f"{k}: {v}" for k, v in cfg.model.overrides.items()) or "no overrides"
    blend = ", ".join(f"{p} ({w:g})" for p, w in zip(cfg.data.paths, cfg.data.weights or [1] * len(cfg.data.paths)))
    return f"""# tiny-agent-base

The base model of the agentic demo chain (`make demo-agent` starts its tool-use SFT from this directory). Made by
`make base` (tools/make_base.py, stage config `recipe.yaml`), which rebuilds it and checks the copy gate.

- Architecture: `{cfg.model.preset}` ({overrides}); Hugging Face `config.json` and float32
  `model.safetensors`, which transformers' Qwen3-MoE class reads.
- Tokenizer: `tokenizer.model`, the one it was trained with. It ships here because the demo's tokenizer is trained
  on the local Python's standard library, which differs between machines.
- Data: {cfg.data.seq_length} tokens a row, {gate["tokens_per_step"]:.0f} tokens a step, stopped at step \
{gate["step"]} ({gate["tokens_seen"] / 1e6:.2f}M tokens), from
  {blend}.
- Copy gate (a list of 8 words repeated after itself; nats per word, first -> second copy; passes under
  {gate["gate_nats"]:g}): the task family's words {gate["copy_pool_first"]:.2f} -> {gate["copy_pool_second"]:.2f}
  ({"pass" if gate["passes"] else "FAIL"}); other one-token words {gate["copy_open_first"]:.2f} -> \
{gate["copy_open_second"]:.2f}.
- The open copy formed (first evaluation under {GATE_NATS:g} nat/word): {formed}. The induction-head law
  (N = 10^5.7 sqrt(B x C)) predicts {gate["law_tokens"] / 1e6:.1f}M tokens at this B x C.
- `metrics.jsonl`: the run's metrics; `copy_gate.png`: the loss and the copy probe against tokens.
"""


def export(run_dir: Path, out: Path, py: str) -> dict:
    """The run's last checkpoint as a Hugging Face directory with its tokenizer, recipe, metrics, curve and gate;
    written beside `out` and renamed into place only when complete."""
    from megatron_composer.config import load_config
    from pretrain.trainer import PretrainConfig
    from tools.copy_eval import copy_probe
    from tools.eval_perplexity import load_hf

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _run([py, "tools/convert_hf.py", "--checkpoint", str(run_dir), "--out", str(tmp), "--dtype", "float32"])
    cfg = load_config(PretrainConfig, run_dir / "config.yaml")
    tok = Path(cfg.data.tokenizer)
    for f in (tok.iterdir() if tok.is_dir() else [tok]):
        shutil.copy2(f, tmp / f.name)
    shutil.copy2(run_dir / "config.yaml", tmp / "recipe.yaml")
    shutil.copy2(run_dir / "metrics.jsonl", tmp / "metrics.jsonl")
    model, tokenizer, _ = load_hf(str(tmp))
    gate = copy_probe(model, tokenizer)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "copy_pool_second" in r][-1]
    gate |= {"gate_nats": GATE_NATS, "passes": gate["copy_pool_second"] < GATE_NATS,
             "step": last["step"], "tokens_seen": last.get("tokens_seen", 0)}
    per_step = last["tokens_seen"] / last["step"] if last.get("step") else 0
    formed = next((r for r in rows if r.get("copy_open_second", GATE_NATS) < GATE_NATS), None)
    gate |= {"tokens_per_step": per_step, "law_tokens": LAW_T * per_step ** 0.5,
             "formed_step": formed["step"] if formed else None,
             "formed_tokens": formed["step"] * per_step if formed else None}
    (tmp / "gate.json").write_text(json.dumps(gate, indent=2) + "\n")
    (tmp / "README.md").write_text(model_card(cfg, gate))
    subprocess.run([py, "tools/plot_metrics.py", str(run_dir), "--output", str(tmp / "copy_gate.png")], cwd=ROOT,
                   check=True, capture_output=True)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return gate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--run-dir", default="runs/tiny_base")
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks (sharing the cores); at 512 tokens a step one rank is the fastest on CPUs")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the code corpus (.py files)")
    ap.add_argument("--copy-docs", type=int, default=400_000, help="copy rows in the copy corpus")
    ap.add_argument("--copy-doc-tokens", type=int, default=0,
                    help="tokens per copy row before its end token (0: the stage's data.seq_length - 1, so that a "
                         "training row is one copy row)")
    ap.add_argument("--min-words", type=int, default=2)
    ap.add_argument("--max-words", type=int, default=8)
    ap.add_argument("--ship", action="store_true",
                    help=f"replace {SHIPPED.relative_to(ROOT)} with the new base if it copies better (the gate's "
                         "second copy of the task family's words)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the stage config, e.g. train.steps=2000")
    args = ap.parse_args(argv)
    from megatron_composer.data.tokenizer import load_tokenizer
    from tools.demo import code_corpus

    t0 = time.time()
    py = sys.executable
    data = Path("data/tiny")  # the demo's tokenizer and code corpus, which examples/tiny/base.yaml reads
    code_corpus(py, Path(args.stdlib), ROOT / data, 4096, args.nproc)
    from megatron_composer.config import load_config
    from pretrain.trainer import PretrainConfig

    seq = load_config(PretrainConfig, str(ROOT / args.config), args.overrides).data.seq_length
    tokenizer = load_tokenizer(str(ROOT / data / "tokenizer"))
    for which, prefix in COPY_CORPORA.items():  # examples/tiny/base.yaml reads them there
        try:
            meta = write_copy_corpus(ROOT / prefix, tokenizer, which, args.copy_docs, args.copy_doc_tokens or seq - 1,
                                     args.min_words, args.max_words, seed=0)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{which} copy rows: {meta['documents']} ({meta['tokens']} tokens) in {prefix}")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    _run([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
          "pretrain_composer.py", "--config", args.config, f"run.dir={args.run_dir}", *args.overrides], env)
    run_dir = ROOT / args.run_dir
    gate = export(run_dir, run_dir / "base", py)
    print(f"\nbase: {run_dir / 'base'} after {gate['step']} steps ({gate['tokens_seen'] / 1e6:.2f}M tokens), "
          f"{(time.time() - t0) / 60:.1f} min")
    print(f"copy gate: task-family words {gate['copy_pool_first']:.2f} -> {gate['copy_pool_second']:.2f} nats/word "
          f"(gate < {GATE_NATS:g}: {'pass' if gate['passes'] else 'FAIL'}); other words "
          f"{gate['copy_open_first']:.2f} -> {gate['copy_open_second']:.2f}")
    if args.ship:
        shipped = json.loads((SHIPPED / "gate.json").read_text()) if (SHIPPED / "gate.json").is_file() else None
        if shipped is not None and shipped["copy_pool_second"] <= gate["copy_pool_second"]:
            print(f"error: not shipping: the shipped base copies as well or better (second copy "
                  f"{shipped['copy_pool_second']:.2f} nats/word); {SHIPPED} is unchanged", file=sys.stderr)
            return 1
        tmp = SHIPPED.with_name(SHIPPED.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(run_dir / "base", tmp)
        if SHIPPED.exists():
            shutil.rmtree(SHIPPED)
        os.replace(tmp, SHIPPED)
        print(f"shipped: {SHIPPED}")
    return 0 if gate["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
