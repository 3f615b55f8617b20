"""torchrun worker: the mismatch filter's threshold is the quantile over the whole step's tokens.

* ``algorithm_token`` / ``algorithm_sequence``: synthetic log-probs of 24 sequences split over the 2 ranks and
  4 micro-batches per rank; the threshold of `mismatch_threshold` over every micro-batch of both ranks and the
  fraction it masks equal those of one `mismatch_mask` over all 24 sequences (a per-micro-batch quantile, the
  old behaviour, is recorded to show it masks a different fraction);
* ``learner_dp2``: `PolicyLearner` on dp=2 with one sample per micro-batch against one rank with all samples in
  one micro-batch: the same threshold, masked fraction and loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import init, run_cases  # noqa: E402

from megatron_composer.config import load_config  # noqa: E402
from megatron_composer.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_composer.training.layout import Layout  # noqa: E402
from rl.algorithm.loss import mismatch_mask, mismatch_statistics, mismatch_threshold  # noqa: E402

TOK = None
Q = 0.99  # the recipe's p99: a micro-batch of ~27 tokens drops its largest on its own


def synthetic(seed: int = 0, B: int = 24, T: int = 16):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(B, T, generator=g) * 5
    infer = train + 0.3 * torch.randn(B, T, generator=g) ** 3  # heavy-tailed train/inference mismatch
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return train, infer, mask


def algorithm_case(level: str):
    def run():
        rank, world = dist.get_rank(), dist.get_world_size()
        train, infer, mask = synthetic()
        B = train.shape[0]
        per_rank, mbs = B // world, 3
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        micro = [list(mine)[i:i + mbs] for i in range(0, per_rank, mbs)]
        values = torch.cat([mismatch_statistics(train[m], infer[m], mask[m], level)[1] for m in micro])
        tau = mismatch_threshold(values, Q, None, group=dist.group.WORLD)
        counts = torch.zeros(3, dtype=torch.float64)  # masked with the step's tau, masked per micro-batch, valid
        for m in micro:
            keep, _ = mismatch_mask(train[m], infer[m], mask[m], level, q=Q, threshold=tau)
            keep_local, _ = mismatch_mask(train[m], infer[m], mask[m], level, q=Q)
            valid = mask[m].sum()
            counts += torch.tensor([float(valid - keep.sum()), float(valid - keep_local.sum()), float(valid)],
                                   dtype=torch.float64)
        dist.all_reduce(counts)
        _, single = mismatch_mask(train, infer, mask, level, q=Q)
        return {"threshold": tau, "single_threshold": single["mismatch_threshold"],
                "masked_fraction": float(counts[0] / counts[2]),
                "single_masked_fraction": single["mismatch_masked_fraction"],
                "per_micro_batch_masked_fraction": float(counts[1] / counts[2])}
    return run


def learner_case(tmp: Path):
    def run():
        from rl_worker import near_policy, rollout_groups

        from rl.config import RLConfig
        from rl.learner import PolicyLearner

        def config(run_dir: str, mbs: int, **parallel) -> RLConfig:
            over = {"model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
                    "data.tokenizer": TOK, "rollout.max_seq_len": 128, "train.micro_batch_size": mbs,
                    "train.seed": 5, "rl.kl_coef": 0.0, "rl.mismatch_quantile": 0.9, "rl.router_replay": "r3",
                    "run.dir": run_dir, "checkpoint.init_from": "''"}
            over.update({f"parallel.{k}": v for k, v in parallel.items()})
            return load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()]).validate()

        tok, cpu = load_tokenizer(TOK), torch.device("cpu")
        ref_cfg, par_cfg = config(str(tmp / "ref"), mbs=64), config(str(tmp / "dp2"), mbs=1)
        ref = PolicyLearner(ref_cfg, tok, Layout(ref_cfg.parallel, distributed=False), cpu)
        par = PolicyLearner(par_cfg, tok, Layout(par_cfg.parallel), cpu)
        results = rollout_groups(11, ref.mc, num_groups=2, group_size=4)
        near_policy(results, ref.model, 21)
        samples, _, n_ep = ref.samples(results)
        m_ref = ref.backward(samples, n_ep)
        m_par = par.backward(par.samples(results)[0], n_ep)
        return {k: [m_ref[k], m_par[k]] for k in ("mismatch_threshold", "mismatch_masked_fraction", "loss")} | {
            "micro_batches_per_rank": len(samples) // 2}
    return run


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", required=True)
    known, rest = ap.parse_known_args()
    TOK = known.tok
    sys.argv = [sys.argv[0], *rest]
    args = init()
    run_cases(args, {"algorithm_token": algorithm_case("token"), "algorithm_sequence": algorithm_case("sequence"),
                     "learner_dp2": learner_case(Path(args.out))})
