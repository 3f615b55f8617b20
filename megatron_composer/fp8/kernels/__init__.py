"""Triton kernels for FP8 quantisation and block-scaled GEMMs.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before any kernel is
defined unless the user chose otherwise), which is how CI tests them bit-for-bit on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
