"""Training parity of MXFP8 against high precision: the same tiny-model pretraining run twice in one invocation,
once with fp8.recipe=none (the baseline: fp32 on CPU, bf16 autocast on GPU) and once with fp8.recipe=mxfp8, and
the final losses compared. Passes if the FP8 run's final training loss (mean of the last 10 logged steps) and
final validation loss are both within --tolerance (default 2%) of the baseline's.

Same seed, data order and initial weights in both runs; only the linear and expert GEMMs differ. The default
block size is 16 (the Composer 2 summary's value), which splits every layer of tiny-deepseek-v3 (its wkv_a has
48 output features, which 32-blocks do not split). Needs the tiny corpus from `make demo` (data/tiny/).
Run directories follow the project convention: running again resumes them.

    python benchmarks/fp8_training_parity.py [--steps 300] [--backend emulated] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_composer.config import load_config  # noqa: E402
from pretrain.trainer import PretrainConfig, run_stage  # noqa: E402


def final_losses(run_dir: Path) -> tuple[float, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r["loss"] for r in rows if "loss" in r and r.get("step", 0) > 0]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return sum(train[-10:]) / len(train[-10:]), val[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="examples/tiny/pretrain.yaml")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--backend", default="emulated", help="fp8.backend of the FP8 run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounding", default="rceil")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--out", default="runs/benchmarks/fp8_parity")
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for both runs")
    args = p.parse_args()

    out = Path(args.out)
    common = [f"train.steps={args.steps}", f"checkpoint.interval={args.steps}", "train.eval_interval=100",
              *args.overrides]
    runs = {
        "baseline": common + [f"run.dir={out / 'baseline'}", "fp8.recipe=none"],
        "mxfp8": common + [f"run.dir={out / 'mxfp8'}", "fp8.recipe=mxfp8", f"fp8.backend={args.backend}",
                           f"fp8.block_size={args.block_size}", f"fp8.rounding={args.rounding}"],
    }
    results, seconds = {}, {}
    for name, overrides in runs.items():
        cfg = load_config(PretrainConfig, args.config, overrides)
        print(f"== {name}: {' '.join(overrides)}", flush=True)
        t0 = time.time()
        run_stage(cfg)
        seconds[name] = time.time() - t0
        results[name] = final_losses(Path(cfg.run.dir))

    (b_train, b_val), (f_train, f_val) = results["baseline"], results["mxfp8"]
    print(f"\n{args.steps} steps of {args.config}")
    print(f"  baseline (no fp8)        train loss {b_train:.4f}  val loss {b_val:.4f}  ({seconds['baseline']:.0f} s)")
    print(f"  mxfp8/{args.block_size} {args.rounding} ({args.backend})  "
          f"train loss {f_train:.4f}  val loss {f_val:.4f}  ({seconds['mxfp8']:.0f} s)")
    ratios = (f_train / b_train, f_val / b_val)
    ok = all(abs(r - 1) <= args.tolerance for r in ratios)
    print(f"  ratio vs baseline: train x{ratios[0]:.4f}, val x{ratios[1]:.4f} -> "
          f"{'PASS' if ok else 'FAIL'} (tolerance {args.tolerance:.0%})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
