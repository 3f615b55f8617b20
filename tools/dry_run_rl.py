"""Dry run of one RL trainer step of an RL config at full size, next to the planner's estimate.

    python tools/dry_run_rl.py --config examples/kimi_k25/rl.yaml --gpus 512 --gpu-mem 288 --sim-layers 3

Builds the policy (and the reference policy when rl.kl_coef > 0) in the config's parallel layout and FP8
recipe as one trainer rank of --gpus on fake tensors and torch's fake process group, and runs the learner's
step on data.seq_length-token samples, micro-batched as train.micro_batch_size and the step's samples per
data-parallel rank say (rl/dry_run.py). Prints the measured peak by kind, the planner's estimate for the same
layout (tools/plan_parallel.py: a pretraining step of the same micro-batches; it models no reference policy,
no extra forward passes and no RL inputs), and whether the measured peak fits --gpu-mem. Exit status 1 when it
does not fit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.config import ConfigError, load_config  # noqa: E402
from tools.plan_parallel import GiB, fit_text, plan  # noqa: E402

ESTIMATED = ("params", "grads", "optimizer")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="an RL config (e.g. examples/kimi_k25/rl.yaml)")
    ap.add_argument("--gpus", type=int, required=True, help="trainer ranks (trainer_ranks of the run)")
    ap.add_argument("--gpu-mem", type=float, required=True, help="GiB of memory per GPU")
    ap.add_argument("--sim-layers", type=int, default=None,
                    help="simulate N and N+1 layers and extrapolate to the model's depth (faster)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default: data.seq_length)")
    ap.add_argument("--micro-batches", type=int, default=2,
                    help="micro-batches of the step to run (the others' held inputs are added)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)

    from megatron_composer.parallel.cost import model_params
    from rl.config import RLConfig
    from rl.dry_run import policy_model_config, simulate_rl, simulate_rl_scaled

    try:
        cfg = load_config(RLConfig, args.config, args.overrides).validate()
        seq = args.seq or cfg.data.seq_length
        kw = dict(micro_batches=args.micro_batches, seq_len=seq)
        r = (simulate_rl_scaled(cfg, args.gpus, layers=args.sim_layers, **kw) if args.sim_layers
             else simulate_rl(cfg, args.gpus, **kw))
        mc = policy_model_config(cfg)
        p = cfg.parallel
        n_micro = r.extra["micro_batches_per_step"]
        est = plan(mc, model_params(mc), args.gpus, p.tp, p.cp, p.ep, seq, cfg.train.micro_batch_size, n_micro,
                   p.sequence_parallel, p.zero1, 2, 400.0, mc.num_mtp_layers > 0, cp_attention=p.cp_attention,
                   fsdp=p.fsdp, dp_replicate=p.dp_replicate, gather_bytes=2)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    rl = cfg.rl
    print(f"{args.config}: {mc.num_layers} layers ({mc.num_mtp_layers} MTP), {mc.num_experts} experts, "
          f"tp={p.tp} cp={p.cp} ep={p.ep} fsdp={p.fsdp} recompute={p.activation_checkpointing}, fp8 {cfg.fp8.recipe}; "
          f"{args.gpus} trainer ranks x {args.gpu_mem:g} GiB")
    print(f"  step: {cfg.train.groups_per_step} groups x {cfg.rollout.group_size} episodes = "
          f"{r.extra['samples_per_rank']} samples per data-parallel rank, "
          f"{n_micro} micro-batches of {cfg.train.micro_batch_size} x {seq} tokens")
    print(f"  RL loss: pg_loss={rl.pg_loss}, kl_coef={rl.kl_coef} ({rl.kl_estimator}, {rl.kl_placement}), "
          f"router_replay={rl.router_replay}, mismatch_mask={rl.mismatch_mask} (quantile {rl.mismatch_quantile}, "
          f"bound {rl.mismatch_bound}); forward passes measured: "
          + ", ".join(f"{k} {v}" for k, v in r.extra["forwards"].items()))
    trained = len(r.extra["parameters"]) - len(r.extra["without_grad"])
    print(f"  gradients reached {trained} of {len(r.extra['parameters'])} parameters"
          + (f" (none: {', '.join(sorted({n.split('.')[0] + '.' + n.split('.')[1] for n in r.extra['without_grad']}))})"
             if r.extra["without_grad"] else ""))
    print(f"  {'kind':22s} {'estimate GiB':>13s} {'simulated GiB':>14s}")
    for k in [*ESTIMATED, *sorted(set(r.by_kind) - set(ESTIMATED))]:
        v = r.by_kind.get(k, 0)
        e = f"{est['mem'][k] / GiB:13.2f}" if k in ESTIMATED else f"{'-':>13s}"
        if v or k in ESTIMATED:
            print(f"  {k:22s} {e} {v / GiB:14.2f}")
    pk = est["peak"]
    print(f"  the estimate's peak is a pretraining step's {pk['phase']} moment (LM + MTP loss; no reference policy, "
          "no extra passes, no RL inputs): " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in pk["terms"].items() if v
                                                          and k not in ESTIMATED) + " GiB")
    total = est["total_full"] if p.activation_checkpointing == "full" else est["total_none"]
    ratio = r.peak_bytes / total
    print(f"  {'peak':22s} {total / GiB:13.2f} {r.peak_bytes / GiB:14.2f}   "
          f"(sim/est {ratio:.2f}, {(ratio - 1) * 100:+.1f}%)")
    fits = r.peak_bytes <= args.gpu_mem * GiB
    print(f"  estimate {total / GiB:.2f} GiB: {fit_text(total, args.gpu_mem)}")
    print(f"  measured peak {r.peak_bytes / GiB:.2f} GiB of {args.gpu_mem:g} GiB: "
          f"{fit_text(r.peak_bytes, args.gpu_mem)}; {r.seconds:.0f} s")
    print("  assumptions:")
    for a in r.assumptions:
        print(f"    - {a}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
