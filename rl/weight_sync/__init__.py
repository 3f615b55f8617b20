"""Lossless delta weight sync through object storage.

``WeightPublisher`` (a plain state dict from one process) writes each version as a per-tensor XOR against the previous one (bf16 bit
patterns), byte-shuffled and zstd-compressed into checksummed shards, with a full snapshot every N versions
and a manifest written last. Rollout workers' ``WeightSubscriber`` polls, downloads and decodes in the
background, verifies checksums, and reconstructs each version bit-exactly from the nearest snapshot plus
deltas. ``ObjectStore`` is a local directory or ``s3://`` through fsspec, with retries and parallel transfers.

    store = ObjectStore("s3://bucket/run1/weights")               # or a local directory
    pub = WeightPublisher(store, snapshot_interval=20)
    stats = pub.publish(model.state_dict(), version=step)         # trainer, after each optimizer step
    sub = WeightSubscriber(store); sub.start(poll_seconds=1.0)    # rollout worker
    ready = sub.pop_ready()                                       # between decode steps: (version, state) or None
    ShardedWeightPublisher(store).publish(model, version=step)    # every trainer rank: its owned boxes (sharded.py)
    ShardedWeightPublisher(store).publish_async(model, step)      # the same in the background (the RL trainer)
    sub = ShardSubscriber.for_model(store, engine_shard)          # every rollout rank: its own boxes only
    update = sub.prepare()                                        # or sub.start() ... sub.pop_ready()
    engine.update_weights(update, update.version, delta=update.delta); update.commit()
"""

from .codec import WeightSyncError
from .config import WeightSyncConfig
from .publisher import PublishStats, WeightPublisher
from .sharded import ShardedWeightPublisher
from .store import ObjectStore, ObjectStoreError
from .subscriber import BoxUpdate, ShardSubscriber, WeightSubscriber, WeightSyncChecksumError

__all__ = [
    "BoxUpdate", "ObjectStore", "ObjectStoreError", "PublishStats", "ShardSubscriber", "ShardedWeightPublisher", "WeightPublisher", "WeightSubscriber", "WeightSyncChecksumError",
    "WeightSyncConfig", "WeightSyncError",
]
