"""`make base`: train the tiny agent base, the model the agentic chain starts from, until it copies.

    python tools/make_base.py                 # train (or resume) runs/tiny_base, export it, check the copy gate
    python tools/make_base.py --ship          # ... and replace the shipped base (models/tiny-agent-base)

A tool-calling agent must copy: file names, words and values from the task into its arguments. A model copies an
arbitrary list it has just read through an induction circuit (a previous-token head feeding a head that attends
to the token after the earlier occurrence of the current one), which small models trained on code alone do not
form in a CPU budget. The base is therefore pretrained on a blend (examples/tiny/base.yaml):
- the Python standard library's code, for the language the agent's transcripts are in;
- open copy rows: a list of 4-15 distinct one-token words, then the same list again from its first word. Lists of
  2-8 words repeated from random starts (the recipe before) left the open copy at 3.3 nats/word after 4M tokens
  and 3.6 after 12.8M: the model learned to predict "a word of the list" (worth ln K nats), and with K <= 8 that
  left too little to gain from following the list. Longer lists formed the induction circuit in about 1M tokens;
- task-family copy rows: the agent task family's own 23 values, lists of 4-15 of them repeated from random starts,
  half written after spaces and half bare (quoted, slashed), as tool calls write them. The model copies this
  closed set first, and the open copy follows it: open rows alone did not form it within 1.7M tokens.
The stage logs the copy probe (tools.copy_eval:copy_probe: both kinds of words) at every evaluation and stops when
both pass with a margin (train.stop_below), so its metrics show where copying forms. It resumes exactly.

Every machine makes the same data: the corpora are encoded with the tokenizer that ships with the base (copied
to data/tiny_base/tokenizer), not one trained on this machine's standard library. Only the code differs, with the
local Python's standard library.

The export (Hugging Face layout: config.json, model.safetensors) carries its tokenizer, the stage config that
made it (recipe.yaml), its metrics, the copy-gate curve and gate.json.
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

from tools.copy_eval import FORMING_NATS, GATE_NATS, LAW_T, OPEN_GATE_NATS, formation_point  # noqa: E402

CONFIG = "examples/tiny/base.yaml"
DATA = Path("data/tiny_base")  # what examples/tiny/base.yaml reads: tokenizer/, stdlib, copy_open, copy_task_family
# Each copy corpus, how its lists repeat and how its rows are written (measured: models/tiny-agent-base/README.md).
# Whole repeats of open words are the probe's own task. The task family's words, a closed set the model learns to
# copy first, repeat from varying starts, and half their rows write them bare, as the agent's tool calls do.
COPY_CORPORA = {"open": (DATA / "copy_open", "whole", ("space",)),
                "task-family": (DATA / "copy_task_family", "shifted", ("space", "space", "quoted", "slash"))}
SHIPPED = ROOT / "models" / "tiny-agent-base"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.vocab")


def shipped_tokenizer(data: Path) -> Path:
    """The shipped base's tokenizer, copied to data/tokenizer for the stage to read, so that every machine encodes
    with the same one. Whatever `data` holds that an earlier tokenizer encoded is removed first."""
    src = SHIPPED / "tokenizer.model"
    if not src.is_file():
        raise FileNotFoundError(f"{src.relative_to(ROOT)} is missing: the base is built with the shipped tokenizer; "
                                f"restore it with `git checkout {SHIPPED.relative_to(ROOT)}`")
    dst = data / "tokenizer"
    if not (dst / "tokenizer.model").is_file() or (dst / "tokenizer.model").read_bytes() != src.read_bytes():
        shutil.rmtree(data, ignore_errors=True)  # derived data only: every corpus in it was encoded by another
        dst.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (SHIPPED / name).is_file():
                shutil.copy2(SHIPPED / name, dst / name)
    return dst


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
                   max_words: int, seed: int, repeat: str = "whole", formats: tuple[str, ...] = ("space",)):
    """Copy rows as documents of `doc_tokens` tokens (+ end of document): a list of K distinct words, K uniform
    in [min_words, max_words], then repeats of it. `whole`: the list again from its first word, as often as the
    row holds; `shifted`: each repeat from a random word of the list (a whole repeat half of the time), so that
    the offset to the earlier occurrence varies. Each row is written in one of `formats` (LIST_FORMATS), drawn
    uniformly: `space` is the words' own tokens after a space; the others write them bare, as tool calls do."""
    if max_words > len(words):
        raise ValueError(f"lists of up to {max_words} distinct words need at least as many words; there are "
                         f"{len(words)}")
    if repeat not in ("whole", "shifted"):
        raise ValueError(f"repeat {repeat!r}: use whole or shifted")
    if not formats or set(formats) - set(LIST_FORMATS):
        raise ValueError(f"formats {list(formats)}: choose from {sorted(LIST_FORMATS)}")
    names = [tokenizer.decode(list(w)).strip() for w in words]
    rng = random.Random(seed)
    for _ in range(n_docs):
        k = rng.randint(min_words, max_words)
        row = rng.sample(range(len(words)), k)
        out = repeat_list(rng, row, repeat, doc_tokens, lambda i: len(words[i]))
        fmt = formats[rng.randrange(len(formats))] if len(formats) > 1 else formats[0]
        if fmt == "space":
            ids = [t for i in out for t in words[i]]
        else:
            ids = tokenizer.encode(LIST_FORMATS[fmt]([names[i] for i in out]))
        yield ids[:doc_tokens] + [tokenizer.eod], 0


