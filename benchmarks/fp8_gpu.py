"""FP8 on one GPU: our Triton kernels checked against the PyTorch reference on real FP8 hardware, then
quantisation GB/s against torchao's kernels and FP8 GEMM TFLOP/s against bf16 torch.matmul, measured in this run.

1. Correctness. Quantisation (MX floor/rceil at block 32 and 16, blockwise 1x128 and 128x128 with FP32 and
   power-of-two scales, bf16 and fp32 inputs, random data with every special-value block, both orientations from
   one fused call) must be bit-identical to `fp8.formats` computed on the CPU (NaN codes may differ in sign);
   dequantisation likewise. GEMMs (dense, grouped, k-grouped) must match float64 matmuls of the dequantised
   operands to GEMM_TOL: Hopper's FP8 tensor cores accumulate each K block with about 14 mantissa bits before
   our FP32 accumulation. The FP8 linear layer (forward, dgrad, wgrad) on the triton and scaled_mm backends must
   match the emulated backend to LINEAR_TOL.
2. Quantisation throughput (GB/s = bytes read + bytes written): ours vs torchao (its MXFP8 Triton kernels on
   sm100+, else `to_mx` under torch.compile; its blockwise FP8 Triton kernels).
3. GEMM throughput (TFLOP/s): ours (MX32, MX16, blockwise), cuBLAS block-scaled `scaled_mm` where the GPU has
   it (blockwise on sm90+, MXFP8 on sm100+; Hopper has no MXFP8 so that row is skipped there), and grouped
   expert GEMMs, each as a ratio against bf16 torch.matmul (torch._grouped_mm for grouped) of the same shape.

Exits non-zero if any correctness check fails.

    bash benchmarks/fp8_gpu.sh [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_composer.fp8 import FP8Config, FP8Ops, formats, fp8_linear  # noqa: E402
from megatron_composer.fp8.backends import (  # noqa: E402
    OperandSpec,
    reference_dequantize,
    reference_quantize,
    select_backend,
    unavailable_reason,
)
from megatron_composer.fp8.kernels import gemm  # noqa: E402
from megatron_composer.fp8.kernels import quantize as kq

GEMM_TOL = 2e-3
LINEAR_TOL = 2e-2  # bf16 outputs of two FP8 GEMM implementations
FAILURES: list[str] = []
RESULTS: list[tuple[str, bool, str]] = []  # every correctness verdict: (name, passed, detail)
LISTENERS: list = []  # callables(name, passed, detail) told of each verdict as it is made


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"  {'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
    RESULTS.append((name, ok, detail))
    for listener in LISTENERS:
        listener(name, ok, detail)
    if not ok:
        FAILURES.append(name)


def run_correctness() -> list[tuple[str, bool, str]]:
    """All correctness checks (quantisation, GEMMs, linear layer) on this CUDA GPU; returns their verdicts.
    A check that raises is recorded as failed with its exception, and the remaining groups still run."""
    for group in (check_quantisation, check_gemms, check_linear):
        try:
            group()
        except Exception as e:  # noqa: BLE001 - a crash is a verdict too; the other groups still run
            report(f"{group.__name__} raised", False, f"{type(e).__name__}: {str(e)[:300]}")
    return RESULTS


def same_codes(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of mismatching codes (E4M3 NaN sign ignored; fp32 scales compared by value, NaN == NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float32:
        return int(((a != b) & ~(a.isnan() & b.isnan())).sum())
    a8, b8 = a.view(torch.uint8), b.view(torch.uint8)
    if a.dtype == torch.float8_e4m3fn:
        nan_a, nan_b = (a8 & 0x7F) == 0x7F, (b8 & 0x7F) == 0x7F
        return int(((a8 != b8) & ~(nan_a & nan_b)).sum())
    return int((a8 != b8).sum())


def check_inputs(dtype: torch.dtype, block: int, rows: int = 512, cols: int = 1024) -> torch.Tensor:
    g = torch.Generator().manual_seed(block)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=g).float())
    special = formats.special_value_blocks(torch.float32, block)
    x[: special.shape[0], :block] = special
    x[-special.shape[0]:, -block:] = special.flip(0)
    return x.to(dtype)


def check_quantisation() -> None:
    print("quantisation kernels vs fp8.formats (bit-exact):", flush=True)
    cases = [(OperandSpec((1, b), k), b) for k in ("floor", "rceil") for b in (32, 16)]
    cases += [(OperandSpec(t, k), 128) for k in ("fp32", "pow2") for t in ((1, 128), (128, 128))]
    for spec, blk in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = check_inputs(dtype, blk)
            for layout, xx in (("rows", x), ("cols", x.t().contiguous())):
                q, s, qt, st = kq.quantize(xx.cuda(), spec.block, spec.kind, rowwise=True, colwise=True)
                rq, rs = reference_quantize(xx, spec)
                rqt, rst = reference_quantize(xx.t().contiguous(), spec)
                bad = same_codes(q, rq) + same_codes(s, rs) + same_codes(qt, rqt) + same_codes(st, rst)
                report(f"quantize {spec.kind:5s} {spec.block} {str(dtype)[6:]:8s} special values along {layout}",
                       bad == 0, f"{bad} mismatching codes" if bad else "")
                if spec.block[0] == 1 and layout == "rows":
                    for out_dtype in (torch.bfloat16, torch.float32):
                        d = kq.dequantize(q, s, spec.block, out_dtype).cpu()
                        r = reference_dequantize(rq, rs, spec, out_dtype)
                        bad = int(((d != r) & ~(d.isnan() & r.isnan())).sum())
                        report(f"dequantize {spec.kind:5s} {spec.block} -> {str(out_dtype)[6:]}", bad == 0,
                               f"{bad} mismatches" if bad else "")


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_gemms() -> None:
    print(f"GEMM kernels vs float64 matmul of the dequantised operands (max error / max |C| < {GEMM_TOL}):")
    g = torch.Generator().manual_seed(0)
    M, N, K = 512, 384, 1024
    a, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    for spec_a, spec_b, upcast in ((OperandSpec((1, 32), "rceil"),) * 2 + (False,),
                                   (OperandSpec((1, 32), "floor"),) * 2 + (True,),
                                   (OperandSpec((1, 16), "rceil"),) * 2 + (None,),
                                   (OperandSpec((1, 128), "fp32"), OperandSpec((128, 128), "fp32"), False)):
        qa, sa = reference_quantize(a, spec_a)
        qb, sb = reference_quantize(b, spec_b)
        ref = (reference_dequantize(qa, sa, spec_a, torch.float64) @
               reference_dequantize(qb, sb, spec_b, torch.float64).T).cuda()
        c = gemm.scaled_mm(qa.cuda(), sa.cuda(), qb.cuda(), sb.cuda(), spec_a.block_k, spec_a.block[0],
                           spec_b.block[0], torch.float32, upcast=upcast)
        e = rel_err(c, ref)
        report(f"scaled_mm {spec_a.kind:5s} A{spec_a.block} B{spec_b.block} upcast={upcast}", e < GEMM_TOL, f"{e:.2e}")
    E, T, D, F = 6, 1000, 512, 256
    offs = torch.tensor([100, 100, 350, 700, 701, 1000], dtype=torch.int32)
    x, w = torch.randn(T, D, generator=g), torch.randn(E, F, D, generator=g)
    spec = OperandSpec((1, 32), "rceil")
    qx, sx = reference_quantize(x, spec)
    qw, sw = reference_quantize(w, spec)
    xd, wd = reference_dequantize(qx, sx, spec, torch.float64), reference_dequantize(qw, sw, spec, torch.float64)
    bounds = list(zip([0, *offs[:-1].tolist()], offs.tolist()))
    ref = torch.cat([xd[lo:hi] @ wd[e].T for e, (lo, hi) in enumerate(bounds)]).cuda()
    c = gemm.grouped_scaled_mm(qx.cuda(), sx.cuda(), qw.cuda(), sw.cuda(), offs.cuda(), 32, 1, torch.float32)
    e = rel_err(c, ref)
    report("grouped_scaled_mm MX32, 6 experts incl. empty", e < GEMM_TOL, f"{e:.2e}")
    k_offs = torch.tensor([128, 128, 512, 1024], dtype=torch.int32)
    qa, sa = reference_quantize(torch.randn(256, 1024, generator=g), spec)
    qb, sb = reference_quantize(torch.randn(192, 1024, generator=g), spec)
    ad, bd = reference_dequantize(qa, sa, spec, torch.float64), reference_dequantize(qb, sb, spec, torch.float64)
    c = gemm.k_grouped_scaled_mm(qa.cuda(), sa.cuda(), qb.cuda(), sb.cuda(), k_offs.cuda(), 32).cpu()
    errs = [((c[i].double() - ad[:, lo:hi] @ bd[:, lo:hi].T).abs().max() /
             max((ad[:, lo:hi] @ bd[:, lo:hi].T).abs().max().item(), 1.0)).item()
            for i, (lo, hi) in enumerate(zip([0, *k_offs[:-1].tolist()], k_offs.tolist()))]
    report("k_grouped_scaled_mm MX32, 4 groups incl. empty", max(errs) < GEMM_TOL, f"{max(errs):.2e}")


def check_linear() -> None:
    print(f"FP8 linear forward/dgrad/wgrad vs the emulated backend (relative Frobenius error < {LINEAR_TOL}):")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 250, 1024, generator=g).cuda().bfloat16()
    w = (torch.randn(768, 1024, generator=g) / 32).cuda()
    dy = torch.randn(4, 250, 768, generator=g).cuda().bfloat16()
    for cfg in (FP8Config(recipe="mxfp8"), FP8Config(recipe="mxfp8", block_size=16, rounding="floor"),
                FP8Config(recipe="blockwise")):
        ref = None
        for name in ("emulated", "triton", "scaled_mm"):
            why = unavailable_reason(name, cfg)
            if why is not None:
                print(f"  skip  linear {cfg.recipe}/{cfg.block} on {name}: {why}")
                continue
            ops = FP8Ops(cfg.replace(backend=name))
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fp8_linear(xr, wr, ops)
            y.backward(dy)
            out = (y.detach(), xr.grad, wr.grad)
            if ref is None:
                ref = out
                continue
            errs = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(out, ref)]
            report(f"linear {cfg.recipe}/{cfg.block}/{cfg.rounding} {name}", max(errs) < LINEAR_TOL,
                   "y/dx/dw " + " ".join(f"{e:.1e}" for e in errs))


def bench(fn) -> float:
    """Median milliseconds per call."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def torchao_quantizers(x: torch.Tensor):
    """torchao baselines by name, each a zero-argument callable, for what this GPU supports."""
    out = {}
    cap = torch.cuda.get_device_capability()
    try:
        from torchao.prototype.mx_formats import kernels as ao_k
        if cap >= (10, 0) and getattr(ao_k, "_triton_kernels_available", False):
            out["mx_rows"] = ("torchao triton_to_mxfp8_dim0", lambda: ao_k.triton_to_mxfp8_dim0(x, 32, "rceil"))
            out["mx_cols"] = ("torchao triton_to_mxfp8_dim1", lambda: ao_k.triton_to_mxfp8_dim1(x, 32, "rceil"))
    except Exception as e:  # noqa: BLE001 - a baseline missing is reported, not fatal
        print(f"  (torchao MX Triton kernels unavailable: {e})")
    if "mx_rows" not in out:
        try:
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
            compiled = torch.compile(lambda t: to_mx(t, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL))
            out["mx_rows"] = ("torchao to_mx (torch.compile)", lambda: compiled(x))
        except Exception as e:  # noqa: BLE001
            print(f"  (torchao to_mx unavailable: {e})")
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as bw
        out["bw_act"] = ("torchao triton_fp8_blockwise_act_quant_lhs", lambda: bw.triton_fp8_blockwise_act_quant_lhs(x))
        out["bw_weight"] = ("torchao triton_fp8_blockwise_weight_quant_rhs",
                            lambda: bw.triton_fp8_blockwise_weight_quant_rhs(x))
    except Exception as e:  # noqa: BLE001
        print(f"  (torchao blockwise kernels unavailable: {e})")
    return out


