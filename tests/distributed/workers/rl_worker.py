"""torchrun worker: the RL trainer (rl.learner.PolicyLearner) on several trainer ranks against one rank.

Per layout, on the same rollout groups (multi-segment episodes, observation tokens masked, behaviour log-probs
off the policy, recorded experts replayed, KL to the reference policy): the step's RL loss and every parameter
gradient (each rank's shard against the slice of the single-rank gradient), then one optimizer step on each
side and the loss of a second batch; the weights every trainer rank publishes of its own boxes (the RL
trainer's WeightPublisher, no gather) reconstruct from the store to the single-rank model's names and
shapes, bit-identical to it before the step and to every rank's own shards after it (a delta on the first
version; the single-rank weights after the step differ in reduction order only, which the loss of the second
batch bounds); a checkpoint written by the layout loads back into a fresh learner of the same layout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import compare_grads, init, reduce_max, run_cases  # noqa: E402

from megatron_composer.config import load_config  # noqa: E402
from megatron_composer.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_composer.parallel.data_parallel import DistributedAdamW  # noqa: E402
from megatron_composer.parallel.slices import local_pieces, local_tensor, named_tensors  # noqa: E402
from megatron_composer.training.core import finish_gradients  # noqa: E402
from megatron_composer.training.layout import Layout  # noqa: E402
from rl.algorithm import token_logprobs  # noqa: E402
from rl.config import RLConfig, weight_store  # noqa: E402
from rl.learner import PolicyLearner, dp_share  # noqa: E402
from rl.weight_sync.codec import to_bits  # noqa: E402

TOK = None  # set from --tok


def config(run_dir: str, mbs: int = 3, **parallel) -> RLConfig:
    over = {"model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
            "data.tokenizer": TOK, "rollout.max_seq_len": 128, "train.micro_batch_size": mbs, "train.seed": 5,
            "optim.lr": 1e-3, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-3,
            "optim.grad_clip": 1.0, "rl.kl_coef": 0.05, "rl.mismatch_bound": 0.2, "rl.router_replay": "r3",
            "run.dir": run_dir, "checkpoint.init_from": "''", "weight_sync.dtype": "float32"}
    over.update({f"parallel.{k}": v for k, v in parallel.items()})
    return load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()]).validate()


def rollout_groups(seed: int, mc, num_groups: int = 2, group_size: int = 3) -> list[dict]:
    """Finished groups as rollout workers write them: 1-2 segments per episode, tool observations (mask 0)
    between sampled tokens, behaviour log-probs near the policy's, the engine's experts per position."""
    g = torch.Generator().manual_seed(seed)
    L, E, K = len(mc.moe_layer_ids), mc.num_experts, mc.num_experts_per_tok
    results = []
    for gi in range(num_groups):
        episodes = []
        for ei in range(group_size):
            segs = []
            for _ in range(1 + int(torch.randint(0, 2, (1,), generator=g))):
                P, R = int(torch.randint(4, 9, (1,), generator=g)), int(torch.randint(5, 14, (1,), generator=g))
                mask = [1] * R
                obs = int(torch.randint(1, R - 2, (1,), generator=g))
                mask[obs:obs + 2] = [0, 0]  # a tool observation inside the response
                logp = (-torch.rand(R, generator=g) * 6).tolist()
                routed = torch.rand(L, P + R, E, generator=g).argsort(-1)[..., :K]
                segs.append({"prompt_ids": torch.randint(3, mc.vocab_size, (P,), generator=g).tolist(),
                             "response_ids": torch.randint(3, mc.vocab_size, (R,), generator=g).tolist(),
                             "response_logprobs": [v if m else 0.0 for v, m in zip(logp, mask)],
                             "response_mask": mask, "routed_experts": routed, "weight_versions": [0] * sum(mask)})
            episodes.append({"reward": float(torch.rand(1, generator=g)), "segments": segs, "meta": {}})
        results.append({"prompt_index": gi, "episodes": episodes, "version_counts": {0: 1}})
    return results


@torch.no_grad()
def near_policy(results: list[dict], model, seed: int) -> None:
    """Behaviour log-probs = the policy's own (replaying the recorded experts) + noise, so that most tokens pass
    the mismatch bound and some do not, as with a real engine a little off-policy."""
    g = torch.Generator().manual_seed(seed)
    for r in results:
        for ep in r["episodes"]:
            for seg in ep["segments"]:
                ids = torch.tensor([seg["prompt_ids"] + seg["response_ids"]])
                out = model(ids, routed_experts=seg["routed_experts"][:, None], return_routing=True)
                logp = token_logprobs(out.logits, ids)[0]
                P = len(seg["prompt_ids"])
                noisy = logp[P:] + 0.15 * torch.randn(len(seg["response_ids"]), generator=g)
                seg["response_logprobs"] = [float(v) if m else 0.0 for v, m in zip(noisy, seg["response_mask"])]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(to_bits(a), to_bits(b))


def grads_to_full_shards(learner: PolicyLearner) -> None:
    opt = learner.optimizer
    finish_gradients(learner.model, opt, 0.0)
    if isinstance(opt, DistributedAdamW):
        opt.gather_grads()


def learners(tmp: Path, name: str, mbs: int, parallel: dict):
    """(one-rank reference learner, learner in the layout, the layout's config) on the same seed."""
    tok = load_tokenizer(TOK)
    cpu = torch.device("cpu")
    ref_cfg, par_cfg = config(str(tmp / f"{name}_ref")), config(str(tmp / name), mbs=mbs, **parallel)
    ref = PolicyLearner(ref_cfg, tok, Layout(ref_cfg.parallel, distributed=False), cpu)
    return ref, PolicyLearner(par_cfg, tok, Layout(par_cfg.parallel), cpu), par_cfg


def make_case(tmp: Path, name: str, mbs: int = 3, odd: bool = False, **parallel):
    def run():
        tok = load_tokenizer(TOK)
        cpu = torch.device("cpu")
        ref, par, par_cfg = learners(tmp, name, mbs, parallel)
        results = rollout_groups(11, ref.mc)
        if odd and sum(len(ep["segments"]) for r in results for ep in r["episodes"]) % 2 == 0:
            # an odd number of samples: the dp ranks get unequal shares
            next(ep for r in results for ep in r["episodes"] if len(ep["segments"]) > 1)["segments"].pop()
        near_policy(results, ref.model, 21)
        # published as the RL trainer does: every rank its owned boxes (rl/trainer.py: Trainer._publish)
        publisher = par_cfg.weight_sync.publisher(weight_store(par_cfg), group=dist.group.WORLD)
        publisher.publish(par.model, 0)
        first = par_cfg.weight_sync.subscriber(weight_store(par_cfg)).fetch(0)
        initial_equal = set(first) == set(ref.model.state_dict()) and all(
            _bits_equal(first[k], v) for k, v in ref.model.state_dict().items())
        samples, _, n_ep = ref.samples(results)
        assert len({s.episode for s in samples if s.segment == 1}) >= 1, "no multi-segment episode"
        errs = {}
        m_ref = ref.backward(samples, n_ep)
        m_par = par.backward(par.samples(results)[0], n_ep)
        micro = dp_share(samples, par.layout.dp_size, par.layout.dp_rank, mbs)
        padding_only = float(sum(not m for m in micro))  # micro-batches this rank ran without samples
        grads_to_full_shards(par)
        errs["loss"] = abs(m_par["loss"] - m_ref["loss"]) / abs(m_ref["loss"])
        errs["train_tokens"] = abs(m_par["train_tokens"] - m_ref["train_tokens"])
        errs.update({f"grad:{k}": v for k, v in compare_grads(dict(par.model.named_parameters()),
                                                              dict(ref.model.named_parameters())).items()})
        n_params = sum(1 for p in ref.model.parameters() if p.grad is not None)
        # one optimizer step each (through the trainer's step: lr, reduction, clipping), then a second batch
        for learner in (ref, par):
            learner.optimizer.zero_grad()
        results2 = rollout_groups(12, ref.mc)
        near_policy(results2, ref.model, 22)  # after the step: the policy moved, the engine lags behind
        ref.step(results, 1e-3)
        par.step(results, 1e-3)
        s2, _, n2 = ref.samples(results2)
        l2_ref = ref.backward(s2, n2)["loss"]
        l2_par = par.backward(par.samples(results2)[0], n2)["loss"]
        errs["loss_after_step"] = abs(l2_par - l2_ref) / abs(l2_ref)
        ref.optimizer.zero_grad()
        par.optimizer.zero_grad()
        # version 1 (a delta on version 0), reconstructed from the store as a rollout worker does
        stats = publisher.publish(par.model, 1)
        full, want = par_cfg.weight_sync.subscriber(weight_store(par_cfg)).fetch(1), ref.model.state_dict()
        errs["publish_keys"] = float(set(full) != set(want) or any(full[k].shape != want[k].shape for k in want))
        errs["publish_delta"] = float(stats.base_version != 0 or not stats.delta_bytes)
        errs["publish_values"] = float(any(not _bits_equal(local_tensor(t)[pc.local], full[n][pc.full])
                                           for n, t in named_tensors(par.model) for pc in local_pieces(t)))
        # checkpoint of the layout, loaded into a fresh learner of the same layout
        state = {"step": 1, "orchestrator": {"sampler": "rank 0 only"}} if dist.get_rank() == 0 else {"step": 1}
        ckpt = par.save(str(tmp / name), 1, state, keep_last=0)
        fresh = PolicyLearner(par_cfg, tok, Layout(par_cfg.parallel), cpu)
        loaded = fresh.load(ckpt)
        errs["ckpt_state"] = float(loaded.get("orchestrator") != {"sampler": "rank 0 only"})
        errs["ckpt_weights"] = float(any(not torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                                               par.model.state_dict().values())))
        l3_par = fresh.backward(fresh.samples(results2)[0], n2)["loss"]
        errs["ckpt_loss"] = abs(l3_par - l2_ref) / abs(l2_ref)
        errs["publish_initial"] = float(not initial_equal)
        errs = reduce_max(errs)
        counts = torch.tensor([padding_only])
        dist.all_reduce(counts)
        return {"errs": errs, "n_params": n_params, "padding_only_micro_batches": counts.item(), "loss": m_ref["loss"],
                "loss_after_step": l2_ref,
                "masked": m_ref["mismatch_masked_fraction"], "train_tokens": m_ref["train_tokens"]}
    return run


