"""Boxes of full tensors: the unit every layout publishes and reads, and the one path that assembles them.

A box is a (start, stop) range per dim of the full tensor. A version stores each tensor as pieces, one per box
an owner published (the whole tensor when one process publishes), each flattened row-major into independently
compressed chunks [shard, offset, length, start, count]: `count` elements from flat element `start` of the
piece, `length` bytes at `offset` of the part's shard object number `shard`. `assemble` builds the bits of any
box from the pieces of the parts on the way to a version (a snapshot's chunks are the bits themselves, XORed
on zeros; a delta's are the XOR to apply), decoding only the chunks of each overlap's flat span: whole tensors
are the boxes covering their full shape.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

Box = tuple[tuple[int, int], ...]


def box_key(box: tuple) -> Box:
    """A box given as slices (parallel/slices.py's Piece.full) or as (start, stop) pairs, as a hashable key."""
    return tuple((s.start, s.stop) if isinstance(s, slice) else (int(s[0]), int(s[1])) for s in box)


def full_box(shape) -> Box:
    return tuple((0, int(n)) for n in shape)


def volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def disjoint(a: Box, b: Box) -> bool:
    return any(ah <= bl or bh <= al for (al, ah), (bl, bh) in zip(a, b))


def model_boxes(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, list[Box]]]:
    """Per tensor of a laid-out model: its dtype and the boxes of the full tensor this rank holds
    (parallel/slices.py's local_pieces, the same boxes Engine.update_weights reads)."""
    from megatron_composer.parallel.slices import local_pieces, named_tensors

    return {name: (t.dtype, [box_key(pc.full) for pc in local_pieces(t)]) for name, t in named_tensors(model)}


def overlaps(box: Box, entries: list[dict]) -> Iterator[tuple[int, Box, list, Box]]:
    """(part index, piece box, its chunks, the overlap) of every stored piece meeting `box`, part by part;
    entries[i] is the tensor's entry in part i of the manifests on the way."""
    for i, entry in enumerate(entries):
        for pc in entry["pieces"]:
            piece_box = tuple(tuple(r) for r in pc["box"])
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece_box))
            if all(lo < hi for lo, hi in inter):
                yield i, piece_box, pc["chunks"], inter


def span(piece_box: Box, inter: Box) -> tuple[int, int, list[int], list[int]]:
    """Box `inter` (full-tensor coordinates) inside a stored piece (its box `piece_box`, stored flat, row-major):
    the flat span [lo, hi) from its first to its last element, the piece's strides and the box's sizes."""
    pshape = [hi - lo for lo, hi in piece_box]
    strides = [1] * len(pshape)
    for d in range(len(pshape) - 2, -1, -1):
        strides[d] = strides[d + 1] * pshape[d + 1]
    local = [(lo - p, hi - p) for (lo, hi), (p, _) in zip(inter, piece_box)]
    lo = sum(a * st for (a, _), st in zip(local, strides))
    hi = sum((b - 1) * st for (_, b), st in zip(local, strides)) + 1
    return lo, hi, strides, [b - a for a, b in local]


def span_chunks(chunks: list, lo: int, hi: int) -> list:
    """The chunks of a stored piece ([shard, offset, length, start, count]) holding elements of [lo, hi)."""
    return [c for c in chunks if max(lo, c[3]) < min(hi, c[3] + c[4])]


def needed_chunks(box: Box, entries: list[dict]) -> Iterator[tuple[int, list]]:
    """(part index, chunk) of every chunk `assemble` decodes for `box`."""
    for i, piece_box, chunks, inter in overlaps(box, entries):
        lo, hi, _, _ = span(piece_box, inter)
        for c in span_chunks(chunks, lo, hi):
            yield i, c


def assemble(out: torch.Tensor, box: Box, entries: list[dict], decode: Callable[[int, list], torch.Tensor]
             ) -> torch.Tensor:
    """XOR onto `out` (the integer bits of `box`, shaped as it) the overlap of every stored piece of every part
    in `entries`; decode(part index, chunk) gives a chunk's `count` elements. Returns `out`."""
    for i, piece_box, chunks, inter in overlaps(box, entries):
        lo, hi, strides, sizes = span(piece_box, inter)
        flat = torch.zeros(hi - lo, dtype=out.dtype)
        for chunk in span_chunks(chunks, lo, hi):
            s, n = chunk[3], chunk[4]
            a, b = max(lo, s), min(hi, s + n)
            flat[a - lo:b - lo] = decode(i, chunk)[a - s:b - s]
        dst = out[tuple(slice(lo_ - w, hi_ - w) for (lo_, hi_), (w, _) in zip(inter, box))]
        dst.bitwise_xor_(flat.as_strided(sizes, strides) if sizes else flat.view(()))
    return out
