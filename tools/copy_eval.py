"""Word-copy evaluation: can a checkpoint repeat a list it has just read (an induction / copy circuit)?

    python tools/copy_eval.py --checkpoint runs/tiny/pretrain
    python tools/copy_eval.py --checkpoint runs/tiny/sft/checkpoints/step_400 --words 6 --trials 128
    python tools/copy_eval.py --hf /path/to/hf_model --pool alpha,beta,gamma,delta,epsilon,zeta,eta,theta

Each trial samples --words distinct words from the pool (default: the agent task family's names, folders and
words, the values its tool calls must copy) and scores the text " w1 w2 ... wN w1 w2 ... wN": per word, the
summed loss of its tokens, in nats. The first copy is what the model guesses without anything to copy (about
log(pool size) for a uniform guess); the second copy is what it pays with the list in front of it. A model
that copies pays well under 1 nat per word on the second copy; the gate is that figure below --gate. Without
--pool the same test also runs on 512 one-token words the task family never uses (the open copy, which only an
induction circuit does; its gate is --open-gate).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GATE_NATS = 1.0
FORMING_NATS = 1.5  # an open second copy under this: the induction circuit is forming (formation points)
OPEN_GATE_NATS = FORMING_NATS  # the base's gate on words the task family never uses
LAW_T = 10 ** 5.7  # induction heads form after about T x sqrt(B x C) tokens (Aoyama, Wilcox and Schneider, 2025)


def formation_point(rows: list[dict], below: float) -> dict | None:
    """The first logged evaluation (a metrics row) whose open second copy is under `below` nats/word, or None."""
    return next((r for r in rows if r.get("copy_open_second", below) < below), None)


def default_pool() -> list[str]:
    from tools.task_family import FOLDERS, MODULES, NAMES, WORDS

    return sorted(set(NAMES) | set(FOLDERS) | set(WORDS) | set(MODULES))


def one_token_words(tokenizer) -> list[str]:
    """The alphabetic vocabulary entries of 3+ letters that the tokenizer writes as one token after a space."""
    words = set()
    for i in range(tokenizer.vocab_size):
        w = tokenizer.decode([i]).strip()
        if len(w) >= 3 and w.isascii() and w.isalpha() and len(tokenizer.encode(" " + w)) == 1:
            words.add(w)
    return sorted(words)


def open_pool(tokenizer, exclude: set[str] = frozenset(), size: int = 512) -> list[str]:
    """Words the model has no closed-set reason to copy: one-token words outside `exclude`, a deterministic
    spread of `size` over the vocabulary."""
    words = [w for w in one_token_words(tokenizer) if w not in exclude]
    return words[:: max(1, len(words) // size)][:size]


def word_spans(tokenizer, words: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of " w1 w2 ... wN w1 ... wN" and, per word occurrence, its [start, end) token span (each word
    with its leading space is tokenized as the whole text tokenizes it: spans come from encoding prefixes). The
    first word has its space too: a word at the very start of a text is other tokens for most tokenizers, and its
    second occurrence would then have nothing to be copied from."""
    text, ends = "", []
    for w in words + words:
        text += " " + w
        ends.append(len(tokenizer.encode(text)))
    ids = tokenizer.encode(text)
    if ends[-1] != len(ids):
        raise ValueError("the tokenizer merges across words; choose other pool words")
    starts = [0] + ends[:-1]
    return ids, list(zip(starts, ends))


