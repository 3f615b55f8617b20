"""RMSNorm computed in float32 and cast back, as the reference checkpoints were trained (kernels/rms_norm.py)."""

import torch
from torch import nn

from ..kernels.rms_norm import RMSNormFunction as _RMSNormFunction  # noqa: F401  (the reference, for tests)
from ..kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
