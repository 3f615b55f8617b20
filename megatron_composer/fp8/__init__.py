"""FP8 training: MX and DeepSeek blockwise formats, quantised linear and grouped GEMM, Triton kernels."""

from megatron_composer.fp8.formats import (
    dequantize_blockwise,
    dequantize_mx,
    quantize_blockwise,
    quantize_mx,
)

__all__ = ["quantize_mx", "dequantize_mx", "quantize_blockwise", "dequantize_blockwise"]
