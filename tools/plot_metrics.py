"""Plot loss curves (and validation loss / MTP agreement when present) of one or more runs to a PNG.
For RL runs (rows with reward_mean) it draws mean and best-of-K reward per group, the held-out pass@1 where the
run evaluated one (eval_pass@1), and, when the rows carry staleness_hist, how many trained tokens were 0, 1, 2,
... weight versions old at each step.

Training curves (loss, MTP agreement, mean reward) are drawn raw in a light shade with a smoothed line over them:
an exponential moving average with debiasing (as TensorBoard's smoothing), its weight stated in the legend
(--smoothing, 0 = off).
Validation and held-out points are drawn as they are.

    python tools/plot_metrics.py runs/tiny/pretrain runs/tiny/long_context --output loss.png
    python tools/plot_metrics.py runs/tiny/rl --output rl.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass run directories that contain metrics.jsonl")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return rows


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average of `values` with weight `weight` on the past, debiased so that the first points are
    not pulled toward 0: s_t = w s_{t-1} + (1 - w) x_t, shown as s_t / (1 - w^t)."""
    out, s = [], 0.0
    for t, x in enumerate(values, 1):
        s = weight * s + (1 - weight) * x
        out.append(s / (1 - weight ** t))
    return out


def plot_smoothed(ax, points: list[tuple[float, float]], label: str, weight: float, **kw):
    """The raw curve in a light shade and its EMA over it in the same colour; returns the EMA's line."""
    xs, ys = zip(*points)
    if weight <= 0:
        line, = ax.plot(xs, ys, lw=1, label=label, **kw)
        return line
    raw, = ax.plot(xs, ys, lw=0.8, alpha=0.25, **kw)
    line, = ax.plot(xs, ema(list(ys), weight), lw=1.5, color=raw.get_color(), label=f"{label} (EMA {weight:g})")
    return line


