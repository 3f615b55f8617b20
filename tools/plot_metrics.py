"""Plot loss curves (and validation loss / MTP agreement when present) of one or more runs to a PNG.

    python tools/plot_metrics.py runs/tiny/pretrain runs/tiny/long_context --output loss.png
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    ap.add_argument("--output", required=True, help="PNG path")
    args = ap.parse_args(argv)
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
    has_mtp = any("mtp1_top1" in row for _, rows in data for row in rows)
    fig, axes = plt.subplots(1, 2 if has_mtp else 1, figsize=(12 if has_mtp else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    offset = 0  # runs are drawn one after another, as a chain of stages
    for run, rows in data:
        train = [(offset + r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(offset + r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            line, = ax.plot(*zip(*train), lw=1, label=f"{run.name} train")
            if val:
                ax.plot(*zip(*val), "o--", color=line.get_color(), ms=3, label=f"{run.name} val")
        elif val:
            ax.plot(*zip(*val), "o--", ms=3, label=f"{run.name} val")
        if has_mtp:
            mtp = [(offset + r["step"], r["mtp1_top1"]) for r in rows if "mtp1_top1" in r]
            if mtp:
                axes[0][1].plot(*zip(*mtp), lw=1, label=run.name)
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
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
