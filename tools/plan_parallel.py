"""Per-GPU memory and communication of a parallel layout for a model preset, before renting the GPUs.

    python tools/plan_parallel.py --preset kimi-k2.5 --gpus 512 --gpu-mem 288 --tp 8 --ep 64 --cp 8 --seq 262144
    python tools/plan_parallel.py --preset kimi-k2.5 --gpus 512 --gpu-mem 288 --seq 262144 --sweep

Memory: parameters, gradients, optimizer state (AdamW moments + fp32 master, ZeRO-1 sharded over data-parallel
replicas) and activations per micro-batch without recompute and with full-layer recompute, from
megatron_composer.parallel.cost (the same model the tests check against measured saved-tensor bytes on tiny
CPU configs). Communication: collective payload bytes per GPU per optimizer step (uniform routing for the
expert all-to-all), and the time they take at --link-gbps (ring algorithm factors).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.config import ConfigError  # noqa: E402
from megatron_composer.model import get_preset  # noqa: E402
from megatron_composer.parallel.cost import (OPS, Layout, activation_bytes, comm_per_step,  # noqa: E402
                                             memory_per_rank, model_params)
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.parallelize import validate_layout  # noqa: E402

GiB = 2**30


def plan(cfg, params, gpus, tp, cp, ep, seq, micro_batch, micro_batches, sp, zero1, param_bytes, act_bytes,
         link_gbps, mtp, cp_attention="allgather") -> dict:
    dims = ParallelDims(gpus, tp=tp, cp=cp, ep=ep, sequence_parallel=sp)
    validate_layout(dims, cfg, seq_len=seq)
    lay = Layout(dims=dims, seq_len=seq, micro_batch=micro_batch, zero1=zero1, mtp=mtp, param_bytes=param_bytes,
                 act_bytes=act_bytes, cp_attention=cp_attention)
    mem = memory_per_rank(cfg, lay, params)
    acts = activation_bytes(cfg, lay, attention_backend="flash")
    comm = comm_per_step(cfg, lay, params=params, micro_batches=micro_batches)
    ring = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "send_recv": 1.0}
    seconds = sum(comm[k] * ring[k] for k in OPS) / (link_gbps * 1e9 / 8)
    static = mem["params"] + mem["grads"] + mem["optimizer"]
    return {"dims": dims, "mem": mem, "acts": acts, "comm": comm, "comm_seconds": seconds,
            "total_none": static + acts["none"], "total_full": static + acts["full"], "static": static}


def print_plan(p: dict, gpu_mem_gib: float, tokens_per_step: int) -> None:
    d, mem, acts = p["dims"], p["mem"], p["acts"]
    print(f"layout: tp={d.tp} cp={d.cp} ep={d.ep} dp={d.dp} (expert-data-parallel {d.edp}), "
          f"sequence parallel {'on' if d.sequence_parallel else 'off'}")
    print(f"  parameters          {mem['params'] / GiB:10.2f} GiB   ({mem['dense_params_local'] / 1e9:.2f} B dense + "
          f"{mem['expert_params_local'] / 1e9:.2f} B expert on this GPU)")
    print(f"  gradients           {mem['grads'] / GiB:10.2f} GiB")
    print(f"  optimizer state     {mem['optimizer'] / GiB:10.2f} GiB")
    print(f"  activations         {acts['none'] / GiB:10.2f} GiB without recompute, {acts['full'] / GiB:.2f} GiB "
          f"with full-layer recompute (per micro-batch)")
    for label, key in (("no recompute", "total_none"), ("full recompute", "total_full")):
        fits = "fits" if p[key] <= gpu_mem_gib * GiB else "does NOT fit"
        print(f"  total ({label:14s}) {p[key] / GiB:8.2f} GiB of {gpu_mem_gib:g} GiB: {fits}")
    print(f"  communication per step ({tokens_per_step} tokens over all GPUs), payload per GPU:")
    for op in OPS:
        if p["comm"][op]:
            print(f"    {op:15s} {p['comm'][op] / GiB:10.3f} GiB")
    print(f"    ~{p['comm_seconds']:.2f} s at the given link bandwidth (ring factors, no overlap)")



def _divisors(n: int, cap: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if k <= cap and n % k == 0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, help="model preset, e.g. kimi-k2.5, deepseek-v3, qwen3-30b-a3b")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu-mem", type=float, required=True, help="GiB of memory per GPU")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step (accumulation)")
    ap.add_argument("--no-sp", action="store_true", help="turn sequence parallelism off")
    ap.add_argument("--cp-attention", choices=["allgather", "ring"], default="allgather",
                    help="context-parallel K/V exchange")
    ap.add_argument("--no-zero1", action="store_true", help="replicate optimizer state on data-parallel ranks")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="parameter/activation dtype")
    ap.add_argument("--mtp-layers", type=int, default=None, help="override the preset's MTP depth")
    ap.add_argument("--link-gbps", type=float, default=400.0, help="per-GPU network bandwidth, Gbit/s")
    ap.add_argument("--sweep", action="store_true", help="try every tp/cp/ep and list the layouts that fit")
    args = ap.parse_args(argv)

    try:
        cfg = get_preset(args.preset)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.mtp_layers is not None:
        cfg = cfg.replace(num_mtp_layers=args.mtp_layers)
    nbytes = 2 if args.dtype == "bf16" else 4
    params = model_params(cfg)
    common = dict(seq=args.seq, micro_batch=args.micro_batch, micro_batches=args.micro_batches, sp=not args.no_sp,
                  zero1=not args.no_zero1, param_bytes=nbytes, act_bytes=nbytes, link_gbps=args.link_gbps,
                  mtp=cfg.num_mtp_layers > 0, cp_attention=args.cp_attention)
    print(f"{args.preset}: {sum(math.prod(s) for _, s in params) / 1e9:.1f} B parameters, "
          f"{cfg.num_layers} layers, {cfg.num_experts} experts; seq {args.seq}, "
          f"{args.gpus} GPUs x {args.gpu_mem:g} GiB")
    if not args.sweep:
        try:
            p = plan(cfg, params, args.gpus, args.tp, args.cp, args.ep, **common)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        dp = p["dims"].dp
        print_plan(p, args.gpu_mem, dp * args.micro_batch * args.micro_batches * args.seq)
        return
    from tqdm import tqdm

    candidates = list(itertools.product(_divisors(args.gpus, 8), _divisors(args.gpus, 64),
                                        _divisors(args.gpus, args.gpus)))
    rows = []
    for tp, cp, ep in tqdm(candidates, desc="layouts"):
        try:
            p = plan(cfg, params, args.gpus, tp, cp, ep, **common)
        except ConfigError:
            continue
        if p["total_full"] <= args.gpu_mem * GiB:
            tokens = p["dims"].dp * args.micro_batch * args.micro_batches * args.seq
            rows.append((p["comm_seconds"] / tokens * 1e6, tp, cp, ep, p))
    if not rows:
        raise SystemExit("no layout fits; add GPUs, shorten --seq or use a smaller --micro-batch")
    rows.sort(key=lambda r: (r[0], r[4]["total_full"]))
    print(f"{'tp':>3s} {'cp':>3s} {'ep':>4s} {'dp':>4s} {'GiB no-recompute':>17s} {'GiB full-recompute':>19s} "
          f"{'comm GiB/step':>14s} {'comm s/step':>12s} {'comm s/Mtok':>12s}")
    print("(sorted by communication time per million trained tokens; memory with full recompute must fit)")
    for per_mtok, tp, cp, ep, p in rows[:15]:
        print(f"{tp:3d} {cp:3d} {ep:4d} {p['dims'].dp:4d} {p['total_none'] / GiB:17.1f} {p['total_full'] / GiB:19.1f} "
              f"{sum(p['comm'].values()) / GiB:14.2f} {p['comm_seconds']:12.2f} {per_mtok:12.3f}")


if __name__ == "__main__":
    main()
