"""Sharded weight publish and apply at 1, 2 and 4 trainer ranks, against one rank; host memory; delta ratio.

For each rank count n the script launches n gloo processes (torchrun); they build one DeepSeek-V3-style MoE
(fp32 masters) with the training core -- one process: the whole model; n > 1: FSDP over the n ranks, each
rank materialising only its shard -- and run ``--steps`` real optimizer steps (AdamW at the RL learning rate on
a random-token LM loss). After the initial weights (a snapshot) and after every step the RL trainer's
publisher (rl/weight_sync/publisher.py: every rank XORs the boxes it owns against its own previous version,
zstd, writes its objects; rank 0 writes the manifest after every owner confirmed) publishes a version in
--dtype. Measured per version and rank:

* publish: the rank's own raw bytes / its encode-and-write seconds (per rank), and the full model's bytes /
  the collective publish's seconds (aggregate: from the first rank starting to the version being visible);
* apply: each of n rollout ranks reconstructs its 1/n rows of every tensor of the last version from the store
  (snapshot plus deltas, read box by box: WeightSubscriber.reader), raw bytes of its rows / seconds per rank,
  the full model's bytes / the slowest rank's seconds in aggregate;
* host memory: every publishing rank samples its RSS while it publishes; peak - RSS just before the publish
  against the full model's bytes in --dtype (target: below half of them at 4 ranks);
* delta ratio: compressed delta bytes / raw bytes of the full model in --dtype (the size of a plain bf16
  copy, the baseline) -- the delta is the XOR of the bf16 bits the rollout engines run (cast from the fp32
  masters) against the previous version's bf16 bits, so it is what an engine downloads per step
  (target <= 1/20).

The aggregate figures are printed as ratios to the 1-rank figures of the same run. The ranks share this
machine's cores: aggregate throughput can grow only up to the number of free cores.

    python benchmarks/weight_sync.py                 # ~0.5B parameters (the memory target's size), 1/2/4 ranks
    python benchmarks/weight_sync.py --size small    # ~25M parameters: the same measurements in about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# hidden, layers, experts, expert width, vocab of the tiny-deepseek-v3 shape
SIZES = {"0.5b": (1024, 8, 40, 512, 32000), "small": (256, 4, 16, 128, 8000)}


def model_config(size: str):
    from megatron_composer.model import get_preset

    hidden, layers, experts, moe_width, vocab = SIZES[size]
    return get_preset("tiny-deepseek-v3").replace(
        hidden_size=hidden, num_layers=layers, num_experts=experts, moe_intermediate_size=moe_width,
        intermediate_size=3 * hidden, vocab_size=vocab, num_mtp_layers=0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS in a thread while the block runs: peak and the RSS at entry."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.peak, self.base = every_s, 0, 0

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def worker(args) -> None:
    """One rank of an n-rank run; rank 0 writes the results of every rank to args.out."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.training.config import OptimizerConfig
    from megatron_composer.training.core import TrainingCore
    from megatron_composer.training.layout import Layout
    from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber

    n = int(os.environ.get("WORLD_SIZE", 1))
    if n > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if n > 1 else 0
    torch.set_num_threads(1)
    mc = model_config(args.size)
    optim = OptimizerConfig(lr=args.lr, min_lr=args.lr, warmup_steps=0, schedule="constant", weight_decay=0.1,
                            grad_clip=1.0)
    core = TrainingCore(mc, {}, Layout(ParallelConfig(fsdp=n > 1)), torch.device("cpu"), optim=optim,
                        fp8=FP8Config(), seed=args.seed)
    store = ObjectStore(args.store)
    publisher = WeightPublisher(store, group=dist.group.WORLD if n > 1 else None, snapshot_interval=args.steps + 1,
                                keep_snapshots=None, dtype=getattr(torch, args.dtype), threads=1)
    gen = torch.Generator().manual_seed(args.seed + rank)

    def loss_fn(_):
        ids = torch.randint(0, mc.vocab_size, (1, args.seq + 1), generator=gen)
        logits = core.model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()), {}

    rows = []
    for version in range(args.steps + 1):
        if version:
            core.step(loss_fn, [0], args.lr)
        with PeakRSS() as mem:
            stats = publisher.publish(core.model, version)
        rows.append({"version": version, "snapshot": stats.is_snapshot, "seconds": stats.seconds,
                     "own_bytes": stats.own_bytes, "own_seconds": stats.own_seconds, "full_bytes": stats.full_bytes,
                     "delta_bytes": stats.delta_bytes, "identical": stats.identical_fraction,
                     "rss_base": mem.base, "rss_peak": mem.peak})
    # apply: rollout rank `rank` of n reconstructs its rows of every tensor of the last version
    if n > 1:
        dist.barrier()
    sub = WeightSubscriber(ObjectStore(args.store), threads=1)
    t0 = time.perf_counter()
    reader = sub.reader(args.steps)
    applied = 0
    for name in reader.names:
        shape = list(reader.meta[name][1])
        rows_ = slice(rank * shape[0] // n, (rank + 1) * shape[0] // n) if shape else slice(None)
        box = reader.read(name, (rows_,) + tuple(slice(None) for _ in shape[1:]) if shape else ())
        applied += box.numel() * box.element_size()
    apply_s = time.perf_counter() - t0
    out = {"rank": rank, "rows": rows, "apply_bytes": applied, "apply_seconds": apply_s,
           "downloaded": sub.bytes_downloaded,
           "params": sum(p.numel() for p in core.model.parameters()) if n == 1 else None}
    every = [None] * n
    if n > 1:
        dist.all_gather_object(every, out)
    else:
        every = [out]
    if rank == 0:
        Path(args.out).write_text(json.dumps(every))
    if n > 1:
        dist.destroy_process_group()


def launch(args, n: int, tmp: Path) -> list[dict]:
    out, store = tmp / f"ranks{n}.json", tmp / f"store{n}"
    cmd = [sys.executable, __file__, "--worker", "--size", args.size, "--steps", str(args.steps), "--lr", str(args.lr),
           "--dtype", args.dtype, "--seq", str(args.seq), "--seed", str(args.seed), "--store", str(store),
           "--out", str(out)]
    if n > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr",
               "127.0.0.1", "--master-port", str(29700 + n), *cmd[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True)
    print(f"  ({n} rank(s): {time.perf_counter() - t0:.0f}s including model build and {args.steps} steps)", flush=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--ranks", default="1,2,4", help="trainer rank counts to measure (the first is the baseline)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (delta versions after the snapshot)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (the kimi-k2.5 RL recipe's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="published dtype")
    ap.add_argument("--seq", type=int, default=32, help="tokens per step per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.steps < 1:
        ap.error("--steps must be >= 1 (the delta ratio needs a step)")
    ranks = [int(r) for r in args.ranks.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="weight_sync_bench_") as tmp:
        for n in ranks:
            results[n] = launch(args, n, Path(tmp))
    base = results[ranks[0]]
    params = base[0]["params"] or 0
    full = base[0]["rows"][0]["full_bytes"]
    print(f"\nmodel: tiny-deepseek-v3 shape {SIZES[args.size]} (hidden, layers, experts, expert width, vocab)"
          + (f": {params / 1e6:.0f}M parameters" if params else "")
          + f"; published in {args.dtype}: {full / 1e9:.3f} GB per full version; {args.steps} AdamW steps at lr "
          f"{args.lr:g}; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")

    def figures(every: list[dict]) -> dict:
        deltas = [i for i, r in enumerate(every[0]["rows"]) if not r["snapshot"]]
        own = [sum(r["rows"][i]["own_bytes"] for i in deltas) / sum(r["rows"][i]["own_seconds"] for i in deltas)
               for r in every]
        wall = sum(max(r["rows"][i]["seconds"] for r in every) for i in deltas)
        apply_wall = max(r["apply_seconds"] for r in every)
        return {"per_rank": sum(own) / len(own), "aggregate": full * len(deltas) / wall,
                "apply_per_rank": sum(r["apply_bytes"] / r["apply_seconds"] for r in every) / len(every),
                "apply_aggregate": sum(r["apply_bytes"] for r in every) / apply_wall,
                "rss": max(r["rss_peak"] - r["rss_base"] for e in every for r in e["rows"]),
                "rss_delta": max(e["rows"][i]["rss_peak"] - e["rows"][i]["rss_base"] for e in every for i in deltas),
                "ratio": [every[0]["rows"][i]["delta_bytes"] / full for i in deltas],
                "identical": [every[0]["rows"][i]["identical"] for i in deltas]}

    figs = {n: figures(results[n]) for n in ranks}
    b = figs[ranks[0]]
    print(f"\n{'ranks':>5} | {'publish GB/s per rank':>21} {'aggregate':>9} {'x 1-rank':>8} | "
          f"{'apply GB/s per rank':>19} {'aggregate':>9} {'x 1-rank':>8} | {'peak RSS growth / full':>22}")
    for n in ranks:
        f = figs[n]
        print(f"{n:>5} | {f['per_rank'] / 1e9:>21.3f} {f['aggregate'] / 1e9:>9.3f} "
              f"{f['aggregate'] / b['aggregate']:>8.2f} | "
              f"{f['apply_per_rank'] / 1e9:>19.3f} {f['apply_aggregate'] / 1e9:>9.3f} "
              f"{f['apply_aggregate'] / b['apply_aggregate']:>8.2f} | "
              f"{f['rss'] / full:>6.3f} (snapshot), {f['rss_delta'] / full:.3f} (delta)")
    last = ranks[-1]
    f = figs[last]
    verdict = "MEETS" if f["rss"] < full / 2 else "MISSES"
    print(f"\npeak RSS growth per publishing rank at {last} ranks: {f['rss'] / 1e6:.0f} MB over the RSS before "
          f"the publish = {f['rss'] / full:.3f} of the full model's {full / 1e6:.0f} MB (target < 0.5) -> {verdict}")
    ratio = max(f["ratio"])
    print(f"delta bytes / full {args.dtype} bytes after each step: "
          + ", ".join(f"1/{1 / r:.1f}" for r in f["ratio"])
          + f" (bit-identical elements {', '.join(f'{x:.1%}' for x in f['identical'])}); worst 1/{1 / ratio:.1f} "
          f"(target <= 1/20) -> {'MEETS' if ratio <= 1 / 20 else 'MISSES'}")
    grows = all(figs[a]["aggregate"] < figs[c]["aggregate"] for a, c in zip(ranks, ranks[1:]))
    scaling = ", ".join(f"{n}: {figs[n]['aggregate'] / b['aggregate']:.2f}x" for n in ranks)
    print(f"aggregate publish throughput grows with ranks: {'yes' if grows else 'NO'} "
          f"({scaling} of {ranks[0]} rank)")


if __name__ == "__main__":
    main()
