"""Apply a weight-sync XOR delta in place to the tensor an engine holds: base ^= delta on the raw bits.

A version arrives as the XOR of its bits with the held version's (rl/weight_sync: lossless, and mostly zero: at
the RL learning rate about 3% of bf16 elements and 0.15% of INT4 words change per step). A delta is either dense
(every element's XOR bits) or a `SparseXor`: the flat positions of the elements that changed and their XOR
bits, which is what a rollout worker stages on the host between fetching a version and applying it (while that
is smaller than the dense bits: `SparseXor.compact`).

`xor_apply_(base, delta)` writes into `base` where it lives: on a CUDA tensor with the Triton kernels below (the
delta copied to the device in one transfer; the host keeps nothing of the base), elsewhere with the reference
`xor_apply_reference_`. Both work on any dtype through its integer view of the same width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# the integer dtype holding a tensor's raw bits, by element width (also the weight-sync codec's)
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s raw bits as the integer dtype of the same width (INT_OF_WIDTH; a view, no copy)."""
    bits = INT_OF_WIDTH[t.element_size()]
    return t if t.dtype == bits else t.view(bits)


@dataclass
class SparseXor:
    """The XOR delta of a tensor of `shape` whose elements at flat `positions` changed by `values` (raw bits, in
    the integer dtype of the tensor's width); every other element's XOR is 0."""

    shape: tuple[int, ...]
    positions: torch.Tensor  # int32 where the tensor has fewer than 2^31 elements, else int64
    values: torch.Tensor

    @classmethod
    def from_dense(cls, bits: torch.Tensor) -> "SparseXor":
        flat = int_view(bits).reshape(-1)
        positions = torch.nonzero(flat).flatten()
        if flat.numel() < 2**31:
            positions = positions.to(torch.int32)
        return cls(tuple(bits.shape), positions, flat[positions.long()].clone())

    @classmethod
    def compact(cls, bits: torch.Tensor) -> "torch.Tensor | SparseXor":
        """The smaller of the dense bits and their SparseXor (sparse while under 1/(1 + position bytes / element
        bytes) of the elements changed: a third for bf16, a half for INT4 words)."""
        flat = int_view(bits).reshape(-1)
        changed = int(torch.count_nonzero(flat))
        position_bytes = 4 if flat.numel() < 2**31 else 8
        if changed * (position_bytes + flat.element_size()) >= flat.numel() * flat.element_size():
            return bits
        return cls.from_dense(bits)

    @property
    def nbytes(self) -> int:
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()

    def numel(self) -> int:
        return math.prod(self.shape)

    def dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel(), dtype=self.values.dtype)
        out[self.positions.long()] = self.values
        return out.view(self.shape)


def xor_apply_reference_(base: torch.Tensor, delta: torch.Tensor | SparseXor) -> torch.Tensor:
    """The reference: base ^= delta in place (base contiguous), for a dense or sparse delta."""
    flat = int_view(base).view(-1)
    if isinstance(delta, SparseXor):
        _check(base, delta)
        idx = delta.positions.to(device=base.device, dtype=torch.long)
        flat[idx] ^= delta.values.to(base.device).view(flat.dtype)
    else:
        flat ^= int_view(delta).reshape(-1).to(base.device).view(flat.dtype)
    return base


def _check(base: torch.Tensor, delta: torch.Tensor | SparseXor) -> None:
    numel = delta.numel()
    width = delta.values.element_size() if isinstance(delta, SparseXor) else delta.element_size()
    if numel != base.numel() or width != base.element_size():
        raise ValueError(f"an XOR delta of {numel} elements of {width} bytes does not apply to a tensor of "
                         f"{base.numel()} elements of {base.element_size()} bytes")
    if not base.is_contiguous():
        raise ValueError("XOR deltas apply to a contiguous tensor (the engine's weight, whole)")


def xor_apply_(base: torch.Tensor, delta: torch.Tensor | SparseXor) -> torch.Tensor:
    """base ^= delta in place: the Triton kernel on a CUDA tensor, the reference elsewhere."""
    _check(base, delta)
    if base.is_cuda:
        return xor_apply_triton_(base, delta)
    return xor_apply_reference_(base, delta)


def xor_apply_triton_(base: torch.Tensor, delta: torch.Tensor | SparseXor, block: int = 1024) -> torch.Tensor:
    """The Triton kernels (on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1): one program per `block`
    elements of the dense delta, or per `block` changed positions of a sparse one."""
    from megatron_composer.optional import require

    require("triton", "the device-side XOR apply of weight updates")
    _check(base, delta)
    flat = int_view(base).view(-1)
    kernels = _kernels()
    if isinstance(delta, SparseXor):
        n = delta.positions.numel()
        if n:
            positions = delta.positions.to(base.device, non_blocking=True)
            values = delta.values.to(base.device, non_blocking=True).view(flat.dtype)
            kernels["sparse"][(-(-n // block),)](flat, positions, values, n, BLOCK=block)
    else:
        n = flat.numel()
        if n:
            values = int_view(delta).reshape(-1).to(base.device, non_blocking=True).view(flat.dtype)
            kernels["dense"][(-(-n // block),)](flat, values, n, BLOCK=block)
    return base


_KERNELS: dict = {}


def _kernels() -> dict:
    """The two kernels, compiled on first use (triton is imported only by a caller that applies on a device)."""
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def xor_dense(base_ptr, delta_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        b = tl.load(base_ptr + offs, mask=mask)
        d = tl.load(delta_ptr + offs, mask=mask)
        tl.store(base_ptr + offs, b ^ d, mask=mask)

    @triton.jit
    def xor_sparse(base_ptr, pos_ptr, val_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        where = tl.load(pos_ptr + offs, mask=mask, other=0).to(tl.int64)  # positions are distinct
        v = tl.load(val_ptr + offs, mask=mask)
        b = tl.load(base_ptr + where, mask=mask)
        tl.store(base_ptr + where, b ^ v, mask=mask)

    _KERNELS.update(dense=xor_dense, sparse=xor_sparse)
    return _KERNELS


__all__ = ["INT_OF_WIDTH", "SparseXor", "int_view", "xor_apply_", "xor_apply_reference_", "xor_apply_triton_"]
