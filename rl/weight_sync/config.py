"""Configuration of weight sync, embedded in the RL config as its ``weight_sync`` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from .publisher import WeightPublisher
from .store import ObjectStore
from .subscriber import WeightSubscriber


def _f(default, help: str):
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class WeightSyncConfig:
    url: Optional[str] = _f(None, "object store for weight versions: a local directory or s3://bucket/prefix; "
                                  "null = <run.dir>/weights")
    storage_options: dict = _f({}, "fsspec options, e.g. {client_kwargs: {endpoint_url: http://host:9000}}")
    snapshot_interval: int = _f(20, "a full snapshot every N versions (deltas in between)")
    keep_snapshots: Optional[int] = _f(2, "versions older than the N-th newest snapshot are deleted; null keeps all")
    shard_mb: int = _f(64, "compressed MiB per shard object")
    chunk_mb: int = _f(4, "raw MiB per independently compressed chunk (unit of parallel encode/decode)")
    compression_level: int = _f(1, "zstd level (1: fast; higher levels barely shrink XOR deltas further)")
    threads: int = _f(8, "parallel shard transfers")
    max_retries: int = _f(5, "retries of a transient store failure (exponential backoff)")
    retry_base_seconds: float = _f(0.5, "first backoff delay; doubles per retry")
    max_refetch: int = _f(3, "re-downloads of a shard that fails its checksum before the version is refused")
    async_versions: int = _f(1, "trainer: versions published in the background while training goes on (each "
                                "rank's owned boxes copied at the step; 0 = every step waits for its version)")
    poll_seconds: float = _f(1.0, "how often rollout workers look for a new version")
    dtype: Literal["bfloat16", "float32"] = _f("bfloat16", "dtype the rollout engine runs in (and the deltas are "
                                                            "taken of)")

    def open_store(self, default_url: str | None = None) -> ObjectStore:
        url = self.url or default_url
        if not url:
            raise ValueError("weight_sync.url is not set; give a directory or s3://bucket/prefix")
        return ObjectStore(url, storage_options=self.storage_options, max_retries=self.max_retries,
                           retry_base_seconds=self.retry_base_seconds, threads=self.threads)

    def publisher(self, store: ObjectStore, group=None, experts: Optional[str] = None) -> WeightPublisher:
        """The publisher of every rank of `group` (None: this process alone), floating weights of a model in
        ``dtype``, routed experts as the engines serve them (experts="int4": packed INT4; see publisher.py)."""
        return WeightPublisher(store, group=group, snapshot_interval=self.snapshot_interval,
                               keep_snapshots=self.keep_snapshots, shard_bytes=self.shard_mb << 20,
                               chunk_bytes=self.chunk_mb << 20, compression_level=self.compression_level,
                               dtype=getattr(torch, self.dtype), experts=experts)

    def subscriber(self, store: ObjectStore, model=None) -> WeightSubscriber:
        """A subscriber of whole tensors, or (given `model`, a rollout rank's shard of the engine's model) of the
        boxes it holds."""
        if model is None:
            return WeightSubscriber(store, max_refetch=self.max_refetch)
        return WeightSubscriber.for_model(store, model, max_refetch=self.max_refetch)
