"""Which data makes the tiny base form its copy (induction) circuit: recipes compared on equal token budgets.

    python benchmarks/copy_recipes.py --arms before lists_4_15 whole_4_15 --steps 4000 --jobs 2 --out runs/copy_recipes

Each arm trains a fresh tiny-qwen3-moe (tied embeddings, the base's shape) on 16 rows of 32 tokens a step, rows
drawn from a blend of the standard library's code and copy rows made in memory (the kinds of tools/make_base.py),
with AdamW, warm-up 200 steps and a cosine to 1e-4 over --steps. Every 250 steps it logs the copy probe of
tools/copy_eval.py (a list of 8 words repeated after itself; second copy, nats per word) on the task family's
words and on 512 words the task family never uses (the open copy). The table gives, per arm, the tokens at which
the open copy first fell under 1.5 and under 1 nat/word, the final values, and the baseline arm measured in the
same run. This is a data-recipe probe, so it drives the model and its loss directly, with no checkpoints, data
files or parallel layouts; `make base` trains the chosen recipe with the real trainer.

Arms (the `before` arm is the recipe the base had until the longer lists):
  before        code 0.15, open rows 0.35, task-family rows 0.5; lists of 2-8 words repeated from random starts
  lists_4_15    the same with lists of 4-15 words
  whole_4_15    lists of 4-15; open lists repeated whole from their first word (tools/make_base.py's recipe)
  whole_2_8     open lists repeated whole, lists of 2-8
  open_only     whole open lists of 4-15 only: no code, no task-family rows
  lists_in_code open lists of 4-12 that reappear at a random distance inside code, and task-family rows
  lr_3e-3       `before` with lr 3e-3 (min 3e-4)
  rope_1e4      `before` with rope_theta 1e4 instead of 1e6
  alphabet_64   `before` with open words from 64 of them at first, growing to all by step 3000
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEFORE = {"mix": {"code": 0.15, "open": 0.35, "family": 0.5}, "words": (2, 8), "open_repeat": "shifted"}
ARMS = {
    "before": {},
    "lists_4_15": {"words": (4, 15)},
    "whole_4_15": {"words": (4, 15), "open_repeat": "whole"},
    "whole_2_8": {"open_repeat": "whole"},
    "open_only": {"words": (4, 15), "open_repeat": "whole", "mix": {"open": 1.0}},
    "lists_in_code": {"words": (4, 12), "mix": {"code": 0.15, "in_code": 0.35, "family": 0.5}},
    "lr_3e-3": {"lr": 3e-3},
    "rope_1e4": {"rope_theta": 1e4},
    "alphabet_64": {"alphabet": (64, 3000)},
}


def run_arm(name: str, steps: int, seed: int, out: Path) -> None:
    import torch
    import torch.nn.functional as F

    from megatron_composer.data.tokenizer import load_tokenizer
    from megatron_composer.model.model import Transformer
    from megatron_composer.model.presets import get_preset
    from tools.copy_eval import copy_score, default_pool, one_token_words, open_pool
    from tools.make_base import repeat_list

    arm = BEFORE | ARMS[name]
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(ROOT / "models" / "tiny-agent-base")
    family = [tuple(tok.encode(" " + w)) for w in default_pool()]
    open_ids = [tok.encode(" " + w)[0] for w in one_token_words(tok)]
    rng.shuffle(open_ids)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    random.Random(1).shuffle(files)
    code = []
    for f in files[:1500]:
        try:
            code += tok.encode(Path(f).read_text(encoding="utf-8")) + [tok.eod]
        except (UnicodeDecodeError, OSError):
            continue
    row_len = 33  # 32 inputs and their targets
    lo, hi = arm["words"]

    def open_words(k: int, step: int) -> list[tuple[int, ...]]:
        n = len(open_ids)
        if "alphabet" in arm:
            first, until = arm["alphabet"]
            n = int(first + (n - first) * min(1.0, step / until))
        return [(t,) for t in rng.sample(open_ids[:n], k)]

    def repeated(words: list[tuple[int, ...]], repeat: str) -> list[int]:
        out = repeat_list(rng, words, repeat, row_len - 1)
        return [tok.eod] + [t for w in out for t in w][:row_len - 1]

    def make_row(kind: str, step: int) -> list[int]:
        i = rng.randrange(len(code) - row_len)
        if kind == "code":
            return code[i: i + row_len]
        k = rng.randint(lo, hi)
        if kind == "family":
            return repeated(rng.sample(family, k), "shifted")
        if kind == "open":
            return repeated(open_words(k, step), arm["open_repeat"])
        ws = [t for w in open_words(k, step) for t in w]  # in_code: a list, code, the list again
        gap = rng.randint(0, max(0, row_len - 2 * k - 2))
        pre = rng.randint(0, max(0, row_len - 2 * k - gap - 1))
        filler = code[i: i + 2 * row_len]
        return (filler[:pre] + ws + filler[pre: pre + gap] + ws + filler[pre + gap:])[:row_len]

    cfg = get_preset("tiny-qwen3-moe").replace(tie_word_embeddings=True,
                                               **({"rope_theta": arm["rope_theta"]} if "rope_theta" in arm else {}))
    model = Transformer(cfg)
    lr, min_lr, warmup = arm.get("lr", 1e-3), arm.get("lr", 1e-3) / 10, 200
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    kinds, weights = zip(*arm["mix"].items())
    probe_open = open_pool(tok, exclude=set(default_pool()))
    with open(out, "w") as log:
        for step in range(steps + 1):
            if step % 250 == 0 or step == steps:
                rec = {"arm": name, "step": step, "tokens": step * 16 * 32,
                       "open_second": copy_score(model, tok, probe_open, 8, 32)["second_copy_nats_per_word"],
                       "pool_second": copy_score(model, tok, default_pool(), 8, 32)["second_copy_nats_per_word"]}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                model.train()
            if step == steps:
                break
            x = torch.tensor([make_row(rng.choices(kinds, weights)[0], step) for _ in range(16)])
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
            p = (step - warmup) / max(1, steps - warmup)
            now = (lr * (step + 1) / warmup if step < warmup
                   else min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * p)))
            for g in opt.param_groups:
                g["lr"] = now
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


def table(out: Path, arms: list[str]) -> str:
    lines = ["| arm | open < 1.5 at | open < 1 at | final open | final task family |", "|---|---|---|---|---|"]
    for name in arms:
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        at = lambda b: next((f"{r['tokens'] / 1e6:.2f}M" for r in rows if r["open_second"] < b), "not formed")  # noqa: E731
        lines.append(f"| {name} | {at(1.5)} | {at(1.0)} | {rows[-1]['open_second']:.2f} | "
                     f"{rows[-1]['pool_second']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=["before", "whole_4_15"], help=", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=4000, help="steps per arm (512 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="arms at once (one thread each)")
    ap.add_argument("--out", default="runs/copy_recipes")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # a worker: train this arm
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.arm:
        run_arm(args.arm, args.steps, args.seed, out / f"{args.arm}.jsonl")
        return 0
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        print(f"error: unknown arms {unknown}; choose from {', '.join(ARMS)}", file=sys.stderr)
        return 2
    arms = ["before"] + [a for a in args.arms if a != "before"]  # the baseline, measured in the same run
    out.mkdir(parents=True, exist_ok=True)
    t0, pending, running = time.time(), list(arms), []
    while pending or running:
        while pending and len(running) < args.jobs:
            arm = pending.pop(0)
            running.append(subprocess.Popen([sys.executable, __file__, "--arm", arm, "--steps", str(args.steps),
                                             "--seed", str(args.seed), "--out", str(out)],
                                            env=dict(os.environ, OMP_NUM_THREADS="1")))
        for p in running[:]:
            if p.poll() is not None:
                running.remove(p)
                if p.returncode:
                    print(f"error: arm {p.args[3]} failed (exit {p.returncode})", file=sys.stderr)
                    return 1
                print(f"arm {p.args[3]} done ({(time.time() - t0) / 60:.1f} min)", flush=True)
        time.sleep(1)
    text = table(out, arms)
    (out / "copy_recipes.md").write_text(text + "\n")
    print(f"{args.steps} steps x 512 tokens per arm, seed {args.seed}, {(time.time() - t0) / 60:.1f} min\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
