"""The parts of the one-command GPU check (benchmarks/gpu_check.py runs each as its own process with its own
time budget). `python benchmarks/gpu_check_parts.py PART --out part.json --budget SECONDS [--reduced]` runs
one part and rewrites part.json after every verdict, so a part stopped at its budget keeps what it found.

The same code runs on CUDA and, reduced (small sizes), on the CPU in CI; a verdict that means something only
on CUDA (a CUDA result against the CPU float32 reference, NCCL) is computed on the CPU as well but recorded
as skipped, with the reason, so CI exercises the code without claiming what it cannot show.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from megatron_composer.model import ModelConfig, Transformer, count_parameters, get_preset  # noqa: E402

# Relative Frobenius errors against the CPU float32 reference: (outputs and the whole gradient, each parameter's
# gradient). float32 on CUDA (no TF32) differs only in summation order; bfloat16 rounds every operand, and an
# expert that few tokens reach has a gradient of few terms, so its relative error is the largest.
FP32_TOL = (1e-4, 1e-3)
BF16_TOL = (3e-2, 0.25)
FP8_LOSS_TOL = 2e-2  # relative difference of an FP8 recipe's training loss from bf16's on the same batch
FP8_KEEP_TINY = "tok_embeddings,output,router,*norm*,wkv_a"
NOT_CUDA = "no CUDA device: computed on the CPU against the CPU only to exercise this code"
OPTIONAL_PACKAGES = {"megatron-core": "megatron", "torchao": "torchao", "zstandard": "zstandard", "s3fs": "s3fs",
                     "transformer-engine": "transformer_engine", "triton": "triton", "transformers": "transformers"}


class Part:
    """Verdicts and figures of one part, written to its JSON file after each one."""

    def __init__(self, name: str, out: Path, budget_s: float, reduced: bool):
        self.name, self.out, self.reduced = name, out, reduced
        self.t0 = time.time()
        self.deadline = self.t0 + budget_s
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.data = {"part": name, "device": self.device.type, "reduced": reduced, "checks": [], "figures": {},
                     "notes": [], "skipped": None}
        self.flush()

    def time_left(self) -> float:
        return self.deadline - time.time()

    def flush(self) -> None:
        self.data["seconds"] = round(time.time() - self.t0, 2)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(self.out)

    def check(self, name: str, ok: bool, detail: str = "", cuda_only: bool = False, **values) -> bool:
        status = "pass" if ok else "fail"
        entry = {"name": name, "status": status, "detail": detail, **values}
        if cuda_only and not self.cuda:
            entry.update(status="skipped", reason=NOT_CUDA, computed_status=status)
        self.data["checks"].append(entry)
        print(f"  {entry['status'].upper():7s} {name}  {detail}", flush=True)
        self.flush()
        return ok

    def skip(self, name: str, reason: str) -> None:
        self.data["checks"].append({"name": name, "status": "skipped", "reason": reason})
        print(f"  SKIPPED {name}: {reason}", flush=True)
        self.flush()

    def skip_part(self, reason: str) -> None:
        self.data["skipped"] = reason
        print(f"  SKIPPED {self.name}: {reason}", flush=True)
        self.flush()

    def figure(self, key: str, value) -> None:
        self.data["figures"][key] = value
        self.flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        print(f"  note: {text}", flush=True)
        self.flush()

    def attempt(self, name: str, fn, *args, **kwargs):
        """Run one group of checks; an exception becomes a failed verdict and the part goes on."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a crash is a verdict; the remaining checks still run
            self.check(name, False, f"raised {type(e).__name__}: {str(e)[:400]}",
                       traceback=traceback.format_exc()[-3000:])
            return None


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    raise TypeError(f"not JSON: {type(x)}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float64 (||a|| when ref is zero); NaN anywhere gives inf."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    denom = ref.norm().item()
    return (a - ref).norm().item() / denom if denom > 0 else a.norm().item()


# ---------------------------------------------------------------- environment

def part_env(p: Part) -> None:
    import importlib.metadata
    import importlib.util

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": p.device.type, "cpu_count": os.cpu_count()}
    for label, mod in OPTIONAL_PACKAGES.items():
        env[f"has_{label}"] = importlib.util.find_spec(mod) is not None
    for mod in ("triton", "transformers"):
        if env[f"has_{mod}"]:
            env[f"{mod}_version"] = importlib.metadata.version(mod)
    if p.cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   gpu_memory_gib=round(props.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,"
                                  "temperature.gpu", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=15)
            env["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            env["nvidia_smi"] = f"unavailable: {e}"
    p.figure("environment", env)
    print("  " + json.dumps(env), flush=True)
    from megatron_composer.training.flops import measure_matmul_peak

    n = 8192 if p.cuda else 256
    peak = measure_matmul_peak(p.device, torch.bfloat16, seconds=1.0 if p.cuda else 0.2, n=n)
    p.figure("bf16_matmul_tflops", peak / 1e12)
    p.figure("bf16_matmul_n", n)
    if p.cuda:
        x = torch.randn(512 << 20, device=p.device, dtype=torch.bfloat16)  # 1 GiB, far past the L2
        y = torch.empty_like(x)
        y.copy_(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        p.figure("copy_tb_per_s", 2 * x.numel() * 2 / statistics.median(times) / 1e12)  # bytes read + written
    print(f"  bf16 matmul {p.data['figures']['bf16_matmul_tflops']:.1f} TFLOP/s (n={n})", flush=True)


# ---------------------------------------------------------------- correctness: the model on the device

def _loss(out, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of the main head plus the MTP heads' (depth k predicts token t+1+k)."""
    V = out.logits.shape[-1]
    loss = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))
    for k, m in enumerate(out.mtp_logits or [], start=1):
        loss = loss + F.cross_entropy(m[:, :-1 - k].float().reshape(-1, V), ids[:, 1 + k:].reshape(-1))
    return loss


def _forward_backward(model, ids, routed=None):
    out = model(ids, mtp=True, return_routing=True, routed_experts=routed)
    loss = _loss(out, ids)
    loss.backward()
    grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, loss.detach(), grads


def _compare(p: Part, label: str, out, loss, grads, ref_out, ref_loss, ref_grads, tols: tuple[float, float],
             cuda_only: bool) -> None:
    tol, tol_param = tols
    errs = {"logits": rel_err(out.logits, ref_out.logits),
            "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for k, (m, r) in enumerate(zip(out.mtp_logits or [], ref_out.mtp_logits or []), start=1):
        errs[f"mtp{k}_logits"] = rel_err(m, r)
    missing = sorted(set(ref_grads) ^ set(grads))
    per_param = {n: rel_err(grads[n], g) for n, g in ref_grads.items() if n in grads}
    worst = max(per_param, key=per_param.get)
    all_grads = rel_err(torch.cat([grads[n].flatten().double().cpu() for n in per_param]),
                        torch.cat([ref_grads[n].flatten().double() for n in per_param]))
    errs["grads_all"] = all_grads
    ok = max(errs.values()) < tol and per_param[worst] < tol_param and not missing
    detail = " ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f"; worst grad {worst} {per_param[worst]:.1e}"
    if missing:
        detail += f"; gradients present on one side only: {missing[:4]}"
    p.check(label, ok, detail + f" (tolerance {tol:g}, per parameter {tol_param:g})", cuda_only=cuda_only,
            errors=errs, worst_grad=[worst, per_param[worst]], tolerance=[tol, tol_param])


def _parity_one(p: Part, preset: str, B: int, S: int) -> None:
    torch.manual_seed(0)
    cfg = get_preset(preset)
    ref = Transformer(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    ref_out, ref_loss, ref_grads = _forward_backward(ref, ids)
    routed = ref_out.routed_experts
    dev_ids = ids.to(p.device)

    # float32 on the device, routing replayed from the CPU run (a near tie may route differently in
    # another summation order; that is measured separately below)
    model = copy.deepcopy(ref).to(p.device)
    out, loss, grads = _forward_backward(model, dev_ids, routed.to(p.device))
    _compare(p, f"{preset} float32 {p.device.type} vs CPU (forward, MTP, backward)", out, loss, grads,
             ref_out, ref_loss, ref_grads, FP32_TOL, cuda_only=True)
    free = model(dev_ids, return_routing=True).routed_experts
    same = (free.sort(-1).values.cpu() == routed.sort(-1).values).all(-1).float().mean().item()
    p.check(f"{preset} float32 free routing: expert sets equal to the CPU's", same >= 0.99,
            f"{same:.2%} of (layer, token) expert sets (>= 99%)", cuda_only=True, agreement=same)

    # router replay on the device: the recorded experts reproduce the forward, and the router keeps its gradient
    with torch.no_grad():
        rec = model(dev_ids, return_routing=True)
        again = model(dev_ids, routed_experts=rec.routed_experts)
    e = rel_err(again, rec.logits)
    out = model(dev_ids, routed_experts=rec.routed_experts)
    out.float().logsumexp(-1).mean().backward()
    router_grads = [m.weight.grad for n, m in model.named_modules() if n.endswith("feed_forward.router")]
    g = sum(float(x.norm()) for x in router_grads if x is not None) if router_grads else 0.0
    model.zero_grad(set_to_none=True)
    # not bit-equal on CUDA: index_add's atomics sum the experts' outputs in no fixed order
    p.check(f"{preset} router replay on {p.device.type}: same logits, router has gradient", e < 1e-5 and g > 0,
            f"replayed vs recorded logits {e:.1e} (< 1e-5); router gradient norm {g:.2e}")
    del model

    # bfloat16 on the device vs the float32 CPU reference
    model = copy.deepcopy(ref).to(p.device, torch.bfloat16)
    out, loss, grads = _forward_backward(model, dev_ids, routed.to(p.device))
    _compare(p, f"{preset} bfloat16 {p.device.type} vs float32 CPU", out, loss, grads, ref_out, ref_loss, ref_grads,
             BF16_TOL, cuda_only=False)


def part_model_parity(p: Part) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the default, stated: float32 is compared as float32
    torch.backends.cudnn.allow_tf32 = False
    B, S = (2, 32) if p.reduced else (2, 128)
    for preset in ("tiny-deepseek-v3", "tiny-kimi-k2.5", "tiny-qwen3-moe"):
        if p.time_left() < 5:
            p.skip(preset, "part budget spent")
            continue
        p.attempt(f"{preset} parity", _parity_one, p, preset, B, S)


# ---------------------------------------------------------------- correctness: FP8 kernels

def triton_on_cuda(p: Part, needs: str, cpu_test: str) -> bool:
    """Whether a Triton part can run (CUDA and triton; the interpreter off); otherwise the part is skipped, naming
    the CPU test that checks the same kernels with TRITON_INTERPRET=1."""
    if not p.cuda:
        p.skip_part(f"needs {needs}; on the CPU {cpu_test} checks the same kernels with TRITON_INTERPRET=1")
        return False
    try:
        import triton  # noqa: F401
    except ImportError as e:
        p.skip_part(f"triton is not importable: {e}")
        return False
    os.environ.pop("TRITON_INTERPRET", None)
    return True


def part_fp8_kernels(p: Part) -> None:
    if not triton_on_cuda(p, "a CUDA GPU with FP8 tensor cores", "tests/unit/fp8/test_fp8_kernels.py"):
        return
    import fp8_gpu

    fp8_gpu.LISTENERS.append(lambda name, ok, detail: p.check(f"fp8 {name}", ok, detail))  # recorded as they come
    fp8_gpu.run_correctness()


# ---------------------------------------------------------------- correctness: engine vs transformers generate

def hf_copy(model: Transformer, dtype: torch.dtype, device: torch.device):
    """transformers' model with our weights, through the Hugging Face checkpoint export (MTP layers dropped)."""
    from transformers import AutoModelForCausalLM
    from transformers import logging as hf_logging

    from megatron_composer.checkpoint.hf import save_hf_checkpoint

    hf_logging.set_verbosity_error()  # its load report lists the MTP layers it drops
    nbytes = sum(t.numel() for t in model.parameters()) * torch.finfo(dtype).bits // 8
    shm = Path("/dev/shm")  # memory-backed where there is room: the export of a 2.4B model is 5 GB
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 3 * nbytes else None
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        save_hf_checkpoint(model, Path(tmp) / "hf", progress=False, dtype=dtype)
        ref = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=dtype).to(device).eval()
    ref.generation_config.eos_token_id = None  # always generate exactly max_new_tokens, like the engine
    ref.generation_config.pad_token_id = 0
    return ref


def part_engine_greedy(p: Part) -> None:
    from megatron_composer.inference import Engine

    B, P, N = (2, 8, 8) if p.reduced else (4, 16, 24)
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-deepseek-v3")).eval().to(p.device)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist() for _ in range(B)]
    ref = hf_copy(model, torch.float32, p.device)
    engine = Engine(model, max_batch_size=8, cache_memory_bytes=64 << 20)
    ours = engine.generate(prompts, max_new_tokens=N)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor(prompts, device=p.device), max_new_tokens=N, do_sample=False)[:, P:].tolist()
    same = sum(r.token_ids == t for r, t in zip(ours, theirs))
    p.check(f"engine greedy == transformers generate, float32 on {p.device.type}", same == B,
            f"{same}/{B} prompts x {N} tokens equal")
    spec = engine.generate(prompts, max_new_tokens=N, speculative=True, num_draft_tokens=2)
    same = sum(a.token_ids == b.token_ids for a, b in zip(spec, ours))
    p.check(f"speculative (MTP, 2 drafts) greedy == plain greedy, float32 on {p.device.type}", same == B,
            f"{same}/{B} prompts equal")
    # bfloat16: rounding may flip near-ties, so this is a figure, not a verdict
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    ref16 = hf_copy(model16, torch.bfloat16, p.device)
    ours16 = Engine(model16, max_batch_size=8, cache_memory_bytes=64 << 20).generate(prompts, max_new_tokens=N)
    with torch.no_grad():
        theirs16 = ref16.generate(torch.tensor(prompts, device=p.device), max_new_tokens=N,
                                  do_sample=False)[:, P:].tolist()
    agree = sum(sum(a == b for a, b in zip(r.token_ids, t)) for r, t in zip(ours16, theirs16)) / (B * N)
    p.figure("bf16_token_agreement_vs_transformers", agree)


# ---------------------------------------------------------------- correctness: training steps through the entrypoint

def _sft_corpus(path: Path, n: int) -> None:
    """Chat conversations cut from Python standard-library sources (SFT data needs no megatron-core)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [t for f in sorted((stdlib / "json").glob("*.py")) for t in f.read_text().split("\n\n") if len(t) > 80]
    with path.open("w") as f:
        for i in range(n):
            code = texts[i % len(texts)][:600]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Write snippet {i} of the json module."},
                                             {"role": "assistant", "content": code}]}) + "\n")


def _train_run(p: Part, work: Path, label: str, overrides: list[str], steps: int, timeout: float) -> None:
    run_dir = work / f"run{len(list(work.glob('run*')))}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "pretrain_composer.py"), "--config", str(work / "train.yaml"), f"run.dir={run_dir}",
           f"train.steps={steps}", *overrides]
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # its own process group: on a timeout torchrun's worker goes too, instead of holding the GPU for later parts
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        p.check(f"training steps ({label})", False, f"pretrain_composer.py did not finish within {timeout:.0f} s")
        return
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    print(r.stdout[-3000:] + r.stderr[-3000:], flush=True)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    rows = [x for x in rows if "loss" in x]
    losses = [x["loss"] for x in rows]
    ok = r.returncode == 0 and len(rows) == steps and all(isinstance(v, float) and math.isfinite(v) for v in losses)
    detail = (f"exit {r.returncode}, {len(rows)}/{steps} steps logged, losses "
              + " ".join(f"{v:.3f}" for v in losses[:8]) + f"; {time.time() - t0:.0f} s")
    if r.returncode != 0:
        detail += "; stderr: " + r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else ""
    p.check(f"training steps ({label}) through pretrain_composer.py, 1 rank", ok, detail,
            tokens_per_s=rows[-1].get("tokens_per_s") if rows else None, mfu=rows[-1].get("mfu") if rows else None)


def part_train_steps(p: Part) -> None:
    work = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    try:
        _train_steps(p, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _train_steps(p: Part, work: Path) -> None:
    import yaml

    sys.path.insert(0, str(ROOT / "tools"))
    import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok_argv = ["--input", str(stdlib / "json"), "--output", str(work / "tok"), "--vocab-size", "512"]
    if train_tokenizer.main(tok_argv) != 0:
        return p.check("tokenizer for the training run", False, "tools/train_tokenizer.py failed")
    _sft_corpus(work / "chat.jsonl", 64)
    seq = 64 if p.reduced else 256
    (work / "train.yaml").write_text(yaml.safe_dump({
        "model": {"preset": "tiny-deepseek-v3"},
        "data": {"kind": "sft", "tokenizer": str(work / "tok"), "paths": [str(work / "chat.jsonl")],
                 "split": "90,10,0", "seq_length": seq},
        "train": {"global_batch_tokens": 4 * seq, "micro_batch_size": 2, "eval_interval": 0, "eval_samples": 0,
                  "seed": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "mtp": {"weight": 0.3},
        "checkpoint": {"interval": 1000},
        "logging": {"interval": 1},
    }))
    steps = 3 if p.reduced else 6
    backend = "nccl" if p.cuda else "gloo"  # pretrain_composer.py's choice
    _train_run(p, work, f"default data-parallel path, {backend}, {p.device.type}", [], steps,
               max(10.0, p.time_left() - 5))
    p.skip("training steps under FSDP", "this part runs one rank; parallel.fsdp is proven against one process on "
           "gloo ranks by tests/distributed/test_parallel_fsdp.py")
    if p.reduced:
        p.skip("training steps with fp8.recipe=mxfp8", "reduced mode runs the bf16 path only (the emulated FP8 "
               "training path is tested in tests/unit/fp8/test_fp8_linear.py)")
    elif p.time_left() > 30:
        # MLA's compressed kv + rope key (48 rows in the tiny preset) does not split into 32-blocks: kept in bf16
        _train_run(p, work, "fp8.recipe=mxfp8", ["fp8.recipe=mxfp8", f"fp8.keep_high_precision={FP8_KEEP_TINY}"], 4,
                   p.time_left() - 5)
    else:
        p.skip("training steps with fp8.recipe=mxfp8", "part budget spent")


# ---------------------------------------------------------------- training speed

def bench_config(reduced: bool, mtp: int = 0) -> ModelConfig:
    """A DeepSeek-V3-shaped MoE (MLA, 64 fine-grained sigmoid-routed experts top-6 + 1 shared, dense first
    layer) of about 2.4B parameters; reduced: the same shape at CPU size. Every dimension FP8 quantises is a
    multiple of 128 except MLA's compressed kv + rope key (kv_lora_rank + 64), kept in bf16 under blockwise."""
    if reduced:
        return ModelConfig(vocab_size=1024, hidden_size=128, num_layers=2, attention="mla", num_heads=4,
                           q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                           v_head_dim=64, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=128, num_shared_experts=1, first_k_dense_replace=1,
                           score_func="sigmoid", n_group=4, topk_group=2, expert_bias=True, norm_topk_prob=True,
                           routed_scaling_factor=2.5, num_mtp_layers=mtp, max_position_embeddings=4096)
    return ModelConfig(vocab_size=32768, hidden_size=2048, num_layers=8, attention="mla", num_heads=16,
                       q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       intermediate_size=8192, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=768,
                       num_shared_experts=1, first_k_dense_replace=1, score_func="sigmoid", n_group=8, topk_group=4,
                       expert_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=mtp,
                       max_position_embeddings=4096)


def fp8_recipes():
    """(label, FP8Config) for each recipe timed; blockwise keeps wkv_a (576 output rows) in bf16."""
    from megatron_composer.fp8 import FP8Config

    keep = FP8Config().keep_high_precision
    return [("mxfp8 (E4M3, E8M0 per 32)", FP8Config(recipe="mxfp8")),
            ("mxfp8 block 16", FP8Config(recipe="mxfp8", block_size=16)),
            ("blockwise 1x128/128x128", FP8Config(recipe="blockwise", keep_high_precision=[*keep, "wkv_a"]))]


def _speed_shape(p: Part) -> tuple[int, int, int]:
    """(batch, seq, timed rounds)"""
    return (1, 128, 1) if p.reduced else (2, 4096, 5)


def _peak(p: Part) -> float:
    from megatron_composer.training.flops import measure_matmul_peak

    return measure_matmul_peak(p.device, torch.bfloat16, seconds=1.0 if p.cuda else 0.2, n=8192 if p.cuda else 256)


def _speed_figures(p: Part, label: str, times: list[float], tokens: int, flops_tok: float, peak: float,
                   **extra) -> dict:
    tps = tokens / statistics.median(times)
    row = {"tokens_per_s": tps, "mfu": tps * flops_tok / peak, "step_s": statistics.median(times),
           "step_s_all": times, **extra}
    if p.cuda:
        row["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    print(f"  {label:40s} {tps:12.0f} tokens/s  MFU {row['mfu']:6.1%}", flush=True)
    return row


def part_train_speed(p: Part) -> None:
    from model_forward_backward import step_fn, time_rounds

    from megatron_composer.fp8 import apply_fp8
    from megatron_composer.fp8.backends import select_backend
    from megatron_composer.training.flops import training_flops_per_token

    B, S, rounds = _speed_shape(p)
    cfg = bench_config(p.reduced)
    counts = count_parameters(cfg)
    flops_tok = training_flops_per_token(cfg, S, include_mtp=False)
    peak = _peak(p)
    p.figure("config", {"total_params": counts["total"], "active_params": counts["active"], "batch": B, "seq": S,
                        "flops_per_token": flops_tok, "bf16_matmul_peak_tflops": peak / 1e12,
                        "mfu_against": "bf16 matmul peak measured in this process (FP8 rows too)"})
    torch.manual_seed(0)
    with torch.device(p.device):  # initialised where it runs: 2.4B parameters would take a while on the host
        base = Transformer(cfg)
    base = base.to(torch.bfloat16).train()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)).to(p.device)
    rows = {}
    loss_bf16 = step_fn(base, ids, hf=False)()
    rows["bf16"] = _speed_figures(p, "ours bf16", time_rounds({"bf16": step_fn(base, ids, hf=False)}, rounds)["bf16"],
                                  B * S, flops_tok, peak, loss=loss_bf16)
    p.figure("ours", rows)
    for label, fcfg in fp8_recipes():
        if p.time_left() < (20 if p.cuda else 3):
            p.skip(f"ours {label}", "part budget spent")
            continue

        def one(label=label, fcfg=fcfg):
            model = apply_fp8(copy.deepcopy(base), fcfg)
            backend = type(select_backend(fcfg)).__name__
            run = step_fn(model, ids, hf=False)
            loss = run()  # the first call compiles the FP8 kernels
            d = abs(loss - loss_bf16) / abs(loss_bf16)
            p.check(f"ours {label}: training loss vs bf16 on the same batch", d < FP8_LOSS_TOL,
                    f"{loss:.5f} vs {loss_bf16:.5f}, relative {d:.1e} (< {FP8_LOSS_TOL:g}); backend {backend}")
            times = time_rounds({label: run}, rounds)[label]
            speedup = statistics.median(rows["bf16"]["step_s_all"]) / statistics.median(times)
            rows[label] = _speed_figures(p, f"ours {label}", times, B * S, flops_tok, peak, loss=loss, backend=backend,
                                         speedup_vs_bf16=speedup)
            p.figure("ours", rows)
            del model
        p.attempt(f"ours {label}", one)
        if p.cuda:
            torch.cuda.empty_cache()


def part_train_speed_hf(p: Part) -> None:
    from model_forward_backward import step_fn, time_rounds, transformers_model

    from megatron_composer.training.flops import training_flops_per_token

    B, S, rounds = _speed_shape(p)
    cfg = bench_config(p.reduced)
    flops_tok = training_flops_per_token(cfg, S, include_mtp=False)
    peak = _peak(p)
    p.figure("config", {"batch": B, "seq": S, "flops_per_token": flops_tok, "bf16_matmul_peak_tflops": peak / 1e12})
    torch.manual_seed(0)
    ref = transformers_model(cfg, torch.bfloat16, p.device).train()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)).to(p.device)
    # batched_mm gathers a weight copy per (token, expert) pair: too large at the full size
    batched_bytes = B * S * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    rows = {}
    switch = hasattr(ref, "set_experts_implementation")
    if not switch:
        p.note("this transformers build has no set_experts_implementation: its default experts code is timed")
    for impl in ("grouped_mm", "eager", "batched_mm") if switch else ("default",):
        if impl == "batched_mm" and batched_bytes > 8 << 30:
            p.skip(f"transformers[{impl}]", f"would gather {batched_bytes / 2**30:.0f} GiB of expert weights per layer")
            continue
        if p.time_left() < (15 if p.cuda else 3):
            p.skip(f"transformers[{impl}]", "part budget spent")
            continue

        def one(impl=impl):
            if impl != "default":
                ref.set_experts_implementation(impl)
            run = step_fn(ref, ids, hf=True)
            loss = run()
            rows[impl] = _speed_figures(p, f"transformers[{impl}] bf16", time_rounds({impl: run}, rounds)[impl],
                                        B * S, flops_tok, peak, loss=loss)
            p.figure("transformers", rows)
        p.attempt(f"transformers[{impl}]", one)
    if rows:
        best = max(rows, key=lambda k: rows[k]["tokens_per_s"])
        p.figure("fastest", best)


