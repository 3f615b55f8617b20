"""RL entrypoint (phase 2): trainer, rollout workers and orchestrator from one config.

    torchrun --nproc-per-node N rl_composer.py --config examples/tiny/rl.yaml [key=value ...]

Ranks 0 .. trainer_ranks-1 train in the configured parallel layout (rank 0 also owns the orchestrator and
publishes the weights); the other ranks are rollout workers, one per process or, with rollout.tp=N, one per N
consecutive processes (a tensor-parallel engine). When no rank is left for rollouts (one process, or
trainer_ranks = the number of processes) the workers run as threads inside trainer rank 0. On clusters, launch the
trainer with role=trainer and the workers with role=rollout against the same run.dir (shared filesystem) and
weight_sync.url; see docs/RL_DEPLOYMENT.md. Running the same command again with the same run.dir resumes from
run.dir/latest and continues the epoch.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_composer.checkpoint.dcp import CheckpointError
from megatron_composer.config import ConfigError, describe_schema, load_config
from megatron_composer.data.tokenizer import TokenizerError
from rl.config import RLConfig
from rl.launch import run_rl
from rl.sandbox.leftovers import release_on_signals


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="config schema (defaults):\n" + describe_schema(RLConfig))
    ap.add_argument("--config", nargs="+", required=True, help="RL config YAML")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10 rollout.group_size=4")
    args = ap.parse_args(argv)
    args.overrides = [c for c in args.config if "=" in c] + args.overrides
    args.config = [c for c in args.config if "=" not in c]
    if len(args.config) != 1:
        ap.error("--config takes exactly one YAML file")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    release_on_signals()  # SIGTERM/SIGINT (SLURM, torchrun) release the run's sandboxes, mounts and cgroups
    try:
        cfg = load_config(RLConfig, args.config[0], args.overrides).validate()
        run_dir = run_rl(cfg)
    except (ConfigError, CheckpointError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if run_dir is not None and int(os.environ.get("RANK", 0)) == 0:
        print(f"RL run done: {run_dir} (metrics: {run_dir / 'metrics.jsonl'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
