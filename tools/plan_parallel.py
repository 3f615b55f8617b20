"""Per-GPU memory and communication of a parallel layout for a model preset, before renting the GPUs.

    python tools/plan_parallel.py --preset kimi-k2.5 --gpus 512 --gpu-mem 288 --tp 8 --ep 64 --cp 8 --seq 262144
    python tools/plan_parallel.py --preset kimi-k2.5 --gpus 512 --gpu-mem 288 --seq 262144 --sweep

    python tools/plan_parallel.py --preset kimi-k2.5 --gpus 512 --gpu-mem 288 --tp 1 --ep 8 --cp 8 --fsdp \
        --seq 262144 --simulate

Memory: parameters and gradients (fp32: the trainer computes in bf16 under autocast), optimizer state (AdamW
moments; ZeRO-1 sharded over data-parallel replicas, or with --fsdp parameters, gradients and moments all
sharded over the dense replicas dp x cp and, for the routed experts, the expert-data-parallel ranks; plus the
gathered blocks in flight), and activations per micro-batch without recompute and with full-layer recompute,
from megatron_composer.parallel.cost (the same model the tests check against measured saved-tensor bytes on
tiny CPU configs). Communication: collective payload bytes per GPU per optimizer step (uniform routing for the
expert all-to-all; FSDP's all-gathers and reduce-scatters of every block per micro-batch), and the time they
take at --link-gbps (ring algorithm factors).

--rollout plans an inference engine instead (rollouts, serving): --gpus GPUs per engine, attention and dense
weights over --tp, routed experts over --ep (default: all of the engine's GPUs, as vLLM's expert parallelism),
each sequence's cache over --dcp of the tp GPUs (vLLM's decode context parallelism, rollout.dcp), weights in
--weights bf16 | fp8 | int4 (experts), and --concurrency sequences of --seq tokens in flight; it prints
the weights and KV cache per GPU, the concurrency that fits, and the smallest engine that holds the request:

    python tools/plan_parallel.py --rollout --preset kimi-k2.5 --gpus 8 --gpu-mem 288 --tp 8 --weights int4 \
        --seq 262144 --concurrency 16

rollout.backend=vllm runs all tp x ep GPUs of an engine as vLLM's tensor-parallel ranks: plan it with
--tp = --gpus (and --dcp, which vLLM needs for MLA's cache not to be replicated over them).

--simulate builds the real model in the layout as one rank of the --gpus world on fake tensors and torch's fake
process group, runs one training step under torch's memory tracker (pretrain/dry_run.py) and prints the
measured peak by kind next to the estimate.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.config import ConfigError  # noqa: E402
from megatron_composer.model import get_preset  # noqa: E402
from megatron_composer.parallel.cost import (  # noqa: E402
    OPS,
    ROLLOUT_WEIGHT_FORMATS,
    RolloutEngine,
    StepPlan,
    activation_bytes,
    backward_peak,
    comm_per_step,
    memory_per_rank,
    model_params,
    rollout_plan,
    rollout_update_plan,
    smallest_rollout_engine,
)
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.parallelize import validate_layout  # noqa: E402

GiB = 2**30


def plan(cfg, params, gpus, tp, cp, ep, seq, micro_batch, micro_batches, sp, zero1, act_bytes, link_gbps, mtp,
         cp_attention="allgather", fsdp=False, dp_replicate=1, gather_bytes=2) -> dict:
    if dp_replicate > 1 and not fsdp:
        raise ConfigError(f"--dp-replicate {dp_replicate} is HSDP and needs --fsdp")
    dims = ParallelDims(gpus, tp=tp, cp=cp, ep=ep, sequence_parallel=sp, dp_replicate=dp_replicate)
    validate_layout(dims, cfg, seq_len=seq)
    lay = StepPlan(dims=dims, seq_len=seq, micro_batch=micro_batch, zero1=zero1, mtp=mtp, param_bytes=4,
                 act_bytes=act_bytes, cp_attention=cp_attention, fsdp=fsdp, dp_replicate=dp_replicate,
                 gather_bytes=gather_bytes)
    mem = memory_per_rank(cfg, lay, params)
    acts = activation_bytes(cfg, lay, attention_backend="flash", loss="trainer")
    comm = comm_per_step(cfg, lay, params=params, micro_batches=micro_batches)
    ring = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "send_recv": 1.0}
    seconds = sum(comm[k] * ring[k] for k in OPS) / (link_gbps * 1e9 / 8)
    static = mem["params"] + mem["grads"] + mem["optimizer"]
    # full recompute: the largest backward moment (cost.backward_peak), which counts the FSDP working set and the
    # gradients that exist at that moment; without recompute every saved tensor is live at the loss
    peak = backward_peak(cfg, lay, acts, params, micro_batches)
    return {"dims": dims, "lay": lay, "mem": mem, "peak": peak, "acts": acts, "comm": comm, "comm_seconds": seconds,
            "total_none": static + peak["terms"]["fsdp root"] + acts["none"], "total_full": peak["total"],
            "static": static}


def print_plan(p: dict, gpu_mem_gib: float, tokens_per_step: int) -> None:
    d, mem, acts, lay = p["dims"], p["mem"], p["acts"], p["lay"]
    fsdp = f", FSDP over {d.dp * d.cp // lay.dp_replicate} dense / {d.edp // lay.dp_replicate} expert ranks" + (
        f" x {lay.dp_replicate} replicas (HSDP)" if lay.dp_replicate > 1 else "") if lay.fsdp else ""
    print(f"layout: tp={d.tp} cp={d.cp} ep={d.ep} dp={d.dp} (expert-data-parallel {d.edp}), "
          f"sequence parallel {'on' if d.sequence_parallel else 'off'}{fsdp}")
    print(f"  parameters          {mem['params'] / GiB:10.2f} GiB   ({mem['dense_params_local'] / 1e9:.2f} B dense + "
          f"{mem['expert_params_local'] / 1e9:.2f} B expert on this GPU before FSDP; fp32)")
    print(f"  gradients           {mem['grads'] / GiB:10.2f} GiB")
    print(f"  optimizer state     {mem['optimizer'] / GiB:10.2f} GiB")
    print(f"  activations         {acts['none'] / GiB:10.2f} GiB without recompute (per micro-batch)")
    pk = p["peak"]
    print(f"  with full-layer recompute, the peak is in the backward's {pk['phase']} moment "
          f"({', '.join(f'{k} {v / GiB:.2f}' for k, v in pk['phases'].items())} GiB):")
    for k, v in pk["terms"].items():
        print(f"    {k:22s} {v / GiB:8.2f} GiB")
    for label, key in (("no recompute", "total_none"), ("full recompute", "total_full")):
        print(f"  total ({label:14s}) {p[key] / GiB:8.2f} GiB of {gpu_mem_gib:g} GiB: {fit_text(p[key], gpu_mem_gib)}")
    print(f"  communication per step ({tokens_per_step} tokens over all GPUs), payload per GPU:")
    for op in OPS:
        if p["comm"][op]:
            print(f"    {op:15s} {p['comm'][op] / GiB:10.3f} GiB")
    print(f"    ~{p['comm_seconds']:.2f} s at the given link bandwidth (ring factors, no overlap)")
    if lay.fsdp:
        print("    FSDP prefetch overlaps each block's all-gather with the previous block's compute and each "
              "reduce-scatter with the next block's backward; the first gather and last reduce-scatter of a pass "
              "are exposed")


def fit_text(total: float, gpu_mem_gib: float) -> str:
    over = total - gpu_mem_gib * GiB
    return "fits" if over <= 0 else f"does NOT fit (over by {over / GiB:.2f} GiB)"


def advise(cfg, params, args, common, p) -> str:
    """Which single change makes a layout that does not fit (with full recompute) fit: --fsdp, or doubling
    ep, cp or tp, or halving the micro-batch; the smallest resulting total first."""
    base = dict(tp=args.tp, cp=args.cp, ep=args.ep)
    tries = []
    if not common["fsdp"]:
        tries.append(("--fsdp", base, dict(common, fsdp=True)))
    for size in ("ep", "cp", "tp"):
        tries.append((f"--{size} {base[size] * 2}", dict(base, **{size: base[size] * 2}), common))
    if common["micro_batch"] > 1:
        half = common["micro_batch"] // 2
        tries.append((f"--micro-batch {half}", base, dict(common, micro_batch=half)))
    fits = []
    for label, sizes, kw in tries:
        try:
            q = plan(cfg, params, args.gpus, sizes["tp"], sizes["cp"], sizes["ep"], **kw)
        except ConfigError:
            continue
        if q["total_full"] <= args.gpu_mem * GiB:
            fits.append((q["total_full"], label))
    if not fits:
        return "no single change of --fsdp, ep, cp, tp or the micro-batch makes it fit; add GPUs or shorten --seq"
    return "fits with " + " or ".join(f"{label} ({t / GiB:.1f} GiB)" for t, label in sorted(fits))


def print_simulation(cfg, args, p) -> bool:
    """Run the dry run (pretrain/dry_run.py) and print it next to the estimate; True if the measured peak fits."""
    from megatron_composer.parallel.dims import ParallelConfig
    from pretrain.dry_run import simulate, simulate_scaled

    pcfg = ParallelConfig(tp=args.tp, cp=args.cp, ep=args.ep, sequence_parallel=not args.no_sp, zero1=not args.no_zero1,
                          cp_attention=args.cp_attention, activation_checkpointing=args.recompute)
    if args.fsdp:
        if not hasattr(pcfg, "fsdp"):
            raise SystemExit("error: this build's training core has no parallel.fsdp; --simulate needs it for --fsdp")
        pcfg.fsdp, pcfg.dp_replicate = True, args.dp_replicate
        pcfg.fsdp_param_dtype = "bfloat16" if args.dtype == "bf16" else "float32"  # what "auto" picks on a GPU
    print(f"dry run: rank 0 of {args.gpus} (fake process group, fake tensors), one step, activation checkpointing "
          f"{args.recompute}" + (f", {args.sim_layers} and {args.sim_layers + 1} of {cfg.num_layers} layers, "
                                 "extrapolated" if args.sim_layers else f", all {cfg.num_layers} layers"))
    if args.micro_batches > 1:
        print("  (the dry run runs one micro-batch; the estimate counts the gradients of earlier ones)")
    kw = dict(micro_batch=args.micro_batch, mtp_weight=0.2 if cfg.num_mtp_layers else 0.0, precision=args.dtype)
    if args.sim_layers:
        r = simulate_scaled(cfg, pcfg, args.gpus, args.seq, layers=args.sim_layers, **kw)
    else:
        r = simulate(cfg, pcfg, args.gpus, args.seq, **kw)
    print("  simulated peak by the tracker's kinds (recomputed and prefetched tensors count as temporaries):")
    for k, v in r.by_kind.items():
        if v:
            print(f"    {k:22s} {v / GiB:8.2f} GiB")
    total_est = p["total_full"] if args.recompute == "full" else p["total_none"]
    print(f"  {'peak':18s} {'estimate GiB':>13s} {'simulated GiB':>14s} {'sim/est':>8s}")
    ratio = r.peak_bytes / total_est
    print(f"  {'':18s} {total_est / GiB:13.2f} {r.peak_bytes / GiB:14.2f} {ratio:8.2f}")
    print(f"  estimate and dry run {'agree within' if abs(ratio - 1) <= 0.15 else 'differ by more than'} 15% "
          f"({(ratio - 1) * 100:+.1f}%)")
    print(f"  measured peak {r.peak_bytes / GiB:.2f} GiB of {args.gpu_mem:g} GiB: "
          f"{fit_text(r.peak_bytes, args.gpu_mem)}; {r.seconds:.0f} s")
    print("  assumptions:")
    for a in r.assumptions:
        print(f"    - {a}")
    return r.peak_bytes <= args.gpu_mem * GiB


def print_rollout(cfg, params, args) -> bool:
    try:
        engine = RolloutEngine(gpus=args.gpus, tp=args.tp, ep=args.ep if args.ep > 1 or args.gpus == 1 else 0,
                               weights=args.weights, kv_bytes=1 if args.kv_dtype == "fp8" else 2, dcp=args.dcp)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    p = rollout_plan(cfg, engine, args.seq, args.concurrency, args.gpu_mem * GiB, args.utilization, params)
    print(f"rollout engine: {engine.gpus} GPUs, attention and dense weights over tp={engine.tp} "
          f"({engine.attention_groups} data-parallel attention group(s)), routed experts over ep={engine.ep}"
          f"{f', cache over dcp={engine.dcp}' if engine.dcp > 1 else ''}; "
          f"{engine.weights} weights, {args.kv_dtype} KV cache")
    for k, v in p["weights"].items():
        print(f"  {k:22s} {v / GiB:9.2f} GiB per GPU")
    print(f"  {'weights':22s} {p['weight_bytes'] / GiB:9.2f} GiB per GPU")
    print(f"  KV cache per token     {p['kv_per_token'] / 2**10:9.1f} KiB per GPU of its attention group "
          f"({p['kv_per_token'] * args.seq / GiB:.2f} GiB per {args.seq}-token sequence)")
    print(f"  {args.concurrency} sequences of {args.seq} tokens: {p['seqs_per_group']} per attention group, "
          f"{p['kv_bytes'] / GiB:.2f} GiB of cache per GPU")
    print(f"  total {p['total'] / GiB:.2f} GiB of the {p['budget'] / GiB:.1f} GiB usable ({args.utilization:g} x "
          f"{args.gpu_mem:g}): {'fits' if p['fits'] else 'does NOT fit'}; at most {p['max_concurrency']} sequences "
          f"of {args.seq} tokens fit this engine")
    best = smallest_rollout_engine(cfg, args.seq, args.concurrency, args.gpu_mem * GiB, args.weights,
                                   kv_bytes=engine.kv_bytes, utilization=args.utilization, params=params)
    if best is None:
        print("  no engine up to 1024 GPUs holds that; lower --concurrency or --seq")
    else:
        e, bp = best
        print(f"  smallest engine for {args.concurrency} x {args.seq} tokens: {e.gpus} GPUs (tp={e.tp}, ep={e.ep}), "
              f"{bp['total'] / GiB:.1f} GiB per GPU")
    print_update_cost(cfg, params, engine, p, args)
    return p["fits"]


def print_update_cost(cfg, params, engine: RolloutEngine, plan: dict, args) -> None:
    """Per node: host bytes held for weight updates with the base on the host and on the GPU, bytes fetched per
    version and the apply pause (cost.rollout_update_plan)."""
    expert_ratio = args.expert_delta_ratio
    if expert_ratio is None:
        expert_ratio = 0.0015 if engine.weights == "int4" else args.delta_ratio
    host_mem = args.host_mem * GiB
    common = dict(gpus_per_node=args.gpus_per_node, delta_ratio=args.delta_ratio, expert_delta_ratio=expert_ratio,
                  link_gbps=args.link_gbps, params=params)
    host = rollout_update_plan(cfg, engine, base="host", **common)
    device = rollout_update_plan(cfg, engine, base="device", **common)
    print(f"  weight updates per node of {host['workers']} GPUs, one engine worker each: non-expert tensors whole "
          f"+ 1/{engine.ep} of the experts = {host['worker_bytes'] / GiB:.1f} GiB per worker "
          f"({host['worker_other'] / GiB:.1f} + {host['worker_experts'] / GiB:.1f})")
    if engine.weights != "bf16":
        bf16 = rollout_update_plan(cfg, replace(engine, weights="bf16"), base="host", staging="dense",
                                   **{**common, "expert_delta_ratio": args.delta_ratio})
        print(f"    bf16 experts published, host base, dense staging: base {bf16['host']['base'] / GiB:.0f} GiB + "
              f"staging {bf16['host']['staging'] / GiB:.0f} GiB per node ({bf16['host']['base'] / host_mem:.0%} + "
              f"{bf16['host']['staging'] / host_mem:.0%} of {args.host_mem:g} GiB host memory)")
    print(f"    {engine.weights} served, host base (vLLM's CPU build), sparse staging: base "
          f"{host['host']['base'] / GiB:.0f} GiB + staging {host['host']['staging'] / GiB:.1f} GiB per node "
          f"({host['host_total'] / host_mem:.0%} of {args.host_mem:g} GiB host memory)")
    total = plan["total"] + device["device_base"]
    print(f"    {engine.weights} served, base on the GPU, sparse staging: {device['device_base'] / GiB:.1f} GiB per "
          f"GPU more (total {total / GiB:.1f} of {plan['budget'] / GiB:.1f} GiB usable: "
          f"{'fits' if total <= plan['budget'] else 'does NOT fit'}); host {device['host_total'] / GiB:.1f} GiB per "
          f"node ({device['host_total'] / host_mem:.1%} of {args.host_mem:g} GiB)")
    print(f"    fetched per version: {host['fetched_per_version'] / GiB:.2f} GiB per node at delta ratio "
          f"{args.delta_ratio:g} (experts {expert_ratio:g}); apply pause {host['pause_s']:.2f} s at "
          f"{args.link_gbps:g} Gb/s per node without prefetch")


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
    ap.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer (parallel.fsdp)")
    ap.add_argument("--dp-replicate", type=int, default=1, help="HSDP: replicas of each FSDP shard")
    ap.add_argument("--fp8-gather", action="store_true", help="FSDP gathers FP8 weights (1 byte + scales)")
    ap.add_argument("--sweep", action="store_true", help="try every tp/cp/ep and list the layouts that fit")
    ap.add_argument("--simulate", action="store_true", help="dry-run one training step at full size (fake tensors)")
    ap.add_argument("--recompute", choices=["full", "none"], default="full",
                    help="activation checkpointing (--simulate)")
    ap.add_argument("--rollout", action="store_true", help="plan an inference engine (rollouts) instead of training")
    ap.add_argument("--weights", choices=sorted(ROLLOUT_WEIGHT_FORMATS), default="bf16",
                    help="--rollout: weight format (int4: pack-quantized routed experts, the rest bf16)")
    ap.add_argument("--concurrency", type=int, default=1, help="--rollout: sequences in flight per engine")
    ap.add_argument("--dcp", type=int, default=1,
                    help="--rollout: split each sequence's cache over this many of the tp GPUs (vLLM's decode context "
                         "parallelism)")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="--rollout: KV cache dtype")
    ap.add_argument("--utilization", type=float, default=0.9,
                    help="--rollout: share of GPU memory for weights and cache (the rest: activations, CUDA graphs)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="--rollout: GPUs (engine workers) per node")
    ap.add_argument("--host-mem", type=float, default=2048, help="--rollout: GiB of host memory per node")
    ap.add_argument("--delta-ratio", type=float, default=0.03,
                    help="--rollout: compressed delta bytes per raw byte of a version (bf16 at the RL lr: "
                         "benchmarks/int4_delta_ratio.py measures 0.03)")
    ap.add_argument("--expert-delta-ratio", type=float, default=None,
                    help="--rollout: the routed experts' (default 0.0015 for int4, as measured, else --delta-ratio)")
    ap.add_argument("--sim-layers", type=int, default=None,
                    help="--simulate N and N+1 layers and extrapolate to the model's depth (faster)")
    args = ap.parse_args(argv)

    try:
        cfg = get_preset(args.preset)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.mtp_layers is not None:
        cfg = cfg.replace(num_mtp_layers=args.mtp_layers)
    if args.rollout:
        params = model_params(cfg)
        print(f"{args.preset}: {sum(math.prod(s) for _, s in params) / 1e9:.1f} B parameters, {cfg.num_layers} layers, "
              f"{cfg.num_experts} experts, {cfg.attention.upper()} attention")
        print_rollout(cfg, params, args)
        return
    nbytes = 2 if args.dtype == "bf16" else 4
    params = model_params(cfg)
    common = dict(seq=args.seq, micro_batch=args.micro_batch, micro_batches=args.micro_batches, sp=not args.no_sp,
                  zero1=not args.no_zero1, act_bytes=nbytes, link_gbps=args.link_gbps,
                  mtp=cfg.num_mtp_layers > 0, cp_attention=args.cp_attention, fsdp=args.fsdp,
                  dp_replicate=args.dp_replicate, gather_bytes=1 + 1 / 32 if args.fp8_gather else nbytes)
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
        fits = p["total_full"] <= args.gpu_mem * GiB
        if not fits:
            print(f"  with full recompute: {fit_text(p['total_full'], args.gpu_mem)}; "
                  f"{advise(cfg, params, args, common, p)}")
        if args.simulate:
            try:
                sim_fits = print_simulation(cfg, args, p)
            except ConfigError as e:
                raise SystemExit(f"error: {e}") from None
            if not sim_fits:
                print(f"  the dry run does not fit: {advise(cfg, params, args, common, p)}")
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
