"""FP8 backends: who quantises and who multiplies. All share the numerics of `fp8.formats`.

* emulated  - the PyTorch reference: quantise, dequantise to FP32, FP32 matmul. Any device; the baseline.
* triton    - our kernels (`fp8/kernels`): fused two-orientation quantisation, block-scaled (grouped) GEMM with
              FP32 accumulation. GPU with FP8 tensor cores (sm89+), or CPU through TRITON_INTERPRET (slow: tests).
* scaled_mm - Triton quantisation + cuBLAS through torch's `scaled_mm` for dense GEMMs: blockwise 1x128/128x128
              on sm90+, MXFP8 (block 32, swizzled E8M0 scales) on sm100+. Grouped expert GEMMs use the Triton
              kernels. cuBLAS writes bf16, so FP32 weight gradients are rounded through bf16 on this backend.
* te        - TransformerEngine, when installed, for dense layers (its own Linear under fp8_autocast);
              grouped expert GEMMs use the Triton kernels.
* auto      - scaled_mm if available, else triton on a GPU, else emulated; the choice is logged.

Quantisation and GEMMs are separate calls so the autograd functions in `fp8.linear` can quantise each operand
once per orientation and reuse it. The GEMM operands are row-major with the reduction dimension last:
C = A B^T, A [M, K] in (ra x KB) tiles, B [N, K] in (rb x KB) tiles.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from megatron_composer.fp8 import formats
from megatron_composer.fp8.config import BLOCKWISE_BLOCK, FP8Config

log = logging.getLogger(__name__)

BACKENDS = ("emulated", "triton", "scaled_mm", "te")


@dataclass(frozen=True)
class OperandSpec:
    """How one GEMM operand is quantised: `block` = (rows, cols) tile with the reduction dimension last, `kind`
    = floor | rceil (MX, E8M0 scales) or fp32 | pow2 (blockwise, FP32 scales)."""
    block: tuple[int, int]
    kind: str

    @property
    def block_k(self) -> int:
        return self.block[1]


def operand_specs(cfg: FP8Config) -> tuple[OperandSpec, OperandSpec]:
    """(activation/gradient spec, weight spec) for a recipe."""
    if cfg.recipe == "mxfp8":
        spec = OperandSpec((1, cfg.block_size), cfg.rounding)
        return spec, spec
    if cfg.recipe == "blockwise":
        kind = "pow2" if cfg.pow2_scale else "fp32"
        return OperandSpec((1, BLOCKWISE_BLOCK), kind), OperandSpec((BLOCKWISE_BLOCK, BLOCKWISE_BLOCK), kind)
    raise ValueError(f"fp8.recipe '{cfg.recipe}' has no FP8 operands")


def reference_quantize(x: torch.Tensor, spec: OperandSpec):
    if spec.kind in ("floor", "rceil"):
        if spec.block[0] != 1:
            raise ValueError(f"MX blocks are 1 x K, got {spec.block}")
        return formats.quantize_mx(x, spec.block_k, spec.kind)
    return formats.quantize_blockwise(x, spec.block, spec.kind == "pow2")


def reference_dequantize(data: torch.Tensor, scale: torch.Tensor, spec: OperandSpec, dtype=torch.float32):
    if spec.kind in ("floor", "rceil"):
        return formats.dequantize_mx(data, scale, spec.block_k, dtype)
    return formats.dequantize_blockwise(data, scale, spec.block, dtype)


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


class EmulatedBackend:
    name = "emulated"

    def quantize(self, x, spec: OperandSpec, rowwise=True, colwise=False):
        q = s = qt = st = None
        if rowwise:
            q, s = reference_quantize(x, spec)
        if colwise:
            qt, st = reference_quantize(x.transpose(-1, -2).contiguous(), spec)
        return q, s, qt, st

    def mm(self, a, sa, b, sb, spec_a: OperandSpec, spec_b: OperandSpec, out_dtype):
        a32 = reference_dequantize(a, sa, spec_a)
        b32 = reference_dequantize(b, sb, spec_b)
        return (a32 @ b32.transpose(-1, -2)).to(out_dtype)

    def grouped_mm(self, a, sa, b, sb, m_offs, spec_a, spec_b, out_dtype):
        a32 = reference_dequantize(a, sa, spec_a)
        b32 = reference_dequantize(b, sb, spec_b)
        out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        for g, (lo, hi) in enumerate(_group_bounds(m_offs)):
            out[lo:hi] = (a32[lo:hi] @ b32[g].T).to(out_dtype)
        return out

    def k_grouped_mm(self, a, sa, b, sb, k_offs, spec: OperandSpec, out_dtype):
        a32 = reference_dequantize(a, sa, spec)
        b32 = reference_dequantize(b, sb, spec)
        return torch.stack([(a32[:, lo:hi] @ b32[:, lo:hi].T).to(out_dtype) for lo, hi in _group_bounds(k_offs)])


class TritonBackend:
    name = "triton"

    def __init__(self):
        from megatron_composer.fp8.kernels import gemm, quantize
        self._gemm, self._quantize = gemm, quantize

    def quantize(self, x, spec: OperandSpec, rowwise=True, colwise=False):
        return self._quantize.quantize(x, spec.block, spec.kind, rowwise, colwise)

    def mm(self, a, sa, b, sb, spec_a, spec_b, out_dtype):
        return self._gemm.scaled_mm(a, sa, b, sb, spec_a.block_k, spec_a.block[0], spec_b.block[0], out_dtype)

    def grouped_mm(self, a, sa, b, sb, m_offs, spec_a, spec_b, out_dtype):
        return self._gemm.grouped_scaled_mm(a, sa, b, sb, m_offs, spec_a.block_k, spec_b.block[0], out_dtype)

    def k_grouped_mm(self, a, sa, b, sb, k_offs, spec, out_dtype):
        return self._gemm.k_grouped_scaled_mm(a, sa, b, sb, k_offs, spec.block_k, out_dtype)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzle_mx_scales(scale: torch.Tensor) -> torch.Tensor:
    """[rows, K/32] E8M0 scales -> cuBLAS's blocked layout (128x4 tiles as 32x16), flattened."""
    rows, cols = scale.shape
    padded = scale.new_zeros((_round_up(rows, 128), _round_up(cols, 4)))
    padded[:rows, :cols] = scale
    blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


