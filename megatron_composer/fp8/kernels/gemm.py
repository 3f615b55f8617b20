"""Triton block-scaled FP8 GEMM and grouped GEMM: C = A B^T with A [M, K], B [N, K] in E4M3 and one scale per
(row block, K block) of each operand, applied per K block to an FP32 accumulator.

For every K block of KB elements the kernel computes dot(A_blk, B_blk^T) in FP32 from the E4M3 codes (exact
products, FP32 sums) and adds it times scale_a[row] * scale_b[col]. This equals dequantise-then-matmul up to the
order of FP32 additions, so results agree with the PyTorch reference to FP32 summation error (tested with a
relative tolerance of 1e-5 against a float64 reference of the dequantised operands).

With UPCAST (used for block 16: FP8 tensor-core dots need K >= 32) the E4M3 codes are decoded to fp16, where they
are exact, and fed to an fp16 dot with FP32 accumulation: the same products and sums.

Modes: dense; "m-grouped" (A's rows are token groups, group g ends at m_offs[g], uses B[g]); "k-grouped"
(C[g] = A[:, k_g] B[:, k_g]^T over group g's K range, which ends at k_offs[g] and starts at a multiple of KB;
used by the expert weight gradient with per-expert token groups padded to the block size).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from megatron_composer.fp8.kernels.quantize import decode_e4m3, e8m0_to_fp32, round_bf16_bits

DENSE, M_GROUPED, K_GROUPED = 0, 1, 2


@triton.jit
def _load_scale(ptr, off, mask, MX: tl.constexpr):
    if MX:
        return e8m0_to_fp32(tl.load(ptr + off, mask=mask, other=127).to(tl.int32))
    return tl.load(ptr + off, mask=mask, other=1.0)


@triton.jit
def _scaled_mm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, offs_ptr, M, N, K, G,
                      BM: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, A_RB: tl.constexpr,
                      B_RB: tl.constexpr, MX: tl.constexpr, MODE: tl.constexpr, UPCAST: tl.constexpr,
                      OUT_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    KS = K // KB  # scale columns per operand row block
    # loop-carried scalars start as int32/int64 tensors so compiled Triton sees one type throughout
    m_start = pid_m * BM
    m_end = tl.full([], 0, tl.int32) + M
    k_start = tl.full([], 0, tl.int32)
    k_end = tl.full([], 0, tl.int32) + K
    b_base = tl.full([], 0, tl.int64)
    sb_base = tl.full([], 0, tl.int64)
    c_base = tl.full([], 0, tl.int64)
    if MODE == 1:  # m-grouped: find the group whose row tiles include pid_m
        tiles_before = tl.full([], 0, tl.int32)
        group = tl.full([], -1, tl.int32)
        for g in range(0, G):
            g_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            g_end = tl.load(offs_ptr + g)
            n_tiles = (g_end - g_start + BM - 1) // BM
            hit = (pid_m >= tiles_before) & (pid_m < tiles_before + n_tiles)
            group = tl.where(hit, g, group)
            m_start = tl.where(hit, g_start + (pid_m - tiles_before) * BM, m_start)
            m_end = tl.where(hit, g_end, m_end)
            tiles_before += n_tiles
        k_end = tl.where(group < 0, 0, k_end)  # a spare tile past the last group: no work, no stores
        m_end = tl.where(group < 0, m_start, m_end)
        b_base = group.to(tl.int64) * N * K
        sb_base = group.to(tl.int64) * (N // B_RB) * KS
    if MODE == 2:  # k-grouped: program_id(2) is the group
        group = tl.program_id(2)
        k_start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
        k_end = tl.load(offs_ptr + group)
        c_base = group.to(tl.int64) * M * N
    offs_m = m_start + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, KB)
    m_mask = offs_m < m_end
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * K
    b_rows = b_ptr + b_base + offs_n.to(tl.int64)[:, None] * K
    sa_rows = (offs_m // A_RB).to(tl.int64) * KS
    sb_rows = sb_base + (offs_n // B_RB).to(tl.int64) * KS
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k in range(k_start, k_end, KB):
        kb = k // KB
        sa = _load_scale(sa_ptr, sa_rows + kb, m_mask, MX)
        sb = _load_scale(sb_ptr, sb_rows + kb, n_mask, MX)
        if UPCAST:
            # E4M3 codes are exact in fp16, so an fp16 dot gives the same products and FP32 sums
            a_bits = tl.load(a_rows + k + offs_k[None, :], mask=m_mask[:, None], other=0).to(tl.int32)
            b_bits = tl.load(b_rows + k + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
            a = decode_e4m3(a_bits).to(tl.float16)
            b = decode_e4m3(b_bits).to(tl.float16)
            acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        else:
            # codes travel as uint8 and are reinterpreted as E4M3 for the FP8 dot
            a = tl.load(a_rows + k + offs_k[None, :], mask=m_mask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            b = tl.load(b_rows + k + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
            acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    c_off = c_base + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if OUT_BF16:
        tl.store(c_ptr + c_off, round_bf16_bits(acc).to(tl.int16), mask=c_mask)
    else:
        tl.store(c_ptr + c_off, acc, mask=c_mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch(a, sa, b, sb, out, offs, M, N, K, G, grid_m, grid_z, KB, A_RB, B_RB, mode, upcast):
    mx = sa.dtype == torch.float8_e8m0fnu
    if upcast is None:
        upcast = KB < 32 and not _interpreting()
    BM = BN = 64 if _interpreting() else 128
    grid = (grid_m(BM), triton.cdiv(N, BN), grid_z)
    if grid[0] == 0 or grid[1] == 0 or grid_z == 0 or is_fake(out):
        return out  # nothing to compute; a fake tensor (the dry run) has no values, only the output's allocation
    as_u8 = (lambda s: s.view(torch.uint8)) if mx else (lambda s: s)
    _scaled_mm_kernel[grid](
        a.view(torch.uint8), as_u8(sa), b.view(torch.uint8), as_u8(sb),
        out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
        offs if offs is not None else torch.zeros(1, dtype=torch.int32, device=a.device), M, N, K, G,
        BM=BM, BN=BN, KB=KB, A_RB=A_RB, B_RB=B_RB, MX=mx, MODE=mode, UPCAST=upcast,
        OUT_BF16=out.dtype == torch.bfloat16, num_warps=8 if BM * BN >= 128 * 128 else 4, num_stages=3)
    return out


def _check_out_dtype(out_dtype):
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"FP8 GEMM writes bfloat16 or float32, got {out_dtype}")


def scaled_mm(a, sa, b, sb, block_k: int, a_rows: int = 1, b_rows: int = 1, out_dtype=torch.bfloat16,
              upcast: bool | None = None):
    """C [M, N] = dequant(a) @ dequant(b)^T; a [M, K] and b [N, K] float8_e4m3fn, sa [M / a_rows, K / block_k],
    sb [N / b_rows, K / block_k] (float8_e8m0fnu or fp32)."""
    _check_out_dtype(out_dtype)
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    return _launch(a.contiguous(), sa.contiguous(), b.contiguous(), sb.contiguous(), out, None, M, N, K, 1,
                   lambda BM: triton.cdiv(M, BM), 1, block_k, a_rows, b_rows, DENSE, upcast)


def grouped_scaled_mm(a, sa, b, sb, m_offs, block_k: int, b_rows: int = 1, out_dtype=torch.bfloat16,
                      upcast: bool | None = None):
    """Rows of a [T, K] come in groups ending at m_offs[g] (int32, cumulative); C[group g rows] = a_g @ b[g]^T
    with b [G, N, K], sb [G, N / b_rows, K / block_k]. Rows after m_offs[-1] are left as zeros."""
    _check_out_dtype(out_dtype)
    T, K = a.shape
    G, N, _ = b.shape
    out = torch.zeros((T, N), dtype=out_dtype, device=a.device)
    return _launch(a.contiguous(), sa.contiguous(), b.contiguous(), sb.contiguous(), out,
                   m_offs.to(torch.int32).contiguous(), T, N, K, G, lambda BM: triton.cdiv(T, BM) + G, 1,
                   block_k, 1, b_rows, M_GROUPED, upcast)


def k_grouped_scaled_mm(a, sa, b, sb, k_offs, block_k: int, out_dtype=torch.float32, upcast: bool | None = None):
    """C[g] [M, N] = a[:, k-range g] @ b[:, k-range g]^T for a [M, Kp], b [N, Kp] whose K ranges end at k_offs[g]
    (int32, multiples of block_k). Both operands are blocked 1 x block_k along K."""
    _check_out_dtype(out_dtype)
    M, Kp = a.shape
    N = b.shape[0]
    G = k_offs.numel()
    out = torch.empty((G, M, N), dtype=out_dtype, device=a.device)
    return _launch(a.contiguous(), sa.contiguous(), b.contiguous(), sb.contiguous(), out,
                   k_offs.to(torch.int32).contiguous(), M, N, Kp, G, lambda BM: triton.cdiv(M, BM), G,
                   block_k, 1, 1, K_GROUPED, upcast)
