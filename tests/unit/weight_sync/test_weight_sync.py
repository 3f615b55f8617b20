"""Weight sync through a local-directory object store: bit-exact reconstruction, checksums, atomicity, retries,
garbage collection, trainer restarts and the background prefetcher."""

import os
import threading
import time

import pytest
import torch

from rl.weight_sync import (
    ObjectStore,
    ObjectStoreError,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncChecksumError,
    WeightSyncConfig,
    WeightSyncError,
)
from rl.weight_sync import manifest as mf


class FakeTraining:
    """fp32 master weights moved by small AdamW-like steps, published as bf16 (plus an fp32 router, an fp16
    tensor and integer/bool buffers), as an RL trainer would."""

    def __init__(self, seed: int = 0, lr: float = 1e-3):
        self.g = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.master = {
            "embed.weight": torch.randn(64, 32, generator=self.g),
            "layers.0.w1": torch.randn(4, 48, 32, generator=self.g) * 0.02,
            "layers.0.router.weight": torch.randn(4, 32, generator=self.g),
            "norm.weight": torch.ones(32),
            "head.fp16": torch.randn(33, generator=self.g),
        }

    def step(self) -> None:
        for w in self.master.values():
            w -= self.lr * torch.sign(torch.randn(w.shape, generator=self.g))

    def state_dict(self) -> dict[str, torch.Tensor]:
        m = self.master
        return {
            "embed.weight": m["embed.weight"].bfloat16(),
            "layers.0.w1": m["layers.0.w1"].bfloat16(),
            "layers.0.router.weight": m["layers.0.router.weight"].clone(),   # fp32 router stays fp32
            "norm.weight": m["norm.weight"].bfloat16(),
            "head.fp16": m["head.fp16"].half(),
            "step": torch.tensor([int(m["norm.weight"].sum().item() * 1000)], dtype=torch.int64),
            "mask": m["head.fp16"] > 0,
            "scalar": m["norm.weight"][0].clone(),   # 0-dim
        }


