"""Continued pretraining entrypoint: one stage, or a chain of stages run in order.

    torchrun --nproc-per-node N pretrain_composer.py --config STAGE.yaml [STAGE2.yaml ...] [key=value ...]

Overrides apply to every stage. With several stages, `run.dir=DIR` on the command line places each stage
in DIR/<config file stem>, and `checkpoint.init_from: previous` in a stage means the previous stage's run.
Running the same command again resumes each unfinished stage from its run.dir/latest.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.checkpoint.dcp import CheckpointError, find_latest
from megatron_composer.config import ConfigError, describe_schema, load_config, parse_overrides
from megatron_composer.data.pretrain_data import DataError
from megatron_composer.data.tokenizer import TokenizerError
from pretrain.trainer import PretrainConfig, run_stage


def _parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config schema (defaults):\n" + describe_schema(PretrainConfig),
    )
    ap.add_argument("--config", nargs="+", required=True, help="stage config(s); several run as a chain")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=10 parallel.ep=2")
    args = ap.parse_args(argv)
    # `--config a.yaml b.yaml key=value` : argparse hands the overrides to --config; split them back out
    args.overrides = [c for c in args.config if "=" in c] + args.overrides
    args.config = [c for c in args.config if "=" not in c]
    if not args.config:
        ap.error("--config needs at least one YAML file")
    return args


def load_stages(configs: list[str], overrides: list[str]) -> list[PretrainConfig]:
    run_dir = next((v for k, v in reversed(parse_overrides(overrides)) if k == "run.dir"), None)
    stages = []
    for i, path in enumerate(configs):
        extra = list(overrides)
        if run_dir is not None and len(configs) > 1:
            extra.append(f"run.dir={Path(str(run_dir)) / Path(path).stem}")
        cfg = load_config(PretrainConfig, path, extra)
        if cfg.checkpoint.init_from == "previous":
            if i == 0:
                raise ConfigError(f"{path}: checkpoint.init_from is 'previous' but it is the first stage; "
                                  "give a run dir or checkpoint path")
            cfg.checkpoint.init_from = stages[-1].run.dir
        stages.append(cfg)
    dirs = [s.run.dir for s in stages]
    if len(set(dirs)) != len(dirs):
        raise ConfigError(f"stages share a run.dir ({dirs}); give each stage its own run.dir")
    return stages


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        stages = load_stages(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        for cfg in stages:
            run_stage(cfg, init_from=cfg.checkpoint.init_from or None)
    except (ConfigError, DataError, TokenizerError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not dist.is_initialized() and int(os.environ.get("RANK", 0)) == 0:
        for cfg in stages:
            latest = find_latest(cfg.run.dir)
            print(f"stage done: {cfg.run.dir} (metrics: {Path(cfg.run.dir) / 'metrics.jsonl'}, checkpoint: {latest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