def bench_quantisation(rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    print(f"\nquantisation of a bf16 [{rows}, {cols}] tensor (GB/s = bytes read + written):")
    ours = {
        "mx_rows": ("MX32 rceil rowwise", lambda: kq.quantize(x, (1, 32), "rceil"), n * 3 + n // 32),
        "mx_floor": ("MX32 floor rowwise", lambda: kq.quantize(x, (1, 32), "floor"), n * 3 + n // 32),
        "mx_cols": ("MX32 rceil colwise", lambda: kq.quantize(x, (1, 32), "rceil", False, True), n * 3 + n // 32),
        "mx_both": ("MX32 rceil both orientations, one read", lambda: kq.quantize(x, (1, 32), "rceil", True, True),
                    n * 4 + n // 16),
        "mx16": ("MX16 rceil rowwise", lambda: kq.quantize(x, (1, 16), "rceil"), n * 3 + n // 16),
        "bw_act": ("blockwise 1x128 rowwise", lambda: kq.quantize(x, (1, 128), "fp32"), n * 3 + n // 32),
        "bw_weight": ("blockwise 128x128", lambda: kq.quantize(x, (128, 128), "fp32"), n * 3 + n // 4096),
    }
    baselines = torchao_quantizers(x)
    base_ms = {key: bench(fn) for key, (_, fn) in baselines.items()}
    for key, (label, fn, nbytes) in ours.items():
        ms = bench(fn)
        line = f"  {label:42s} {ms:8.3f} ms {nbytes / ms / 1e6:8.1f} GB/s"
        base_key = "mx_rows" if key in ("mx_floor", "mx16") else key
        if base_key in base_ms:
            bname = baselines[base_key][0]
            line += f"   x{base_ms[base_key] / ms:5.2f} vs {bname} ({nbytes / base_ms[base_key] / 1e6:.1f} GB/s)"
        print(line, flush=True)


def bench_gemms(shapes) -> None:
    print("\nGEMM TFLOP/s (operands pre-quantised; ratio against bf16 torch.matmul of the same shape):")
    cfg_bw = FP8Config(recipe="blockwise")
    cfg_mx = FP8Config(recipe="mxfp8")
    scaled_bw = unavailable_reason("scaled_mm", cfg_bw) is None
    scaled_mx_why = unavailable_reason("scaled_mm", cfg_mx)
    if scaled_mx_why:
        print(f"  MXFP8 scaled_mm skipped: {scaled_mx_why}")
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        flops = 2 * M * N * K
        bf16_ms = bench(lambda: a @ b.T)
        print(f"  [{M} x {K}] @ [{K} x {N}]: bf16 torch.matmul {flops / bf16_ms / 1e9:7.1f} TFLOP/s")
        cases = []
        for label, blk, kind, b_rows, upcast in (("triton MX32 rceil", 32, "rceil", 1, False),
                                                 ("triton MX16 rceil (fp16 dot)", 16, "rceil", 1, True),
                                                 ("triton blockwise 1x128 x 128x128", 128, "fp32", 128, False)):
            qa, sa, _, _ = kq.quantize(a, (1, blk), kind)
            qb, sb, _, _ = kq.quantize(b, (b_rows, blk), kind)
            cases.append((label, lambda qa=qa, sa=sa, qb=qb, sb=sb, blk=blk, b_rows=b_rows, up=upcast:
                          gemm.scaled_mm(qa, sa, qb, sb, blk, 1, b_rows, torch.bfloat16, upcast=up)))
        if scaled_bw:
            be = select_backend(cfg_bw.replace(backend="scaled_mm"))
            sa_spec, sb_spec = OperandSpec((1, 128), "fp32"), OperandSpec((128, 128), "fp32")
            qa, sa, _, _ = kq.quantize(a, (1, 128), "fp32")
            qb, sb, _, _ = kq.quantize(b, (128, 128), "fp32")
            cases.append(("cuBLAS scaled_mm blockwise",
                          lambda: be.mm(qa, sa, qb, sb, sa_spec, sb_spec, torch.bfloat16)))
        if scaled_mx_why is None:
            be = select_backend(cfg_mx.replace(backend="scaled_mm"))
            spec = OperandSpec((1, 32), "rceil")
            qa, sa, _, _ = kq.quantize(a, (1, 32), "rceil")
            qb, sb, _, _ = kq.quantize(b, (1, 32), "rceil")
            cases.append(("cuBLAS scaled_mm MXFP8", lambda: be.mm(qa, sa, qb, sb, spec, spec, torch.bfloat16)))
        for label, fn in cases:
            try:
                ms = bench(fn)
                print(f"    {label:36s} {flops / ms / 1e9:7.1f} TFLOP/s   x{bf16_ms / ms:5.2f} vs bf16", flush=True)
            except Exception as e:  # noqa: BLE001 - one failing variant should not hide the others
                print(f"    {label:36s} failed: {type(e).__name__}: {str(e)[:200]}")
                FAILURES.append(f"gemm {label} {M}x{N}x{K}")


def bench_grouped(E: int, T: int, D: int, F: int) -> None:
    print(f"\ngrouped expert GEMM, {E} experts, {T} tokens, x[T, {D}] @ w[e][{F}, {D}]^T:")
    counts = torch.full((E,), T // E, dtype=torch.int64)
    counts[0] += T - counts.sum()
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, F, D, device="cuda", dtype=torch.bfloat16)
    flops = 2 * T * D * F
    if hasattr(torch, "_grouped_mm"):
        wt = w.transpose(-2, -1)
        base_label, base = "bf16 torch._grouped_mm", lambda: torch._grouped_mm(x, wt, offs=offs)
    else:
        bounds = list(zip([0, *offs[:-1].tolist()], offs.tolist()))
        base_label, base = "bf16 matmul per expert", lambda: [x[lo:hi] @ w[e].T for e, (lo, hi) in enumerate(bounds)]
    base_ms = bench(base)
    print(f"  {base_label:36s} {flops / base_ms / 1e9:7.1f} TFLOP/s")
    for label, blk, b_rows, kind in (("triton grouped MX32 rceil", 32, 1, "rceil"),
                                     ("triton grouped blockwise", 128, 128, "fp32")):
        qx, sx, _, _ = kq.quantize(x, (1, blk), kind)
        qw, sw, _, _ = kq.quantize(w, (b_rows, blk), kind)
        ms = bench(lambda: gemm.grouped_scaled_mm(qx, sx, qw, sw, offs, blk, b_rows, torch.bfloat16))
        print(f"  {label:36s} {flops / ms / 1e9:7.1f} TFLOP/s   x{base_ms / ms:5.2f} vs {base_label}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller benchmark shapes")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_gpu.py needs a CUDA GPU; CI checks the kernels on CPU with TRITON_INTERPRET=1 (make test)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this script checks compiled kernels on the GPU")
    import triton
    cap = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}), "
          f"torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    run_correctness()
    print(f"correctness: {len(FAILURES)} failure(s) in {time.time() - t0:.0f} s", flush=True)
    if args.quick:
        bench_quantisation(4096, 4096)
        bench_gemms([(4096, 4096, 4096)])
        bench_grouped(8, 8192, 2048, 1024)
    else:
        bench_quantisation(8192, 8192)
        bench_gemms([(8192, 8192, 8192), (16384, 2048, 7168), (16384, 7168, 2048)])
        bench_grouped(8, 32768, 4096, 1536)
    failed = ': ' + ', '.join(FAILURES) if FAILURES else ''
    print(f"\ntotal {time.time() - t0:.0f} s; {len(FAILURES)} failure(s){failed}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
