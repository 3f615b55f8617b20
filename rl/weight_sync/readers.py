"""What a subscriber hands out, both readers for an engine (`names`, `shape(name)`, `read(name, box)`):
BoxUpdate, one version of a subscriber's boxes ready to apply, and VersionReader, boxes of one version decoded
on demand."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_composer.kernels.xor_apply import SparseXor

from .boxes import Box, assemble, box_key
from .codec import WeightSyncError, decode_chunk, dtype_from_name, from_bits, int_view_dtype


class Subscriber(Protocol):
    """What a reader asks of the subscriber that made it (a WeightSubscriber)."""

    def commit(self, update: "BoxUpdate") -> None: ...

    def get_verified(self, version: int, shard: dict) -> bytes: ...


class BoxUpdate:
    """One version for a subscriber's boxes, ready to apply: a reader for Engine.update_weights (`names`,
    `shape(name)`, `read(name, box)`). `delta`: the bits are the XOR from the version held (`base_id`) to this
    one (apply with delta=True); otherwise they are the version's values. `bytes_read`: compressed bytes fetched
    for it; `version_bytes`: the compressed bytes of the parts it was built from (what a whole-version reader
    downloads); `ranged_reads` / `whole_reads`: the reads it took."""

    def __init__(self, subscriber: Subscriber, version: int, vid: str, base_id: str | None, delta: bool,
                 meta: dict[str, tuple[torch.dtype, list[int]]], bits: dict[str, dict[Box, torch.Tensor]],
                 bytes_read: int, version_bytes: int, ranged_reads: int, whole_reads: int):
        self.subscriber, self.version, self.id, self.base_id, self.delta = subscriber, version, vid, base_id, delta
        self.meta, self.bits = meta, bits
        self.bytes_read, self.version_bytes = bytes_read, version_bytes
        self.ranged_reads, self.whole_reads = ranged_reads, whole_reads

    @property
    def names(self) -> list[str]:
        return list(self.bits)

    def shape(self, name: str) -> list[int]:
        return list(self.meta[name][1])

    def read(self, name: str, box: tuple) -> torch.Tensor:
        held = self.bits.get(name, {})
        key = box_key(box)
        # the engine reads its pieces whole or in row chunks: any box inside one prepared box
        outer = next((k for k in held if all(a <= c and d <= b for (a, b), (c, d) in zip(k, key))), None)
        if outer is None:
            raise WeightSyncError(f"weight version {self.version}: box {key} of '{name}' lies in none this rank "
                                  f"prepared ({sorted(held)}); the subscriber's boxes must be the engine's pieces")
        bits = held[outer]
        if isinstance(bits, SparseXor):  # a sparse delta: whole, or densified for a part of its box
            if outer == key:
                return bits
            bits = bits.dense()
        bits = bits[tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, key))]
        return bits if self.delta else from_bits(bits, self.meta[name][0], list(bits.shape))

    @property
    def staged_bytes(self) -> int:
        """Host bytes this update holds (dense bits, or a sparse delta's positions and values)."""
        return sum(b.nbytes if isinstance(b, SparseXor) else b.numel() * b.element_size()
                   for boxes in self.bits.values() for b in boxes.values())

    def applies_to(self, held_id: str | None, held_version: int | None) -> bool:
        """Whether it can be applied on the version held: newer, and a delta only on its own base."""
        newer = held_version is None or self.version > held_version
        return newer and (not self.delta or self.base_id == held_id)

    def commit(self) -> None:
        """This version is now held: later updates are planned from it."""
        self.subscriber.commit(self)


class VersionReader:
    """Boxes of the full tensors of one published version, read without reconstructing the version.

    `read(name, box)` decodes only the compressed chunks that hold the box's elements (boxes.assemble): the
    chunks of the snapshot the version is planned from (or starting from the subscriber's held bits), then the
    same elements of each delta on the way, XORed on. Each stored piece is flattened in independently
    compressed chunks of consecutive elements, so a box's cost is the flat span from its first to its last
    element within each piece: a box of leading rows (a routed expert, a column-parallel shard) is read alone;
    a box of columns spans nearly the whole piece, which is then decoded one tensor at a time (bounded memory).
    Downloaded shard objects are kept while consecutive reads use them (the last two per part), so a rank
    downloads each object once when it reads tensors in the published order. `names` are the version's tensors;
    `parts` (manifest, part name, tensor entries by name) what it reads; `elements_decoded` counts decoded
    elements (for tests and logs)."""

    def __init__(self, subscriber: Subscriber, version: int, parts: list[dict],
                 held: tuple[dict, dict] | None = None):
        self.subscriber, self.version, self.held = subscriber, version, held
        self.parts: list[tuple[dict, str, dict]] = []
        for i, m in enumerate(parts):
            name = "snapshot" if i == 0 and held is None else "delta"
            self.parts.append((m, name, {t["name"]: t for t in m["parts"][name]["tensors"]}))
        self.meta = dict(held[1]) if held is not None else {
            t["name"]: (dtype_from_name(t["dtype"]), list(t["shape"])) for t in self.parts[0][2].values()}
        self.names = list(self.meta)
        self.elements_decoded = 0
        self._shards: dict[tuple[int, int], bytes] = {}

    def _shard(self, manifest: dict, part: str, index: int) -> bytes:
        key = (manifest["version"], index)
        if key not in self._shards:
            if len(self._shards) >= 2 * len(self.parts):
                self._shards.pop(next(iter(self._shards)))
            shard = manifest["parts"][part]["shards"][index]
            self._shards[key] = self.subscriber.get_verified(manifest["version"], shard)
        return self._shards[key]

    def shape(self, name: str) -> list[int]:
        return list(self.meta[name][1])

    def read(self, name: str, box: tuple[slice, ...] = ()) -> torch.Tensor:
        """The box `box` (slices over the full tensor's dims; () for all of it) of tensor `name`."""
        if name not in self.meta:
            raise WeightSyncError(f"weight version {self.version} has no tensor '{name}'")
        dtype, shape = self.meta[name]
        box = tuple(box) + (slice(None),) * (len(shape) - len(box))
        want = []
        for s, n in zip(box, shape):
            r = range(*s.indices(n))
            if r.step != 1:
                raise WeightSyncError(f"read of '{name}': box {box} has a step; boxes are contiguous slices")
            want.append((r.start, max(r.start, r.stop)))
        want = tuple(want)
        sizes = [hi - lo for lo, hi in want]
        int_dtype = int_view_dtype(dtype)
        if 0 in sizes:
            return torch.empty(sizes, dtype=dtype)
        if self.held is not None:
            out = self.held[0][name].reshape(shape)[tuple(slice(lo, hi) for lo, hi in want)].clone()
        else:
            out = torch.zeros(sizes, dtype=int_dtype)

        def decode(i: int, chunk: list) -> torch.Tensor:
            manifest, part, _ = self.parts[i]
            shard, offset, length, _, n = chunk
            bits = torch.empty(n, dtype=int_dtype)
            data = self._shard(manifest, part, shard)
            decode_chunk(memoryview(data)[offset:offset + length], n, int_dtype, None, bits)
            self.elements_decoded += n
            return bits

        assemble(out, want, [tensors[name] for _, _, tensors in self.parts], decode)
        return from_bits(out, dtype, sizes)