def make_records_case(tmp: Path, name: str, mbs: int = 2, **parallel):
    """The step's groups as rollout workers store them (rl/rollout/records.py), each rank reading only its own
    samples from the files: the same loss and gradients as the in-memory groups on one rank, and the bytes each
    rank read are exactly its data-parallel share's."""
    def run():
        from rl.rollout import records

        ref, par, _ = learners(tmp, name, mbs, parallel)
        results = rollout_groups(11, ref.mc, num_groups=3, group_size=3)
        near_policy(results, ref.model, 21)
        paths = [str(tmp / f"{name}_g{i}.group") for i in range(len(results))]
        if dist.get_rank() == 0:
            for path, group in zip(paths, results):
                Path(path).write_bytes(records.encode_group(group))
        dist.barrier()
        stored = [records.read_group_index(p) for p in paths]
        samples, _, n_ep = ref.samples(results)
        m_ref = ref.backward(samples, n_ep)
        par_samples = par.samples(stored)[0]
        before = records.bytes_read.bytes
        m_par = par.backward(par_samples, n_ep)
        read = records.bytes_read.bytes - before
        mine = [s for chunk in dp_share(par_samples, par.layout.dp_size, par.layout.dp_rank, mbs) for s in chunk]
        grads_to_full_shards(par)
        errs = {"loss": abs(m_par["loss"] - m_ref["loss"]) / abs(m_ref["loss"]),
                "train_tokens": abs(m_par["train_tokens"] - m_ref["train_tokens"]),
                "bytes_are_the_share": float(read != sum(s.stored.nbytes for s in mine))}
        errs.update({f"grad:{k}": v for k, v in compare_grads(dict(par.model.named_parameters()),
                                                              dict(ref.model.named_parameters())).items()})
        errs = reduce_max(errs)
        per_rank = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size())]
        tp_rank = par.layout.dims.coords(dist.get_rank())["tp"]
        dist.all_gather(per_rank, torch.tensor([float(read), float(par.layout.dp_rank), float(tp_rank)],
                                               dtype=torch.float64))
        return {"errs": errs, "n_params": sum(1 for p in ref.model.parameters() if p.grad is not None),
                "bytes_per_rank": [t.tolist() for t in per_rank],
                "bytes_total": float(sum(s.stored.nbytes for s in par_samples))}
    return run


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", required=True)
    known, rest = ap.parse_known_args()
    TOK = known.tok
    sys.argv = [sys.argv[0], *rest]
    args = init()
    tmp = Path(args.out)
    if dist.get_world_size() == 2:
        cases = {
            "tp2": make_case(tmp, "tp2", tp=2),
            "tp2_sp": make_case(tmp, "tp2_sp", tp=2, sequence_parallel=True),
            "ep2": make_case(tmp, "ep2", ep=2),
            "ep2_mbs1": make_case(tmp, "ep2_mbs1", mbs=1, odd=True, ep=2),  # a dp rank runs a padding-only micro-batch
            "cp2": make_case(tmp, "cp2", cp=2),
            "dp2_zero1": make_case(tmp, "dp2_zero1", zero1=True),
        }
    else:
        cases = {
            "tp2_sp_cp2_ep2_zero1": make_case(tmp, "tp2_sp_cp2_ep2_zero1", tp=2, sequence_parallel=True, cp=2, ep=2),
            "dp2_tp2_ep4_mbs2": make_case(tmp, "dp2_tp2_ep4_mbs2", mbs=2, tp=2, ep=4),
            "fsdp_ep2": make_case(tmp, "fsdp_ep2", fsdp=True, ep=2),  # dense over dp x cp, experts on their mesh
            "dp2_tp2_records": make_records_case(tmp, "dp2_tp2_records", tp=2),
        }
    run_cases(args, cases)