class ScaledMMBackend(TritonBackend):
    """cuBLAS block-scaled GEMMs for dense layers; Triton for quantisation and grouped GEMMs."""
    name = "scaled_mm"

    def mm(self, a, sa, b, sb, spec_a, spec_b, out_dtype):
        import torch.nn.functional as F
        M, K = a.shape
        N = b.shape[0]
        if spec_a.kind in ("floor", "rceil"):
            e8m0 = torch.float8_e8m0fnu
            sa_sw = swizzle_mx_scales(sa.view(torch.uint8).view(M, K // 32)).view(e8m0)
            sb_sw = swizzle_mx_scales(sb.view(torch.uint8).view(N, K // 32)).view(e8m0)
            out = torch._scaled_mm(a, b.t(), sa_sw, sb_sw, out_dtype=torch.bfloat16)
            return out.to(out_dtype)
        ST = F.ScalingType
        sa_t = sa.t().contiguous().t()  # [M, K/128], M-major as cuBLAS wants
        if spec_b.block[0] == 1:
            recipe_b, sb_t = ST.BlockWise1x128, sb.t().contiguous().t()
        else:  # 128x128: [L4, N/128] K-major, with K/128 padded to a multiple of 4
            kb = K // BLOCKWISE_BLOCK
            padded = sb.new_ones((N // BLOCKWISE_BLOCK, _round_up(kb, 4)))
            padded[:, :kb] = sb
            recipe_b, sb_t = ST.BlockWise128x128, padded.t()
        out = F.scaled_mm(a, b.t(), sa_t, ST.BlockWise1x128, sb_t, recipe_b, output_dtype=torch.bfloat16)
        return out.to(out_dtype)


class TEBackend(TritonBackend):
    """`apply_fp8` runs dense layers as TransformerEngine Linear modules (`fp8.linear.TELinear`); the GEMM methods
    inherited here serve the grouped expert GEMMs and direct `fp8_linear` calls."""
    name = "te"


def _cuda_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def unavailable_reason(name: str, cfg: FP8Config) -> str | None:
    """None if backend `name` can run this recipe here, else why not."""
    cap = _cuda_capability()
    if name == "emulated":
        return None
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if cap is not None and cap < (8, 9):
            return f"FP8 tensor cores need compute capability 8.9+, this GPU is {cap[0]}.{cap[1]}"
        return None
    if name == "scaled_mm":
        if cap is None:
            return "needs a CUDA GPU"
        if cfg.recipe == "mxfp8":
            if cap < (10, 0):
                return f"MXFP8 scaled_mm needs Blackwell (sm100+), this GPU is sm{cap[0]}{cap[1]}"
            if cfg.block_size != 32:
                return "MXFP8 scaled_mm supports block size 32 only"
            return None
        if cap < (9, 0) or not hasattr(torch.nn.functional, "ScalingType"):
            return "blockwise scaled_mm needs Hopper (sm90+) and torch with nn.functional.ScalingType"
        return None
    if name == "te":
        if cap is None:
            return "needs a CUDA GPU"
        if importlib.util.find_spec("transformer_engine") is None:
            return "transformer_engine is not installed"
        try:
            from transformer_engine.pytorch import fp8 as te_fp8
            check = te_fp8.check_mxfp8_support if cfg.recipe == "mxfp8" else te_fp8.check_fp8_block_scaling_support
            ok, why = check()
        except Exception as e:  # an old TE without the recipe
            return f"this TransformerEngine lacks the {cfg.recipe} recipe ({e})"
        return None if ok else f"TransformerEngine: {why}"
    raise ValueError(f"unknown FP8 backend '{name}'; choose one of {list(BACKENDS)} or auto")


def available_backends(cfg: FP8Config) -> list[str]:
    return [b for b in BACKENDS if unavailable_reason(b, cfg) is None]


def select_backend(cfg: FP8Config):
    """The backend object for cfg.backend; `auto` picks scaled_mm > triton (GPU) > emulated and logs it."""
    name = cfg.backend
    if name == "auto":
        if _cuda_capability() is None:
            name = "emulated"
        else:
            name = next(b for b in ("scaled_mm", "triton", "emulated") if unavailable_reason(b, cfg) is None)
        log.info("fp8.backend=auto chose '%s' for recipe %s (available: %s)", name, cfg.recipe,
                 ", ".join(available_backends(cfg)))
    else:
        reason = unavailable_reason(name, cfg)
        if reason is not None:
            raise RuntimeError(f"fp8.backend '{name}' is unavailable here ({reason}); "
                               f"available backends: {', '.join(available_backends(cfg))}")
    return {"emulated": EmulatedBackend, "triton": TritonBackend, "scaled_mm": ScaledMMBackend,
            "te": TEBackend}[name]()
