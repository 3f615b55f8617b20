"""torchrun worker (2 ranks, a tp2 model): a sharded weight publish whose owner is SIGKILLed between two object
uploads, and the restarted trainer's next publish.

--phase kill: versions 1 and 2 are published; during version 3 rank 1 kills itself (SIGKILL, no clean-up, no
error report) right after its first object reached the store; torchrun then stops rank 0. --phase resume: a new
launch (a trainer restarted from its checkpoint: a new lineage) publishes version 3. The test reads the store
from its own process between the two (tests/distributed/test_weight_sync_kill.py)."""

from __future__ import annotations

import argparse
import datetime
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.inference.loading import BoxWeights, engine_model
from megatron_composer.model import Transformer, get_preset
from megatron_composer.parallel.dims import ParallelDims
from megatron_composer.parallel.slices import named_tensors
from rl.weight_sync import ObjectStore, WeightPublisher


def model_config():
    return get_preset("tiny-qwen3-moe").replace(vocab_size=256, num_layers=2)


def full_weights(version: int) -> dict[str, torch.Tensor]:
    """The full bf16 weights of `version` (seeded; the same in every process)."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in named_tensors(Transformer(model_config()))}
    g = torch.Generator().manual_seed(1000 + version)
    return {name: torch.randn(shape, generator=g).bfloat16() for name, shape in shapes.items()}


def publish(version: int, pub: WeightPublisher, groups) -> None:
    full = full_weights(version)
    model = engine_model(model_config(), BoxWeights(lambda name, box: full[name][box]), groups, dtype=torch.bfloat16)
    pub.publish(model, version)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["kill", "resume"], required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    groups = ParallelDims(2, tp=2).build()
    store = ObjectStore(str(Path(args.out) / "store"))
    pub = WeightPublisher(store, group=dist.group.WORLD, snapshot_interval=10, shard_bytes=4 << 10, chunk_bytes=1024)
    if args.phase == "resume":
        publish(3, pub, groups)
        if dist.get_rank() == 0:
            (Path(args.out) / "resumed").write_text("3")
        dist.destroy_process_group()
        return
    publish(1, pub, groups)
    publish(2, pub, groups)
    if dist.get_rank() == 1:
        real_put = store.put
        uploaded = []

        def put_then_die(key, data):
            if uploaded:   # one of this owner's objects is in the store: die before the next one
                (Path(args.out) / "killed").write_text(uploaded[0])
                os.kill(os.getpid(), signal.SIGKILL)
            real_put(key, data)
            uploaded.append(key)
        store.put = put_then_die
    publish(3, pub, groups)
    raise SystemExit("unreachable: rank 1 was to be killed during version 3")


if __name__ == "__main__":
    main()
