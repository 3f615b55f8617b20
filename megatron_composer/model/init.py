"""Layout-independent initialisation: any box of any parameter's full tensor, drawn on its own.

`Transformer.init_rule(name)` says which distribution a tensor has (normal with a std, ones, zeros). A normal
tensor is drawn in fixed blocks of rows along dim 0 (`rows_per_block`: about 2^20 elements, never split
below one row), block j from its own generator seeded by (seed, name, j). A process that needs only a box
of the tensor -- its tensor-parallel, expert or FSDP shard -- draws only the blocks the box touches, so its
memory is its shard plus one block, and every layout assembles the same full tensor as one process does.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

ROW_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class InitRule:
    kind: Literal["normal", "ones", "zeros"]
    std: float = 0.0


def new_init_seed() -> int:
    """A base seed drawn from torch's global generator (so torch.manual_seed(s) fixes the initialisation)."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def rows_per_block(shape: Sequence[int]) -> int:
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, ROW_BLOCK_ELEMENTS // max(inner, 1))


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _norm_box(shape: Sequence[int], box: Sequence[slice]) -> list[tuple[int, int]]:
    box = list(box) + [slice(None)] * (len(shape) - len(box))
    out = []
    for s, n in zip(box, shape):
        lo, hi, step = s.indices(n)
        if step != 1:
            raise ValueError(f"init boxes are contiguous; got step {step}")
        out.append((lo, max(lo, hi)))
    return out


def init_box(rule: InitRule, shape: Sequence[int], seed: int, name: str, box: Sequence[slice] = (),
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The box `box` of tensor `name` (full shape `shape`) as initialised by `rule` under base seed `seed`."""
    shape = tuple(shape)
    ranges = _norm_box(shape, box)
    out_shape = tuple(hi - lo for lo, hi in ranges)
    if rule.kind == "ones":
        return torch.ones(out_shape, dtype=dtype)
    if rule.kind == "zeros":
        return torch.zeros(out_shape, dtype=dtype)
    if rule.kind != "normal":
        raise ValueError(f"unknown init rule {rule.kind!r} for {name}")
    if not shape:
        g = torch.Generator().manual_seed(block_seed(seed, name, 0))
        return torch.empty((), dtype=torch.float32).normal_(0.0, rule.std, generator=g).to(dtype)
    out = torch.empty(out_shape, dtype=dtype)
    rows = rows_per_block(shape)
    (r0, r1), inner = ranges[0], tuple(slice(lo, hi) for lo, hi in ranges[1:])
    for j in range(r0 // rows, -(-r1 // rows)):
        lo, hi = j * rows, min((j + 1) * rows, shape[0])
        g = torch.Generator().manual_seed(block_seed(seed, name, j))
        block = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32).normal_(0.0, rule.std, generator=g)
        a, b = max(r0, lo), min(r1, hi)
        out[a - r0:b - r0] = block[(slice(a - lo, b - lo), *inner)]
    return out


__all__ = ["InitRule", "ROW_BLOCK_ELEMENTS", "block_seed", "init_box", "new_init_seed", "rows_per_block"]
