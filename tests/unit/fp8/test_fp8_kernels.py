"""Triton FP8 kernels under TRITON_INTERPRET=1: bit-identical to the reference formats in both orientations,
and the block-scaled GEMMs equal to dequantise-then-matmul up to FP32 summation order."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_composer.fp8 import formats  # noqa: E402
from megatron_composer.fp8.kernels import gemm  # noqa: E402
from megatron_composer.fp8.kernels import quantize as kq

# NaN/inf edge cases make numpy (the interpreter's engine) warn about invalid operations, as intended
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def u8(t):
    return t.view(torch.uint8)


def same(a, b):
    """Bit equality for fp8/e8m0 codes, except that E4M3 NaN codes may differ in sign (IEEE 754 leaves the sign of
    an arithmetic NaN unspecified, and CPUs and GPUs differ); value equality (NaN == NaN) for fp32 scales."""
    if a.dtype == torch.float32:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    if a.dtype == torch.float8_e4m3fn:
        a, b = u8(a), u8(b)
        a_nan, b_nan = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
        return torch.equal(a_nan, b_nan) and torch.equal(a[~a_nan], b[~b_nan])
    return torch.equal(u8(a), u8(b))


def reference(x, block, kind):
    if kind in ("floor", "rceil"):
        return formats.quantize_mx(x, block[1], kind)
    return formats.quantize_blockwise(x, block, kind == "pow2")


def inputs(dtype, block_len, rows=96, cols=160):
    """Random wide-range data with edge-case blocks along rows, in an [rows, cols] matrix (cols % 32 == 0)."""
    g = torch.Generator().manual_seed(block_len)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=g).float())
    edge = formats.special_value_blocks(torch.float32, block_len)
    n = min(edge.shape[0], rows)
    x[:n, :block_len] = edge[:n]
    x[:n, -block_len:] = edge[:n].flip(0)
    return x.to(dtype)


def check_both_orientations(x, block, kind):
    q, s, qt, st = kq.quantize(x, block, kind, rowwise=True, colwise=True)
    rq, rs = reference(x, block, kind)
    rqt, rst = reference(x.transpose(-1, -2).contiguous(), block, kind)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and qt.shape == rqt.shape
    assert same(q, rq) and same(s, rs)
    assert same(qt, rqt) and same(st, rst)


@pytest.mark.parametrize("kind", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_len", [32, 16])
def test_mx_quantize_kernel_bit_identical(kind, dtype, block_len):
    x = inputs(dtype, block_len)
    check_both_orientations(x, (1, block_len), kind)                       # edge blocks along rows
    check_both_orientations(x.t().contiguous(), (1, block_len), kind)      # ... and along columns


@pytest.mark.parametrize("kind", ["fp32", "pow2"])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128)])
def test_blockwise_quantize_kernel_bit_identical(kind, tile):
    x = inputs(torch.bfloat16, 128, rows=256, cols=384)
    x[130, 5] = float("nan")
    x[200, 300] = float("inf")
    x[0:128, 256:384] = 0.0
    check_both_orientations(x, tile, kind)
    check_both_orientations(x.float().t().contiguous(), tile, kind)


def test_quantize_kernel_batched_and_rowwise_only():
    x = inputs(torch.float32, 32, rows=64, cols=96).reshape(2, 32, 96)
    q, s, qt, st = kq.quantize(x, (1, 32), "rceil", rowwise=True, colwise=False)
    assert qt is None and st is None
    rq, rs = formats.quantize_mx(x, 32, "rceil")
    assert same(q, rq) and same(s, rs)
    _, _, qt, st = kq.quantize(x, (1, 32), "floor", rowwise=False, colwise=True)
    rqt, rst = formats.quantize_mx(x.transpose(1, 2).contiguous(), 32, "floor")
    assert same(qt, rqt) and same(st, rst)


def test_e4m3_cast_rounding_ties_and_subnormals():
    """Every E4M3 code, every midpoint between neighbours and points just off them, passed through a block
    whose amax is 448 (scale 1), must round exactly like torch's cast."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    vals = torch.cat([codes, mids, mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20), codes * (1 + 2.0 ** -22)])
    vals = torch.cat([vals, -vals])
    vals = vals[: vals.numel() // 31 * 31].reshape(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals.clamp(-448, 448)], dim=1)
    q, s, _, _ = kq.quantize(x, (1, 32), "rceil")
    assert (u8(s) == 127).all()
    assert torch.equal(u8(q), u8(x.to(torch.float8_e4m3fn)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_kernel_bit_identical(dtype):
    x = inputs(torch.float32, 32)
    for kind in ("floor", "rceil"):
        q, s = formats.quantize_mx(x, 32, kind)
        out = kq.dequantize(q, s, (1, 32), dtype)
        ref = formats.dequantize_mx(q, s, 32, dtype)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    q, s = formats.quantize_blockwise(x[:, :128], (1, 128))
    out = kq.dequantize(q, s, (1, 128), dtype)
    ref = formats.dequantize_blockwise(q, s, (1, 128), dtype)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())


def rel_err(c, ref):
    return ((c.double() - ref).abs().max() / ref.abs().max()).item()


GEMM_TOL = 1e-5  # FP32 summation order only


@pytest.mark.parametrize("block_len,upcast", [(32, False), (32, True), (16, False), (16, True)])
def test_mx_gemm_kernel(block_len, upcast):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(80, 192, generator=g)
    b = torch.randn(72, 192, generator=g) * 1e-3
    qa, sa = formats.quantize_mx(a, block_len)
    qb, sb = formats.quantize_mx(b, block_len)
    c = gemm.scaled_mm(qa, sa, qb, sb, block_len, out_dtype=torch.float32, upcast=upcast)
    ref = (formats.dequantize_mx(qa, sa, block_len, torch.float64)
           @ formats.dequantize_mx(qb, sb, block_len, torch.float64).T)
    assert rel_err(c, ref) < GEMM_TOL
    c16 = gemm.scaled_mm(qa, sa, qb, sb, block_len, out_dtype=torch.bfloat16, upcast=upcast)
    assert torch.equal(c16, c.to(torch.bfloat16))


def test_blockwise_gemm_kernel_and_nan_propagation():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 256, generator=g)
    a[3, 200] = float("nan")
    b = torch.randn(256, 256, generator=g)
    qa, sa = formats.quantize_blockwise(a, (1, 128))
    qb, sb = formats.quantize_blockwise(b, (128, 128))
    c = gemm.scaled_mm(qa, sa, qb, sb, 128, a_rows=1, b_rows=128, out_dtype=torch.float32)
    ref = formats.dequantize_blockwise(qa, sa, (1, 128), torch.float64) @ \
        formats.dequantize_blockwise(qb, sb, (128, 128), torch.float64).T
    assert torch.equal(c.isnan(), ref.isnan()) and c[3].isnan().all() and not c[4].isnan().any()
    finite = ~ref.isnan()
    assert ((c.double() - ref).abs()[finite].max() / ref.abs()[finite].max()) < GEMM_TOL


def test_grouped_gemm_kernels():
    g = torch.Generator().manual_seed(2)
    E, T, K, N = 4, 70, 128, 96
    offs = torch.tensor([20, 20, 61, 70], dtype=torch.int32)  # expert 1 gets no tokens
    x = torch.randn(T, K, generator=g)
    w = torch.randn(E, N, K, generator=g)
    qx, sx = formats.quantize_mx(x, 32)
    qw, sw = formats.quantize_mx(w, 32)
    c = gemm.grouped_scaled_mm(qx, sx, qw, sw, offs, 32, out_dtype=torch.float32)
    xd = formats.dequantize_mx(qx, sx, 32, torch.float64)
    wd = formats.dequantize_mx(qw, sw, 32, torch.float64)
    ref = torch.cat([xd[s:e] @ wd[i].T for i, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
    assert rel_err(c, ref) < GEMM_TOL
    # k-grouped (expert weight gradient): groups padded to the block length along K
    k_offs = torch.tensor([64, 64, 160, 192], dtype=torch.int32)
    a = torch.randn(48, 192, generator=g)
    b = torch.randn(40, 192, generator=g)
    qa, sa = formats.quantize_mx(a, 32)
    qb, sb = formats.quantize_mx(b, 32)
    c = gemm.k_grouped_scaled_mm(qa, sa, qb, sb, k_offs, 32)
    ad = formats.dequantize_mx(qa, sa, 32, torch.float64)
    bd = formats.dequantize_mx(qb, sb, 32, torch.float64)
    for i, (s, e) in enumerate(zip([0, *k_offs[:-1].tolist()], k_offs.tolist())):
        r = ad[:, s:e] @ bd[:, s:e].T
        assert (c[i].double() - r).abs().max() <= GEMM_TOL * max(r.abs().max().item(), 1.0)
    assert (c[1] == 0).all()
