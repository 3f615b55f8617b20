"""torchrun worker (2 ranks): a tensor-parallel (tp2) or expert-parallel (ep2) rollout worker against a one-rank
worker with the same weights.

Rank 0 runs `RolloutWorker` on its shard (the engine driven through Lockstep), rank 1 `run_follower` on its
shard; both start from different random weights and read every version from a weight store (rank 1 fetches
the versions itself). The worker's seeded generations under v0, then under v1 (published while it runs and
picked up by its background subscriber), must equal a one-rank worker's given the same versions.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import run_cases  # noqa: E402

from megatron_composer.data.chat_template import render_text  # noqa: E402
from megatron_composer.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_composer.model import Transformer, get_preset  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.parallelize import parallelize_model  # noqa: E402
from rl.rollout.config import RolloutConfig  # noqa: E402
from rl.rollout.engines import run_follower  # noqa: E402
from rl.rollout.worker import RolloutWorker  # noqa: E402
from rl.weight_sync import WeightSyncConfig  # noqa: E402

PROMPTS = ["Start a function.", "Say hi.", "Write a class."]
NEW_TOKENS = 12


def _weights(cfg, seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Transformer(cfg).state_dict().items()}


def rollout_case(preset: str, tp: int = 2, ep: int = 1):
    def run():
        rank = dist.get_rank()
        groups = ParallelDims(2, tp=tp, ep=ep).build()
        engine_group = dist.group.WORLD  # both ranks make the engine's calls (tp2: its tp group; ep2: its ep group)
        cfg = get_preset(preset).replace(num_layers=2, num_mtp_layers=0)
        rcfg = RolloutConfig(max_batch_size=8, max_seq_len=128, cache_memory_mb=16, temperature=1.0)
        torch.manual_seed(100 + rank)  # each rank's shard starts from other weights: only the store's count
        par = parallelize_model(Transformer(cfg), groups).eval()
        store_dir = Path(ARGS.out) / f"weights_{preset}"
        sync = WeightSyncConfig(dtype="float32")
        if rank == 0:
            publisher = sync.publisher(sync.open_store(str(store_dir)))
            publisher.publish(_weights(cfg, 0), 0)
        dist.barrier()
        subscriber = sync.subscriber(sync.open_store(str(store_dir)), par)   # this rank's boxes only
        if rank != 0:
            run_follower("follower", rcfg, par, subscriber, poll_seconds=0.05, engine_group=engine_group)
            return {}
        tok = load_tokenizer(ARGS.tok)
        prompts = [tok.encode(render_text([{"role": "user", "content": p}], add_generation_prompt=True))
                   for p in PROMPTS]
        seeds = [11, 12, 13]
        worker = RolloutWorker("tp", rcfg, par, tok, [], queue=None, subscriber=subscriber, poll_seconds=0.05,
                               engine_group=engine_group)
        try:
            first = worker.wait_for_weights(60)
            got = [worker.generate(prompts, NEW_TOKENS, seeds)]
            publisher.publish(_weights(cfg, 1), 1)
            deadline = time.monotonic() + 60
            while worker.engine.weight_version < 1 and time.monotonic() < deadline:
                with worker._drive_lock:
                    worker.apply_ready()
                time.sleep(0.02)
            got.append(worker.generate(prompts, NEW_TOKENS, seeds))
        finally:
            worker.drive.stop()
            subscriber.stop()
        one = RolloutWorker("one", rcfg, Transformer(cfg).eval(), tok, [], queue=None, subscriber=None)
        want = []
        for version in (0, 1):
            one.drive.update_weights(_weights(cfg, version), version)
            want.append(one.generate(prompts, NEW_TOKENS, seeds))
        pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
        return {"first_version": first, "applied": [v for v, _ in worker.applied],
                "tokens_equal": all(a.token_ids == b.token_ids for a, b in pairs),
                "versions": [sorted(set(a.weight_versions)) for a, _ in pairs],
                "num_tokens": sum(len(a.token_ids) for a, _ in pairs),
                "max_logprob_diff": max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs))}
    return run


CASES = {"mla_rollout_tp2": rollout_case("tiny-deepseek-v3"), "gqa_rollout_tp2": rollout_case("tiny-qwen3-moe"),
         "mla_rollout_ep2": rollout_case("tiny-deepseek-v3", tp=1, ep=2)}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="all")
    ap.add_argument("--tok", required=True, help="tokenizer directory")
    ARGS = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    torch.set_num_threads(1)
    run_cases(ARGS, CASES)
