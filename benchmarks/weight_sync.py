"""Lossless delta weight sync after realistic RL steps, against sending the full bf16 model.

A >= 100M-parameter DeepSeek-V3-style MoE is built on the meta device and materialised on CPU. Each step runs
AdamW (lr 1e-6, as in RL fine-tuning) on fp32 master weights with random gradients, casts to bf16 (routers stay
fp32) and publishes the version. Printed per version: delta bytes against the full bf16 bytes (the baseline: a
plain copy of the published state dict), the fraction of bit-identical weights, encode and decode throughput.
Two subscribers reconstruct every version (one following each version, one joining at the end from the latest
snapshot plus deltas) and every tensor is asserted bit-identical to what was published.

    python benchmarks/weight_sync.py                      # ~115M parameters, 20 steps, snapshot every 10
    python benchmarks/weight_sync.py --store s3://bucket/prefix   # same through S3 (s3fs credentials from env)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_composer.model import Transformer, get_preset  # noqa: E402
from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber  # noqa: E402


def published_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer sends: bf16 weights; routers and buffers (expert bias) in fp32, as their precision
    decides expert choice."""
    params = {id(p) for p in model.parameters()}
    return {name: t.detach().to(torch.bfloat16) if id(t) in params and ".router." not in name else t.detach().clone()
            for name, t in model.state_dict(keep_vars=True).items()}


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8)) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (versions after the initial one)")
    ap.add_argument("--snapshot-interval", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--level", type=int, default=1, help="zstd level")
    ap.add_argument("--store", default=None, help="directory or s3://bucket/prefix (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 20:
        ap.error(f"--steps {args.steps}: the bit-exactness proof needs at least 20 versions")

    torch.manual_seed(args.seed)
    cfg = get_preset("tiny-deepseek-v3").replace(
        hidden_size=args.hidden, num_layers=args.layers, num_experts=args.experts, vocab_size=32000,
        moe_intermediate_size=args.hidden // 2, intermediate_size=3 * args.hidden)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.reset_parameters()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: tiny-deepseek-v3 shape hidden={args.hidden} layers={args.layers} experts={args.experts} "
          f"vocab=32000 -> {n_params / 1e6:.1f}M parameters (fp32 master weights, published as bf16 + fp32 routers)")
    if n_params < 100e6:
        print("WARNING: fewer than 100M parameters; raise --hidden/--layers/--experts for the reference setting")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    tmp = None
    if args.store is None:
        tmp = tempfile.TemporaryDirectory(prefix="weight_sync_bench_")
        url = tmp.name
    else:
        url = args.store
    store = ObjectStore(url)
    publisher = WeightPublisher(store, snapshot_interval=args.snapshot_interval, keep_snapshots=2,
                                compression_level=args.level)
    follower = WeightSubscriber(store)

    print(f"store: {url}; zstd level {args.level}; snapshot every {args.snapshot_interval} versions; "
          f"{publisher.threads} encode threads")
    print(f"{'ver':>4} {'kind':>8} {'written MB':>10} {'delta MB':>9} {'full/delta':>10} {'identical':>10} "
          f"{'enc GB/s':>9} {'dec GB/s':>9}")
    ratios, identical, enc_rates, dec_rates = [], [], [], []
    full_bytes = snapshot_bytes = 0
    for version in range(args.steps + 1):
        if version:
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state = published_state(model)
        stats = publisher.publish(state, version)
        t0 = time.perf_counter()
        got = follower.fetch(version)
        dec_s = time.perf_counter() - t0
        assert bits_equal(got, state), f"version {version} is not bit-exact"
        full_bytes = stats.full_bytes
        enc_rate, dec_rate = stats.full_bytes / stats.seconds / 1e9, stats.full_bytes / dec_s / 1e9
        if stats.is_snapshot:
            snapshot_bytes = stats.snapshot_bytes
        if version:   # the follower downloads only the delta; rates are per full-model equivalent
            ratios.append(stats.delta_bytes / stats.full_bytes)
            identical.append(stats.identical_fraction)
            if not stats.is_snapshot:
                enc_rates.append(enc_rate)
            dec_rates.append(dec_rate)
        print(f"{version:>4} {'snapshot' if stats.is_snapshot else 'delta':>8} {stats.bytes_written / 1e6:>10.2f} "
              f"{stats.delta_bytes / 1e6:>9.2f} "
              f"{(stats.full_bytes / stats.delta_bytes if stats.delta_bytes else float('nan')):>10.1f} "
              f"{(stats.identical_fraction if stats.identical_fraction is not None else float('nan')):>10.4%} "
              f"{enc_rate:>9.3f} {dec_rate:>9.3f}", flush=True)

    late = WeightSubscriber(ObjectStore(url))
    t0 = time.perf_counter()
    assert bits_equal(late.fetch(), state), "late joiner's reconstruction is not bit-exact"
    late_s = time.perf_counter() - t0
    mean_ratio = sum(ratios) / len(ratios)
    print()
    print(f"baseline: full bf16 state dict = {full_bytes / 1e6:.1f} MB per version "
          f"(zstd snapshot of it: {snapshot_bytes / 1e6:.1f} MB = {snapshot_bytes / full_bytes:.3f} of full)")
    print(f"delta bytes / full bf16 bytes: mean {mean_ratio:.4f} = 1/{1 / mean_ratio:.1f} "
          f"(min 1/{1 / max(ratios):.1f}, max 1/{1 / min(ratios):.1f}; target <= 1/10, anchor ~1/20) "
          f"-> {'MEETS' if mean_ratio <= 0.1 else 'MISSES'} target")
    print(f"against the zstd-compressed full copy (no XOR): delta is 1/{snapshot_bytes / (mean_ratio * full_bytes):.1f} of it")
    print(f"bit-identical bf16/fp32 weights between versions: mean {sum(identical) / len(identical):.4%} "
          f"(min {min(identical):.4%})")
    print(f"encode (XOR + zstd + write, delta versions): mean {sum(enc_rates) / len(enc_rates):.3f} GB/s of model; "
          f"decode (read + verify + zstd + XOR): mean {sum(dec_rates) / len(dec_rates):.3f} GB/s of model")
    print(f"(throughputs on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end of the run)")
    print(f"late joiner (snapshot {late.version - (late.version % args.snapshot_interval)} + deltas -> {late.version}): "
          f"{late.bytes_downloaded / 1e6:.1f} MB in {late_s:.2f}s")
    print(f"bit-exact reconstruction: {args.steps + 1} versions by the follower and the latest by a late joiner, "
          f"snapshot interval {args.snapshot_interval}: OK")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
