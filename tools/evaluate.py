"""Evaluate a checkpoint on a task set: K samples per task, pass@1 and pass@K, transcripts (rl/evaluate.py).

    python tools/evaluate.py --tasks examples/tasks --checkpoint runs/tiny/rl --samples 4 [--output FILE] \
        [key=value ...]

The model, tokenizer and rollout settings come from the checkpoint's run (run.dir/config.yaml, written by
rl_composer.py or pretrain_composer.py); key=value overrides apply on top (e.g. rollout.temperature=0.7).
Episodes run exactly as in RL (the same rollout worker: the inference engine, sandboxes, agent protocol).
pass@k is the unbiased estimator 1 - C(n - c, k) / C(n, k) over n samples with c successes per task
(success: reward >= --success-reward), averaged over tasks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.evaluate import evaluate  # noqa: E402
from rl.sandbox.leftovers import release_on_signals  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", required=True, help="task directory (tasks.jsonl and/or Harbor task folders)")
    ap.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint) or checkpoint directory")
    ap.add_argument("--samples", type=int, default=4, help="samples per task (K of pass@K)")
    ap.add_argument("--output", default=None, help="transcripts JSONL (default: CHECKPOINT/eval_<tasks>.jsonl)")
    ap.add_argument("--success-reward", type=float, default=1.0,
                    help="a sample passes when its reward is at least this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-tasks", type=int, default=0, help="evaluate a seeded random subset of this many tasks")
    ap.add_argument("--summary", default=None, help="also write the summary (per tier and per task) to this JSON file")
    ap.add_argument("overrides", nargs="*",
                    help="key=value overrides of the run's config, e.g. rollout.temperature=0.7")
    args = ap.parse_args(argv)
    if args.samples < 1:
        ap.error("--samples must be >= 1")
    release_on_signals()  # a stopped evaluation leaves no sandbox behind
    from megatron_composer.checkpoint.dcp import CheckpointError
    from megatron_composer.config import ConfigError

    try:
        s = evaluate(args.tasks, args.checkpoint, args.samples, args.output, args.overrides, args.success_reward,
                     args.seed, args.sample_tasks)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.summary:
        Path(args.summary).write_text(json.dumps(s, indent=1, default=str))
    k = f"pass@{s['samples']}"
    for t in s["per_task"]:
        print(f"{t['task']:40s} rewards {t['rewards']} pass@1 {t['pass@1']:.2f} {k} {t[k]:.2f}")
    for tier, t in s["per_tier"].items():
        print(f"tier {tier}: {t['tasks']} tasks, pass@1 {t['pass@1']:.3f}  {k} {t[k]:.3f}")
    print(f"pass@1 {s['pass@1']:.3f}  {k} {s[k]:.3f}  reward_mean {s['reward_mean']:.3f} over {s['tasks']} tasks; "
          f"transcripts: {s['transcripts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
