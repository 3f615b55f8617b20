"""Trainer side: every trainer rank publishes the boxes of the weights it owns; one process is the one-rank case.

Each rank holds boxes of the full tensors (parallel/slices.py's local_pieces: tensor/expert-parallel cuts, then
FSDP's; a plain tensor or a one-process model: the whole tensor). A box held by several ranks (a replicated
tensor, an HSDP replica) is owned by the lowest of them, so every element of every full tensor is published
exactly once. A rank encodes the XOR of its owned boxes against its own previous version of the same boxes
(zstd, byte-shuffled: codec.py), writes them as its own shard objects, and confirms; rank 0 writes the manifest
after every owner has confirmed, so a version is visible whole or not at all. An owner that fails reports its
error in the confirmation instead of leaving the others waiting: no manifest is written, the version's objects
are deleted, no rank advances its base, and the next publish is a delta against the last visible version.
Per-rank host memory is O(its shard): its owned bits of the last version plus one version in flight.

The manifest (manifest.py) lists per tensor its `pieces`: the box of the full tensor and its chunks, which a
subscriber reads for any box of any layout (boxes.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_composer.checkpoint import int4
from megatron_composer.parallel.slices import full_shape, local_pieces, local_tensor, named_tensors

from . import manifest as mf
from .boxes import Box, box_key, disjoint, full_box, volume
from .codec import WeightSyncError, dtype_from_name, dtype_name, encode_chunk, to_bits
from .policy import VersionPolicy
from .store import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)


@dataclass
class PublishStats:
    version: int
    base_version: int | None
    is_snapshot: bool
    bytes_written: int          # shards (delta and snapshot) of every owner + manifest
    delta_bytes: int            # compressed delta part; 0 when the version has none
    snapshot_bytes: int         # compressed snapshot part; 0 when the version is not a snapshot
    full_bytes: int             # raw bytes of the full state dict (the size of a plain copy in the published dtypes)
    identical_fraction: float | None   # elements whose bits equal the base version's; None without a base
    seconds: float              # the whole publish, until the version is visible (or refused)
    retries: int                # transient failures of this rank's store retried during this publish
    own_bytes: int = 0          # raw bytes this rank encoded (all of them when one process publishes)
    own_seconds: float = 0.0    # this rank's encode-and-write time, before every owner's confirmation

    @property
    def delta_ratio(self) -> float | None:
        return self.delta_bytes / self.full_bytes if self.delta_bytes and self.full_bytes else None


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
        if sum(map(volume, boxes)) != volume(full_box(shape)) or any(
                not disjoint(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            raise WeightSyncError(f"the trainer ranks' pieces of '{name}' {sorted(boxes)} do not tile its full "
                                  f"shape {shape} exactly once; the layout cannot be published sharded")
    out: list[set[tuple[str, Box]]] = [set() for _ in held]
    for item, rank in owner.items():
        out[rank].add(item)
    return out


def _piece(local: torch.Tensor, where: tuple[slice, ...], to: torch.dtype | None) -> torch.Tensor:
    t = local[where]
    return t.to(to) if to is not None else t


def _full_bytes(meta: dict[str, tuple[str, list[int]]]) -> int:
    """Raw bytes of the full (unsharded) state dict."""
    return sum(volume(full_box(shape)) * torch.empty((), dtype=dtype_from_name(d)).element_size()
               for d, shape in meta.values())


class WeightPublisher:
    """Publishes versions of weights from every rank of `group` (all of them call `publish`).

    Args:
        store: this rank's handle on the shared store.
        group: the trainer's process group; None: this process alone (a one-rank publish, owning every tensor
            whole), also under torch.distributed. Its collectives carry Python objects: give a gloo group when
            the trainer's own group is NCCL.
        dtype: a model's floating tensors are published cast to it (None: as held), e.g. the rollout engine's
            bf16 while the trainer holds fp32 masters; a state dict is published as given.
        threads: encode threads per rank (store transfers use the store's own pool).
        snapshot_interval, keep_snapshots, shard_bytes, chunk_bytes, compression_level: policy.VersionPolicy's.
        experts: "int4": a model's routed experts are published as the engine serves them, pack-quantized INT4
            (checkpoint/int4.py: `X.weight_packed` int32 and `X.weight_scale` bf16 per expert tensor X, equal to
            the INT4 export's), so the deltas are taken of the bytes the engine holds; None: like other tensors.
    """

    def __init__(self, store: ObjectStore, *, group=None, snapshot_interval: int = 20,
                 keep_snapshots: int | None = 2, shard_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20,
                 compression_level: int = 1, threads: int | None = None, dtype: torch.dtype | None = None,
                 experts: str | None = None):
        if experts not in (None, "int4"):
            raise WeightSyncError(f"experts={experts!r}: publish routed experts as they are (None) or as int4")
        self.policy = VersionPolicy(snapshot_interval, keep_snapshots, shard_bytes, chunk_bytes, compression_level)
        self.store, self.group, self.dtype, self.experts = store, group, dtype, experts
        self.distributed = group is not None
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._base: dict[tuple[str, Box], torch.Tensor] | None = None   # this rank's owned bits, last version
        self._base_meta: dict[str, tuple[str, list[int]]] | None = None
        self._base_version: int | None = None
        self._base_id: str | None = None
        self._owned: set[tuple[str, Box]] | None = None   # the boxes this rank published last
        self._executor: ThreadPoolExecutor | None = None  # publish_async's one background thread
        self._inflight: list[tuple[int, Future]] = []

    @property
    def last_version(self) -> int | None:
        return self._base_version

    def _gather(self, obj):
        if not self.distributed:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _layout(self, weights: nn.Module | Mapping[str, torch.Tensor]):
        """The published tensors as (box of the full tensor, bits of it) per name, their full metadata as
        published, and the (name, box) this rank holds. With int4 experts a model's routed-expert tensors are
        published as their served parts (`X.weight_packed`, `X.weight_scale`), each box quantised from this
        rank's piece when it is taken."""
        module = isinstance(weights, nn.Module)
        named = list(named_tensors(weights) if module else weights.items())
        if not named:
            what = "a model without parameters" if module else "an empty state_dict"
            raise WeightSyncError(f"cannot publish {what}")
        cast = self.dtype if module else None
        sources: dict[str, list[tuple[Box, Callable[[], torch.Tensor]]]] = {}
        meta: dict[str, tuple[str, list[int]]] = {}
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise WeightSyncError(f"state_dict['{name}'] is a {type(t).__name__}, not a tensor")
            local, pieces, shape = local_tensor(t), local_pieces(t), list(full_shape(t))
            if self.experts == "int4" and int4.is_routed_expert(name):
                self._add_int4(sources, meta, name, local, pieces, shape)
                continue
            to = cast if cast is not None and t.is_floating_point() else None
            sources[name] = [(box_key(pc.full), functools.partial(_piece, local, pc.local, to)) for pc in pieces]
            meta[name] = (dtype_name(to or t.dtype), shape)
        held = [(name, box) for name, items in sources.items() for box, _ in items]
        return sources, meta, held

    @staticmethod
    def _add_int4(sources: dict, meta: dict, name: str, local: torch.Tensor, pieces: list, shape: list[int]) -> None:
        """The served parts of a routed-expert tensor: per piece, the same box of rows and its input columns / 8
        (words) or / 32 (scales); a piece is quantised once for both parts."""
        for pc in pieces:
            cols = pc.full[-1]
            if cols.start % int4.GROUP or cols.stop % int4.GROUP:
                raise WeightSyncError(f"'{name}' is cut at input columns {cols.start}:{cols.stop}, not on INT4 "
                                      f"groups of {int4.GROUP}: publish its experts unquantised "
                                      "(rollout.quantize_experts=none) or cut it on group boundaries")
        quantised = [functools.lru_cache(1)(functools.partial(int4.served_parts, local[pc.local])) for pc in pieces]
        for suffix in int4.SERVED_PARTS:
            part_shape = int4.served_shape(shape, suffix)
            per = shape[-1] // part_shape[-1]
            meta[name + suffix] = (dtype_name(int4.PART_DTYPES[suffix]), part_shape)
            sources[name + suffix] = [
                (box_key((*pc.full[:-1], slice(pc.full[-1].start // per, pc.full[-1].stop // per))),
                 lambda q=q, suffix=suffix: q()[suffix]) for pc, q in zip(pieces, quantised)]

    @staticmethod
    def _take(sources: dict, mine: set) -> dict[tuple[str, Box], torch.Tensor]:
        """Bits (CPU copies, in the published dtype) of the boxes in `mine`."""
        return {(name, box): to_bits(get()) for name, items in sources.items() for box, get in items
                if (name, box) in mine}

    @torch.no_grad()
    def publish(self, weights: nn.Module | Mapping[str, torch.Tensor], version: int) -> PublishStats:
        """Write ``version`` of a model's weights or of a state dict of full tensors (every rank its owned boxes);
        returns on every rank once the version is visible, or raises WeightSyncError on every rank if any owner
        failed (then nothing is)."""
        sources, meta, held = self._layout(weights)
        return self._write(version, meta, held, lambda mine: self._take(sources, mine))

    @torch.no_grad()
    def publish_async(self, weights: nn.Module | Mapping[str, torch.Tensor], version: int,
                      max_pending: int = 1) -> list[tuple[int, object]]:
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
        if self._owned is None:
            done = self.flush()
            try:
                return done + [(version, self.publish(weights, version))]
            except (WeightSyncError, ObjectStoreError) as e:
                return done + [(version, e)]
        sources, meta, held = self._layout(weights)
        bits = self._take(sources, self._owned)

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

    # --- one publish: 1. agree on owners and the version id, 2. every owner writes, 3. rank 0's manifest ------
    def _write(self, version: int, meta: dict, held: list, take) -> PublishStats:
        """take(mine) gives the bits of the owned boxes."""
        t0 = time.perf_counter()
        retries0 = self.store.retries
        if self._base_version is not None and version <= self._base_version:
            raise WeightSyncError(f"weight version {version} is not newer than the last published version "
                                  f"{self._base_version}; versions must increase")
        if self.rank == 0 and self._base is None:
            self.policy.start_lineage(self.store, version)
        # phase 1 (after rank 0's clean-up): pieces, whether each rank holds a base, the version id
        first = self._gather((held, self._base is not None and self._base_meta == meta, uuid.uuid4().hex, meta))
        if any(m != meta for *_, m in first):
            raise WeightSyncError(f"trainer ranks disagree on the model's tensors (names, dtypes, full shapes) at "
                                  f"weight version {version}; every rank must publish the same model")
        vid = first[0][2]
        mine = self._owned = owned_boxes([h for h, *_ in first], {n: s for n, (_, s) in meta.items()})[self.rank]
        has_base = all(b for _, b, *_ in first)
        if self._base is not None and not has_base:
            log.warning("weight sync: tensors or layout changed since version %d; writing a snapshot",
                        self._base_version)
        is_snapshot = self.policy.is_snapshot(version, has_base)

        # phase 2: encode and write this rank's boxes; failures are reported, not raised, so no rank waits
        t_own = time.perf_counter()
        bits, result = self._write_own(version, vid, mine, has_base, is_snapshot, take)
        own_seconds = time.perf_counter() - t_own
        confirmed = self._gather(result)

        # phase 3: rank 0 writes the manifest last, after every owner confirmed; every rank learns the outcome
        manifest_bytes = self._commit(version, vid, has_base, meta, confirmed)

        base_version = self._base_version
        self._base, self._base_meta, self._base_version, self._base_id = bits, meta, version, vid
        self.policy.published(version, is_snapshot, self.store if self.rank == 0 else None)
        delta_bytes = sum(c.get("delta", {}).get("bytes", 0) for c in confirmed)
        snapshot_bytes = sum(c.get("snapshot", {}).get("bytes", 0) for c in confirmed)
        unchanged = sum(c.get("delta", {}).get("unchanged", 0) for c in confirmed)
        numel = sum(c.get("delta", {}).get("numel", 0) for c in confirmed)
        return PublishStats(
            version=version, base_version=base_version if has_base else None,
            is_snapshot=is_snapshot, bytes_written=delta_bytes + snapshot_bytes + len(manifest_bytes),
            delta_bytes=delta_bytes, snapshot_bytes=snapshot_bytes, full_bytes=_full_bytes(meta),
            identical_fraction=unchanged / numel if has_base and numel else None,
            seconds=time.perf_counter() - t0, retries=self.store.retries - retries0,
            own_bytes=sum(b.numel() * b.element_size() for b in bits.values()), own_seconds=own_seconds)

    def _write_own(self, version: int, vid: str, mine: set, has_base: bool, is_snapshot: bool, take
                   ) -> tuple[dict, dict]:
        """Phase 2: this rank's owned bits and its confirmation (its parts, or the error it met)."""
        try:
            if has_base and set(self._base) != mine:
                raise WeightSyncError(f"trainer rank {self.rank} owns other boxes than at version "
                                      f"{self._base_version}")
            bits = take(mine)
            result = {}
            if has_base:
                result["delta"] = self._write_part(version, vid, "delta", bits, self._base)
            if is_snapshot:
                result["snapshot"] = self._write_part(version, vid, "snapshot", bits, None)
            return bits, result
        except Exception as e:   # reported to every rank
            log.error("weight sync: trainer rank %d failed to write weight version %d: %s", self.rank, version, e)
            return {}, {"error": f"{type(e).__name__}: {e}"}

    def _commit(self, version: int, vid: str, has_base: bool, meta: dict, confirmed: list[dict]) -> bytes:
        """Phase 3: rank 0 writes the manifest if every owner confirmed (else deletes the version's objects);
        raises WeightSyncError on every rank if the version did not become visible. Returns the manifest."""
        errors = [f"rank {r}: {c['error']}" for r, c in enumerate(confirmed) if "error" in c]
        manifest_bytes, status = b"", [None]
        if self.rank == 0:
            try:
                if errors:
                    raise WeightSyncError("; ".join(errors))
                manifest_bytes = mf.dumps(self._manifest(version, vid, has_base, meta, confirmed))
                self.store.put(mf.manifest_key(version), manifest_bytes)   # last: the version now exists
            except Exception as e:
                status = [f"{type(e).__name__}: {e}"]
                try:
                    self.store.delete_prefix(mf.version_dir(version))
                except Exception as e2:   # the version stays invisible without its manifest
                    log.warning("weight sync: could not delete the objects of failed version %d: %s", version, e2)
        if self.distributed:
            dist.broadcast_object_list(status, src=dist.get_global_rank(self.group, 0), group=self.group)
        if status[0] is not None:
            raise WeightSyncError(f"weight version {version} was not published (it stays invisible; the next "
                                  f"version is a delta against {self._base_version}): {status[0]}")
        return manifest_bytes

    def _write_part(self, version: int, vid: str, part: str, bits: dict[tuple[str, Box], torch.Tensor],
                    base: dict[tuple[str, Box], torch.Tensor] | None) -> dict:
        keys = list(bits)
        pieces = [{"name": name, "box": [list(r) for r in box], "chunks": []} for name, box in keys]
        p = self.policy
        shards, unchanged = encode_and_upload(
            self.store, [bits[k] for k in keys], None if base is None else [base[k] for k in keys], pieces,
            lambda n: f"{mf.version_dir(version)}/{part}-{vid[:8]}-r{self.rank:05d}-{n:05d}.zst",
            chunk_bytes=p.chunk_bytes, shard_bytes=p.shard_bytes, threads=self.threads,
            compression_level=p.compression_level)
        return {"bytes": sum(s["bytes"] for s in shards), "shards": shards, "pieces": pieces,
                "unchanged": unchanged, "numel": sum(b.numel() for b in bits.values())}

    def _manifest(self, version: int, vid: str, has_base: bool, meta: dict[str, tuple[str, list[int]]],
                  confirmed: list[dict]) -> dict:
        manifest = {
            "format": mf.FORMAT, "version": version, "id": vid, "created": time.time(),
            "base": {"version": self._base_version, "id": self._base_id} if has_base else None,
            "codec": {"transform": "xor-byteshuffle", "compressor": "zstd", "level": self.policy.compression_level},
            "full_bytes": _full_bytes(meta), "owners": len(confirmed), "parts": {},
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
        return manifest


def _ordered_map(pool: ThreadPoolExecutor, fn: Callable, items: Iterable, window: int) -> Iterator:
    """pool.map that keeps at most ``window`` results in flight, so memory stays bounded."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def encode_and_upload(store, bits: list[torch.Tensor], base: list[torch.Tensor] | None, entries: list[dict],
                      shard_key: Callable[[int], str], *, chunk_bytes: int, shard_bytes: int, threads: int,
                      compression_level: int) -> tuple[list[dict], int]:
    """Encode each flat bit tensor bits[i] in chunks (XOR against base[i], zstd) on `threads` threads, pack the
    blobs in order into shard objects of about shard_bytes named shard_key(n), upload them while encoding goes
    on, and record every chunk as [shard, offset, length, start, count] in entries[i]["chunks"]. Returns the
    shard records (key, bytes, sha256) and the number of unchanged elements."""
    jobs = []   # (entry index, start, count)
    for i, b in enumerate(bits):
        step = max(1, chunk_bytes // b.element_size())
        jobs += [(i, s, min(step, b.numel() - s)) for s in range(0, b.numel(), step)]

    def encode(job):
        i, s, n = job
        return (i, s, n, *encode_chunk(bits[i][s:s + n], None if base is None else base[i][s:s + n],
                                       compression_level))

    shards: list[dict] = []
    uploads: list[Future] = []
    buf: list[bytes] = []
    buf_len, unchanged = 0, 0

    def flush() -> None:
        nonlocal buf, buf_len
        data = b"".join(buf)
        key = shard_key(len(shards))
        shards.append({"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        uploads.append(put_pool.submit(store.put, key, data))
        buf, buf_len = [], 0

    with ThreadPoolExecutor(threads, thread_name_prefix="wsync-encode") as enc_pool, \
            ThreadPoolExecutor(store.threads, thread_name_prefix="wsync-put") as put_pool:
        for i, s, n, blob, same in _ordered_map(enc_pool, encode, jobs, window=4 * threads):
            if buf and buf_len + len(blob) > shard_bytes:
                flush()
            entries[i]["chunks"].append([len(shards), buf_len, len(blob), s, n])
            buf.append(blob)
            buf_len += len(blob)
            unchanged += same
        if buf:
            flush()
        for f in uploads:
            f.result()
    return shards, unchanged