def repeat_list(rng: random.Random, row: list, repeat: str, tokens: int, length=len) -> list:
    """`row` and then repeats of it until the items' `length`s sum to `tokens`: `whole` repeats from the first item,
    `shifted` ones from a random item half of the time (copy_documents)."""
    out, k = list(row), len(row)
    while sum(length(item) for item in out) < tokens:
        start = rng.randrange(k - 1) if repeat == "shifted" and rng.random() < 0.5 else 0
        out += row if start == 0 else row[start: start + rng.randint(2, k - start)]
    return out


def copy_conversations(tokenizer, n: int, min_words: int, max_words: int, seed: int) -> list[dict]:
    """Chat records that keep the copy alive through a tool-use SFT: the user lists K distinct words (half the
    records the task family's, half other one-token words) and the assistant repeats the list. Without them the
    agent chain's 300 SFT steps took a base's second copy from 0.47 to 2.81 nats/word on the task family's words
    and from 1.1 to 4.9 on other words; with them, from 0.51 and 0.71 to 0.53 and 1.28. Written after spaces:
    lists also written bare (quoted, slashed) kept the family's copy a little better (0.72 against 1.02 on the
    shipped base) and lost the open copy (2.58 against 1.20)."""
    from tools.copy_eval import default_pool, one_token_words

    family, words = default_pool(), [w for w in one_token_words(tokenizer) if w not in set(default_pool())]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pool = family if i % 2 == 0 else words
        text = " ".join(rng.sample(pool, rng.randint(min_words, min(max_words, len(pool)))))
        out.append({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text}]})
    return out


# How a list is written: its words' own tokens after a space (as the copy probe writes them), or bare after a quote, a
# slash or a newline, as the agent's tool calls write the values they copy (a word after '"' is another token than
# the same word after a space, and the base copies only the tokens its rows showed it copying).
LIST_FORMATS = {"space": lambda ws: " " + " ".join(ws), "quoted": lambda ws: ", ".join(f'"{w}"' for w in ws),
                "slash": lambda ws: "/".join(ws), "lines": lambda ws: "\n".join(ws)}


def write_copy_corpus(prefix: Path, tokenizer, which: str, n_docs: int, doc_tokens: int, min_words: int,
                      max_words: int, seed: int, repeat: str = "whole", formats: tuple[str, ...] = ("space",)) -> dict:
    from tools.preprocess_data import write_indexed_dataset

    what = (f"copy rows of {which} words: {n_docs} x {doc_tokens} tokens, {min_words}-{max_words} words, "
            f"{repeat} repeats, written {'/'.join(formats)}, seed {seed}")
    meta_path = Path(f"{prefix}.meta.json")
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("inputs") == [what]:
        return json.loads(meta_path.read_text())  # made already (the rows are a pure function of these numbers)
    docs = copy_documents(tokenizer, copy_words(tokenizer, which), n_docs, doc_tokens, min_words, max_words, seed,
                          repeat, formats)
    return write_indexed_dataset(prefix, tokenizer, tqdm(docs, total=n_docs, desc=f"{which} copy rows", unit="row"),
                                 [what])


