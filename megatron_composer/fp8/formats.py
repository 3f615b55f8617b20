"""Reference FP8 formats: MX (E4M3 data + E8M0 scales) and DeepSeek blockwise (E4M3 data + FP32 scales).

This module defines the numerics. The Triton kernels in `fp8/kernels/` are tested bit-for-bit against it, and
`quantize_mx` is tested bit-for-bit against torchao's `to_mx` (FLOOR and RCEIL, bf16 and fp32 inputs).

Common to both formats
----------------------
* Quantisation works in fp32: the input (bf16 or fp32) is widened exactly, the block's amax = max |x| is taken
  in fp32, and the final cast to E4M3 (float8_e4m3fn, max 448, no infinities) rounds to nearest-even,
  subnormals (2^-9 .. 2^-7) included, and saturates finite overflow to +-448.
* NaN policy: a NaN anywhere in a block makes the block's amax NaN, hence its scale NaN, hence every element of
  the block dequantises to NaN. A NaN is never hidden behind a finite scale.

MX (OCP Microscaling v1.0, MXFP8 E4M3)
--------------------------------------
One E8M0 scale (a power of two 2^(s - 127), s in 0..254; s = 255 is NaN) per `block_size` consecutive elements
along the last dimension (32 as in OCP, 16 as in the Composer 2 summary).

* rounding="floor" (OCP): s = clamp(floor(log2 amax) - 8, -127, 127) with floor(log2 amax) read from amax's
  fp32 exponent field (fp32 denormals and zero count as 2^-127). amax / 2^s lies in [256, 512), so the largest
  elements of a block may saturate to 448 (up to 12.5% relative error there). Scaling divides by
  max(2^s, 2^-126) (torchao's guard against fp32-denormal scales). +-inf: amax's exponent field is 255, so
  s = 120 and the infinity is stored as +-448 (dequantises to +-inf again: 448 * 2^120
  overflows). NaN: s = 255, data of finite elements is 0, of NaNs NaN.
* rounding="rceil" (cuBLAS / TransformerEngine, torchao RCEIL): s = clamp(ceil(log2(amax / 448)), -127, 127),
  with amax / 448 rounded to fp32 first and the ceiling taken exactly (a power of two stays, anything above
  rounds up). No element saturates. Data = x * 2^-s, except s = -127 (all |x| <= 448 * 2^-127) which uses a
  factor of 1 (cuBLAS convention; the data is then 0). +-inf: s = 254 - 127 and the infinity is stored as
  +-448 (dequantises to +-inf again). Other elements of such a block are flushed to 0.
  NaN: s = 255 and the whole block's data is NaN.
  torchao's eager fallback computes ceil(torch.log2(d)) in fp32, which for fp32 inputs within a few ulps above
  448 * 2^k with |k| >= 2 can round the logarithm down to k and so saturate one element by an ulp; its hardware
  path (`cvt.rp.satfinite.ue8m0x2.f32`) and this module use the exact ceiling. For bf16 inputs the two agree
  always (amax / 448 can never land within that distance of a power of two).
* Error bound (finite blocks): per element |dequant(quant(x)) - x| <= 2^-4 |x| (half an E4M3 ulp) for elements
  in the normal E4M3 range, and <= 2^-10 * 2^s absolute below it; floor additionally saturates elements above
  448 * 2^s to 448 * 2^s.
* Dequantisation: data (exact in fp32) times 2^(s - 127) in fp32, rounded once to the target dtype; s = 255
  gives NaN. This matches torchao's `MXTensor.to_dtype`.

DeepSeek-V3 blockwise
---------------------
FP32 scale per tile: 1x128 for activations and gradients (per token, along the reduction dimension) and
128x128 for weights. scale = amax / 448 rounded to fp32 (or, with pow2_scale=True, 2^ceil(log2(amax / 448))
exactly, clamped to the normal fp32 range), data = x / scale (IEEE division) cast to E4M3. A zero block (or one
whose amax / 448 underflows to 0) gets scale 1 and zero data. IEEE arithmetic decides the specials: a NaN gives
scale NaN (block dequantises to NaN); an infinity gives scale inf, data NaN at the infinity and 0 elsewhere, so
the block dequantises to NaN: overflow surfaces instead of being clipped.
Error bound: half an E4M3 ulp (2^-4 relative) for elements in the normal range, plus one fp32 rounding of the
scale (2^-24 relative) when pow2_scale is False.
"""

