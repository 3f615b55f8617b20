"""FP8 training: MX and DeepSeek blockwise formats, quantised linear and grouped GEMM, Triton kernels.

`formats` defines the numerics (see its docstring for rounding, NaN/inf policy and error bounds); `kernels`
holds the Triton versions, bit-identical to it; `linear` the autograd functions and `apply_fp8`; `backends` the
choice of kernels; `config` the `fp8:` config section.
"""

from megatron_composer.fp8.config import FP8Config
from megatron_composer.fp8.formats import (
    dequantize_blockwise,
    dequantize_mx,
    quantize_blockwise,
    quantize_mx,
)
from megatron_composer.fp8.linear import FP8GroupedMM, FP8Linear, FP8LinearFunction, FP8Ops, apply_fp8, fp8_linear

__all__ = ["FP8Config", "FP8Ops", "FP8Linear", "FP8LinearFunction", "FP8GroupedMM", "apply_fp8", "fp8_linear",
           "quantize_mx", "dequantize_mx", "quantize_blockwise", "dequantize_blockwise"]