def plot_rl(plt, data: list[tuple[Path, list[dict]]], output: str, smoothing: float = 0.9) -> int:
    """Reward (mean and best-of-K per group) of each run, and the staleness of trained tokens per step."""
    has_staleness = any("staleness_hist" in row for _, rows in data for row in rows)
    fig, axes = plt.subplots(1, 2 if has_staleness else 1, figsize=(12 if has_staleness else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for run, rows in data:
        mean = [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r]
        best = [(r["step"], r["reward_best_of_k"]) for r in rows if "reward_best_of_k" in r]
        line = plot_smoothed(ax, mean, f"{run.name} mean", smoothing)
        if best:
            ax.plot(*zip(*best), "--", lw=1, color=line.get_color(), label=f"{run.name} best-of-K")
        held_out = [(r["step"], r["eval_pass@1"]) for r in rows if "eval_pass@1" in r]
        if held_out:
            ax.plot(*zip(*held_out), ":o", lw=1.5, ms=3, color=line.get_color(), label=f"{run.name} held-out pass@1")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / pass@1")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if has_staleness:
        run, rows = next((run, rows) for run, rows in data if any("staleness_hist" in r for r in rows))
        rows = [r for r in rows if "staleness_hist" in r]
        ages = sorted({int(k) for r in rows for k in r["staleness_hist"]})
        steps = [r["step"] for r in rows]
        counts = [[r["staleness_hist"].get(str(a), 0) for r in rows] for a in ages]
        axes[0][1].stackplot(steps, *counts, labels=[f"{a} version(s) old" for a in ages])
        axes[0][1].set_xlabel("step")
        axes[0][1].set_ylabel(f"trained tokens ({run.name})")
        axes[0][1].set_title("staleness of trained tokens", fontsize=9)
        axes[0][1].legend(fontsize=8)
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    ap.add_argument("--output", required=True, help="PNG path")
    ap.add_argument("--smoothing", type=float, default=0.9,
                    help="EMA weight of the smoothed training curves, in [0, 1); 0 draws the raw curves alone")
    args = ap.parse_args(argv)
    if not 0 <= args.smoothing < 1:
        print(f"error: --smoothing must be in [0, 1), got {args.smoothing}", file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: matplotlib is not installed; pip install matplotlib", file=sys.stderr)
        return 1
    try:
        data = [(Path(r), read_metrics(Path(r))) for r in args.runs]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if any("reward_mean" in row for _, rows in data for row in rows):
        return plot_rl(plt, data, args.output, args.smoothing)
    has_mtp = any("mtp1_top1" in row for _, rows in data for row in rows)
    has_copy = any("copy_pool_second" in row for _, rows in data for row in rows)
    panels = 1 + has_mtp + has_copy
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels if panels > 1 else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    offset = 0  # runs are drawn one after another, as a chain of stages
    for run, rows in data:
        train = [(offset + r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(offset + r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            line = plot_smoothed(ax, train, f"{run.name} train", args.smoothing)
            if val:
                ax.plot(*zip(*val), "o--", color=line.get_color(), ms=3, label=f"{run.name} val")
        elif val:
            ax.plot(*zip(*val), "o--", ms=3, label=f"{run.name} val")
        if has_mtp:
            mtp = [(offset + r["step"], r["mtp1_top1"]) for r in rows if "mtp1_top1" in r]
            if mtp:
                plot_smoothed(axes[0][1], mtp, run.name, args.smoothing)
        offset += max((r["step"] for r in rows), default=0)
    ax.set_xlabel("step (stages concatenated)")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if has_mtp:
        axes[0][1].set_xlabel("step")
        axes[0][1].set_ylabel("MTP depth-1 top-1 agreement with main head")
        axes[0][1].legend(fontsize=8)
        axes[0][1].grid(alpha=0.3)
    if has_copy:
        plot_copy(axes[0][-1], data)
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
    return 0


def plot_copy(ax, data: list[tuple[Path, list[dict]]]) -> None:
    """The copy probe (tools.copy_eval:copy_probe) against training tokens: first and second copy of the task
    family's words and of other words, the gate, and the formation point the induction-head law predicts for the
    run's tokens per step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.copy_eval import FORMING_NATS, GATE_NATS, LAW_T, formation_point

    for run, rows in data:
        per_step = max((r["tokens_seen"] / r["step"] for r in rows if r.get("step") and "tokens_seen" in r), default=0)
        rows = [r for r in rows if "copy_pool_second" in r]
        x = [r["step"] * per_step / 1e6 for r in rows]
        for key, style in (("copy_pool_first", ":"), ("copy_pool_second", "-o"), ("copy_open_second", "-s")):
            ax.plot(x, [r[key] for r in rows], style, ms=3, lw=1.2, label=f"{run.name} {key[5:].replace('_', ' ')}")
        for below in (FORMING_NATS, GATE_NATS):  # the measured formation points of the open copy
            row = formation_point(rows, below)
            if row is not None:
                at = row["step"] * per_step / 1e6
                ax.plot([at], [row["copy_open_second"]], "k*", ms=9, label=f"{run.name} open < {below:g}")
                ax.annotate(f"open < {below:g} at {at:.2f}M", (at, row["copy_open_second"]), fontsize=7,
                            xytext=(6, 6 if below == GATE_NATS else 14), textcoords="offset points")
        if per_step:
            law = LAW_T * per_step ** 0.5 / 1e6
            ax.axvline(law, color="grey", ls="--", lw=1)
            ax.text(law, ax.get_ylim()[1] * 0.95, f" law: {law:.1f}M\n (B x C = {per_step:.0f})", fontsize=7,
                    va="top")
    ax.axhline(GATE_NATS, color="red", lw=0.8, label=f"gate {GATE_NATS:g} nat/word")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("nats per word")
    ax.set_title("copy probe: a list of 8 words repeated after itself", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


if __name__ == "__main__":
    sys.exit(main())
