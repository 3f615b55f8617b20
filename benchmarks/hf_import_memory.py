"""Per-rank host memory of a training start from a Hugging Face checkpoint, measured on 4 CPU ranks (gloo).

Writes a DeepSeek-V3-style checkpoint (MLA, routed + shared experts, sigmoid routing, bf16, the config.json
transformers loads; a few hundred million parameters, tiny vocabulary) to a temp dir, then launches
torchrun --nproc-per-node 4 several times in the same run:
  sharded       -- the run as users launch it: the training core's start (training/core.py:build_model: meta
                   build, layout FSDP x ep2, each rank allocating its shards and reading only its slices of the
                   checkpoint, load_hf_shards), then --steps optimizer steps, so that gradients and AdamW moments
                   exist. build_model fixes glibc's mmap threshold (megatron_composer/host_memory.py);
  sharded-glibc -- the same with glibc's default allocator settings (MC_MALLOC_DEFAULTS=1), the baseline of
                   the allocator setting: its working set and its step time;
  sharded-mmap=N -- (on request) the same with MALLOC_MMAP_THRESHOLD_=N from the environment: another threshold;
  whole         -- the previous start, the baseline of the import: every rank builds the whole model in float32,
                   loads the whole checkpoint into a second whole model, copies it over, then shards it (ep2).
Per rank it prints the process baseline (resident memory once the libraries are loaded: after a tiny model took
the same start and one step in the same process, and was freed; the raw figure after imports is printed too),
the peak resident set (VmHWM: anonymous and mapped-file pages) above it per phase (import, forward, backward
with the gradient reduction, optimizer step; the worst over the steps), the training state's share (16 bytes x
parameters / 4: float32 parameters, gradients and two AdamW moments, sharded 4 ways), and the working set (the
run's peak - baseline - share) against the checkpoint's size, PASS when every rank is under 1/3. Next to each
phase's peak RSS it prints the most memory malloc had handed out (live) in that phase: the difference is what
the allocator kept after free. The cost of the allocator setting: each sharded run's step CPU time (user +
system of the 4 ranks, the sampler thread's excluded; median over steps 2..) and wall time against the
glibc-default run's, as ratios (CPU time is the steadier figure on a shared machine).

The imported model's logits equal transformers' for this architecture in this layout (fsdp x ep2, 4 ranks):
tests/distributed/test_checkpoint_hf_dist.py (tests/distributed/workers/hf_worker.py); --check-logits repeats that
check here, for this checkpoint (rank 0 of the sharded run against transformers' DeepseekV3ForCausalLM, float32).

    python benchmarks/hf_import_memory.py                  # ~300M parameters; ~15 minutes on 2 busy cores
    python benchmarks/hf_import_memory.py --check-logits   # and the logits against transformers'
    python benchmarks/hf_import_memory.py --layers 16 --hidden 512 --experts 8 --moe-ffn 256 --steps 2 \
        --runs sharded,sharded-glibc                       # the smaller model of tests/e2e/test_hf_import_memory.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from megatron_composer.host_memory import malloc_in_use, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

WORLD = 4
GIB = 1 << 30
LAYOUTS = {"fsdp": dict(fsdp=True), "fsdp_ep2": dict(fsdp=True, ep=2), "fsdp_tp2": dict(fsdp=True, tp=2),
           # FSDP's gathers and gradients in bf16 (what parallel.fsdp_param_dtype=auto picks on a GPU)
           "fsdp_bf16": dict(fsdp=True, fsdp_param_dtype="bfloat16"),
           "fsdp_tp2_bf16": dict(fsdp=True, tp=2, fsdp_param_dtype="bfloat16")}


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
                        progress=False, quantize="int4-experts" if args.int4 else None)
    n = sum(t.numel() for t in model.parameters())
    return n, sum(f.stat().st_size for f in path.glob("*.safetensors"))


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads): a step's cost that, unlike its wall time, other
    load on a shared machine barely changes; the allocator's page faults and mmap calls are system time."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class PhaseMeter:
    """Per phase of a run: the resident set's high-water mark (VmHWM, reset at each phase's end) and the most bytes
    malloc had handed out (live memory, sampled every millisecond by a thread); their difference is what the
    allocator kept after free."""

    def __init__(self):
        self.phases: list[dict] = []
        self._live = malloc_in_use() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        reset_peak_rss()

    def _sample(self):
        while not self._stop.wait(0.001):
            self._live = max(self._live, malloc_in_use() or 0)
            self.cpu = time.thread_time()  # the sampler's own CPU time, not counted in a step's

    cpu = 0.0

    def mark(self, phase: str, **extra) -> None:
        """The phase `phase` ends now."""
        self.phases.append({"phase": phase, "peak_rss": peak_rss_bytes(),
                            "peak_live": max(self._live, malloc_in_use() or 0), **extra})
        self._live = malloc_in_use() or 0
        reset_peak_rss()

    def close(self):
        self._stop.set()
        self._thread.join()


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron_composer.checkpoint.hf import load_hf_checkpoint
    from megatron_composer.fp8 import FP8Config
    from megatron_composer.model import Transformer
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.parallel.slices import local_tensor
    from megatron_composer.parallel.vocab_parallel import vocab_parallel_cross_entropy
    from megatron_composer.training.core import InitialWeights, TrainingCore
    from megatron_composer.training.layout import Layout
    from megatron_composer.training.optim import OptimizerConfig

    cfg = model_config(args)
    out = {"raw_baseline": rss_bytes()}
    # The process baseline: libraries loaded by a tiny model taking the same path (meta-device construction
    # loads torch's meta kernels, sympy and triton; FSDP, the first forward and backward load theirs), freed.
    tiny = argparse.Namespace(**{**vars(args), "layers": 2, "hidden": 128, "experts": 4, "moe_ffn": 64})
    tiny_cfg = model_config(tiny).replace(q_lora_rank=32, kv_lora_rank=32, intermediate_size=128)
    parallel = ParallelConfig(**LAYOUTS[args.layout])
    core = TrainingCore(tiny_cfg, {}, Layout(parallel), torch.device("cpu"),
                        optim=OptimizerConfig(warmup_steps=0), fp8=FP8Config(), seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    meter = None

    def loss_of(model):  # the main head and the MTP head, so that every parameter has a gradient and moments
        tp_group = model._mc_groups.tp_group

        def loss_fn(_):
            out = model(ids[:, :-1], mtp=True)  # vocab-parallel logits under tp
            loss = sum(vocab_parallel_cross_entropy(lg, ids[:, 1:], tp_group).mean()
                       for lg in [out.logits, *out.mtp_logits])
            if meter is not None:
                meter.mark("forward")
            return loss, {}
        return loss_fn
    core.step(loss_of(core.model), [0], lr=1e-4)
    del core
    gc.collect()
    dist.barrier()
    baseline = rss_bytes()
    out["baseline"], out["live_baseline"] = baseline, malloc_in_use() or 0
    meter = PhaseMeter()
    if args.mode == "sharded":
        layout = Layout(parallel)
        core = TrainingCore(cfg, {}, layout, torch.device("cpu"), optim=OptimizerConfig(warmup_steps=0),
                            fp8=FP8Config(), seed=0, init=InitialWeights(hf=args.path))
        meter.mark("import")
        out["local_params"] = sum(local_tensor(p).numel() for p in core.model.parameters())
        # the backward (and the gradient reduction) ends when the optimizer step begins
        core.optimizer.register_step_pre_hook(lambda *_: meter.mark("backward"))
        core.optimizer.register_step_post_hook(lambda *_: meter.mark("optimizer"))
        step_times, step_cpu = [], []
        for _ in range(args.steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), cpu_seconds() - meter.cpu
            core.step(loss_of(core.model), [0], lr=1e-4)
            step_times.append(time.perf_counter() - t0)
            step_cpu.append(cpu_seconds() - meter.cpu - c0)
        out["step_times"], out["step_cpu"] = step_times, step_cpu
        if args.logits:
            del core
            with torch.no_grad():
                fixed = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(1))[None, :16]
                core = TrainingCore(cfg, {}, layout, torch.device("cpu"), optim=OptimizerConfig(warmup_steps=0),
                                    fp8=FP8Config(), seed=0, init=InitialWeights(hf=args.path))
                core.model.eval()
                logits = core.model(fixed)  # the main head's logits (this rank's vocabulary shard under tp)
                tp_group = layout.groups.tp_group
                shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(shards, logits.contiguous(), group=tp_group)
                logits = torch.cat(shards, dim=-1)
                if dist.get_rank() == 0:
                    torch.save({"ids": fixed, "logits": logits.float()}, args.logits)
    else:  # the previous start: the whole model twice on every rank during import, then sharded
        torch.manual_seed(0)
        model = Transformer(cfg)
        hf = load_hf_checkpoint(args.path, progress=False)
        model.load_state_dict(hf.state_dict(), strict=False)
        del hf
        model = Layout(ParallelConfig(ep=2)).parallelize(model)
        meter.mark("import")
        out["local_params"] = sum(p.numel() for p in model.parameters())
    meter.close()
    out["phases"] = meter.phases
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


def launch(args, mode: str, path: Path, result: Path, logits: Path | None = None, **env_extra) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), __file__, "--worker", "--mode", mode,
           "--path", str(path), "--result", str(result), "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--experts", str(args.experts), "--moe-ffn", str(args.moe_ffn), "--steps", str(args.steps),
           "--layout", args.layout]
    if logits is not None:
        cmd += ["--logits", str(logits)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def phase_peaks(rank: dict) -> dict[str, tuple[int, int]]:
    """Per phase, the worst (over the steps) peak RSS and peak live bytes, each above its baseline."""
    out: dict[str, tuple[int, int]] = {}
    for p in rank["phases"]:
        rss, live = out.get(p["phase"], (0, 0))
        out[p["phase"]] = (max(rss, p["peak_rss"] - rank["baseline"]),
                           max(live, p["peak_live"] - rank["live_baseline"]))
    return out


def transformers_logits_error(path: Path, logits_file: Path) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its report lists the MTP layer, which transformers does not load
    hf_logging.disable_progress_bar()
    ours = torch.load(logits_file)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(ours["ids"]).logits
    return (theirs - ours["logits"]).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-ffn", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per sharded run")
    ap.add_argument("--layout", default="fsdp_ep2", choices=sorted(LAYOUTS), help="the sharded runs' layout on 4 ranks")
    ap.add_argument("--int4", action="store_true", help="the checkpoint's routed experts in Kimi K2.5's INT4 "
                    "(compressed-tensors pack-quantized), dequantised on each rank's boxes")
    ap.add_argument("--target", type=float, default=1 / 3, help="PASS when the working set is under this share of "
                    "the checkpoint")
    ap.add_argument("--shard-mb", type=int, default=128, help="checkpoint shard file size")
    ap.add_argument("--runs", default="sharded,sharded-glibc,whole",
                    help="which of sharded, sharded-glibc, whole to launch, and sharded-mmap=N: the sharded start "
                         "with MALLOC_MMAP_THRESHOLD_=N from the environment (another fixed threshold)")
    ap.add_argument("--json", help="also write the per-rank figures (bytes) to this file")
    ap.add_argument("--check-logits", action="store_true",
                    help="compare the sharded start's logits with transformers' (loads the model in float32 here)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="sharded", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--logits", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    wanted = args.runs.split(",")
    envs = {"sharded": {}, "sharded-glibc": {"MC_MALLOC_DEFAULTS": "1"}, "whole": {}}
    envs.update({r: {"MALLOC_MMAP_THRESHOLD_": r.split("=", 1)[1]} for r in wanted if r.startswith("sharded-mmap=")})
    unknown = [r for r in wanted if r not in envs]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {list(envs)}")
    logits_error = None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hf"
        n, ckpt_bytes = make_checkpoint(args, path)
        print(f"checkpoint: {n / 1e6:.0f}M parameters, {ckpt_bytes / GIB:.3f} GiB "
              f"{'bf16 with INT4 experts' if args.int4 else 'bf16'} in "
              f"{len(list(path.glob('*.safetensors')))} files; {WORLD} ranks")
        runs = {}
        for mode in wanted:
            logits = Path(tmp) / "logits.pt" if args.check_logits and mode == "sharded" else None
            runs[mode] = launch(args, "whole" if mode == "whole" else "sharded", path, Path(tmp) / f"{mode}.json",
                                logits, **envs[mode])
            if logits is not None:
                logits_error = transformers_logits_error(path, logits)
    share = 16 * n / WORLD
    print(f"layout {args.layout}; training-state share per rank (16 B x params / {WORLD}): {share / GIB:.3f} GiB; "
          f"target: working set < {args.target:.2f} x the checkpoint = {ckpt_bytes * args.target / GIB:.3f} GiB")
    print("peak RSS above the baseline per phase, GiB (worst over the steps); in brackets the most bytes malloc had "
          "handed out above the baseline's in the same phase (live)")
    phases = ["import", "forward", "backward", "optimizer"]
    print(f"{'run':20} {'rank':>4} {'raw base':>8} {'baseline':>8} " + " ".join(f"{p:>15}" for p in phases)
          + f" {'peak RSS':>8} {'working':>8} {'/ ckpt':>6}")
    worst: dict[str, float] = {}
    summary = {"checkpoint_bytes": ckpt_bytes, "parameters": n, "share": share, "runs": {}}
    for mode, ranks in runs.items():
        for r, m in enumerate(ranks):
            by = phase_peaks(m)
            summary["runs"].setdefault(mode, []).append(
                {"baseline": m["baseline"], "peak_above_baseline": max(v[0] for v in by.values()),
                 "phases": {p: {"rss": v[0], "live": v[1]} for p, v in by.items()}})
            cells = " ".join(f"{by[p][0] / GIB:7.3f}({by[p][1] / GIB:6.3f})" if p in by else f"{'-':>15}"
                             for p in phases)
            peak = max(v[0] for v in by.values())
            line = f"{mode:20} {r:4d} {m['raw_baseline'] / GIB:8.3f} {m['baseline'] / GIB:8.3f} {cells} " \
                   f"{(m['baseline'] + peak) / GIB:8.3f}"
            if mode != "whole":
                working = peak - share
                worst[mode] = max(worst.get(mode, -1e30), working)
                line += f" {working / GIB:8.3f} {working / ckpt_bytes:6.2f}"
            print(line)
    for mode, w in worst.items():
        verdict = "PASS" if w < ckpt_bytes * args.target else "FAIL"
        print(f"{mode}: worst working set {w / GIB:.3f} GiB = {w / ckpt_bytes:.3f} x the checkpoint: {verdict} "
              f"(target < {args.target:.2f})")
    if "sharded-glibc" in runs:
        def per_step(ranks, key):  # summed over the ranks, median over the steps after the first (warm)
            steps = range(1, args.steps) if args.steps > 1 else range(1)
            return statistics.median(sum(m[key][i] for m in ranks) for i in steps)
        for key, what in (("step_cpu", "CPU time (user + system, 4 ranks)"),
                          ("step_times", "wall time (sum of ranks)")):
            base = per_step(runs["sharded-glibc"], key)
            for mode in runs:
                if mode.startswith("sharded") and mode != "sharded-glibc":
                    print(f"step {what}: {mode} / sharded-glibc = {per_step(runs[mode], key) / base:.2f} "
                          f"({per_step(runs[mode], key):.1f} s vs {base:.1f} s)")
    if "whole" in runs and "sharded" in runs:
        def import_peak(ranks):
            return max(phase_peaks(m)["import"][0] for m in ranks)
        old, new = import_peak(runs["whole"]), import_peak(runs["sharded"])
        print(f"import peak above baseline: whole-model start {old / GIB:.3f} GiB, sharded start {new / GIB:.3f} GiB "
              f"(ratio {old / new:.1f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "logits_error": logits_error}, indent=1))
    if logits_error is not None:
        print(f"logits of the sharded start vs transformers' DeepseekV3ForCausalLM (float32): max abs error "
              f"{logits_error:.2e}: {'PASS' if logits_error <= 1e-4 else 'FAIL'} (<= 1e-4)")


if __name__ == "__main__":
    main()
