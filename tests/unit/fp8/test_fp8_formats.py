"""Reference FP8 formats: bit-identical to torchao's `to_mx`, edge cases, error bounds, bad input."""

import pytest
import torch

from megatron_composer.fp8.formats import (
    dequantize_blockwise,
    dequantize_mx,
    quantize_blockwise,
    quantize_mx,
    special_value_blocks,
)

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


def random_input(dtype, shape=(8, 256), seed=0):
    g = torch.Generator().manual_seed(seed)
    # log-uniform magnitudes over a wide range and random signs
    mag = torch.exp2(torch.empty(shape).uniform_(-30, 30, generator=g))
    x = mag * torch.randn(shape, generator=g).sign()
    # Gaussian rows with a random power-of-two and non-power-of-two scale per row
    rows = torch.randn(shape, generator=g) * torch.exp2(torch.empty(*shape[:-1], 1).uniform_(-60, 60, generator=g))
    x[..., 1::2, :] = rows[..., 1::2, :]
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [32, 16])
def test_quantize_mx_bit_identical_to_torchao(rounding, dtype, block):
    for x in (random_input(dtype), random_input(dtype, (4, 3, 64), seed=1), special_value_blocks(dtype, block)):
        data, scale = quantize_mx(x, block, rounding)
        ao_scale, ao_data = torchao_mx.to_mx(x.contiguous(), torch.float8_e4m3fn, block, MODES[rounding])
        assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
        assert data.shape == x.shape and scale.shape == (*x.shape[:-1], x.shape[-1] // block)
        assert torch.equal(bits(scale), bits(ao_scale))
        assert torch.equal(bits(data), bits(ao_data))
        # dequantisation matches torchao's MXTensor.to_dtype
        deq = dequantize_mx(data, scale, block, dtype)
        ao_deq = torchao_mx.to_dtype(ao_data, ao_scale, torch.float8_e4m3fn, block, dtype)
        assert torch.equal(deq.isnan(), ao_deq.isnan())
        assert torch.equal(torch.nan_to_num(deq), torch.nan_to_num(ao_deq))


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_special_values(rounding):
    x = special_value_blocks(torch.float32, 32)
    data, scale = quantize_mx(x, 32, rounding)
    deq = dequantize_mx(data, scale, 32, torch.float32)
    has_nan = x.isnan().any(-1)
    assert torch.equal(deq.isnan().all(-1), has_nan)       # a NaN poisons exactly its block
    assert not deq[~has_nan].isnan().any()
    assert (bits(scale)[has_nan] == 255).all()
    assert torch.equal(deq[0], x[0]) and torch.equal(deq[2], x[2]) and torch.equal(deq[3], x[3])
    inf_rows = x.isinf().any(-1) & ~has_nan
    # an infinity is stored as +-448 under a scale so large that dequantisation overflows back to it
    assert (data[inf_rows].float().abs().amax(-1) == 448.0).all()
    assert torch.equal(deq[inf_rows].isinf(), x[inf_rows].isinf())
    assert torch.equal(deq[inf_rows][x[inf_rows].isinf()], x[inf_rows][x[inf_rows].isinf()])


def mx_scale_of(scale):
    return torch.exp2(bits(scale).float() - 127).squeeze(-1)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_error_bound(rounding):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    data, scale = quantize_mx(x, 32, rounding)
    deq = dequantize_mx(data, scale, 32, torch.float32)
    s = mx_scale_of(scale).repeat_interleave(32, -1)
    normal = x.abs() >= 2.0 ** -6 * s
    rel = ((deq - x).abs() / x.abs())[normal]
    if rounding == "rceil":
        assert rel.max() <= 2.0 ** -4
    else:  # floor saturates the top of each block (amax / 2^s in [256, 512))
        unsat = normal & (x.abs() <= 448 * s)
        assert ((deq - x).abs() / x.abs())[unsat].max() <= 2.0 ** -4
    assert ((deq - x).abs()[~normal] <= 2.0 ** -10 * s[~normal]).all()


def test_mx_rejects_bad_input():
    with pytest.raises(ValueError, match="not divisible by the FP8 block size 32"):
        quantize_mx(torch.randn(4, 48), 32)
    with pytest.raises(ValueError, match="rounding"):
        quantize_mx(torch.randn(4, 64), 32, "nearest")


@pytest.mark.parametrize("pow2", [False, True])
def test_blockwise_reference(pow2):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 384, generator=g) * torch.exp2(torch.randint(-20, 20, (256, 1), generator=g).float())
    for tile in ((1, 128), (128, 128)):
        data, scale = quantize_blockwise(x, tile, pow2)
        assert scale.shape == (256 // tile[0], 384 // tile[1]) and scale.dtype == torch.float32
        deq = dequantize_blockwise(data, scale, tile, torch.float32)
        s = scale.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)
        normal = x.abs() >= 2.0 ** -6 * s
        assert (((deq - x).abs() / x.abs())[normal]).max() <= 2.0 ** -4 * (1 + 2.0 ** -20)
        amax_code = (x.abs() / s).amax()
        # the fp32 rounding of amax / 448 may put the top element an ulp above 448 (the cast saturates it)
        assert amax_code <= 448.0 * (1 + 2.0 ** -22) and (pow2 or amax_code >= 448.0 * (1 - 2.0 ** -22))
        if pow2:
            assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))


def test_blockwise_special_values():
    nan, inf = float("nan"), float("inf")
    x = torch.zeros(4, 128)
    x[1, 5] = nan
    x[2, 7] = inf
    x[3] = 2.0
    data, scale = quantize_blockwise(x, (1, 128))
    deq = dequantize_blockwise(data, scale, (1, 128), torch.float32)
    assert scale[0, 0] == 1.0 and (deq[0] == 0).all()
    assert deq[1].isnan().all() and deq[2].isnan().all()   # NaN and overflow surface, never clipped
    assert torch.equal(deq[3], x[3])
