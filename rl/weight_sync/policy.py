"""How a publisher writes and keeps versions: its settings (checked once), which versions are snapshots, and
which versions the store no longer needs (garbage collection)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import manifest as mf
from .store import ObjectStore


@dataclass
class VersionPolicy:
    """Args:
        snapshot_interval: a full snapshot every N versions (and for the first one of a lineage, and when the
            tensors, their shapes, dtypes or owners change). Every version also carries a delta when it has a
            base, so an up-to-date subscriber never downloads a snapshot.
        keep_snapshots: versions older than the ``keep_snapshots``-th newest snapshot are deleted (nothing
            newer needs them); None keeps everything.
        shard_bytes: compressed bytes per shard object (a chunk larger than this gets an object of its own).
        chunk_bytes: raw bytes per independently compressed chunk (the unit of parallel encode/decode and of
            ranged reads).
        compression_level: zstd level; level 1 is fast and shrinks XOR deltas about as much as level 3.
    `snapshots` are the snapshot versions of this lineage still in the store."""

    snapshot_interval: int = 20
    keep_snapshots: int | None = 2
    shard_bytes: int = 64 << 20
    chunk_bytes: int = 4 << 20
    compression_level: int = 1
    snapshots: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be >= 1, got {self.snapshot_interval}")
        if self.keep_snapshots is not None and self.keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1 or None (keep all), got {self.keep_snapshots}")
        if self.shard_bytes < 1 or self.chunk_bytes < 8:
            raise ValueError(f"shard_bytes must be >= 1 and chunk_bytes >= 8, got {self.shard_bytes}, "
                             f"{self.chunk_bytes}")
        if not -7 <= self.compression_level <= 22:
            raise ValueError(f"compression_level must be a zstd level in [-7, 22], got {self.compression_level}")

    def is_snapshot(self, version: int, has_base: bool) -> bool:
        return not has_base or version - self.snapshots[-1] >= self.snapshot_interval

    def start_lineage(self, store: ObjectStore, version: int) -> None:
        """A new lineage (first publish, or a trainer resumed from a checkpoint): versions at or above
        `version` belong to a dead run and must not be mistaken for ours."""
        delete_versions(store, lambda v: v >= version)

    def published(self, version: int, is_snapshot: bool, store: ObjectStore | None) -> None:
        """Record a visible version and delete (from `store`: None on every rank but the one that collects)
        the versions older than the ``keep_snapshots``-th newest snapshot."""
        if is_snapshot:
            self.snapshots.append(version)
        if self.keep_snapshots is None or not self.snapshots:
            return
        cutoff = self.snapshots[-min(self.keep_snapshots, len(self.snapshots))]
        if store is not None:
            delete_versions(store, lambda v: v < cutoff)
        self.snapshots = [v for v in self.snapshots if v >= cutoff]


def delete_versions(store: ObjectStore, doomed: Callable[[int], bool]) -> None:
    for name in store.list_dirs():
        v = mf.parse_version_dir(name)
        if v is not None and doomed(v):
            store.delete(mf.manifest_key(v))   # invisible first, then the shards
            store.delete_prefix(mf.version_dir(v))
