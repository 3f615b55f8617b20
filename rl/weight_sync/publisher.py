"""Trainer side: publish each optimizer step's weights as a lossless delta against the previous version."""

from __future__ import annotations

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

from . import manifest as mf
from .codec import WeightSyncError, dtype_name, encode_chunk, to_bits
from .store import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class PublishStats:
    version: int
    base_version: int | None
    is_snapshot: bool
    bytes_written: int          # shards (delta and snapshot) + manifest
    delta_bytes: int            # compressed delta part; 0 when the version has none
    snapshot_bytes: int         # compressed snapshot part; 0 when the version is not a snapshot
    full_bytes: int             # raw bytes of the state dict (the size of a plain bf16 copy)
    identical_fraction: float | None   # elements whose bits equal the base version's; None without a base
    seconds: float
    retries: int                # transient store failures retried during this publish
    own_bytes: int = 0          # raw bytes this rank encoded (all of them for the whole-tensor publisher)
    own_seconds: float = 0.0    # this rank's encode-and-write time, before the confirmation (sharded publish)

    @property
    def delta_ratio(self) -> float | None:
        return self.delta_bytes / self.full_bytes if self.delta_bytes and self.full_bytes else None


def _ordered_map(pool: ThreadPoolExecutor, fn: Callable, items: Iterable, window: int) -> Iterator:
    """pool.map that keeps at most ``window`` results in flight, so memory stays bounded."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class WeightPublisher:
    """Publishes versions of a state dict to an ObjectStore.

    Args:
        store: where versions go.
        snapshot_interval: a full snapshot every N versions (and for the first one, and when the set of
            tensors, their shapes or dtypes change). Every version also carries a delta when it has a base,
            so an up-to-date subscriber never downloads a snapshot.
        keep_snapshots: versions older than the ``keep_snapshots``-th newest snapshot are deleted (they are
            not needed to reconstruct anything newer); None keeps everything.
        shard_bytes: compressed bytes per shard object (a chunk larger than this gets a shard of its own).
        chunk_bytes: raw bytes per independently compressed chunk (the unit of parallel encode/decode).
        compression_level: zstd level; level 1 is fast and shrinks XOR deltas about as much as level 3.
        threads: encode threads (store transfers use the store's own pool).
    """

    def __init__(self, store: ObjectStore, snapshot_interval: int = 20, keep_snapshots: int | None = 2,
                 shard_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20, compression_level: int = 1,
                 threads: int | None = None):
        if snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
        if keep_snapshots is not None and keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1 or None (keep all), got {keep_snapshots}")
        if shard_bytes < 1 or chunk_bytes < 8:
            raise ValueError(f"shard_bytes must be >= 1 and chunk_bytes >= 8, got {shard_bytes}, {chunk_bytes}")
        if not -7 <= compression_level <= 22:
            raise ValueError(f"compression_level must be a zstd level in [-7, 22], got {compression_level}")
        self.store = store
        self.snapshot_interval = snapshot_interval
        self.keep_snapshots = keep_snapshots
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self.compression_level = compression_level
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._base: dict[str, torch.Tensor] | None = None          # bits of the last published version
        self._base_meta: dict[str, tuple[str, list[int]]] | None = None
        self._base_version: int | None = None
        self._base_id: str | None = None
        self._snapshots: list[int] = []                            # snapshot versions of this lineage

    @property
    def last_version(self) -> int | None:
        return self._base_version

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        """Write ``version``; returns once its manifest is in the store (i.e. once it is visible)."""
        t0 = time.perf_counter()
        retries0 = self.store.retries
        if self._base_version is not None and version <= self._base_version:
            raise WeightSyncError(f"weight version {version} is not newer than the last published version "
                                  f"{self._base_version}; versions must increase")
        bits, meta = {}, {}
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise WeightSyncError(f"state_dict['{name}'] is a {type(t).__name__}, not a tensor")
            bits[name] = to_bits(t)
            meta[name] = (dtype_name(t.dtype), list(t.shape))
        if not bits:
            raise WeightSyncError("cannot publish an empty state_dict")

        if self._base is None:
            # A new lineage (first publish, or a trainer resumed from a checkpoint): versions at or above
            # this one belong to a dead run and must not be mistaken for ours.
            self._delete_versions(lambda v: v >= version)
        has_base = self._base is not None and self._base_meta == meta
        if self._base is not None and not has_base:
            log.warning("weight sync: tensor names/shapes/dtypes changed since version %d; writing a snapshot",
                        self._base_version)
        is_snapshot = not has_base or version - self._snapshots[-1] >= self.snapshot_interval
        vid = uuid.uuid4().hex
        manifest = {
            "format": mf.FORMAT, "version": version, "id": vid, "created": time.time(),
            "base": {"version": self._base_version, "id": self._base_id} if has_base else None,
            "codec": {"transform": "xor-byteshuffle", "compressor": "zstd", "level": self.compression_level},
            "full_bytes": sum(b.numel() * b.element_size() for b in bits.values()),
            "parts": {},
        }
        unchanged = 0
        if has_base:
            manifest["parts"]["delta"], unchanged = self._write_part(version, vid, "delta", bits, meta, self._base)
        if is_snapshot:
            manifest["parts"]["snapshot"], _ = self._write_part(version, vid, "snapshot", bits, meta, None)
        manifest_bytes = mf.dumps(manifest)
        self.store.put(mf.manifest_key(version), manifest_bytes)   # last: the version now exists

        self._base, self._base_meta, self._base_version, self._base_id = bits, meta, version, vid
        if is_snapshot:
            self._snapshots.append(version)
        self._collect_garbage()

        parts = manifest["parts"]
        delta_bytes = parts["delta"]["bytes"] if "delta" in parts else 0
        snapshot_bytes = parts["snapshot"]["bytes"] if "snapshot" in parts else 0
        numel = sum(b.numel() for b in bits.values())
        return PublishStats(
            version=version, base_version=manifest["base"]["version"] if has_base else None,
            is_snapshot=is_snapshot, bytes_written=delta_bytes + snapshot_bytes + len(manifest_bytes),
            delta_bytes=delta_bytes, snapshot_bytes=snapshot_bytes, full_bytes=manifest["full_bytes"],
            identical_fraction=unchanged / numel if has_base else None,
            seconds=time.perf_counter() - t0, retries=self.store.retries - retries0,
            own_bytes=manifest["full_bytes"], own_seconds=time.perf_counter() - t0)

    # --- encoding ------------------------------------------------------------------------------------------
    def _write_part(self, version: int, vid: str, part: str, bits: dict[str, torch.Tensor],
                    meta: dict[str, tuple[str, list[int]]], base: dict[str, torch.Tensor] | None) -> tuple[dict, int]:
        tensors = [{"name": name, "dtype": meta[name][0], "shape": meta[name][1], "chunks": []} for name in bits]
        shards, unchanged = encode_and_upload(
            self.store, list(bits.values()), None if base is None else [base[n] for n in bits], tensors,
            lambda n: f"{mf.version_dir(version)}/{part}-{vid[:8]}-{n:05d}.zst", chunk_bytes=self.chunk_bytes,
            shard_bytes=self.shard_bytes, threads=self.threads, compression_level=self.compression_level)
        return {"bytes": sum(s["bytes"] for s in shards), "shards": shards, "tensors": tensors}, unchanged

    # --- garbage collection --------------------------------------------------------------------------------
    def _collect_garbage(self) -> None:
        if self.keep_snapshots is None or not self._snapshots:
            return
        cutoff = self._snapshots[-min(self.keep_snapshots, len(self._snapshots))]
        self._delete_versions(lambda v: v < cutoff)
        self._snapshots = [v for v in self._snapshots if v >= cutoff]

    def _delete_versions(self, doomed: Callable[[int], bool]) -> None:
        for name in self.store.list_dirs():
            v = mf.parse_version_dir(name)
            if v is not None and doomed(v):
                self.store.delete(mf.manifest_key(v))   # invisible first, then the shards
                self.store.delete_prefix(mf.version_dir(v))


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