# ---------------------------------------------------------------- decode

def part_decode(p: Part) -> None:
    from generate_throughput import compare_decode, compare_speculative, experts_implementations, load_pretrain_run

    from megatron_composer.inference import Engine

    run_dir = os.environ.get("GPU_CHECK_PRETRAIN_RUN")
    P, N = (8, 8) if p.reduced else (128, 64)
    batches = (1, 4) if p.reduced else (1, 16, 64)
    rounds = 1  # after a warm-up call; a GPU's decode times vary little, and the budget is short
    drafts = [2] if p.reduced else [1, 3]
    if run_dir:
        model, tokenizer, ckpt = load_pretrain_run(run_dir)
        from generate_throughput import text_prompts

        prompts = text_prompts(tokenizer, max(batches), P)
        source = f"trained checkpoint {ckpt}"
    else:
        torch.manual_seed(0)
        with torch.device(p.device):
            model = Transformer(bench_config(p.reduced, mtp=1)).eval()
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist() for _ in range(max(batches))]
        source = ("random weights: the MTP head is untrained, so acceptance is near zero "
                  "and speculative speedup is a lower bound")
    p.note(f"model: {source}; {count_parameters(model.config, include_mtp=True)['total'] / 1e9:.2f}B parameters, bf16, "
           f"prompt {P} + {N} new tokens, greedy")
    model = model.to(p.device, torch.bfloat16)
    ref = hf_copy(model, torch.bfloat16, p.device)
    impls, missing = experts_implementations(ref)
    impls = [i for i in impls if i != "batched_mm"]  # a weight copy per (token, expert): never the fastest here
    engine = Engine(model, max_batch_size=max(batches), cache_memory_bytes=(2 << 30) if p.cuda else (64 << 20))
    rows = []
    for B in batches:
        if p.time_left() < (10 if p.cuda else 2):
            p.skip(f"decode batch {B}", "part budget spent")
            continue
        got = p.attempt(f"decode batch {B}", compare_decode, engine, ref, impls, prompts, [B], N, rounds,
                        time.perf_counter)  # wall clock: the device is synchronised around each call
        rows += got or []
        p.figure("decode", rows)
    for B in sorted({r["batch"] for r in rows}):
        rates = {r["contender"]: r["tokens_per_s"] for r in rows if r["batch"] == B}
        theirs = [k for k in rates if k.startswith("transformers")]
        if not theirs:
            continue
        best = max(theirs, key=rates.get)
        p.figure(f"decode_ratio_batch{B}", {"vs": best, "ratio": rates["ours (Engine)"] / rates[best]})
    p.check("decode timed against transformers generate", bool(rows), f"{len(rows)} rows; implementations {impls}")
    spec = []
    for B in batches:
        if p.time_left() < (10 if p.cuda else 2):
            p.skip(f"speculative batch {B}", "part budget spent")
            continue
        got = p.attempt(f"speculative batch {B}", compare_speculative, engine, prompts, [B], N, drafts, rounds,
                        time.perf_counter)
        spec += got or []
        p.figure("speculative", spec)


