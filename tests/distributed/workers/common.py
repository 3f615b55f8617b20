"""Shared pieces of the torchrun workers: process setup, gradient comparison, result writing."""

from __future__ import annotations

import argparse
import datetime
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.parallel.slices import local_pieces, local_tensor

REL_TOL = 1e-5


def init() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="all")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    torch.set_num_threads(1)
    return args


def max_rel_err(got: torch.Tensor, ref: torch.Tensor, scale_ref: torch.Tensor | None = None) -> float:
    """max |got - ref| / max |full reference tensor| (0 when both are exactly zero)."""
    scale = (scale_ref if scale_ref is not None else ref).abs().max().item()
    diff = (got.double() - ref.double()).abs().max().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def compare_grads(par_named: dict, ref_named: dict, rename=lambda n: n) -> dict:
    """Per parameter, the relative error of this rank's gradient shard against the reference's slice (box by
    box of the full tensor, so FSDP's DTensor shards compare too)."""
    errs = {}
    for name, p in par_named.items():
        ref = ref_named[rename(name)]
        assert p.grad is not None, f"{name} has no gradient"
        grad = local_tensor(p.grad)
        errs[name] = max((max_rel_err(grad[pc.local], ref.grad[pc.full], ref.grad) for pc in local_pieces(p)),
                         default=0.0)
    return errs


def reduce_max(errs: dict) -> dict:
    """Worst error across ranks for each key (every rank must hold the same keys)."""
    keys = sorted(errs)
    t = torch.tensor([errs[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def run_cases(args, cases: dict) -> None:
    wanted = list(cases) if args.cases == "all" else args.cases.split(",")
    results = {}
    for name in wanted:
        try:
            results[name] = {"ok": True, **cases[name]()}
        except Exception:  # report, and keep the other cases running
            results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


__all__ = ["init", "max_rel_err", "compare_grads", "reduce_max", "run_cases", "REL_TOL"]
