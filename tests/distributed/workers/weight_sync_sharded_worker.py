"""torchrun worker (4 ranks): a trainer in fsdp x ep2 (training core) publishes its weights sharded, every rank
its owned boxes (rl/weight_sync/publisher.py), after each of 5 optimizer steps; readers in other layouts --
one rank reading the full state, rollout ranks of a 2-way layout reading row boxes (experts under ep2,
column-parallel shards under tp2) and column boxes (row-parallel shards) -- get bits identical to the
trainer's gathered full weights after every version, from a fresh subscriber (snapshot + deltas) and from one
that follows every version (deltas on what it holds), and fetch only the objects overlapping their boxes.

Slow owner: publish_async returns while one owner's upload is held back, the next training step runs while the
version is invisible, the following publish waits for it (one version in flight), and both versions are
bit-identical.

Fault case: an owner failing mid-publish leaves the version invisible (no manifest, no objects), and the next
publish succeeds as a delta a follower applies bit-exactly (published in bf16 from the fp32 masters).

--store: a local directory (default, under --out) or s3://... (the endpoint in WEIGHT_SYNC_S3_ENDPOINT)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import run_cases  # noqa: E402
from fsdp_worker import MICRO, QW, _loss_fn, _optim, _step_batches  # noqa: E402
from model_worker import tiny_config  # noqa: E402

from megatron_composer.fp8 import FP8Config  # noqa: E402
from megatron_composer.parallel.dims import ParallelConfig  # noqa: E402
from megatron_composer.parallel.layers import full_state_dict  # noqa: E402
from megatron_composer.training.core import TrainingCore  # noqa: E402
from megatron_composer.training.layout import Layout  # noqa: E402
from rl.weight_sync import ObjectStore, WeightPublisher, WeightSubscriber, WeightSyncError  # noqa: E402
from rl.weight_sync import manifest as mf  # noqa: E402
from rl.weight_sync.codec import to_bits  # noqa: E402

LR = 3e-3


def _store(name: str) -> ObjectStore:
    if ARGS.store.startswith("s3://"):
        return ObjectStore(f"{ARGS.store}/{name}", retry_base_seconds=0.01,
                           storage_options={"client_kwargs": {"endpoint_url": os.environ["WEIGHT_SYNC_S3_ENDPOINT"]}})
    return ObjectStore(str(Path(ARGS.out) / "store" / name))


def _trainer():
    core = TrainingCore(tiny_config(QW).replace(num_layers=2), {}, Layout(ParallelConfig(fsdp=True, ep=2)),
                        torch.device("cpu"), optim=_optim(), fp8=FP8Config(), seed=7)
    return core, core.layout.groups


def _step(core, groups, step):
    bs, n_main, n_mtp = _step_batches(1 + step, core.model.config)
    core.step(_loss_fn(core.model, groups, n_main, n_mtp, False, bs), range(MICRO), LR)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(to_bits(a), to_bits(b))


def _boxes(shape, r: int):
    """Rollout rank r of 2: its half of the rows (dim 0) and its half of the last dim."""
    out = []
    for d in {0, len(shape) - 1} if shape else ():
        n = shape[d]
        lo, hi = r * n // 2, (r + 1) * n // 2
        out.append(tuple(slice(lo, hi) if i == d else slice(None) for i in range(len(shape))))
    return out


def _all_ok(flag: bool) -> bool:
    t = torch.tensor([float(not flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def publish_read():
    core, groups = _trainer()
    store = _store("publish_read")
    pub = WeightPublisher(store, group=dist.group.WORLD, snapshot_interval=3, keep_snapshots=None,
                          shard_bytes=16 << 10, chunk_bytes=4096)
    follower = WeightSubscriber(_store("publish_read"))
    rollout = dist.get_rank() % 2
    out = {"versions": [], "full_equal": [], "follower_equal": [], "box_equal": [], "held_box_equal": [],
           "fetched_fraction": [], "delta_ratio": [], "owners": []}
    for v in range(1, 6):
        _step(core, groups, v)
        stats = pub.publish(core.model, v)
        full = full_state_dict(core.model, groups)
        head = mf.loads(store.get(mf.manifest_key(v)), v)
        out["owners"].append(len({s["key"].split("-")[2] for p in head["parts"].values() for s in p["shards"]}))
        out["versions"].append(WeightSubscriber(_store("publish_read")).latest_version())
        if stats.delta_ratio is not None:
            out["delta_ratio"].append(stats.delta_ratio)
        # one rank, full state: a fresh subscriber (nearest snapshot + deltas) and a follower (deltas)
        fresh = WeightSubscriber(_store("publish_read")).fetch(v)
        out["full_equal"].append(_all_ok(set(fresh) == set(full) and all(_same(fresh[k], full[k]) for k in full)))
        held_reader = follower.reader(v)   # row boxes on top of what the follower holds (version v - 1)
        out["held_box_equal"].append(_all_ok(all(_same(held_reader.read(k, b), full[k][b])
                                                 for k in full for b in _boxes(list(full[k].shape), rollout)[:1])))
        got = follower.fetch(v)
        out["follower_equal"].append(_all_ok(all(_same(got[k], full[k]) for k in full)))
        # a rollout rank of a 2-way layout: boxes of rows and of columns, from a fresh reader
        sub = WeightSubscriber(_store("publish_read"))
        reader = sub.reader(v)
        ok = all(_same(reader.read(k, b), full[k][b]) for k in full for b in _boxes(list(full[k].shape), rollout))
        out["box_equal"].append(_all_ok(ok))
        if v < 5:
            continue
        # expert rows of rollout rank 0 only: a reader fetches the objects overlapping them, not all
        rows = WeightSubscriber(_store("publish_read"))
        rows_reader = rows.reader(v)
        for k in full:
            if ".experts." in k:
                rows_reader.read(k, _boxes(list(full[k].shape), 0)[0])
        total = sum(p["bytes"] for m, name, _ in rows_reader.parts for p in [m["parts"][name]])
        out["fetched_fraction"].append(rows.bytes_downloaded / total)
    return out


def owner_fault():
    core, groups = _trainer()
    store = _store("owner_fault")
    pub = WeightPublisher(store, group=dist.group.WORLD, snapshot_interval=10, shard_bytes=16 << 10,
                          chunk_bytes=4096, dtype=torch.bfloat16)   # the fp32 masters published as the engine's bf16
    follower = WeightSubscriber(_store("owner_fault"))
    out = {}
    for v in (1, 2):
        _step(core, groups, v)
        pub.publish(core.model, v)
    follower.fetch(2)
    _step(core, groups, 3)
    real_put = pub.store.put
    if dist.get_rank() == 1:   # this owner fails after writing some of its objects, before confirming
        calls = []

        def failing_put(key, data):
            calls.append(key)
            if len(calls) > 1:
                raise RuntimeError("injected owner failure")
            return real_put(key, data)
        pub.store.put = failing_put
    try:
        pub.publish(core.model, 3)
        out["failed_publish_raised"] = False
    except WeightSyncError as e:
        out["failed_publish_raised"] = "injected owner failure" in str(e)
    pub.store.put = real_put
    out["failed_publish_raised"] = _all_ok(out["failed_publish_raised"])
    out["latest_after_failure"] = WeightSubscriber(_store("owner_fault")).latest_version()
    out["failed_version_objects"] = len(store.list_dirs(mf.version_dir(3)))
    dist.barrier()
    _step(core, groups, 4)
    stats = pub.publish(core.model, 4)
    out["next_base"] = stats.base_version
    full = {k: t.to(torch.bfloat16) if t.is_floating_point() else t
            for k, t in full_state_dict(core.model, groups).items()}
    got = follower.fetch()
    out["follower_version"] = follower.version
    out["follower_equal"] = _all_ok(all(_same(got[k], full[k]) for k in full))
    out["follower_snapshots"] = follower.snapshots_fetched
    return out


def _engines():
    """Ranks 0-1: a tp2 rollout engine; ranks 2-3: an ep2 one (two layouts other than the trainer's), each rank
    its shard of the model in bf16, allocated and empty (the weights arrive through the store)."""
    from megatron_composer.inference import Engine
    from megatron_composer.inference.loading import engine_model
    from megatron_composer.parallel.dims import ParallelDims

    tp_groups = ParallelDims(4, tp=2).build()
    ep_groups = ParallelDims(4, ep=2).build()
    layout, groups = ("tp2", tp_groups) if dist.get_rank() < 2 else ("ep2", ep_groups)
    model = engine_model(tiny_config(QW).replace(num_layers=2), None, groups, dtype=torch.bfloat16)
    return layout, groups, model, Engine(model, max_batch_size=2, max_seq_len=32, cache_memory_bytes=1 << 20)


def _engine_holds(model, full: dict) -> bool:
    from megatron_composer.parallel.slices import local_pieces, local_tensor, named_tensors

    return all(_same(local_tensor(t)[pc.local], full[name][pc.full])
               for name, t in named_tensors(model) for pc in local_pieces(t))


def _own_chunk_bytes(store, version: int, part: str, wants: dict) -> int:
    """Compressed bytes of the chunks of `part` of `version` holding at least one element of the boxes in
    `wants` (name -> (dtype, boxes)): found element by element, independently of the subscriber's planning."""
    part_m = mf.loads(store.get(mf.manifest_key(version)), version)["parts"][part]
    hit = {}
    for t in part_m["tensors"]:
        if t["name"] not in wants:
            continue
        for pc in t["pieces"]:
            pbox = [tuple(r) for r in pc["box"]]
            flat = torch.arange(max(1, _numel(pbox))).view([hi - lo for lo, hi in pbox])
            for box in wants[t["name"]][1]:
                sel = tuple(slice(max(a, c) - c, min(b, d) - c) for (a, b), (c, d) in zip(box, pbox))
                idx = flat[sel].reshape(-1)
                if idx.numel() == 0:
                    continue
                for shard, offset, length, start, count in pc["chunks"]:
                    if ((idx >= start) & (idx < start + count)).any():
                        hit[(shard, offset)] = length
    return sum(hit.values())


def _numel(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def engines():
    """The trainer (fsdp x ep2) publishes 5 versions in the engines' bf16; every rollout rank's WeightSubscriber
    prefetches its own boxes of each in the background, the engine applies it between steps (XOR in place
    after the first), and holds exactly the trainer's weights; then each engine generates what the one-rank
    engine of the gathered weights does."""
    from megatron_composer.inference import Engine
    from megatron_composer.inference.loading import BoxWeights, engine_model

    core, groups = _trainer()
    layout, egroups, model, engine = _engines()
    store = _store("engines")
    pub = WeightPublisher(store, group=dist.group.WORLD, snapshot_interval=3, keep_snapshots=None,
                          shard_bytes=16 << 10, chunk_bytes=4096, dtype=torch.bfloat16)
    sub = WeightSubscriber.for_model(_store("engines"), model)
    sub.start(poll_seconds=0.05)
    mine = {"layout": layout, "equal": [], "delta": [], "bytes_read": [], "version_bytes": [], "ranged": [],
            "whole": [], "own_chunk_bytes": [],
            "own_fraction": sum(_numel(b) * 2 for _, bs in sub.wants.values() for b in bs)}
    try:
        for v in range(1, 6):
            _step(core, groups, v)
            pub.publish(core.model, v)
            full = {k: t.to(torch.bfloat16) for k, t in full_state_dict(core.model, groups).items()}
            deadline = time.monotonic() + 120
            update = None
            while update is None or update.version != v:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {dist.get_rank()}: version {v} was not prepared in the background "
                                       f"(last error: {sub.last_error!r})")
                update = sub.pop_ready() or update
                time.sleep(0.02)
            engine.update_weights(update, v, delta=update.delta)
            update.commit()
            mine["equal"].append(_engine_holds(model, full))
            mine["delta"].append(update.delta)
            mine["bytes_read"].append(update.bytes_read)
            mine["version_bytes"].append(update.version_bytes)
            mine["own_chunk_bytes"].append(_own_chunk_bytes(store, v, "delta" if update.delta else "snapshot",
                                                            sub.wants))
            mine["ranged"].append(update.ranged_reads)
            mine["whole"].append(update.whole_reads)
    finally:
        sub.stop()
    # the engines generate with the weights they hold: the one-rank engine of the gathered weights agrees
    ref = Engine(engine_model(model.config, BoxWeights(lambda name, box: full[name][box]), None,
                              dtype=torch.bfloat16), max_batch_size=2, max_seq_len=32, cache_memory_bytes=1 << 20)
    prompt = [[3, 14, 15, 92, 65]]
    want = ref.generate(prompt, max_new_tokens=4)[0].token_ids
    mine["tokens_equal"] = engine.generate(prompt, max_new_tokens=4)[0].token_ids == want
    mine["weight_version"] = engine.weight_version
    mine["own_fraction"] /= sum(t.numel() * 2 for t in full.values())   # raw bf16 bytes held / the model's
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks}




