"""A rollout rank's subscriber of boxes (rl/weight_sync/subscriber.py: WeightSubscriber) in one process: the engine's
weights follow every version bit-exactly as XOR deltas applied in place, ranged reads fetch only the chunks of
the rank's boxes, and a corrupt object (ranged or whole) is refused while the engine keeps what it holds."""

import logging
import time

import pytest
import torch

from megatron_composer.inference import Engine
from megatron_composer.inference.loading import engine_model
from megatron_composer.model import get_preset
from megatron_composer.parallel.slices import named_tensors
from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber, WeightSyncChecksumError
from rl.weight_sync.codec import to_bits


def _cfg():
    return get_preset("tiny-qwen3-moe").replace(vocab_size=256, num_layers=2)


def _versions(n: int, seed: int = 0):
    """Versions 1..n of the full bf16 weights: a seeded model moved by small signed steps (few bits change)."""
    torch.manual_seed(seed)
    from megatron_composer.model import Transformer

    master = {k: v.float() for k, v in Transformer(_cfg()).state_dict().items() if v.is_floating_point()}
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n):
        for w in master.values():
            w += 1e-3 * torch.sign(torch.randn(w.shape, generator=g))
        out.append({k: w.bfloat16() for k, w in master.items()})
    return out


def _engine():
    model = engine_model(_cfg(), None, dtype=torch.bfloat16)
    return model, Engine(model, max_batch_size=2, max_seq_len=32, cache_memory_bytes=1 << 20)


def _same_as(model, full: dict) -> bool:
    return all(torch.equal(to_bits(t.detach()), to_bits(full[name])) for name, t in named_tensors(model))


def _store(tmp_path):
    return ObjectStore(str(tmp_path / "weights"), retry_base_seconds=0.001)


def test_engine_follows_every_version_with_in_place_deltas(tmp_path):
    store = _store(tmp_path)
    pub = WeightPublisher(store, snapshot_interval=3, keep_snapshots=None, shard_bytes=8 << 10, chunk_bytes=2048)
    model, engine = _engine()
    sub = WeightSubscriber.for_model(store, model)
    versions = _versions(5)
    kinds = []
    for v, full in enumerate(versions, start=1):
        pub.publish(full, v)
        update = sub.prepare()
        engine.update_weights(update, v, delta=update.delta)
        update.commit()
        kinds.append(update.delta)
        assert engine.weight_version == v and sub.version == v
        assert _same_as(model, full), f"engine weights differ from version {v}"
        assert sub.prepare() is None   # already held
    assert kinds == [False, True, True, True, True]   # snapshot once, then deltas on the held weights
    assert sub.snapshots_fetched == 1


def test_ranged_reads_fetch_only_the_chunks_of_the_rank_boxes(tmp_path):
    store = _store(tmp_path)
    pub = WeightPublisher(store, snapshot_interval=10, shard_bytes=64 << 10, chunk_bytes=1024)
    model, _ = _engine()
    full = _versions(2)
    pub.publish(full[0], 1)
    pub.publish(full[1], 2)
    # a rank holding the first half of the experts (rows of dim 0) of every expert tensor, nothing else
    wants = {}
    for name, t in named_tensors(model):
        if ".experts." in name:
            n = t.shape[0]
            wants[name] = (t.dtype, [((0, n // 2),) + tuple((0, d) for d in t.shape[1:])])
    sub = WeightSubscriber(store, wants)
    update = sub.prepare(1)
    assert update.ranged_reads > 0 and update.whole_reads == 0
    assert update.bytes_read < 0.6 * update.version_bytes
    for name, (_, (box,)) in wants.items():
        assert torch.equal(to_bits(update.read(name, box)), to_bits(full[0][name][tuple(slice(*r) for r in box)]))
    update.commit()
    delta = sub.prepare(2)
    assert delta.delta and delta.bytes_read < 0.6 * delta.version_bytes
    # ranged reads off: every object holding a needed chunk is read whole (and checked by its sha256)
    whole = WeightSubscriber(store, wants, range_reads=False).prepare(1)
    assert whole.ranged_reads == 0 and whole.bytes_read > update.bytes_read


def _corrupt_chunk_of(store, version: int, name: str) -> None:
    """Flip a byte in the middle of the first delta chunk of tensor `name`."""
    from rl.weight_sync import manifest as mf

    part = mf.loads(store.get(mf.manifest_key(version)), version)["parts"]["delta"]
    shard, offset, length, _, _ = next(t for t in part["tensors"] if t["name"] == name)["pieces"][0]["chunks"][0]
    path = store.path(part["shards"][shard]["key"])
    data = bytearray(store.fs.cat_file(path))
    data[offset + length // 2] ^= 0x5A
    store.fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("range_reads", [True, False])
def test_corrupt_object_is_refused_and_the_engine_keeps_its_version(tmp_path, range_reads, caplog):
    store = _store(tmp_path)
    pub = WeightPublisher(store, snapshot_interval=10, shard_bytes=1 << 20, chunk_bytes=1 << 20)
    model, engine = _engine()
    sub = WeightSubscriber.for_model(store, model, max_refetch=1, range_reads=range_reads)
    # the trainer also publishes a tensor this engine does not hold: its chunks share the objects, so ranged
    # reads skip them (and verify the engine's chunks by their frame checksums)
    extra = [torch.randn(4096, generator=torch.Generator().manual_seed(v)).bfloat16() for v in range(2)]
    full = _versions(2)
    pub.publish({"extra": extra[0], **full[0]}, 1)
    first = sub.prepare()
    assert (first.ranged_reads > 0) == range_reads
    engine.update_weights(first, 1, delta=first.delta)
    first.commit()
    pub.publish({"extra": extra[1], **full[1]}, 2)
    _corrupt_chunk_of(store, 2, "tok_embeddings.weight")
    with pytest.raises(WeightSyncChecksumError, match="failed its (sha256 )?check"):
        sub.prepare(2)
    assert sub.checksum_failures == 2 and sub.version == 1
    # the background prefetcher refuses it too, says so in one line, offers nothing, and the engine stays at v1
    caplog.set_level(logging.WARNING, logger="rl.weight_sync.subscriber")
    sub.start(poll_seconds=0.02)
    try:
        deadline = time.monotonic() + 20
        while sub.prefetch_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)   # more polls: a refused version is not read again
        assert sub.pop_ready() is None
    finally:
        sub.stop()
    lines = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert len(lines) == 1 and "weight version 2 not applied, the engine keeps v1" in lines[0]
    assert sub.prefetch_errors == 1
    assert engine.weight_version == 1 and _same_as(model, full[0])


def test_boxes_outside_the_published_shape_or_dtype_are_refused(tmp_path):
    store = _store(tmp_path)
    WeightPublisher(store).publish({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, 1)
    with pytest.raises(Exception, match="outside its published shape"):
        WeightSubscriber(store, {"w": (torch.bfloat16, [((0, 8), (0, 4))])}).prepare()
    with pytest.raises(Exception, match="publish in the engine's dtype"):
        WeightSubscriber(store, {"w": (torch.float32, [((0, 4), (0, 4))])}).prepare()