@torch.no_grad()
def copy_score(model, tokenizer, pool: list[str], n_words: int = 8, trials: int = 64, seed: int = 0) -> dict:
    """Mean nats per word on the first and on the second copy of a list of `n_words` pool words."""
    if n_words > len(pool) or n_words < 1:
        raise ValueError(f"--words {n_words} must be between 1 and the pool's {len(pool)} words")
    model.eval()
    rng = random.Random(seed)
    first, second = [], []
    for _ in range(trials):
        words = rng.sample(pool, n_words)
        ids, spans = word_spans(tokenizer, words)
        x = torch.tensor([tokenizer.eod] + ids)[None]  # as a document starts in the pretraining stream
        out = model(x[:, :-1])
        logits = out.logits if hasattr(out, "logits") else out
        nll = F.cross_entropy(logits[0].float(), x[0, 1:], reduction="none")  # nll[i]: loss of ids[i]
        per_word = [float(nll[a:b].sum()) for a, b in spans]
        first += per_word[:n_words]
        second += per_word[n_words:]
    return {"words": n_words, "trials": trials, "pool": len(pool),
            "first_copy_nats_per_word": sum(first) / len(first),
            "second_copy_nats_per_word": sum(second) / len(second)}


def copy_probe(model, tokenizer) -> dict:
    """A training-time probe (train.eval_hooks: tools.copy_eval:copy_probe): the gate on the task family's words
    (copy_pool_*) and the same test on words outside it (copy_open_*, the open copy an induction circuit does)."""
    pool = default_pool()
    key = getattr(tokenizer, "path", id(tokenizer))
    if key not in _OPEN_POOLS:
        _OPEN_POOLS[key] = open_pool(tokenizer, exclude=set(pool))
    out = {}
    for name, words in (("pool", pool), ("open", _OPEN_POOLS[key])):
        r = copy_score(model, tokenizer, words, n_words=8, trials=32)
        out[f"copy_{name}_first"] = r["first_copy_nats_per_word"]
        out[f"copy_{name}_second"] = r["second_copy_nats_per_word"]
    return out


_OPEN_POOLS: dict = {}


def main() -> int:
    from megatron_composer.checkpoint.dcp import CheckpointError
    from megatron_composer.config import ConfigError
    from megatron_composer.data.tokenizer import TokenizerError
    from tools.eval_perplexity import load_hf, load_ours

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="one of our run directories (its latest checkpoint) or a checkpoint in one")
    src.add_argument("--hf", help="a Hugging Face model directory")
    ap.add_argument("--pool", help="comma-separated words (default: the agent task family's values)")
    ap.add_argument("--words", type=int, default=8, help="words per list")
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gate", type=float, default=GATE_NATS, help="pass when the second copy costs less (nats/word)")
    ap.add_argument("--open-gate", type=float, default=OPEN_GATE_NATS,
                    help="without --pool: the same test on words the task family never uses passes under this")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    pool = [w for w in args.pool.split(",") if w] if args.pool else default_pool()
    try:
        model, tokenizer, where = load_ours(args.checkpoint) if args.checkpoint else load_hf(args.hf)
        result = copy_score(model, tokenizer, pool, args.words, args.trials, args.seed)
        other = None if args.pool else copy_score(model, tokenizer, open_pool(tokenizer, exclude=set(pool)),
                                                  args.words, args.trials, args.seed)
    except (CheckpointError, ConfigError, TokenizerError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result |= {"checkpoint": where, "gate": args.gate, "passes": result["second_copy_nats_per_word"] < args.gate}
    if other is not None:  # the open copy: an induction circuit, not a closed set learned word by word
        result["open"] = other | {"gate": args.open_gate,
                                  "passes": other["second_copy_nats_per_word"] < args.open_gate}
    if args.json:
        print(json.dumps(result))
        return 0
    rows = [("the task family's words" if not args.pool else "the given words", result)]
    rows += [("words the task family never uses", result["open"])] if other is not None else []
    for what, r in rows:
        print(f"{where}: {args.words} words from a pool of {r['pool']} ({what}), {args.trials} trials: first copy "
              f"{r['first_copy_nats_per_word']:.2f} nats/word, second copy {r['second_copy_nats_per_word']:.2f} "
              f"nats/word (gate < {r['gate']:g}: {'pass' if r['passes'] else 'FAIL'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