from __future__ import annotations

from typing import Literal

import torch

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
MX_BLOCK_SIZES = (16, 32)
Rounding = Literal["floor", "rceil"]


def check_blocked_dim(size: int, block: int, what: str) -> None:
    """Reject a dimension that does not split into whole blocks, naming it and the fix."""
    if size % block != 0:
        raise ValueError(
            f"{what} has size {size}, not divisible by the FP8 block size {block}; "
            f"pad it to {(size + block - 1) // block * block} or keep this layer in high precision")


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"FP8 quantisation takes float32/bfloat16/float16 input, got {x.dtype}")


def _exact_ceil_log2(d: torch.Tensor) -> torch.Tensor:
    """ceil(log2(d)) for finite d > 0, exactly (int32); frexp gives d = m * 2^e with m in [0.5, 1)."""
    m, e = torch.frexp(d)
    return torch.where(m == 0.5, e - 1, e)


def _cast_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even fp32 -> E4M3 (clamp keeps NaN)."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def mx_scale_exponent(amax: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """Biased E8M0 exponent (int32, 0..255) for fp32 block amax values."""
    if rounding == "floor":
        # floor(log2 amax) is amax's fp32 exponent field minus the bias (zero/denormal -> -127, inf -> 128).
        exp_field = (amax.view(torch.int32) >> 23) & 0xFF
        s = (exp_field - 127 - 8).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
        return torch.where(torch.isnan(amax), E8M0_NAN, s)
    if rounding == "rceil":
        descale = amax / E4M3_MAX
        finite_pos = torch.isfinite(descale) & (descale > 0)
        c = _exact_ceil_log2(torch.where(finite_pos, descale, torch.ones_like(descale)))
        s = torch.where(finite_pos, c.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS, 0)
        s = torch.where(torch.isinf(descale), 254, s)
        return torch.where(torch.isnan(descale), E8M0_NAN, s)
    raise ValueError(f"MX rounding must be 'floor' or 'rceil', got {rounding!r}")


def mx_scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale (float8_e8m0fnu or uint8) -> fp32 2^(s - 127); s = 255 -> NaN."""
    s = scale.view(torch.uint8).to(torch.int32)
    value = torch.exp2((s - E8M0_BIAS).to(torch.float32))
    return torch.where(s == E8M0_NAN, float("nan"), value)


def quantize_mx(x: torch.Tensor, block_size: int = 32, rounding: Rounding = "rceil"):
    """Quantise along the last dimension to MXFP8. Returns (data float8_e4m3fn like x, scale float8_e8m0fnu
    of shape [..., K // block_size])."""
    _check_input(x)
    if rounding not in ("floor", "rceil"):
        raise ValueError(f"MX rounding must be 'floor' or 'rceil', got {rounding!r}")
    check_blocked_dim(x.shape[-1], block_size, "the last dimension")
    x_blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size).float()
    amax = x_blocks.abs().amax(dim=-1)  # NaN if any element is NaN
    s = mx_scale_exponent(amax, rounding)
    s_ = s.unsqueeze(-1)
    if rounding == "floor":
        # divide by 2^(s-127), never by an fp32 denormal (torchao's guard); s = 255 divides by inf
        scale_f = torch.clamp((s_ << 23).view(torch.float32), min=2.0 ** -126)
        y = x_blocks / scale_f
    else:
        rcp = torch.exp2((E8M0_BIAS - s_).to(torch.float32))
        rcp = torch.where(s_ == 0, 1.0, rcp)
        rcp = torch.where(s_ == 254, 2.0 ** -127, rcp)
        rcp = torch.where(s_ == E8M0_NAN, float("nan"), rcp)
        y = x_blocks * rcp
    data = _cast_e4m3(y).reshape(x.shape)
    return data, s.to(torch.uint8).view(torch.float8_e8m0fnu)