def slow_owner():
    """publish_async, as the RL trainer publishes: rank 1's upload of version 2 is held back; the call returns,
    the trainer's next step runs while version 2 is invisible, the publish after it waits for version 2
    (one version in flight), and both versions reconstruct bit-identically."""
    core, groups = _trainer()
    store = _store("slow_owner")
    group = dist.new_group(backend="gloo")   # the publisher's own group, beside the training collectives
    pub = WeightPublisher(store, group=group, snapshot_interval=10, shard_bytes=16 << 10, chunk_bytes=4096)
    latest = lambda: WeightSubscriber(_store("slow_owner")).latest_version()  # noqa: E731
    out = {}
    first = pub.publish_async(core.model, 1, max_pending=1)   # the first call is synchronous (learns ownership)
    out["first_sync"] = _all_ok([v for v, _ in first] == [1] and not isinstance(first[0][1], Exception))
    _step(core, groups, 2)
    release = threading.Event()
    real_put = pub.store.put
    if dist.get_rank() == 1:
        def slow_put(key, data):
            if key.startswith(mf.version_dir(2)):
                release.wait(timeout=120)   # a synchronous publish would be stuck here until the timeout
            return real_put(key, data)
        pub.store.put = slow_put
    want = {2: full_state_dict(core.model, groups)}
    done = pub.publish_async(core.model, 2, max_pending=1)
    out["returned_while_invisible"] = _all_ok(not done and latest() == 1)
    _step(core, groups, 3)   # the trainer's next step: collectives on the default group, version 2 still pending
    out["stepped_while_invisible"] = _all_ok(latest() == 1)
    want[3] = full_state_dict(core.model, groups)
    release.set()
    done = pub.publish_async(core.model, 3, max_pending=1)   # the bound: version 2 first
    out["waited_for_previous"] = _all_ok([v for v, _ in done] == [2] and not isinstance(done[0][1], Exception))
    done = pub.flush()
    out["flushed"] = _all_ok([v for v, _ in done] == [3] and not isinstance(done[0][1], Exception))
    follower = WeightSubscriber(_store("slow_owner"))
    out["equal"] = _all_ok(all(all(_same(got[k], want[v][k]) for k in want[v])
                               for v in (2, 3) for got in [follower.fetch(v)]))
    return out


CASES = {"publish_read": publish_read, "owner_fault": owner_fault, "engines": engines,
         "slow_owner": slow_owner}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="all")
    ap.add_argument("--store", default="")
    ARGS = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    torch.set_num_threads(1)
    run_cases(ARGS, CASES)
