"""Per-rank host memory of a training start from a Hugging Face checkpoint, measured on 4 CPU ranks (gloo).

Writes a DeepSeek-V3-style checkpoint (MLA, routed + shared experts, sigmoid routing, bf16, the config.json
transformers loads; a few hundred million parameters, tiny vocabulary) to a temp dir, then launches
torchrun --nproc-per-node 4 twice in the same run:
  sharded -- the training core's start (training/core.py:build_model): meta build, layout (FSDP x ep2), each
             rank allocating its shards and reading only its slices of the checkpoint (load_hf_shards),
             then one optimizer step, so that gradients and AdamW moments exist;
  whole   -- the previous start, the baseline: every rank builds the whole model in float32, loads the
             whole checkpoint into a second whole model, copies it over, then shards it (ep2).
Per rank it prints the process baseline (resident memory once the libraries are loaded: after a tiny model took
the same start and one step in the same process, and was freed; the raw figure after imports is printed too), the peak
resident set (ru_maxrss: anonymous and mapped-file pages) after the start and after the step, the training
state's share (16 bytes x parameters / 4: float32 parameters, gradients and two AdamW moments, sharded 4
ways), and the working set (peak after the step - baseline - share) against the checkpoint's size; +start and
+step are the peaks above the baseline. The sharded start runs twice: with glibc's default allocator
settings, and with MALLOC_MMAP_THRESHOLD_=65536 (rows "sharded*"), under which freed blocks over 64 KiB go
back to the OS at once: by default glibc raises its mmap threshold to up to 32 MiB after the first frees, so
FSDP's freed all-gather and gradient buffers of the blocks stay resident in the heap and the peak RSS counts
memory the process no longer uses (a layer-count effect: more, smaller blocks fall under the threshold).

    python benchmarks/hf_import_memory.py                  # ~300M parameters; a few minutes on 2 cores
    python benchmarks/hf_import_memory.py --layers 4       # smaller
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

WORLD = 4


def rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def model_config(args):
    from megatron_composer.model import get_preset

    return get_preset("tiny-deepseek-v3").replace(
        vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers, num_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=2048,
        moe_intermediate_size=args.moe_ffn, num_experts=args.experts, num_experts_per_tok=2, num_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, num_mtp_layers=1)


def make_checkpoint(args, path: Path) -> tuple[int, int]:
    """Random bf16 weights in the hub layout, written tensor by tensor; returns (parameters, bytes on disk)."""
    from megatron_composer.checkpoint.hf import write_hf_checkpoint
    from megatron_composer.model import Transformer

    cfg = model_config(args)
    with torch.device("meta"):
        model = Transformer(cfg)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers())
    shapes = {n: tuple(t.shape) for n, t in named.items() if n != "rope.inv_freq"}
    g = torch.Generator().manual_seed(0)

    def tensor(name):
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name])
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shapes[name])
        return torch.randn(shapes[name], generator=g) * 0.02

    write_hf_checkpoint(path, cfg, shapes, tensor, torch.bfloat16, max_shard_bytes=args.shard_mb << 20,
                        progress=False)
    n = sum(t.numel() for t in model.parameters())
    return n, sum(f.stat().st_size for f in path.glob("*.safetensors"))


def worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron_composer.checkpoint.hf import load_hf_checkpoint
    from megatron_composer.fp8 import FP8Config
    from megatron_composer.model import Transformer
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.parallel.slices import local_tensor
    from megatron_composer.training.core import InitialWeights, TrainingCore
    from megatron_composer.training.layout import Layout
    from megatron_composer.training.optim import OptimizerConfig

    cfg = model_config(args)
    out = {"raw_baseline": rss_now()}
    # The process baseline: libraries loaded by a tiny model taking the same path (meta-device construction
    # loads torch's meta kernels, sympy and triton; FSDP, the first forward and backward load theirs), freed.
    tiny = argparse.Namespace(**{**vars(args), "layers": 2, "hidden": 128, "experts": 4, "moe_ffn": 64})
    tiny_cfg = model_config(tiny).replace(q_lora_rank=32, kv_lora_rank=32, intermediate_size=128)
    core = TrainingCore(tiny_cfg, {}, Layout(ParallelConfig(fsdp=True, ep=2)), torch.device("cpu"),
                        optim=OptimizerConfig(warmup_steps=0), fp8=FP8Config(), seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))

    def loss_of(model):  # the main head and the MTP head, so that every parameter has a gradient and moments
        def loss_fn(_):
            out = model(ids[:, :-1], mtp=True)
            loss = sum(F.cross_entropy(lg.flatten(0, 1).float(), ids[:, 1:].flatten())
                       for lg in [out.logits, *out.mtp_logits])
            return loss, {}
        return loss_fn
    core.step(loss_of(core.model), [0], lr=1e-4)
    del core
    gc.collect()
    dist.barrier()
    baseline = rss_now()
    out["baseline"] = baseline
    if args.mode == "sharded":
        layout = Layout(ParallelConfig(fsdp=True, ep=2))
        core = TrainingCore(cfg, {}, layout, torch.device("cpu"), optim=OptimizerConfig(warmup_steps=0),
                            fp8=FP8Config(), seed=0, init=InitialWeights(hf=args.path))
        out["start_peak"] = rss_peak()
        core.step(loss_of(core.model), [0], lr=1e-4)
        out["step_peak"] = rss_peak()
        out["local_params"] = sum(local_tensor(p).numel() for p in core.model.parameters())
    else:  # the previous start: the whole model twice on every rank during import, then sharded
        torch.manual_seed(0)
        model = Transformer(cfg)
        hf = load_hf_checkpoint(args.path, progress=False)
        model.load_state_dict(hf.state_dict(), strict=False)
        del hf
        model = Layout(ParallelConfig(ep=2)).parallelize(model)
        out["start_peak"] = rss_peak()
        out["local_params"] = sum(p.numel() for p in model.parameters())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, mode: str, path: Path, result: Path, **env_extra) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), __file__, "--worker", "--mode", mode,
           "--path", str(path), "--result", str(result), "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--experts", str(args.experts), "--moe-ffn", str(args.moe_ffn)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-ffn", type=int, default=512)
    ap.add_argument("--shard-mb", type=int, default=128, help="checkpoint shard file size")
    ap.add_argument("--skip-whole", action="store_true", help="do not measure the whole-model baseline")
    ap.add_argument("--skip-mmap", action="store_true", help="do not repeat the sharded run with a fixed mmap threshold")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="sharded", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    gib = 1 << 30
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hf"
        n, ckpt_bytes = make_checkpoint(args, path)
        print(f"checkpoint: {n / 1e6:.0f}M parameters, {ckpt_bytes / gib:.3f} GiB bf16 in "
              f"{len(list(path.glob('*.safetensors')))} files; {WORLD} ranks")
        share = 16 * n / WORLD
        runs = {"sharded": launch(args, "sharded", path, Path(tmp) / "sharded.json")}
        if not args.skip_mmap:
            runs["sharded*"] = launch(args, "sharded", path, Path(tmp) / "sharded_mmap.json",
                                      MALLOC_MMAP_THRESHOLD_=str(64 << 10))
        if not args.skip_whole:
            runs["whole"] = launch(args, "whole", path, Path(tmp) / "whole.json")
    print(f"training-state share per rank (16 B x params / {WORLD}): {share / gib:.3f} GiB")
    print(f"{'start':8} {'rank':>4} {'raw base':>9} {'baseline':>9} {'+start':>8} {'+step':>8} {'local params':>12} "
          f"{'working set':>11} {'/ checkpoint':>12}")
    for mode, ranks in runs.items():
        for r, m in enumerate(ranks):
            base = m["baseline"]
            line = (f"{mode:8} {r:4d} {m['raw_baseline'] / gib:8.3f}G {base / gib:8.3f}G "
                    f"{(m['start_peak'] - base) / gib:7.3f}G ")
            if "step_peak" in m:  # working set: the peak above baseline and the training state's share
                working = m["step_peak"] - base - share
                line += (f"{(m['step_peak'] - base) / gib:7.3f}G {m['local_params'] / 1e6:11.1f}M "
                         f"{working / gib:10.3f}G {working / ckpt_bytes:12.2f}")
            else:
                line += f"{'-':>8} {m['local_params'] / 1e6:11.1f}M {'-':>11} {'-':>12}"
            print(line)
    for mode in ("sharded", "sharded*"):
        if mode in runs:
            worst = max(m["step_peak"] - m["baseline"] - share for m in runs[mode])
            print(f"{mode}: worst working set {worst / gib:.3f} GiB = {worst / ckpt_bytes:.2f} x the checkpoint "
                  f"(target: well under 1/3)")
    if "sharded*" in runs:
        print("sharded*: the same run with MALLOC_MMAP_THRESHOLD_=65536: glibc returns freed blocks over 64 KiB to "
              "the OS at once; by default its threshold grows to 32 MiB and freed FSDP all-gather buffers stay "
              "resident in the heap")
    if "whole" in runs:
        old = max(m["start_peak"] - m["baseline"] for m in runs["whole"])
        new = max(m["start_peak"] - m["baseline"] for m in runs["sharded"])
        print(f"import peak above baseline: whole-model start {old / gib:.3f} GiB, sharded start {new / gib:.3f} GiB "
              f"(ratio {old / new:.1f}x)")


if __name__ == "__main__":
    main()
