"""Training throughput of a model preset: tokens/s and MFU, against the matmul peak of this machine.

    python benchmarks/train_throughput.py --preset tiny-deepseek-v3 --seq-length 256 --batch 4 --steps 10

Baseline: the FLOP/s of a large square matmul measured in the same run on the same device and dtype
(`measure_matmul_peak`); MFU = model FLOPs per second (6 x active params + attention, MoE-aware) / that peak.
One step = forward with MTP, LM + MTP self-distillation loss, backward, AdamW.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_composer.model import Transformer, get_preset  # noqa: E402
from megatron_composer.training.flops import measure_matmul_peak, training_flops_per_token  # noqa: E402
from megatron_composer.training.optim import OptimizerConfig, build_optimizer  # noqa: E402
from pretrain.losses import MTPLossConfig, pretrain_loss, token_counts  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-deepseek-v3")
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = get_preset(args.preset)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    opt = build_optimizer(model, OptimizerConfig())
    mtp_cfg = MTPLossConfig(weight=0.3 if cfg.num_mtp_layers else 0.0)
    B, S = args.batch, args.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), device=device)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(B, S, device=device),
             "position_ids": torch.arange(S, device=device).expand(B, S)}
    counts = token_counts(batch, cfg.num_mtp_layers if mtp_cfg.weight else 0).to(device)
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16
           else torch.autocast(device.type, enabled=False))

    def step():
        with ctx:
            out = model(batch["tokens"], batch["position_ids"], mtp=mtp_cfg.weight > 0)
        loss, _ = pretrain_loss(out, batch, mtp_cfg, counts)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    tok_s = B * S / dt
    model_flops = training_flops_per_token(cfg, S, include_mtp=mtp_cfg.weight > 0) * tok_s
    peak = measure_matmul_peak(device, dtype, n=4096 if device.type == "cuda" else 1024)
    print(f"{args.preset} on {device.type} ({dtype}): batch {B} x seq {S}, {dt * 1e3:.1f} ms/step, "
          f"{tok_s:.0f} tokens/s")
    print(f"model FLOP/s {model_flops / 1e9:.2f} G vs measured matmul peak {peak / 1e9:.2f} G "
          f"-> MFU {model_flops / peak:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
