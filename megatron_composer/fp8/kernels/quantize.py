"""Triton kernels: fused amax -> scale -> cast FP8 quantisation (both orientations from one read) and
dequantisation, bit-identical to `megatron_composer.fp8.formats`.

Every rounding step is written with integer bit operations or IEEE-exact division (`div_rn`), never with
hardware conversion instructions, so the kernels give the same bits on a GPU and under TRITON_INTERPRET=1
(whose own fp32 -> fp8, bf16 -> fp32 and fp32 -> bf16 casts are wrong for subnormals and do not saturate).
The one freedom left is the sign bit of a NaN code, which IEEE 754 leaves unspecified for arithmetic results
(x * NaN); tests treat 0x7F and 0xFF alike.

Scale kinds (KIND): 0 = MX floor, 1 = MX rceil (E8M0 scales stored as uint8), 2 = blockwise fp32 amax / 448,
3 = blockwise with the scale rounded up to a power of two (fp32 scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

KIND = {"floor": 0, "rceil": 1, "fp32": 2, "pow2": 3}


@triton.jit
def cast_e4m3_bits(y):
    """fp32 -> float8_e4m3fn bit pattern (int32 in 0..255): round to nearest even, saturate to +-448, NaN kept."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    a_n = tl.minimum(a, 0x7F800000)
    # normal E4M3 range (|y| >= 2^-6): keep 3 mantissa bits, ties to even, rebias exponent 127 -> 7
    normal = ((a_n + 0x7FFFF + ((a_n >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal E4M3 range: m = round_half_even(|y| * 2^9), |y| = M * 2^(E - 150)
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(141 - tl.maximum(e, 1), 25)
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    mag = tl.minimum(mag, 0x7E)
    mag = tl.where(a > 0x7F800000, 0x7F, mag)
    return sign | mag


@triton.jit
def decode_e4m3(bits):
    """float8_e4m3fn bit pattern (int32) -> fp32, exactly."""
    sign = (bits & 0x80) << 24
    e = (bits >> 3) & 0xF
    m = bits & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(sign != 0, -sub, sub)
    val = tl.where(e == 0, sub, normal)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), val)


@triton.jit
def e8m0_to_fp32(s):
    """E8M0 biased exponent (int32) -> fp32 2^(s - 127); 0 -> 2^-127 (fp32 denormal), 255 -> NaN."""
    val = (s << 23).to(tl.float32, bitcast=True)
    val = tl.where(s == 0, 5.877471754111438e-39, val)
    return tl.where(s == 255, float("nan"), val)


@triton.jit
def round_bf16_bits(y):
    """fp32 -> bfloat16 bit pattern (int32 in 0..65535), round to nearest even, NaN kept quiet."""
    b = y.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(y != y, ((b >> 16) & 0xFFFF) | 0x40, r)


@triton.jit
def _block_scale(amax, KIND: tl.constexpr):
    """Per-block scale from fp32 amax. Returns (stored scale, factor, multiply?): data = x * factor if
    multiply else x / factor. Stored scale is the E8M0 biased exponent (int32) for MX, fp32 otherwise."""
    if KIND == 0:  # MX floor: 2^(floor(log2 amax) - 8) from amax's exponent field
        e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        s = tl.minimum(tl.maximum(e - 135, -127), 128) + 127
        s = tl.where(amax != amax, 255, s)
        factor = tl.maximum((s << 23).to(tl.float32, bitcast=True), 1.1754943508222875e-38)
        return s, factor, False
    elif KIND == 1:  # MX rceil: 2^ceil(log2(amax / 448)), exact ceiling
        d = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        db = d.to(tl.int32, bitcast=True)
        e = (db >> 23) & 0xFF
        mant = db & 0x7FFFFF
        s = tl.where(e > 0, tl.minimum(e + (mant != 0).to(tl.int32), 254), (mant > 0x400000).to(tl.int32))
        s = tl.where(e == 255, 254, s)  # inf
        s = tl.where(d != d, 255, s)
        rcp = ((254 - s) << 23).to(tl.float32, bitcast=True)
        rcp = tl.where(s == 0, 1.0, rcp)
        rcp = tl.where(s == 254, 5.877471754111438e-39, rcp)
        rcp = tl.where(s == 255, float("nan"), rcp)
        return s, rcp, True
    else:  # blockwise: fp32 amax / 448, optionally rounded up to a power of two
        sc = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        if KIND == 3:
            sb = sc.to(tl.int32, bitcast=True)
            e = (sb >> 23) & 0xFF
            c = tl.where(e > 0, e - 127 + ((sb & 0x7FFFFF) != 0).to(tl.int32), -126)
            c = tl.minimum(tl.maximum(c, -126), 127)
            p2 = ((c + 127) << 23).to(tl.float32, bitcast=True)
            sc = tl.where((sc > 0) & (e < 255), p2, sc)
        sc = tl.where(sc == 0, 1.0, sc)
        return sc, sc, False


@triton.jit
def _quantize_tile(x, BM: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                   KIND: tl.constexpr):
    """Quantise an fp32 tile [BM, BN] in blocks of RB x CB. Returns (E4M3 bits [BM, BN], scales [BM/RB, BN/CB])."""
    x4 = tl.reshape(x, (BM // RB, RB, BN // CB, CB))
    # tl.reduce with tl.max's own combine rather than tl.max: the wrapper is compiled, not interpreted, when
    # triton was imported before TRITON_INTERPRET was set, and the interpreter cannot call it; the combine it
    # recognises and runs as a numpy max. Max drops NaNs on GPUs, so NaNs are counted separately.
    amax = tl.reduce(tl.reduce(tl.abs(x4), 3, tl.standard._elementwise_max), 1, tl.standard._elementwise_max)
    nan = (x4 != x4).to(tl.int32)
    nan = tl.reduce(tl.reduce(nan, 3, tl.standard._elementwise_max), 1, tl.standard._elementwise_max)
    amax = tl.where(nan > 0, float("nan"), amax)
    scale, factor, multiply = _block_scale(amax, KIND)
    f4 = tl.reshape(factor, (BM // RB, 1, BN // CB, 1))
    if multiply:
        y4 = x4 * f4
    else:
        y4 = tl.math.div_rn(x4, tl.broadcast_to(f4, (BM // RB, RB, BN // CB, CB)))
    bits = cast_e4m3_bits(tl.reshape(y4, (BM, BN)))
    return bits, scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N,
                     BM: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                     KIND: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, IN_BF16: tl.constexpr):
    """One read of a [M, N] tile of batch b; writes x quantised in RB x CB blocks (ROWWISE) and/or x^T [N, M]
    quantised in RB x CB blocks of x^T, i.e. CB x RB blocks of x (COLWISE)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    base = b * M * N
    if IN_BF16:  # widen through the bit pattern: exact for bf16 denormals on every backend
        xb = tl.load(x_ptr + base + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0)
        x = (xb.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + base + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROWWISE:
        bits, scale = _quantize_tile(x, BM, BN, RB, CB, KIND)
        tl.store(q_ptr + base + offs_m[:, None] * N + offs_n[None, :], bits.to(tl.uint8), mask=mask)
        sm = pid_m * (BM // RB) + tl.arange(0, BM // RB)
        sn = pid_n * (BN // CB) + tl.arange(0, BN // CB)
        s_mask = (sm[:, None] < M // RB) & (sn[None, :] < N // CB)
        s_off = b * (M // RB) * (N // CB) + sm[:, None] * (N // CB) + sn[None, :]
        if KIND < 2:
            tl.store(s_ptr + s_off, scale.to(tl.uint8), mask=s_mask)
        else:
            tl.store(s_ptr + s_off, scale, mask=s_mask)
    if COLWISE:
        bits, scale = _quantize_tile(x, BM, BN, CB, RB, KIND)  # [BM/CB, BN/RB] scales in x coordinates
        bits_t = tl.trans(bits)
        tl.store(qt_ptr + base + offs_n[:, None] * M + offs_m[None, :], bits_t.to(tl.uint8), mask=tl.trans(mask))
        sn = pid_n * (BN // RB) + tl.arange(0, BN // RB)
        sm = pid_m * (BM // CB) + tl.arange(0, BM // CB)
        s_mask = (sn[:, None] < N // RB) & (sm[None, :] < M // CB)
        s_off = b * (N // RB) * (M // CB) + sn[:, None] * (M // CB) + sm[None, :]
        scale_t = tl.trans(scale)
        if KIND < 2:
            tl.store(st_ptr + s_off, scale_t.to(tl.uint8), mask=s_mask)
        else:
            tl.store(st_ptr + s_off, scale_t, mask=s_mask)


def _tile_sizes(RB: int, CB: int, M: int, N: int) -> tuple[int, int]:
    big = max(RB, CB, 64)
    return big, big


def quantize(x: torch.Tensor, block: tuple[int, int], kind: str, rowwise: bool = True, colwise: bool = False):
    """Quantise the last two dims of a contiguous [..., M, N] tensor.

    block = (RB, CB) is the tile shape on each output: rowwise output x in RB x CB tiles, colwise output x^T
    (shape [..., N, M]) in RB x CB tiles of x^T. kind in KIND. Returns (data, scale, data_t, scale_t) with the
    outputs not asked for set to None; data is float8_e4m3fn, scale float8_e8m0fnu for MX kinds, fp32 otherwise.
    """
    RB, CB = block
    *lead, M, N = x.shape
    B = 1
    for d in lead:
        B *= d
    if rowwise and (M % RB or N % CB):
        raise ValueError(f"shape {tuple(x.shape)} does not split into {RB}x{CB} blocks")
    if colwise and (N % RB or M % CB):
        raise ValueError(f"shape {tuple(x.shape)} transposed does not split into {RB}x{CB} blocks")
    x = x.contiguous()
    mx = kind in ("floor", "rceil")
    scale_dtype = torch.uint8 if mx else torch.float32
    dev = x.device
    q = s = qt = st = None
    if rowwise:
        q = torch.empty((*lead, M, N), dtype=torch.uint8, device=dev)
        s = torch.empty((*lead, M // RB, N // CB), dtype=scale_dtype, device=dev)
    if colwise:
        qt = torch.empty((*lead, N, M), dtype=torch.uint8, device=dev)
        st = torch.empty((*lead, N // RB, M // CB), dtype=scale_dtype, device=dev)
    BM, BN = _tile_sizes(RB, CB, M, N)
    dummy = torch.empty(1, dtype=scale_dtype, device=dev)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), B)
    if M and N and B and not is_fake(x):  # a fake tensor (the dry run) has no values: only the allocations
        _quantize_kernel[grid](
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            q if q is not None else dummy, s if s is not None else dummy,
            qt if qt is not None else dummy, st if st is not None else dummy, M, N,
            BM=BM, BN=BN, RB=RB, CB=CB, KIND=KIND[kind], ROWWISE=rowwise, COLWISE=colwise,
            IN_BF16=x.dtype == torch.bfloat16, num_warps=8)

    def view(data, scale):
        if data is None:
            return None, None
        return data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu) if mx else scale

    return (*view(q, s), *view(qt, st))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                       CB: tl.constexpr, MX: tl.constexpr, OUT_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    off = b * M * N + offs_m[:, None] * N + offs_n[None, :]
    bits = tl.load(q_ptr + off, mask=mask, other=0).to(tl.int32)
    s_off = b * (M // RB) * (N // CB) + (offs_m // RB)[:, None] * (N // CB) + (offs_n // CB)[None, :]
    if MX:
        scale = e8m0_to_fp32(tl.load(s_ptr + s_off, mask=mask, other=127).to(tl.int32))
    else:
        scale = tl.load(s_ptr + s_off, mask=mask, other=1.0)
    y = decode_e4m3(bits) * scale
    if OUT_BF16:
        tl.store(out_ptr + off, round_bf16_bits(y).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + off, y, mask=mask)


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16):
    """Inverse of `quantize` (rowwise layout): data [..., M, N] in RB x CB tiles -> `dtype` (bf16 or fp32)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dequantize writes bfloat16 or float32, got {dtype}")
    RB, CB = block
    *lead, M, N = data.shape
    B = 1
    for d in lead:
        B *= d
    mx = scale.dtype == torch.float8_e8m0fnu
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    BM, BN = 64, 64
    if M and N and B:
        _dequantize_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), B)](
            data.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8) if mx else scale.contiguous(),
            out.view(torch.int16) if dtype == torch.bfloat16 else out, M, N,
            BM=BM, BN=BN, RB=RB, CB=CB, MX=mx, OUT_BF16=dtype == torch.bfloat16)
    return out