def dequantize_mx(data: torch.Tensor, scale: torch.Tensor, block_size: int = 32,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_mx`: data * 2^(s - 127) computed in fp32, rounded once to `dtype`."""
    if data.shape[-1] != scale.shape[-1] * block_size:
        raise ValueError(f"data last dim {data.shape[-1]} != scale last dim {scale.shape[-1]} x block {block_size}")
    blocks = data.float().reshape(*data.shape[:-1], scale.shape[-1], block_size)
    return (blocks * mx_scale_to_float(scale).unsqueeze(-1)).reshape(data.shape).to(dtype)


def blockwise_scale(amax: torch.Tensor, pow2_scale: bool = False) -> torch.Tensor:
    """FP32 scale for blockwise FP8 from fp32 tile amax values (see module docstring)."""
    scale = amax / E4M3_MAX
    if pow2_scale:
        finite_pos = torch.isfinite(scale) & (scale > 0)
        c = _exact_ceil_log2(torch.where(finite_pos, scale, torch.ones_like(scale))).clamp(-126, 127)
        scale = torch.where(finite_pos, torch.exp2(c.to(torch.float32)), scale)
    return torch.where(scale == 0, 1.0, scale)


def quantize_blockwise(x: torch.Tensor, tile: tuple[int, int] = (1, 128), pow2_scale: bool = False):
    """DeepSeek blockwise FP8 of the last two dimensions in `tile` = (rows, cols) tiles.

    Returns (data float8_e4m3fn like x, scale fp32 [..., R // rows, C // cols])."""
    _check_input(x)
    if x.dim() < 2:
        raise ValueError(f"blockwise quantisation needs at least 2 dims, got shape {tuple(x.shape)}")
    tr, tc = tile
    R, C = x.shape[-2:]
    check_blocked_dim(C, tc, "the last dimension")
    check_blocked_dim(R, tr, "the second-to-last dimension")
    lead = x.shape[:-2]
    t = x.float().reshape(*lead, R // tr, tr, C // tc, tc)
    amax = t.abs().amax(dim=(-3, -1))  # [..., R/tr, C/tc]
    scale = blockwise_scale(amax, pow2_scale)
    y = t / scale[..., :, None, :, None]
    return _cast_e4m3(y).reshape(x.shape), scale


def dequantize_blockwise(data: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int] = (1, 128),
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    tr, tc = tile
    R, C = data.shape[-2:]
    t = data.float().reshape(*data.shape[:-2], R // tr, tr, C // tc, tc)
    return (t * scale[..., :, None, :, None]).reshape(data.shape).to(dtype)


def special_value_blocks(dtype: torch.dtype, block: int) -> torch.Tensor:
    """One block per row, each an edge case the formats must get exactly right (used by tests and the GPU check)."""
    nan, inf = float("nan"), float("inf")
    tiny = torch.finfo(dtype).tiny
    rows = [
        [0.0] * block,                                   # all zero
        [-0.0] * block,                                  # negative zeros
        [3.0] * block,                                   # all equal
        [448.0] * block,                                 # exactly at E4M3 max
        [448.0 * 2 ** 20, 1.0] + [449.0] * (block - 2),  # above E4M3 max
        [1e30, -1e-30] + [0.5] * (block - 2),            # huge dynamic range
        [tiny / 4, tiny / 2] + [tiny / 8] * (block - 2),  # denormals only
        [tiny, tiny * 1.5] + [0.0] * (block - 2),        # smallest normals
        [nan, 1.0] + [2.0] * (block - 2),                # NaN must surface
        [1.0, -nan] + [0.0] * (block - 2),
        [inf, 1.0] + [-2.0] * (block - 2),               # +inf
        [-inf, 1.0] + [0.25] * (block - 2),              # -inf
        [inf, nan] + [1.0] * (block - 2),                # inf and NaN
        [1.75 * 2 ** 10] + [1.0] * (block - 1),          # amax/448 exactly a power of two
        [1.7578125 * 2 ** 10] + [-1.0] * (block - 1),    # just above
        [448.0 * 2 ** -130] + [1.0e-38] * (block - 1),   # rceil scale clamps at 2^-127
        [-(2.0 ** -9) * 1.5, 2.0 ** -10] + [1.0] * (block - 2),  # E4M3 subnormal rounding ties
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)
