"""Bytes a step's rollout data moves through trainer rank 0, before and after the record files.

Before: trainer rank 0 unpickled every finished group (`torch.load`, routing as int64 [layers, tokens, top_k])
and sent all of them to every trainer rank (`broadcast_object_list`); each rank kept its data-parallel share.
After (rl/rollout/records.py): rank 0 reads only the files' headers and sends the other ranks their paths; each
data-parallel rank (with its tp/cp/ep peers) reads only its own samples (routing uint8/int16).

Synthetic groups of the Kimi K2.5 example's shape (60 MoE layers, top-8 of 384 experts) are measured at a small
token count and scaled linearly (every per-token array is linear in tokens) to the example's step:

    python benchmarks/rollout_data_path.py --groups 64 --episodes 16 --tokens 131072 --dp 64 --trainer-ranks 512
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.rollout import records  # noqa: E402

GiB = 2**30


def synthetic_group(gid: int, episodes: int, tokens: int, layers: int, experts: int, top_k: int) -> dict:
    g = torch.Generator().manual_seed(gid)
    prompt = tokens // 8
    eps = []
    for _ in range(episodes):
        R = tokens - prompt
        mask = (torch.rand(R, generator=g) < 0.6).int().tolist()
        eps.append({"reward": float(torch.rand(1, generator=g)), "verifier_reward": 1.0, "reward_terms": {},
                    "meta": {"turns": 12, "stop_reason": "submitted"},
                    "segments": [{"prompt_ids": torch.randint(0, 160000, (prompt,), generator=g).tolist(),
                                  "response_ids": torch.randint(0, 160000, (R,), generator=g).tolist(),
                                  "response_logprobs": (-torch.rand(R, generator=g)).tolist(),
                                  "response_mask": mask, "weight_versions": [3] * sum(mask),
                                  "routed_experts": torch.randint(0, experts, (layers, tokens, top_k), generator=g)}]})
    return {"gid": gid, "prompt_index": gid, "attempt": 0, "task": "t", "kind": "agent", "worker": "w",
            "episodes": eps, "version_counts": {3: 1}, "min_weight_version": 3}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=131072, help="tokens per episode at the example's size")
    ap.add_argument("--dp", type=int, default=64, help="data-parallel size of the trainer")
    ap.add_argument("--trainer-ranks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=60, help="MoE layers")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--measure-tokens", type=int, default=1024, help="tokens per episode actually built")
    args = ap.parse_args(argv)

    n = 2  # groups built; everything scales with groups x episodes x tokens
    groups = [synthetic_group(i, args.episodes, args.measure_tokens, args.layers, args.experts, args.top_k)
              for i in range(n)]
    buf = io.BytesIO()
    torch.save(groups[0], buf)
    old_file = buf.getbuffer().nbytes  # what rank 0 unpickled per group
    old_broadcast = len(pickle.dumps(groups, protocol=pickle.HIGHEST_PROTOCOL)) / n  # per group, to every rank
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.group"
        path.write_bytes(records.encode_group(groups[0]))
        new_file = path.stat().st_size
        before = records.bytes_read.bytes
        index = records.read_group_index(path)
        header = records.bytes_read.bytes - before
        arrays = sum(s.nbytes for ep in index["episodes"] for s in ep["segments"])
    scale = args.tokens / args.measure_tokens  # per-token arrays; the header (metadata) does not grow with tokens
    G = args.groups
    old_rank0 = G * (old_file + old_broadcast * (args.trainer_ranks - 1)) * scale
    new_rank0 = G * (header + len(str(path)) * (args.trainer_ranks - 1)) + G * arrays * scale / args.dp
    print(f"step: {G} groups x {args.episodes} episodes x {args.tokens} tokens; {args.trainer_ranks} trainer ranks, "
          f"dp {args.dp}; routing over {args.layers} MoE layers, top-{args.top_k} of {args.experts} experts")
    print(f"  per token stored: before {old_file / (args.episodes * args.measure_tokens):.0f} B "
          f"(torch.save, int64 routing), "
          f"after {arrays / (args.episodes * args.measure_tokens):.0f} B (records, "
          f"{'uint8' if args.experts <= 256 else 'int16'} routing; file {new_file / old_file:.2f}x the pickle's size)")
    print(f"  before: rank 0 reads every group ({G * old_file * scale / GiB:,.1f} GiB) and broadcasts them to "
          f"{args.trainer_ranks - 1} ranks "
          f"({G * old_broadcast * scale * (args.trainer_ranks - 1) / GiB:,.1f} GiB sent); "
          f"every rank receives {G * old_broadcast * scale / GiB:,.1f} GiB")
    print(f"  after:  rank 0 reads {G} headers ({G * header / 2**20:.2f} MiB) and sends {G} paths; every rank reads "
          f"its dp share, {G * arrays * scale / args.dp / GiB:,.2f} GiB")
    print(f"  bytes through trainer rank 0 per step: {old_rank0 / GiB:,.1f} GiB -> {new_rank0 / GiB:,.2f} GiB "
          f"({old_rank0 / new_rank0:,.0f}x less)")


if __name__ == "__main__":
    main()
