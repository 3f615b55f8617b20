"""Pretraining loss against reward after RL (the report's Figure 2), at tiny scale: one command, the plot and table.

    python tools/loss_to_reward.py --budgets 0.125,0.25,0.5,1 --seeds 3 --jobs 2 --out runs/loss_to_reward

Run after `make demo` (it reads the demo's data under data/tiny). For each budget, a fraction of the pretraining
stage's ``train.steps`` (its warmup scaled with it, its own cosine schedule to the end), the chain runs from scratch
in ``<out>/budget<steps>/``:

1. pretraining (examples/tiny/pretrain.yaml) on ``--nproc`` ranks, evaluated once at its last step on
   ``--eval-samples`` held-out sequences (the validation split: the same documents for every budget). That
   validation loss (nats/token) is the budget's x;
2. the same long-context stage and the same SFT (examples/tiny/{long_context,sft}.yaml; ``--sft-overrides``
   change the SFT alike for every budget, e.g. a shorter ``train.steps``);
3. the same RL (examples/tiny/rl.yaml with its held-out evaluation, ``--rl-overrides`` for every run) with
   ``--seeds`` seeds. The final verifier reward (mean of the last ``--final-steps`` steps) and the held-out pass@1
   of the last evaluation are the budget's y, as means with 95% bootstrap intervals over seeds.

Written to ``<out>``: ``loss_to_reward.md`` / ``.csv`` (budgets, CPT losses, rewards with intervals, the least-
squares trend of each y on x, Spearman's rank correlation and whether the means are monotone: lower loss, higher
reward, as the report claims) and ``loss_to_reward.png``. Finished stages and runs are reused; an interrupted one
resumes. ``--report-only`` tabulates what exists.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.ablate import eval_rows, read_rows, run_one, seed_values, train_rows, write_csv  # noqa: E402
from tools.intervals import RESAMPLES, mean_interval  # noqa: E402

PRETRAIN, LONG_CONTEXT, SFT = "examples/tiny/pretrain.yaml", "examples/tiny/long_context.yaml", "examples/tiny/sft.yaml"
RL = "examples/tiny/rl.yaml"
YS = (("verifier_reward", "final verifier reward"), ("heldout_pass1", "held-out pass@1"))


def pretrain_config(root: Path):
    from megatron_composer.config import load_config
    from pretrain.trainer import PretrainConfig

    return load_config(PretrainConfig, str(root / PRETRAIN), [])


def budget_steps(cfg, fractions: list[float]) -> list[tuple[int, int]]:
    """(steps, warmup steps) of each budget: fractions of the stage's steps, warmup scaled alike (at least 1)."""
    out = []
    for f in fractions:
        steps = max(1, round(cfg.train.steps * f))
        out.append((steps, max(1, min(steps - 1, round(cfg.optim.warmup_steps * f))) if steps > 1 else 0))
    return out


def _stage(cmd_args: list[str], nproc: int, log: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "pretrain_composer.py"), "--config", *cmd_args]
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"error: {' '.join(cmd_args[:2])} failed (rc {rc}); see {log}")


def run_chain(budget_dir: Path, steps: int, warmup: int, args) -> None:
    """Pretraining of `steps` steps, then the long-context stage and the SFT, each continued from the last."""
    budget_dir.mkdir(parents=True, exist_ok=True)
    stages = [
        ("pretrain", [PRETRAIN, f"train.steps={steps}", f"optim.warmup_steps={warmup}", "train.eval_interval=0",
                      f"train.eval_samples={args.eval_samples}", "checkpoint.keep_last=1"]),
        ("long_context", [LONG_CONTEXT, f"checkpoint.init_from={budget_dir / 'pretrain'}"]),
        ("sft", [SFT, f"checkpoint.init_from={budget_dir / 'long_context'}", *args.sft_overrides]),
    ]
    for name, cmd_args in stages:
        run_dir = budget_dir / name
        if (run_dir / "done").is_file():
            continue
        print(f"{budget_dir.name}: {name} ...", flush=True)
        _stage([*cmd_args, f"run.dir={run_dir}"], args.nproc, budget_dir / f"{name}.log")
        (run_dir / "done").write_text("ok\n")


def cpt_loss(budget_dir: Path) -> float | None:
    """The pretraining stage's validation loss at its last step (nats/token on the held-out split)."""
    path = budget_dir / "pretrain" / "metrics.jsonl"
    if not path.is_file():
        return None
    vals = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "val_loss" in row:
            vals.append(row)
    return float(vals[-1]["val_loss"]) if vals else None


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    return pearson(rx, ry)


def pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")
    return my - slope * mx, slope


