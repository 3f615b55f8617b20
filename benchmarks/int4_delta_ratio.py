"""Delta ratio of routed experts published as the engine serves them (INT4) against bf16, after AdamW steps.

One DeepSeek-V3-style MoE (benchmarks/weight_sync.py's shapes at --size, fp32 masters) trains --steps real optimizer
steps (AdamW at --lr on a random-token LM loss). After the initial weights and after every step two publishers
write the same model to their own stores: the baseline publishes every tensor in bf16 (what a bf16 engine holds),
the other with `experts="int4"` (rollout.quantize_experts=int4: the routed experts as their pack-quantized INT4
words and bf16 group scales, the rest in bf16). Printed per step and in the mean over the delta versions:

* the routed experts' delta ratio in each form: compressed XOR-delta bytes / raw bytes of a full copy in that form
  (what an engine holding that form downloads per version, over what a snapshot in that form would be);
* the routed experts' delta bytes of INT4 over bf16's (what a node fetches per version, INT4 against bf16);
* the fraction of the experts' elements whose bits did not change.

    python benchmarks/int4_delta_ratio.py                      # 4 steps at the Kimi K2.5 RL lr 1e-6 (~1 min)
    python benchmarks/int4_delta_ratio.py --lr 1e-5 --steps 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from weight_sync import SIZES, model_config  # noqa: E402  (the same model shapes as that benchmark)


def main(argv=None) -> None:
    from megatron_composer.checkpoint import int4
    from megatron_composer.fp8.config import FP8Config
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.training.config import OptimizerConfig
    from megatron_composer.training.core import TrainingCore
    from megatron_composer.training.layout import Layout
    from rl.weight_sync import ObjectStore, WeightPublisher

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (delta versions after the snapshot)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (the kimi-k2.5 RL recipe's)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1 (a delta needs a step)")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    mc = model_config(args.size)
    optim = OptimizerConfig(lr=args.lr, min_lr=args.lr, warmup_steps=0, schedule="constant", weight_decay=0.1,
                            grad_clip=1.0)
    core = TrainingCore(mc, {}, Layout(ParallelConfig()), torch.device("cpu"), optim=optim, fp8=FP8Config(),
                        seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    def loss_fn(_):
        ids = torch.randint(0, mc.vocab_size, (1, args.seq + 1), generator=gen)
        logits = core.model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()), {}

    def experts_of(model) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.named_parameters() if int4.is_routed_expert(n)}

    n_experts = sum(t.numel() for t in experts_of(core.model).values())
    print(f"model: tiny-deepseek-v3 shape {SIZES[args.size]} (hidden, layers, experts, expert width, vocab), "
          f"{sum(p.numel() for p in core.model.parameters()) / 1e6:.1f}M parameters of which {n_experts / 1e6:.1f}M "
          f"routed experts; {args.steps} AdamW steps at lr {args.lr:g}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="int4_delta_") as tmp:
        forms = {"bf16": None, "int4": "int4"}
        pubs = {form: WeightPublisher(ObjectStore(f"{tmp}/{form}"), snapshot_interval=args.steps + 1,
                                      keep_snapshots=None, dtype=torch.bfloat16, threads=2, experts=experts)
                for form, experts in forms.items()}
        for version in range(args.steps + 1):
            if version:
                core.step(loss_fn, [0], args.lr)
            row = {}
            for form, pub in pubs.items():
                # the experts alone, cast as the engine holds them (bf16) or quantised from the fp32 masters
                experts = experts_of(core.model)
                row[form] = pub.publish({n: t.to(torch.bfloat16) for n, t in experts.items()} if form == "bf16"
                                        else experts, version)
            if version:
                rows.append(row)
                b, q = row["bf16"], row["int4"]
                print(f"step {version}: experts bf16 delta ratio {b.delta_ratio:.4f} (unchanged "
                      f"{b.identical_fraction:.3f}), int4 {q.delta_ratio:.4f} (unchanged {q.identical_fraction:.3f}); "
                      f"int4 / bf16 delta bytes {q.delta_bytes / b.delta_bytes:.3f}", flush=True)
    mean = {form: sum(r[form].delta_ratio for r in rows) / len(rows) for form in ("bf16", "int4")}
    per_version = {form: sum(r[form].delta_bytes for r in rows) / len(rows) for form in ("bf16", "int4")}
    full = {form: rows[0][form].full_bytes for form in ("bf16", "int4")}
    print(f"routed experts per version (mean of {len(rows)}): bf16 {per_version['bf16'] / 1e3:.1f} kB of "
          f"{full['bf16'] / 1e6:.1f} MB (delta ratio {mean['bf16']:.4f}); int4 {per_version['int4'] / 1e3:.1f} kB of "
          f"{full['int4'] / 1e6:.1f} MB (delta ratio {mean['int4']:.4f})")
    print(f"int4 / bf16 experts' bytes per version: {per_version['int4'] / per_version['bf16']:.3f} "
          f"(raw size ratio {full['int4'] / full['bf16']:.3f})")


if __name__ == "__main__":
    main()