def part_vllm(p: Part) -> None:
    """rollout.backend=vllm where vLLM is installed: its greedy tokens and log-probs against our engine (bf16 on
    CUDA: token agreement and the log-prob gap are figures, since rounding flips near-ties), its routed experts
    (vLLM's own enable_return_routed_experts on CUDA) against our router on the same tokens, then a weight
    update and the same comparison under the new weights; last, the experts served in Kimi K2.5's INT4 (Marlin
    on CUDA) against our model with the same INT4 experts."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        p.skip_part("vLLM is not installed in this environment (pip install 'megatron-composer[vllm]')")
        return
    from megatron_composer.inference import Engine
    from megatron_composer.inference.vllm_engine import VLLMEngine

    dtype = torch.bfloat16 if p.cuda else torch.float32
    torch.manual_seed(0)
    cfg = get_preset("tiny-qwen3-moe")
    model = Transformer(cfg).eval().to(p.device, dtype)
    engine = VLLMEngine(cfg, dtype=dtype, max_batch_size=8, max_seq_len=256, cache_memory_bytes=256 << 20, seed=0)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]

    def compare(label: str, version: int) -> None:
        ours = Engine(model).generate(prompts, max_new_tokens=8)
        theirs = engine.generate(prompts, max_new_tokens=8)
        agree = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x.token_ids, y.token_ids)) / (8 * len(prompts))
        gaps = []
        for x, y in zip(ours, theirs):  # log-probs along each shared prefix (after a flip the contexts differ)
            n = next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids))
            gaps += [abs(a - b) for a, b in zip(x.logprobs[:n + 1], y.logprobs[:n + 1])]
        gap = max(gaps)
        p.figure(f"{label}_token_agreement", agree)
        p.figure(f"{label}_logprob_gap", gap)
        same = total = 0
        for prompt, r in zip(prompts, theirs):  # our router on vLLM's own tokens
            with torch.no_grad():
                out = model(torch.tensor([prompt + r.token_ids[:-1]], device=p.device), return_routing=True)
            a = out.routed_experts[:, 0].sort(-1).values.cpu()
            b = r.routing_for_training().sort(-1).values
            same += int((a == b).all(-1).sum())
            total += a.shape[0] * a.shape[1]
        p.figure(f"{label}_routing_agreement", same / total)
        if dtype == torch.float32:
            p.check(f"vLLM routed experts == our router, float32 ({label})", same == total, f"{same}/{total}")
        p.check(f"vLLM tokens carry weight version {version} ({label})",
                all(r.weight_versions == [version] * len(r.token_ids) for r in theirs))
        if dtype == torch.float32:
            p.check(f"vLLM greedy == our engine, float32 ({label})", agree == 1.0 and gap <= 1e-5, f"gap {gap:.2e}")

    engine.update_weights({k: t.detach().cpu() for k, t in model.state_dict().items()}, 0)
    compare("initial", 0)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(0.01 * torch.randn_like(w))
    engine.update_weights({k: t.detach().cpu() for k, t in model.state_dict().items()}, 1)
    compare("after_update", 1)
    if not p.cuda:  # vLLM's CPU build has no kernel for compressed-tensors' symmetric INT4 MoE
        return
    from megatron_composer.checkpoint import int4

    del engine
    engine = VLLMEngine(cfg, dtype=dtype, max_batch_size=8, max_seq_len=256, cache_memory_bytes=256 << 20, seed=0,
                        quantize_experts="int4")
    engine.update_weights({k: t.detach().cpu() for k, t in model.state_dict().items()}, 2)
    with torch.no_grad():  # our model with the experts vLLM serves: on the INT4 grid
        for name, w in model.named_parameters():
            if ".experts." in name:
                for e in range(w.shape[0]):
                    w[e] = int4.fake_quantize(w[e].float()).to(dtype)
    compare("int4_experts", 2)


def part_xor_apply(p: Part) -> None:
    """The device-side apply of weight updates (kernels/xor_apply.py): a version's XOR delta, dense and sparse,
    applied in place to a tensor on the GPU equals the reference bit for bit and gives the new version; the
    apply's bandwidth (bytes of the base per second)."""
    if not triton_on_cuda(p, "a CUDA GPU", "tests/unit/kernels/test_kernels_xor_apply.py"):
        return
    from megatron_composer.kernels.xor_apply import SparseXor, int_view, xor_apply_, xor_apply_reference_

    g = torch.Generator().manual_seed(0)
    rows = 8192 if p.reduced else 65536
    for dtype, changed in ((torch.bfloat16, 0.03), (torch.int32, 0.0015)):  # the non-expert and INT4 word rates
        old = torch.randint(-2**15, 2**15 - 1, (rows, 2048), generator=g, dtype=torch.int32).to(dtype) \
            if dtype == torch.int32 else torch.randn(rows, 2048, generator=g).to(dtype)
        new = old.clone()
        mask = torch.rand(rows, 2048, generator=g) < changed
        int_view(new)[mask] ^= 1  # flip the lowest bit of the changed elements
        bits = int_view(old) ^ int_view(new)
        for label, delta in (("dense", bits), ("sparse", SparseXor.from_dense(bits))):
            warm = torch.zeros(64, dtype=dtype, device=p.device)  # compile the kernel before timing it
            xor_apply_(warm, torch.zeros(64, dtype=dtype) if label == "dense" else SparseXor.from_dense(
                int_view(torch.ones(64, dtype=dtype))))
            base = old.to(p.device, copy=True)
            sync(p.device)
            t0 = time.perf_counter()
            xor_apply_(base, delta)
            sync(p.device)
            seconds = time.perf_counter() - t0
            ref = xor_apply_reference_(old.clone(), delta)
            ok = torch.equal(int_view(base).cpu(), int_view(ref)) and torch.equal(int_view(ref), int_view(new))
            nbytes = base.numel() * base.element_size()
            p.check(f"xor_apply {label} {str(dtype).split('.')[-1]}", ok,
                    f"{nbytes / 2**20:.0f} MiB base, {changed:.2%} changed, {nbytes / seconds / 1e9:.1f} GB/s "
                    "(with the delta's host-to-device copy)")
            p.figure(f"xor_apply_{label}_{str(dtype).split('.')[-1]}_GBps", nbytes / seconds / 1e9)


PARTS = {"env": part_env, "model_parity": part_model_parity, "fp8_kernels": part_fp8_kernels,
         "engine_greedy": part_engine_greedy, "train_steps": part_train_steps, "train_speed": part_train_speed,
         "train_speed_hf": part_train_speed_hf, "decode": part_decode, "vllm": part_vllm,
         "xor_apply": part_xor_apply}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, required=True, help="seconds this part may take")
    ap.add_argument("--reduced", action="store_true", help="small sizes (CPU / CI)")
    args = ap.parse_args()
    p = Part(args.part, args.out, args.budget, args.reduced)
    try:
        PARTS[args.part](p)
    except Exception as e:  # noqa: BLE001 - recorded, then the process fails
        p.check(f"{args.part} raised", False, f"{type(e).__name__}: {str(e)[:400]}",
                traceback=traceback.format_exc()[-3000:])
        traceback.print_exc()
        return 1
    p.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
