"""Trainer side, sharded: every trainer rank publishes the slices of the weights it owns, in parallel.

Each rank holds boxes of the full tensors (parallel/slices.py's local_pieces: tensor/expert-parallel cuts, then
FSDP's). A box held by several ranks (a replicated tensor, an HSDP replica) is owned by the lowest of them, so
every element of every full tensor is published exactly once. A rank encodes the XOR of its owned boxes against
its own previous version of the same boxes (zstd, byte-shuffled: codec.py), writes them as its own shard
objects, and confirms; rank 0 writes the manifest after every owner has confirmed, so a version is visible whole
or not at all. An owner that fails reports its error in the confirmation instead of leaving the others waiting:
no manifest is written, the version's objects are deleted, no rank advances its base, and the next publish is
a delta against the last visible version. Per-rank host memory is O(its shard): its owned bits of the last
version plus one version in flight.

The manifest (manifest.py) lists per tensor `pieces`: the box of the full tensor ([[start, stop], ...] per
dim) and its chunks ([shard, offset, length, start, count], flat within the box, row-major), which
subscriber.VersionReader reads for any box of any layout.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_composer.parallel.slices import full_shape, local_pieces, local_tensor, named_tensors

from . import manifest as mf
from .codec import WeightSyncError, dtype_from_name, dtype_name, to_bits
from .publisher import PublishStats, encode_and_upload
from .store import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]


def _box(full: tuple[slice, ...]) -> Box:
    return tuple((s.start, s.stop) for s in full)


def _volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _disjoint(a: Box, b: Box) -> bool:
    return any(ah <= bl or bh <= al for (al, ah), (bl, bh) in zip(a, b))


def owned_boxes(held: list[list[tuple[str, Box]]], shapes: dict[str, list[int]]) -> list[set[tuple[str, Box]]]:
    """Per rank, the (name, box) it publishes: each distinct box by the lowest rank holding it. Raises unless the
    distinct boxes of every tensor tile it exactly (no partial overlaps, no gaps)."""
    owner: dict[tuple[str, Box], int] = {}
    for rank, items in enumerate(held):
        for item in items:
            owner.setdefault(item, rank)
    by_name: dict[str, list[Box]] = {}
    for name, box in owner:
        by_name.setdefault(name, []).append(box)
    for name, shape in shapes.items():
        boxes = by_name.get(name, [])
        numel = _volume(tuple((0, n) for n in shape))
        if sum(map(_volume, boxes)) != numel or any(not _disjoint(a, b) for i, a in enumerate(boxes)
                                                     for b in boxes[i + 1:]):
            raise WeightSyncError(f"the trainer ranks' pieces of '{name}' {sorted(boxes)} do not tile its full "
                                  f"shape {shape} exactly once; the layout cannot be published sharded")
    out: list[set[tuple[str, Box]]] = [set() for _ in held]
    for item, rank in owner.items():
        out[rank].add(item)
    return out


def _full_bytes(meta: dict[str, tuple[str, list[int]]]) -> int:
    """Raw bytes of the full (unsharded) state dict."""
    return sum(_volume(tuple((0, n) for n in shape)) * torch.empty((), dtype=dtype_from_name(d)).element_size()
               for d, shape in meta.values())


class ShardedWeightPublisher:
    """Publishes versions of a laid-out model from every rank of `group` (all of them call `publish`).

    Args are WeightPublisher's (store: this rank's handle on the shared store); `group` is the trainer's
    process group (None: the default group; a single process without torch.distributed is the one-rank case,
    owning every tensor whole); `dtype`: floating tensors are published cast to it (None: as held), e.g. the
    rollout engine's bf16 while the trainer holds fp32 masters. The group's collectives carry Python objects:
    give a gloo group when the trainer's own group is NCCL."""

    def __init__(self, store: ObjectStore, group=None, snapshot_interval: int = 20, keep_snapshots: int | None = 2,
                 shard_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, compression_level: int = 1,
                 threads: int | None = None, dtype: torch.dtype | None = None):
        if snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
        if keep_snapshots is not None and keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1 or None (keep all), got {keep_snapshots}")
        if shard_bytes < 1 or chunk_bytes < 8:
            raise ValueError(f"shard_bytes must be >= 1 and chunk_bytes >= 8, got {shard_bytes}, {chunk_bytes}")
        if not -7 <= compression_level <= 22:
            raise ValueError(f"compression_level must be a zstd level in [-7, 22], got {compression_level}")
        self.store, self.group, self.dtype = store, group, dtype
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.snapshot_interval, self.keep_snapshots = snapshot_interval, keep_snapshots
        self.shard_bytes, self.chunk_bytes, self.compression_level = shard_bytes, chunk_bytes, compression_level
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._base: dict[tuple[str, Box], torch.Tensor] | None = None   # this rank's owned bits, last version
        self._base_meta: dict[str, tuple[str, list[int]]] | None = None
        self._base_version: int | None = None
        self._base_id: str | None = None
        self._snapshots: list[int] = []
        self._owned: set[tuple[str, Box]] | None = None   # the boxes this rank published last
        self._executor: ThreadPoolExecutor | None = None  # publish_async's one background thread
        self._inflight: list[tuple[int, Future]] = []

    @property
    def last_version(self) -> int | None:
        return self._base_version

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def _gather(self, obj):
        if not self.distributed:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _layout(self, model: nn.Module):
        """The model's tensors (this rank's local tensor and its pieces), their full metadata as published, and
        the (name, box) this rank holds."""
        tensors: dict[str, tuple[torch.Tensor, list]] = {}
        meta: dict[str, tuple[str, list[int]]] = {}
        for name, t in named_tensors(model):
            pieces = local_pieces(t)
            tensors[name] = (local_tensor(t), pieces)
            dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
            meta[name] = (dtype_name(dtype), list(full_shape(t)))
        if not tensors:
            raise WeightSyncError("cannot publish a model without parameters")
        held = [(name, _box(pc.full)) for name, (_, pieces) in tensors.items() for pc in pieces]
        return tensors, meta, held

    def _take(self, tensors: dict, mine: set) -> dict[tuple[str, Box], torch.Tensor]:
        """Bits (CPU copies, in the published dtype) of the boxes in `mine`."""
        bits = {}
        for name, (local, pieces) in tensors.items():
            for pc in pieces:
                key = (name, _box(pc.full))
                if key in mine:
                    bits[key] = to_bits(self._cast(local[pc.local]))
        return bits

    @torch.no_grad()
    def publish(self, model: nn.Module, version: int) -> PublishStats:
        """Write ``version`` of ``model``'s weights (every rank its owned boxes); returns on every rank once the
        version is visible, or raises WeightSyncError on every rank if any owner failed (then nothing is)."""
        tensors, meta, held = self._layout(model)
        return self._write(version, meta, held, lambda mine: self._take(tensors, mine))

    @torch.no_grad()
    def publish_async(self, model: nn.Module, version: int, max_pending: int = 1) -> list[tuple[int, object]]:
        """Start publishing ``version`` in this rank's background thread and return: the owned boxes are copied
        now (the weights as of this call), encoding, writes, the confirmation and rank 0's manifest happen in
        the thread, over `group` -- which nothing else may use meanwhile -- so a slow owner delays when the
        version becomes visible, not the caller. At most ``max_pending`` versions are in flight: a call
        beyond that first waits for the oldest, so the trainer runs at most that many versions ahead of the
        newest visible one. The first call publishes synchronously (it learns which boxes this rank owns).
        Returns (version, PublishStats or the exception it raised) of the publishes finished since the last
        call, oldest first; `flush` waits for the rest."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        tensors, meta, held = self._layout(model)
        if self._owned is None:
            done = self.flush()
            try:
                return done + [(version, self.publish(model, version))]
            except (WeightSyncError, ObjectStoreError) as e:
                return done + [(version, e)]
        bits = self._take(tensors, self._owned)

        def take(mine: set) -> dict:
            if mine != set(bits):
                raise WeightSyncError(f"trainer rank {self.rank} owns other boxes than it copied for version "
                                      f"{version}; the layout changed during background publishing")
            return bits

        done = self._finished()
        while len(self._inflight) >= max_pending:
            done += self._wait_oldest()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="wsync-publish")
        self._inflight.append((version, self._executor.submit(self._write, version, meta, held, take)))
        return done

    def flush(self) -> list[tuple[int, object]]:
        """Wait for every background publish; their (version, PublishStats or exception), oldest first."""
        done = []
        while self._inflight:
            done += self._wait_oldest()
        return done

    def _wait_oldest(self) -> list[tuple[int, object]]:
        version, future = self._inflight.pop(0)
        try:
            return [(version, future.result())]
        except (WeightSyncError, ObjectStoreError) as e:
            return [(version, e)]

    def _finished(self) -> list[tuple[int, object]]:
        done = []
        while self._inflight and self._inflight[0][1].done():
            done += self._wait_oldest()
        return done

    def _write(self, version: int, meta: dict, held: list, take) -> PublishStats:
        """Phases 1-3 of a publish (module docstring); take(mine) gives the bits of the owned boxes."""
        t0 = time.perf_counter()
        retries0 = self.store.retries
        if self._base_version is not None and version <= self._base_version:
            raise WeightSyncError(f"weight version {version} is not newer than the last published version "
                                  f"{self._base_version}; versions must increase")
        if self.rank == 0 and self._base is None:
            # a new lineage: versions at or above this one belong to a dead run
            self._delete_versions(lambda v: v >= version)
        # phase 1 (after rank 0's clean-up): pieces, whether each rank holds a base, the version id
        vid = uuid.uuid4().hex
        first = self._gather((held, self._base is not None and self._base_meta == meta, vid, meta))
        if any(m != meta for *_, m in first):
            raise WeightSyncError(f"trainer ranks disagree on the model's tensors (names, dtypes, full shapes) at "
                                  f"weight version {version}; every rank must publish the same model")
        vid = first[0][2]
        mine = owned_boxes([h for h, *_ in first], {n: s for n, (_, s) in meta.items()})[self.rank]
        self._owned = mine
        has_base = all(b for _, b, *_ in first)
        if self._base is not None and not has_base:
            log.warning("weight sync: tensors or layout changed since version %d; writing a snapshot", self._base_version)
        is_snapshot = not has_base or version - self._snapshots[-1] >= self.snapshot_interval

        # phase 2: encode and write this rank's boxes; failures are reported, not raised, so no rank waits
        bits: dict[tuple[str, Box], torch.Tensor] = {}
        result: dict = {}
        t_own = time.perf_counter()
        try:
            if has_base and set(self._base) != mine:
                raise WeightSyncError(f"trainer rank {self.rank} owns other boxes than at version "
                                      f"{self._base_version}")
            bits = take(mine)
            if has_base:
                result["delta"] = self._write_part(version, vid, "delta", bits, self._base)
            if is_snapshot:
                result["snapshot"] = self._write_part(version, vid, "snapshot", bits, None)
        except Exception as e:   # reported to every rank below
            log.error("weight sync: trainer rank %d failed to write weight version %d: %s", self.rank, version, e)
            result = {"error": f"{type(e).__name__}: {e}"}
        own_seconds = time.perf_counter() - t_own
        confirmed = self._gather(result)

        # phase 3: rank 0 writes the manifest last, after every owner confirmed; every rank learns the outcome
        errors = [f"rank {r}: {c['error']}" for r, c in enumerate(confirmed) if "error" in c]
        manifest, manifest_bytes, status = None, b"", [None]
        if self.rank == 0:
            try:
                if errors:
                    raise WeightSyncError("; ".join(errors))
                manifest = self._manifest(version, vid, has_base, meta, confirmed)
                manifest_bytes = mf.dumps(manifest)
                self.store.put(mf.manifest_key(version), manifest_bytes)   # last: the version now exists
            except Exception as e:
                status = [f"{type(e).__name__}: {e}"]
                try:
                    self.store.delete_prefix(mf.version_dir(version))
                except Exception as e2:   # the version stays invisible without its manifest
                    log.warning("weight sync: could not delete the objects of failed version %d: %s", version, e2)
        if self.distributed:
            dist.broadcast_object_list(status, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        if status[0] is not None:
            raise WeightSyncError(f"weight version {version} was not published (it stays invisible; the next "
                                  f"version is a delta against {self._base_version}): {status[0]}")

        base_version = self._base_version
        self._base, self._base_meta, self._base_version, self._base_id = bits, meta, version, vid
        if is_snapshot:
            self._snapshots.append(version)
        self._collect_garbage()
        delta_bytes = sum(c.get("delta", {}).get("bytes", 0) for c in confirmed)
        snapshot_bytes = sum(c.get("snapshot", {}).get("bytes", 0) for c in confirmed)
        full_bytes = _full_bytes(meta)
        unchanged = sum(c.get("delta", {}).get("unchanged", 0) for c in confirmed)
        numel = sum(c.get("delta", {}).get("numel", 0) for c in confirmed)
        return PublishStats(
            version=version, base_version=base_version if has_base else None,
            is_snapshot=is_snapshot, bytes_written=delta_bytes + snapshot_bytes + len(manifest_bytes),
            delta_bytes=delta_bytes, snapshot_bytes=snapshot_bytes, full_bytes=full_bytes,
            identical_fraction=unchanged / numel if has_base and numel else None,
            seconds=time.perf_counter() - t0, retries=self.store.retries - retries0,
            own_bytes=sum(b.numel() * b.element_size() for b in bits.values()), own_seconds=own_seconds)

    # --- encoding ------------------------------------------------------------------------------------------
    def _write_part(self, version: int, vid: str, part: str, bits: dict[tuple[str, Box], torch.Tensor],
                    base: dict[tuple[str, Box], torch.Tensor] | None) -> dict:
        keys = list(bits)
        pieces = [{"name": name, "box": [list(r) for r in box], "chunks": []} for name, box in keys]
        shards, unchanged = encode_and_upload(
            self.store, [bits[k] for k in keys], None if base is None else [base[k] for k in keys], pieces,
            lambda n: f"{mf.version_dir(version)}/{part}-{vid[:8]}-r{self.rank:05d}-{n:05d}.zst",
            chunk_bytes=self.chunk_bytes, shard_bytes=self.shard_bytes, threads=self.threads,
            compression_level=self.compression_level)
        return {"bytes": sum(s["bytes"] for s in shards), "shards": shards, "pieces": pieces,
                "unchanged": unchanged, "numel": sum(b.numel() for b in bits.values())}

    def _manifest(self, version: int, vid: str, has_base: bool, meta: dict[str, tuple[str, list[int]]],
                  confirmed: list[dict]) -> dict:
        manifest = {
            "format": mf.FORMAT, "version": version, "id": vid, "created": time.time(),
            "base": {"version": self._base_version, "id": self._base_id} if has_base else None,
            "codec": {"transform": "xor-byteshuffle", "compressor": "zstd", "level": self.compression_level},
            "full_bytes": 0, "owners": len(confirmed), "parts": {},
        }
        for part in ("delta", "snapshot"):
            if part not in confirmed[0]:
                continue
            entries = {name: {"name": name, "dtype": d, "shape": s, "pieces": []} for name, (d, s) in meta.items()}
            shards: list[dict] = []
            for c in confirmed:   # owner by owner: shard indices offset by the shards before
                offset = len(shards)
                shards += c[part]["shards"]
                for pc in c[part]["pieces"]:
                    entries[pc["name"]]["pieces"].append(
                        {"box": pc["box"], "chunks": [[k + offset, *rest] for k, *rest in pc["chunks"]]})
            manifest["parts"][part] = {"bytes": sum(s["bytes"] for s in shards), "shards": shards,
                                       "tensors": list(entries.values())}
        manifest["full_bytes"] = _full_bytes(meta)
        return manifest

    # --- garbage collection (rank 0) ---------------------------------------------------------------------
    def _collect_garbage(self) -> None:
        if self.keep_snapshots is None or not self._snapshots:
            return
        cutoff = self._snapshots[-min(self.keep_snapshots, len(self._snapshots))]
        if self.rank == 0:
            self._delete_versions(lambda v: v < cutoff)
        self._snapshots = [v for v in self._snapshots if v >= cutoff]

    def _delete_versions(self, doomed) -> None:
        for name in self.store.list_dirs():
            v = mf.parse_version_dir(name)
            if v is not None and doomed(v):
                self.store.delete(mf.manifest_key(v))   # invisible first, then the shards
                self.store.delete_prefix(mf.version_dir(v))
