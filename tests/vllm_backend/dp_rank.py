"""One rank of a data-parallel attention vLLM engine, for test_vllm_dp.py: subscribes to the store the test
publishes to, generates its own prompts until it holds `--last` version, then checks its greedy tokens and
log-probs against the project's engine on the same weights and writes what it saw as JSON.

    python tests/vllm_backend/dp_rank.py --rank R --size 2 --port P --store DIR --last 3 --out rank_R.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--last", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from megatron_composer.inference import Engine
    from megatron_composer.inference.vllm_engine import DataParallel, VLLMEngine
    from megatron_composer.model import Transformer, get_preset
    from rl.weight_sync import ObjectStore, WeightSubscriber

    cfg = get_preset("tiny-qwen3-moe").replace(num_layers=2)
    engine = VLLMEngine(cfg, dtype=torch.float32, max_batch_size=8, max_seq_len=128, cache_memory_bytes=16 << 20,
                        seed=0, routed_experts=False, dp=DataParallel(args.size, args.rank, master_port=args.port))
    store = ObjectStore(args.store)
    with torch.device("meta"):
        names = Transformer(cfg)
    subscription = engine.subscription(WeightSubscriber.for_model(store, names, max_refetch=0))
    while (first := subscription.latest_version()) is None:
        time.sleep(0.05)
    engine.update_weights(subscription.prepare(first), first)
    subscription.start(0.05)
    Path(args.out).with_suffix(".ready").touch()  # the test publishes the next versions once every rank is here
    seen, rounds = [], 0
    deadline = time.monotonic() + 240
    # each rank its own prompts and lengths: rank 1 runs longer requests, so rank 0 often steps idle (dummy batches)
    prompts = [[1 + args.rank, 2, 3], [5, 6 + args.rank, 7, 8]][:1 + args.rank]
    while engine.weight_version < args.last and time.monotonic() < deadline:
        for r in engine.generate(prompts, max_new_tokens=4 + 4 * args.rank, temperature=1.0, seed=rounds):
            seen.append(r.weight_versions)
        rounds += 1
    # the last version: both ranks' greedy tokens and log-probs against our engine on the same weights
    model = Transformer(cfg)
    model.load_state_dict(WeightSubscriber(store).fetch(args.last))
    ours = Engine(model.eval()).generate(prompts, max_new_tokens=6)
    theirs = engine.generate(prompts, max_new_tokens=6)
    gap = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o.logprobs, t.logprobs))
    same = all(o.token_ids == t.token_ids for o, t in zip(ours, theirs))
    result = {"rank": args.rank, "applied_at": engine.applied_at, "versions_seen": seen, "rounds": rounds,
              "final_version": engine.weight_version, "greedy_equal": same, "logprob_gap": gap,
              "final_versions": [t.weight_versions for t in theirs]}
    engine.close()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