def summarise(points: list[dict]) -> dict:
    """Per y: the trend over the budgets' means, Spearman's rho, and monotonicity (lower loss -> higher y)."""
    out = {}
    for key, _ in YS:
        pts = sorted((p["cpt_loss"], p[key].mean) for p in points
                     if p["cpt_loss"] is not None and p[key].n > 0 and math.isfinite(p[key].mean))
        if len(pts) < 2:
            out[key] = None
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        intercept, slope = fit_line(xs, ys)
        monotone = all(ys[i] > ys[i + 1] for i in range(len(ys) - 1))  # xs ascending: y must fall
        low, high = slope_interval(points, key)
        out[key] = {"intercept": intercept, "slope": slope, "slope_low": low, "slope_high": high,
                    "spearman": spearman(xs, ys), "monotone": monotone, "points": len(pts)}
    return out


def slope_interval(points: list[dict], key: str, level: float = 0.95, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the trend's slope: each budget's seeds resampled on their own, the line refitted."""
    groups = [(p["cpt_loss"], [v for v in p["per_seed"].get(key, []) if v is not None and math.isfinite(v)])
              for p in points if p["cpt_loss"] is not None]
    groups = [(x, vs) for x, vs in groups if vs]
    if len(groups) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    xs = [x for x, _ in groups]
    slopes = sorted(fit_line(xs, [sum(rng.choice(vs) for _ in vs) / len(vs) for _, vs in groups])[1]
                    for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return slopes[int(tail * resamples)], slopes[min(resamples - 1, int((1.0 - tail) * resamples))]


def collect(out: Path, budgets: list[tuple[int, int]], fractions: list[float], seeds: int,
            final_steps: int) -> list[dict]:
    points = []
    for (steps, _), frac in zip(budgets, fractions):
        budget_dir = out / f"budget{steps}"
        per_seed: dict[str, list] = {}
        runs = []
        for s in range(1, seeds + 1):
            run = budget_dir / "rl" / f"seed{s}"
            rows = read_rows(run) if (run / "done").is_file() else []
            if train_rows(rows):
                runs.append(rows)
                for k, v in seed_values(rows, final_steps).items():
                    per_seed.setdefault(k, []).append(v)
        point = {"fraction": frac, "steps": steps, "cpt_loss": cpt_loss(budget_dir), "seeds": len(runs),
                 "per_seed": per_seed}
        for key in ("verifier_reward", "heldout_start", "heldout_pass1"):
            point[key] = mean_interval(per_seed.get(key, []))
        points.append(point)
    return points


def write_report(points: list[dict], trends: dict, out: Path, tokens_per_step: int) -> None:
    rows = []
    for p in points:
        row = {"fraction": p["fraction"], "steps": p["steps"], "tokens": p["steps"] * tokens_per_step,
               "cpt_loss": p["cpt_loss"], "seeds": p["seeds"]}
        for key in ("heldout_start", "verifier_reward", "heldout_pass1"):
            row.update(p[key].columns(key))
        row["per_seed"] = json.dumps(p["per_seed"])
        rows.append(row)
    write_csv(out / "loss_to_reward.csv", rows)
    lines = ["| budget | pretraining steps | tokens | CPT held-out loss | RL seeds | held-out pass@1 after SFT | "
             "final verifier reward | held-out pass@1 after RL |", "|" + "---|" * 8]
    for p in points:
        loss = f"{p['cpt_loss']:.4f}" if p["cpt_loss"] is not None else "n/a"
        lines.append(f"| {p['fraction']:g} | {p['steps']} | {p['steps'] * tokens_per_step:,} | {loss} | {p['seeds']} | "
                     f"{p['heldout_start']} | {p['verifier_reward']} | {p['heldout_pass1']} |")
    lines += ["", "mean over RL seeds [95% percentile-bootstrap interval over seeds]; CPT loss: the pretraining "
              "stage's validation loss at its last step (nats/token, the same held-out documents for every budget).",
              ""]
    for key, label in YS:
        t = trends.get(key)
        if t is None:
            lines.append(f"- {label}: fewer than 2 budgets with runs; no trend")
            continue
        lines.append(f"- {label} = {t['intercept']:.3f} {'+' if t['slope'] >= 0 else '-'} {abs(t['slope']):.3f} x "
                     f"CPT loss (least squares over {t['points']} budgets' means; slope 95% interval "
                     f"[{t['slope_low']:.3f}, {t['slope_high']:.3f}], seeds resampled within budgets); Spearman rho "
                     f"{t['spearman']:.2f}; monotone (lower loss, higher reward at every budget): "
                     f"{'yes' if t['monotone'] else 'no'}")
    (out / "loss_to_reward.md").write_text("\n".join(lines) + "\n")


def plot(points: list[dict], trends: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(YS), figsize=(6 * len(YS), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], YS):
        pts = [p for p in points if p["cpt_loss"] is not None and p[key].n > 0]
        for p in pts:
            iv = p[key]
            ax.errorbar([p["cpt_loss"]], [iv.mean], yerr=[[iv.mean - iv.low], [iv.high - iv.mean]], marker="o",
                        capsize=4, color="C0")
            ax.annotate(f"{p['fraction']:g}x", (p["cpt_loss"], iv.mean), textcoords="offset points", xytext=(6, 4),
                        fontsize=8)
            ax.scatter([p["cpt_loss"]] * len(p["per_seed"].get(key, [])),
                       [v for v in p["per_seed"].get(key, [])], s=8, color="C0", alpha=0.3)
        t = trends.get(key)
        if t is not None and pts:
            xs = [min(p["cpt_loss"] for p in pts), max(p["cpt_loss"] for p in pts)]
            ax.plot(xs, [t["intercept"] + t["slope"] * x for x in xs], "--", color="C1",
                    label=f"least squares (slope {t['slope']:.3f}, rho {t['spearman']:.2f})")
            ax.legend(fontsize=8)
        ax.set_xlabel("continued-pretraining loss on held-out code (nats/token)")
        ax.set_ylabel(f"{label} after RL")
        ax.set_title(f"{label} after RL against CPT loss (mean, 95% interval)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="0.125,0.25,0.5,1", help="fractions of the pretraining stage's steps")
    ap.add_argument("--seeds", type=int, default=3, help="RL seeds per budget (train.seed = 1 .. N)")
    ap.add_argument("--jobs", type=int, default=2, help="RL runs at once (each one process, one thread)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the pretraining, long-context and SFT stages")
    ap.add_argument("--eval-samples", type=int, default=512, help="held-out sequences of the CPT loss")
    ap.add_argument("--final-steps", type=int, default=10, help="final reward = mean over this many last RL steps")
    ap.add_argument("--out", default="runs/loss_to_reward")
    ap.add_argument("--sft-overrides", nargs="*", default=[], help="for every budget's SFT stage")
    ap.add_argument("--rl-overrides", nargs="*", default=[], help="for every RL run, e.g. train.steps=40")
    ap.add_argument("--report-only", action="store_true", help="tabulate what exists under --out; run nothing")
    args = ap.parse_args(argv)
    try:
        fractions = [float(f) for f in args.budgets.split(",") if f.strip()]
    except ValueError:
        ap.error(f"--budgets must be comma-separated numbers, got {args.budgets!r}")
    if len(fractions) < 2 or any(f <= 0 for f in fractions) or len(set(fractions)) != len(fractions):
        ap.error("--budgets needs at least 2 distinct positive fractions (a trend needs two points)")
    if args.seeds < 1 or args.jobs < 1 or args.nproc < 1:
        ap.error("--seeds, --jobs and --nproc must be >= 1")
    fractions.sort()
    pcfg = pretrain_config(ROOT)
    budgets = budget_steps(pcfg, fractions)
    if len({s for s, _ in budgets}) != len(budgets):
        ap.error(f"--budgets {args.budgets} round to the same step counts {[s for s, _ in budgets]}; spread them")
    out = Path(args.out).resolve()
    if not args.report_only:
        missing = [p for p in pcfg.data.paths
                   if not (ROOT / (p + ".idx")).is_file() and not (ROOT / p).exists()]
        if missing or not (ROOT / "data/tiny/sft.jsonl").is_file():
            print("error: the demo's data (data/tiny/stdlib, data/tiny/sft.jsonl) is missing; run `make demo` first",
                  file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        for steps, warmup in budgets:
            run_chain(out / f"budget{steps}", steps, warmup, args)
        todo = [(steps, s) for steps, _ in budgets for s in range(1, args.seeds + 1)
                if not (out / f"budget{steps}" / "rl" / f"seed{s}" / "done").is_file()]
        from tools.ablate import run_overrides

        rl_overrides = run_overrides(str(ROOT / RL), args.rl_overrides)

        def one(job):
            steps, seed = job
            run = out / f"budget{steps}" / "rl" / f"seed{seed}"
            run.parent.mkdir(parents=True, exist_ok=True)
            log = run.parent / f"seed{seed}.log"
            rc = run_one(str(ROOT / RL), [*rl_overrides, f"checkpoint.init_from={out / f'budget{steps}' / 'sft'}",
                                          f"train.seed={seed}"], run, log)
            if rc != 0:
                print(f"budget {steps} seed {seed}: RL failed (rc {rc}); see {log}", flush=True)
                return
            (run / "done").write_text("ok\n")
            ev = eval_rows(read_rows(run))
            print(f"budget {steps} seed {seed}: held-out pass@1 "
                  + (f"{ev[0]['eval_pass@1']:.3f} -> {ev[-1]['eval_pass@1']:.3f}" if ev else "n/a"), flush=True)

        if todo:
            print(f"{len(todo)} RL runs to go, {args.jobs} at a time", flush=True)
            with ThreadPoolExecutor(args.jobs) as pool:
                list(pool.map(one, todo))
    if not out.is_dir():
        print(f"error: {out} does not exist; run without --report-only first", file=sys.stderr)
        return 2
    points = collect(out, budgets, fractions, args.seeds, args.final_steps)
    trends = summarise(points)
    write_report(points, trends, out, pcfg.train.global_batch_tokens)
    plot(points, trends, out / "loss_to_reward.png")
    print((out / "loss_to_reward.md").read_text())
    print(f"table: {out / 'loss_to_reward.md'} (csv: {out / 'loss_to_reward.csv'}); plot: {out / 'loss_to_reward.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
