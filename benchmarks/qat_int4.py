"""INT4 quantisation-aware training of the routed experts against plain training: the tiny pretraining stage
(examples/tiny/pretrain.yaml, one process, the same seed and data) run twice in the same session, with
qat.experts=none (the named baseline) and qat.experts=int4. Prints both loss curves' means over windows of steps,
the ratio of the last window's losses (QAT / baseline) and whether it lies in the stated band, and writes both
curves to a PNG.

    python benchmarks/qat_int4.py [--steps 80] [--band 1.05] [--out runs/qat_int4]

The data is built from this machine's Python standard library the way `make demo` builds it, when absent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "tiny"


def ensure_data() -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    if not (DATA / "tokenizer" / "tokenizer.model").exists():
        subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", stdlib, "--output",
                        str(DATA / "tokenizer"), "--vocab-size", "4096", "--max-lines", "300000"], cwd=ROOT, check=True)
    if not (DATA / "stdlib.idx").exists():
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", stdlib, "--tokenizer",
                        str(DATA / "tokenizer"), "--output-prefix", str(DATA / "stdlib"), "--workers", "2"],
                       cwd=ROOT, check=True)


def run(out: Path, qat: str, steps: int) -> list[float]:
    run_dir = out / f"qat_{qat}"
    cmd = [sys.executable, "pretrain_composer.py", "--config", "examples/tiny/pretrain.yaml", f"run.dir={run_dir}",
           f"train.steps={steps}", f"qat.experts={qat}", f"checkpoint.interval={steps}", "logging.interval=10",
           f"train.eval_interval={steps}"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r and r.get("step", 0) > 0}
    return [losses[s] for s in sorted(losses)][-steps:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--window", type=int, default=10, help="steps per mean in the printed curve")
    ap.add_argument("--band", type=float, default=1.05, help="QAT's last-window loss within this factor of plain's")
    ap.add_argument("--out", default="runs/qat_int4")
    args = ap.parse_args()
    ensure_data()
    out = ROOT / args.out
    curves = {qat: run(out, qat, args.steps) for qat in ("none", "int4")}
    print(f"\nloss, mean over windows of {args.window} steps (tiny MoE, {args.steps} steps, one process)")
    print(f"{'steps':>12} {'plain (baseline)':>18} {'int4 QAT':>10} {'ratio':>7}")
    n = min(len(c) for c in curves.values())
    for start in range(0, n, args.window):
        plain = sum(curves["none"][start:start + args.window]) / len(curves["none"][start:start + args.window])
        qat = sum(curves["int4"][start:start + args.window]) / len(curves["int4"][start:start + args.window])
        print(f"{start + 1:>5}-{min(start + args.window, n):<6} {plain:>18.4f} {qat:>10.4f} {qat / plain:>7.3f}")
    first = sum(curves["none"][:args.window]) / args.window
    last = {k: sum(c[-args.window:]) / args.window for k, c in curves.items()}
    ratio = last["int4"] / last["none"]
    print(f"plain: {first:.3f} -> {last['none']:.3f}; int4 QAT last window / plain's: {ratio:.3f} "
          f"({'within' if ratio <= args.band else 'OUTSIDE'} the band {args.band})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for k, label in (("none", "plain (baseline)"), ("int4", "INT4 QAT experts")):
            ax.plot(range(1, len(curves[k]) + 1), curves[k], label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend()
        fig.savefig(out / "loss.png", dpi=100, bbox_inches="tight")
        print(f"curves: {out / 'loss.png'}")
    except ImportError:
        print("matplotlib is not installed: no curves written (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