def _run(cmd: list[str], env=None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


def model_card(cfg, gate: dict) -> str:
    """What the shipped directory is, how it was made and what it measured."""
    def point(key):
        step = gate.get(f"{key}_step")
        if step is None:
            return "no evaluation of this run"
        return f"step {step} ({gate[f'{key}_tokens'] / 1e6:.2f}M tokens)"

    overrides = ", ".join(f"{k}: {v}" for k, v in cfg.model.overrides.items()) or "no overrides"
    blend = ", ".join(f"{p} ({w:g})" for p, w in zip(cfg.data.paths, cfg.data.weights or [1] * len(cfg.data.paths)))
    return f"""# tiny-agent-base

The base model of the agentic demo chain (`make demo-agent` starts its tool-use SFT from this directory). Made by
`make base` (tools/make_base.py, stage config `recipe.yaml`), which rebuilds it and checks the copy gate.

- Architecture: `{cfg.model.preset}` ({overrides}); Hugging Face `config.json` and float32
  `model.safetensors`, which transformers' Qwen3-MoE class reads.
- Tokenizer: `tokenizer.model`, the one it was trained with. `make base` encodes every corpus with it, so every
  machine builds the same copy rows (the demo's own tokenizer is trained on the local standard library).
- Data: {cfg.data.seq_length} tokens a row, {gate["tokens_per_step"]:.0f} tokens a step, stopped at step \
{gate["step"]} ({gate["tokens_seen"] / 1e6:.2f}M tokens), from
  {blend}.
- Copy gate (a list of 8 words repeated after itself; nats per word, first -> second copy): the task family's
  words {gate["copy_pool_first"]:.2f} -> {gate["copy_pool_second"]:.2f} (passes under {gate["gate_nats"]:g}); other \
one-token words {gate["copy_open_first"]:.2f} -> {gate["copy_open_second"]:.2f}
  (passes under {gate["open_gate_nats"]:g}): {"pass" if gate["passes"] else "FAIL"}.
- The open copy's formation: its second copy first fell under {FORMING_NATS:g} nats/word at {point("forming")},
  under {GATE_NATS:g} at {point("formed")}. The induction-head law (N = 10^5.7 sqrt(B x C)) predicts \
{gate["law_tokens"] / 1e6:.1f}M tokens at
  this B x C.
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
    gate |= {"gate_nats": GATE_NATS, "open_gate_nats": OPEN_GATE_NATS,
             "passes": gate["copy_pool_second"] < GATE_NATS and gate["copy_open_second"] < OPEN_GATE_NATS,
             "step": last["step"], "tokens_seen": last.get("tokens_seen", 0)}
    per_step = last["tokens_seen"] / last["step"] if last.get("step") else 0
    gate |= {"tokens_per_step": per_step, "law_tokens": LAW_T * per_step ** 0.5}
    for key, below in (("forming", FORMING_NATS), ("formed", GATE_NATS)):  # the open copy's formation points
        row = formation_point(rows, below)
        gate |= {f"{key}_step": row["step"] if row else None, f"{key}_tokens": row["step"] * per_step if row else None}
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
    ap.add_argument("--min-words", type=int, default=4, help="the fewest distinct words in a copy row's list")
    ap.add_argument("--max-words", type=int, default=15,
                    help="the most (lists of 2-8 words left the open copy at 3.3 nats/word after 2M tokens; 4-15 "
                         "formed it within 1M)")
    ap.add_argument("--ship", action="store_true",
                    help=f"replace {SHIPPED.relative_to(ROOT)} with the new base if it copies better (the sum of the "
                         "second copies of the task family's words and of other words)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the stage config, e.g. train.steps=2000")
    args = ap.parse_args(argv)
    from megatron_composer.config import load_config
    from megatron_composer.data.tokenizer import load_tokenizer
    from pretrain.trainer import PretrainConfig

    t0 = time.time()
    py = sys.executable
    seq = load_config(PretrainConfig, str(ROOT / args.config), args.overrides).data.seq_length
    try:
        tokenizer_dir = shipped_tokenizer(ROOT / DATA)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (ROOT / DATA / "stdlib.idx").exists():
        _run([py, "tools/preprocess_data.py", "--input", args.stdlib, "--tokenizer", str(tokenizer_dir),
              "--output-prefix", str(DATA / "stdlib"), "--workers", str(os.cpu_count() or 1)])
    tokenizer = load_tokenizer(str(tokenizer_dir))
    for which, (prefix, repeat, formats) in COPY_CORPORA.items():
        try:
            meta = write_copy_corpus(ROOT / prefix, tokenizer, which, args.copy_docs, args.copy_doc_tokens or seq - 1,
                                     args.min_words, args.max_words, seed=0, repeat=repeat, formats=formats)
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
          f"(< {GATE_NATS:g}); other words {gate['copy_open_first']:.2f} -> {gate['copy_open_second']:.2f} "
          f"(< {OPEN_GATE_NATS:g}): {'pass' if gate['passes'] else 'FAIL'}")
    if args.ship:
        shipped = json.loads((SHIPPED / "gate.json").read_text()) if (SHIPPED / "gate.json").is_file() else None
        cost = lambda g: g["copy_pool_second"] + g["copy_open_second"]  # noqa: E731  (both copies, nats/word)
        if shipped is not None and cost(shipped) <= cost(gate):
            print(f"error: not shipping: the shipped base copies as well or better (second copies "
                  f"{shipped['copy_pool_second']:.2f} + {shipped['copy_open_second']:.2f} nats/word against "
                  f"{gate['copy_pool_second']:.2f} + {gate['copy_open_second']:.2f}); {SHIPPED} is unchanged",
                  file=sys.stderr)
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