def assert_bit_exact(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.reshape(-1).view(torch.uint8).equal(w.reshape(-1).view(torch.uint8)), f"{name} differs"


def make(tmp_path, **kw):
    store = ObjectStore(str(tmp_path / "weights"), retry_base_seconds=0.001)
    pub_kw = dict(snapshot_interval=5, keep_snapshots=2, shard_bytes=4096, chunk_bytes=1024)
    pub_kw.update(kw)
    return store, WeightPublisher(store, **pub_kw)


def stored_versions(store: ObjectStore) -> list[int]:
    return sorted(v for v in map(mf.parse_version_dir, store.list_dirs()) if v is not None)


def test_round_trip_bit_exact_over_24_versions(tmp_path):
    store, pub = make(tmp_path)
    train = FakeTraining()
    every = WeightSubscriber(store)        # follows every version: downloads deltas only after the first
    lagging = WeightSubscriber(store)      # fetches every 7th version: walks delta chains or a snapshot
    for v in range(24):
        train.step()
        sd = train.state_dict()
        stats = pub.publish(sd, v)
        assert stats.is_snapshot == (v % 5 == 0)
        assert stats.base_version == (None if v == 0 else v - 1)
        if v:
            assert 0 < stats.delta_bytes < stats.full_bytes
            assert 0.0 <= stats.identical_fraction < 1.0
        before = every.bytes_downloaded
        assert_bit_exact(every.fetch(), sd)
        if v:
            assert every.bytes_downloaded - before == stats.delta_bytes   # only delta v, never a snapshot
        if v % 7 == 6:
            assert_bit_exact(lagging.fetch(v), sd)
    assert every.snapshots_fetched == 1 and every.versions_fetched == 24
    assert_bit_exact(WeightSubscriber(store).fetch(), sd)   # a fresh worker: latest snapshot (20) + deltas 21..23
    # GC keeps what the two newest snapshots (15, 20) need and nothing older
    assert stored_versions(store) == list(range(15, 24))
    assert not [p for p in store.fs.find(store.root) if ".tmp-" in p]


def test_lagging_subscriber_falls_back_to_snapshot_after_gc(tmp_path):
    store, pub = make(tmp_path, snapshot_interval=3, keep_snapshots=1)
    train = FakeTraining(seed=1)
    sub = WeightSubscriber(store)
    for v in range(10):
        train.step()
        pub.publish(train.state_dict(), v)
        if v == 1:
            sub.fetch()
    assert stored_versions(store) == [9]
    sd = train.state_dict()
    assert_bit_exact(sub.fetch(), sd)
    assert sub.snapshots_fetched == 2
    with pytest.raises(WeightSyncError, match="version 3 is not in"):
        sub.fetch(3)


def test_corrupt_shard_once_is_refetched(tmp_path, monkeypatch):
    store, pub = make(tmp_path)
    train = FakeTraining()
    pub.publish(train.state_dict(), 0)
    sub = WeightSubscriber(store)
    corrupted = []
    real_get = store.get

    def get_corrupting_first_shard(key):
        data = real_get(key)
        if key.endswith(".zst") and not corrupted:
            corrupted.append(key)
            return data[:10] + bytes([data[10] ^ 1]) + data[11:]
        return data

    monkeypatch.setattr(store, "get", get_corrupting_first_shard)
    assert_bit_exact(sub.fetch(), train.state_dict())
    assert corrupted and sub.checksum_failures == 1


def test_persistently_corrupt_shard_is_refused_naming_it(tmp_path):
    store, pub = make(tmp_path)
    train = FakeTraining()
    pub.publish(train.state_dict(), 0)
    sub = WeightSubscriber(store, max_refetch=2)
    sd0 = sub.fetch()
    train.step()
    pub.publish(train.state_dict(), 1)
    shard = sorted(p for p in store.fs.find(store.path("v000000000001")) if p.endswith(".zst"))[0]
    data = bytearray(store.fs.cat_file(shard))
    data[len(data) // 2] ^= 0x40
    store.fs.pipe_file(shard, bytes(data))
    with pytest.raises(WeightSyncChecksumError, match=os.path.basename(shard) + ".*failed its sha256 check 3 times"):
        sub.fetch()
    assert sub.checksum_failures == 3
    assert sub.version == 0                        # the refused version left the held state untouched
    assert_bit_exact(sub._state(), sd0)


def test_version_without_manifest_is_invisible(tmp_path, monkeypatch):
    store, pub = make(tmp_path)
    train = FakeTraining()
    pub.publish(train.state_dict(), 0)
    sd0 = train.state_dict()
    train.step()
    real_put = store.put

    def crash_before_manifest(key, data):
        if key.endswith(mf.MANIFEST):
            raise KeyboardInterrupt("trainer killed")
        real_put(key, data)

    monkeypatch.setattr(store, "put", crash_before_manifest)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(train.state_dict(), 1)
    monkeypatch.setattr(store, "put", real_put)
    assert any(p.endswith(".zst") for p in store.fs.find(store.path("v000000000001")))   # shards landed
    sub = WeightSubscriber(store)
    assert sub.latest_version() == 0
    assert_bit_exact(sub.fetch(), sd0)
    with pytest.raises(WeightSyncError, match="version 1 is not in"):
        sub.fetch(1)


def test_transient_failures_are_retried_with_backoff(tmp_path):
    store, pub = make(tmp_path)
    failures = {"pipe_file": 2, "cat_file": 3}
    sleeps = []

    def flaky(name, exc):
        real = getattr(store.fs, name)

        def call(*a, **k):
            if failures[name] > 0:
                failures[name] -= 1
                raise exc
            return real(*a, **k)
        return call

    store.fs.pipe_file = flaky("pipe_file", OSError("503 Slow Down"))
    store.fs.cat_file = flaky("cat_file", ConnectionError("connection reset"))
    real_sleep = time.sleep
    import rl.weight_sync.store as store_mod
    store_mod.time.sleep = lambda s: (sleeps.append(s), real_sleep(s))
    try:
        train = FakeTraining()
        stats = pub.publish(train.state_dict(), 0)
        assert stats.retries == 2
        assert_bit_exact(WeightSubscriber(store).fetch(), train.state_dict())
    finally:
        store_mod.time.sleep = real_sleep
    assert store.retries == 5 and failures == {"pipe_file": 0, "cat_file": 0}
    # exponential: the three consecutive retries of the manifest read wait about twice as long each (+-25% jitter)
    assert len(sleeps) == 5 and sleeps[3] > sleeps[2] * 1.1 and sleeps[4] > sleeps[3] * 1.1


def test_persistent_outage_raises_clear_error_and_missing_key_is_not_retried(tmp_path):
    store = ObjectStore(str(tmp_path / "w"), max_retries=2, retry_base_seconds=0.001)

    def down(*a, **k):
        raise ConnectionError("connection refused")

    store.fs.cat_file = down
    with pytest.raises(ObjectStoreError, match=r"read .*k' failed 3 times.*ConnectionError"):
        store.get("k")
    assert store.retries == 2
    store2 = ObjectStore(str(tmp_path / "w2"), retry_base_seconds=0.001)
    with pytest.raises(FileNotFoundError):
        store2.get("missing")
    assert store2.retries == 0


def test_trainer_restart_starts_a_new_lineage(tmp_path):
    store, pub = make(tmp_path)
    train = FakeTraining()
    sub = WeightSubscriber(store)
    for v in range(6):
        train.step()
        pub.publish(train.state_dict(), v)
    sub.fetch()
    # the trainer crashes and resumes from a checkpoint at version 3 on another random path
    resumed = FakeTraining(seed=7)
    pub2 = WeightPublisher(store, snapshot_interval=5, shard_bytes=4096, chunk_bytes=1024)
    stats = pub2.publish(resumed.state_dict(), 4)
    assert stats.is_snapshot and stats.base_version is None
    assert stored_versions(store) == [4]   # the old lineage can serve no delta of the new one: all removed
    resumed.step()
    pub2.publish(resumed.state_dict(), 5)
    assert_bit_exact(sub.fetch(), resumed.state_dict())   # held old-lineage 5 is not used as a base


def test_background_prefetch_offers_newest_version(tmp_path):
    store, pub = make(tmp_path)
    train = FakeTraining()
    sub = WeightSubscriber(store)
    announced = []
    ready_event = threading.Event()

    def on_ready(v):
        announced.append(v)
        ready_event.set()

    sub.start(poll_seconds=0.02, on_ready=on_ready)
    try:
        assert sub.pop_ready() is None
        for v in range(3):
            train.step()
            pub.publish(train.state_dict(), v)
            ready_event.clear()
            assert ready_event.wait(10), f"version {v} was not prefetched"
        version, state = sub.pop_ready()
        assert version == 2 and announced[-1] == 2
        assert_bit_exact(state, train.state_dict())
        assert sub.pop_ready() is None
        # an unreadable store is counted and the thread keeps polling
        real = store.list_dirs
        store.list_dirs = lambda prefix="": (_ for _ in ()).throw(ObjectStoreError("store down"))
        time.sleep(0.1)
        assert sub.prefetch_errors > 0 and sub._thread.is_alive()
        store.list_dirs = real
        train.step()
        pub.publish(train.state_dict(), 3)
        ready_event.clear()
        assert ready_event.wait(10)
        version, state = sub.pop_ready()
        assert version == 3
        assert_bit_exact(state, train.state_dict())
    finally:
        sub.stop(5)


def test_bad_input_is_refused(tmp_path):
    store, pub = make(tmp_path)
    with pytest.raises(WeightSyncError, match=r"state_dict\['x'\] is a list"):
        pub.publish({"x": [1, 2]}, 0)
    with pytest.raises(WeightSyncError, match="empty"):
        pub.publish({}, 0)
    pub.publish({"x": torch.zeros(3)}, 5)
    with pytest.raises(WeightSyncError, match="not newer"):
        pub.publish({"x": torch.zeros(3)}, 5)
    with pytest.raises(WeightSyncError, match="no weight version is published"):
        WeightSubscriber(ObjectStore(str(tmp_path / "empty"))).fetch()
    with pytest.raises(ValueError, match="snapshot_interval"):
        WeightPublisher(store, snapshot_interval=0)


def test_shape_change_writes_a_snapshot_and_config_builds_the_pieces(tmp_path):
    cfg = WeightSyncConfig(snapshot_interval=10, chunk_mb=1)
    store = cfg.open_store(str(tmp_path / "w"))
    pub, sub = cfg.publisher(store), cfg.subscriber(store)
    pub.publish({"x": torch.randn(4, dtype=torch.bfloat16)}, 0)
    sub.fetch()
    grown = {"x": torch.randn(4, dtype=torch.bfloat16), "y": torch.randn(2)}
    assert pub.publish(grown, 1).is_snapshot
    assert_bit_exact(sub.fetch(), grown)


def test_parallel_put_and_get_many(tmp_path):
    store = ObjectStore(str(tmp_path / "w"), threads=4)
    items = [(f"batch/{i:03d}.bin", os.urandom(100 + i)) for i in range(20)]
    store.put_many(items)
    assert store.get_many([k for k, _ in items]) == [d for _, d in items]
    assert store.list_dirs("batch")[:2] == ["000.bin", "001.bin"]
    store.delete_prefix("batch")
    assert store.list_dirs("batch") == []


def test_a_store_travels_to_another_process_as_its_settings(tmp_path):
    """vLLM's workers get the rollout worker's store pickled: they open their own, with the same settings."""
    import pickle

    store = ObjectStore(f"file://{tmp_path}/s", max_retries=2, threads=3)
    store.put("a/b", b"payload")
    copy = pickle.loads(pickle.dumps(store))
    assert copy is not store and (copy.url, copy.max_retries, copy.threads) == (store.url, 2, 3)
    assert copy.get("a/b") == b"payload"
