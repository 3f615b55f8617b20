"""Forward+backward tokens/s of our model versus transformers' DeepseekV3ForCausalLM with identical weights.

Both sides run in the same process, interleaved step by step, in float32 and bfloat16, each through its own
training loss (transformers' `labels=` loss; our trainer's pretrain_loss, which fuses the output head into the
cross-entropy where it can), and the losses are checked equal;
transformers is run with each of its expert implementations (eager loop, grouped_mm, batched_mm) and the
fastest is the baseline. MFU is quoted against the peak matmul FLOP/s of the same dtype measured in this run.

Times are medians over --steps rounds after one warm-up round. batched_mm gathers a weight copy per (token,
expert) pair (about 1 GiB per layer at the default size) and is tens of times slower; freeing that much makes
the allocator hand memory back to the system, so whichever step ran next paid to fault it in again. It is
therefore timed in its own rounds after the interleaved ones (--batched-steps, 0 to skip it).

    python benchmarks/model_forward_backward.py [--layers 4 --hidden 256 --experts 32 --topk 4 --seq 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.checkpoint.hf import load_hf_checkpoint  # noqa: E402
from megatron_composer.training.flops import measure_matmul_peak, training_flops_per_token  # noqa: E402
from pretrain.losses import MTPLossConfig, fused_head_applies, pretrain_loss, token_counts  # noqa: E402


def build_reference(args):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=8, n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=args.topk,
        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg)


def transformers_model(cfg, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa"):
    """transformers' DeepseekV3ForCausalLM (or Qwen3MoeForCausalLM) of our ModelConfig's shape, randomly
    initialised directly on `device` (no checkpoint round trip: for timing, not for comparing outputs)."""
    import transformers

    from megatron_composer.checkpoint.hf import config_to_hf

    hf = config_to_hf(cfg, dtype)
    config_name = {"deepseek_v3": "DeepseekV3Config", "qwen3_moe": "Qwen3MoeConfig"}[hf["model_type"]]
    config_cls = getattr(transformers, config_name)
    model_cls = getattr(transformers, hf["architectures"][0])
    config = config_cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type", "dtype")})
    config._attn_implementation = attn_implementation
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype)


def step_fn(model, ids, hf: bool, mtp_weight: float = 0.0):
    """One training step's forward+backward through each library's own next-token loss: transformers'
    `labels=` path (its ForCausalLMLoss) and our pretraining trainer's forward + `pretrain_loss` (MTP
    self-distillation included when mtp_weight > 0; transformers' DeepseekV3 has no MTP head to train).
    Returns a callable that runs one step and returns the loss (its `.item()` waits for the device)."""
    mask = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    mask[:, -1] = 0
    batch = {"labels": F.pad(ids[:, 1:], (0, 1)), "loss_mask": mask,
             "position_ids": torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)}
    mtp_cfg = MTPLossConfig(weight=mtp_weight)
    depths = model.config.num_mtp_layers if mtp_weight > 0 and not hf else 0
    counts = token_counts(batch, depths).to(ids.device)

    def run():
        if hf:
            loss = model(ids, labels=ids).loss
        else:
            fused = fused_head_applies(model, mtp_cfg)
            out = model(ids, batch["position_ids"], logits=not fused, return_hidden=True, mtp=depths > 0)
            loss, _ = pretrain_loss(out, batch, mtp_cfg, counts, head_weight=model.output.weight if fused else None)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()
    return run


def time_rounds(runners: dict, steps: int, before=None) -> dict[str, list[float]]:
    """Seconds per call of each runner over `steps` interleaved rounds after one warm-up round (not timed).
    `before(name)`, if given, runs untimed before each call (e.g. switching an implementation). The device
    is synchronised before each clock read, so queued work is counted where it belongs."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for it in range(steps + 1):
        for name, run in runners.items():
            if before is not None:
                before(name)
            _sync()
            t0 = time.perf_counter()
            run()
            _sync()
            if it:
                times[name].append(time.perf_counter() - t0)
    return times


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batched-steps", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()

    ref = build_reference(args)
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        ours = load_hf_checkpoint(tmp, dtype=torch.float32, progress=False)
    ours.train()
    ref.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (ours(ids) - ref(ids).logits).abs().max().item()
    print(f"config: layers={args.layers} hidden={args.hidden} experts={args.experts} top{args.topk} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab}; float32 logits max|ours-transformers| = {err:.2e}")
    loss_ours, loss_ref = step_fn(ours, ids, hf=False)(), step_fn(ref, ids, hf=True)()
    print(f"float32 training loss: ours {loss_ours:.6f}, transformers {loss_ref:.6f}")
    if abs(loss_ours - loss_ref) > 1e-4 * abs(loss_ref):
        raise SystemExit("the two sides do not compute the same loss: "
                         "the timings below would not compare like with like")
    flops_tok = training_flops_per_token(ours.config, args.seq, include_mtp=False)
    tokens = args.batch * args.seq
    impls = ["eager", "grouped_mm"]
    print(f"{'dtype':9} {'implementation':28} {'tokens/s':>10} {'MFU':>7}   ours / this")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        ours.to(dtype)
        ref.to(dtype)
        peak = measure_matmul_peak(torch.device("cpu"), dtype, seconds=1.0)
        runners = {"ours": step_fn(ours, ids, hf=False)}
        impl_of = {f"transformers[{impl}]": impl for impl in impls}
        for name in impl_of:
            runners[name] = step_fn(ref, ids, hf=True)
        set_impl = lambda name: ref.set_experts_implementation(impl_of[name]) if name in impl_of else None  # noqa: E731
        times = time_rounds(runners, args.steps, set_impl)
        if args.batched_steps > 0:
            impl_of["transformers[batched_mm]"] = "batched_mm"
            times.update(time_rounds({"transformers[batched_mm]": step_fn(ref, ids, hf=True)}, args.batched_steps,
                                     set_impl))
        tps = {k: tokens / statistics.median(v) for k, v in times.items()}
        fastest_hf = max((k for k in tps if k != "ours"), key=tps.get)
        for name, value in tps.items():
            mfu = value * flops_tok / peak
            ratio = tps["ours"] / value
            print(f"{dtype_name:9} {name:28} {value:10.0f} {mfu:7.1%}   {ratio:5.2f}x")
        print(f"{dtype_name:9} peak matmul {peak / 1e12:.2f} TFLOP/s; ours vs fastest transformers ({fastest_hf}): "
              f"{tps['ours'] / tps[fastest_hf]:.2f}x")


if __name__ == "__main__":
    main()
