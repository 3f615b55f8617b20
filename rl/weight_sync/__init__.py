"""Lossless delta weight sync through object storage.

Every trainer rank's ``WeightPublisher`` writes the boxes of the weights it owns (the whole tensors when one
process publishes) as an XOR against its previous version of them (raw bits, e.g. bf16), byte-shuffled and
zstd-compressed in chunks into checksummed objects, with a full snapshot every N versions; rank 0 writes the
manifest last, once every owner confirmed, so a version is visible whole or not at all. A ``WeightSubscriber``
polls, downloads and decodes in the background, verifies checksums, and reconstructs each version bit-exactly
from the nearest snapshot plus deltas: whole tensors (a state dict), or only the boxes a rollout rank's engine
holds, fetched by ranged reads and applied in place as XOR updates. ``ObjectStore`` is a local directory or
``s3://`` through fsspec, with retries and parallel transfers. The words (box, piece, part, owner, lineage,
held) are in docs/ARCHITECTURE.md's glossary.

    store = ObjectStore("s3://bucket/run1/weights")                 # or a local directory
    pub = WeightPublisher(store, snapshot_interval=20)              # one process (group=None)
    stats = pub.publish(model.state_dict(), version=step)           # a state dict of full tensors, or a model
    WeightPublisher(store, group=g).publish_async(model, step)      # every trainer rank, in the background
    sub = WeightSubscriber(store); sub.start(poll_seconds=1.0)      # whole tensors
    ready = sub.pop_ready()                                         # between steps: (version, state) or None
    sub = WeightSubscriber.for_model(store, engine_shard)           # a rollout rank: its own boxes only
    update = sub.prepare()                                          # or sub.start() ... sub.pop_ready()
    engine.update_weights(update, update.version, delta=update.delta); update.commit()
"""

from .codec import WeightSyncError
from .config import WeightSyncConfig
from .publisher import PublishStats, WeightPublisher
from .store import ObjectStore, ObjectStoreError
from .subscriber import BoxUpdate, VersionReader, WeightSubscriber, WeightSyncChecksumError

__all__ = [
    "BoxUpdate", "ObjectStore", "ObjectStoreError", "PublishStats", "VersionReader", "WeightPublisher",
    "WeightSubscriber", "WeightSyncChecksumError", "WeightSyncConfig", "WeightSyncError",
]
