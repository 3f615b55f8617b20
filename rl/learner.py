"""The RL trainer's model side on one or more trainer ranks: policy, reference policy, optimizer, RL loss.

A `PolicyLearner` is the RL loss over the training core (megatron_composer.training.core.TrainingCore: this
rank's shard of the policy in the pretraining layouts -- tp, tp+sp, cp, ep, dp with ZeRO-1 through
DistributedAdamW; the FP8 recipe of `fp8:` -- its optimizer, checkpoints and optimizer step). Every trainer
rank gets the same rollout samples for a step and trains on its data-parallel share of them:

* samples are split over dp ranks in contiguous runs of ceil(N / dp); every dp rank runs the same number of
  micro-batches (expert all-to-alls span dp ranks), a rank with fewer samples runs padding-only sequences
  whose loss mask is 0;
* each micro-batch is right-padded to a multiple of 2*cp (x tp under sequence parallelism); tensor-parallel
  ranks see the whole micro-batch, context-parallel ranks their head-tail slice of it, and the recorded
  experts (router replay) are sliced the same way;
* the token log-probs come from the vocab-parallel logits; the context-parallel pieces are gathered into
  whole sequences (the gradient flows back to each rank's own positions only), so the loss -- importance
  ratios, the mismatch quantile, the KL reward-to-go -- is the single-process code on whole sequences;
* the loss is normalised by step-level counts (episodes of the step, Dr. GRPO constant = rl.loss_constant or
  the longest sample of the step, loss-mask tokens of the step), so micro-batching and the layout do not
  change it; data-parallel gradients are summed (megatron_composer.training.core.finish_gradients).

The mismatch quantile (rl.mismatch_bound null) is taken over the tokens of one micro-batch on one dp rank, as
on a single rank; give rl.mismatch_bound for a layout-independent threshold.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_composer.parallel import collectives as C
from megatron_composer.parallel.context_parallel import shard_sequence, unshard_sequence
from megatron_composer.parallel.vocab_parallel import vocab_parallel_logprobs
from megatron_composer.training.core import TrainingCore, build_model, initial_weights
from megatron_composer.training.layout import Layout
from rl.algorithm import (
    Episode,
    PolicyGradientLoss,
    Segment,
    TrainingSample,
    collate_samples,
    episodes_to_samples,
    replay_routing,
    routing_mismatch,
)
from rl.model import build_model_meta


def episodes_of(result: dict) -> list[Episode]:
    """The episodes of one finished group (a rollout worker's result) in the algorithm's types."""
    out = []
    for ep in result["episodes"]:
        segs = [Segment(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], response_logprobs=s["response_logprobs"],
                        response_mask=s["response_mask"], routed_experts=s["routed_experts"]) for s in ep["segments"]]
        out.append(Episode(segments=segs, reward=float(ep["reward"]), metadata=ep.get("meta", {})))
    return out


def dp_share(samples: list, dp: int, dp_rank: int, micro_batch_size: int) -> list[list]:
    """This dp rank's micro-batches (lists of samples; possibly empty) -- the same count on every rank."""
    per_rank = -(-len(samples) // dp)
    mine = samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    n_micro = max(1, -(-per_rank // micro_batch_size))
    return [mine[m * micro_batch_size:(m + 1) * micro_batch_size] for m in range(n_micro)]


def _pad_to(batch: dict[str, torch.Tensor], multiple: int, pad_id: int, top_k: int | None) -> dict[str, torch.Tensor]:
    S = batch["input_ids"].shape[1]
    extra = (-S) % multiple
    if extra == 0:
        return batch
    out = dict(batch)
    for key, fill in (("input_ids", pad_id), ("loss_mask", 0.0), ("behaviour_logp", 0.0)):
        out[key] = torch.nn.functional.pad(batch[key], (0, extra), value=fill)
    if "routed_experts" in batch:  # padding routes to experts 0..k-1, as collate_samples pads
        r = batch["routed_experts"]
        tail = torch.arange(top_k, dtype=r.dtype).expand(r.shape[0], r.shape[1], extra, top_k)
        out["routed_experts"] = torch.cat([r, tail], dim=2)
    return out


class PolicyLearner:
    """This trainer rank's policy shard, reference policy, optimizer and RL loss (see the module docstring)."""

    def __init__(self, cfg, tokenizer, layout: Layout, device: torch.device, init_from: str = "",
                 resuming: bool = False):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.tokenizer = tokenizer
        self.mc, self.meta = build_model_meta(cfg, tokenizer)
        layout.validate(self.mc, None)
        # the initial weights start a fresh run and are the reference policy; a resume loads the run's own
        # checkpoint next (load)
        init = initial_weights(init_from, self.meta) if not resuming or cfg.rl.kl_coef > 0 else None
        self.core = TrainingCore(self.mc, self.meta, layout, device, optim=cfg.optim, fp8=cfg.fp8, seed=cfg.train.seed,
                                 init=None if resuming else init, max_skipped_steps=cfg.train.max_skipped_steps)
        self.model, self.optimizer = self.core.model, self.core.optimizer
        self.ref_model = None
        if cfg.rl.kl_coef > 0:  # the reference policy: the initial weights (same seed and init checkpoint)
            self.ref_model = build_model(self.mc, layout, device, cfg.fp8, seed=cfg.train.seed, init=init,
                                         meta=self.meta).eval().requires_grad_(False)
        self.loss_fn = PolicyGradientLoss(cfg.rl)
        pad = tokenizer.pad
        self.pad_id = pad if pad is not None and pad >= 0 else 0
        dims = layout.dims
        self.seq_multiple = (2 * dims.cp if dims.cp > 1 else 1) * (dims.tp if dims.sequence_parallel else 1)
        self.top_k = self.mc.num_experts_per_tok if self.mc.num_experts else None

    # -- checkpoints and weights ----------------------------------------------------------------------
    def load(self, ckpt) -> dict:
        return self.core.load(ckpt)

    def save(self, run_dir, step: int, state: dict, keep_last: int):
        """Collective. ``state`` (trainer step, orchestrator) is written by trainer rank 0."""
        return self.core.save(run_dir, step, state, keep_last)

    def full_state_dict(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """Collective: the unsharded weights in ``dtype`` on CPU on trainer rank 0 (None elsewhere), the format
        rollout workers load."""
        return self.core.full_state_dict(dtype)

    # -- one step ---------------------------------------------------------------------------------------
    def _local(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's context-parallel slice of a micro-batch (tensor-parallel ranks keep all of it)."""
        dims, r = self.layout.dims, self.layout.cp_rank
        B, S = batch["input_ids"].shape
        out = {"input_ids": shard_sequence(batch["input_ids"], 1, dims.cp, r).contiguous(), "position_ids": None}
        if dims.cp > 1:  # context-parallel attention needs each local token's position
            out["position_ids"] = shard_sequence(torch.arange(S).expand(B, S), 1, dims.cp, r).contiguous()
        if "routed_experts" in batch:
            out["routed_experts"] = shard_sequence(batch["routed_experts"], 2, dims.cp, r).contiguous()
            out["loss_mask"] = shard_sequence(batch["loss_mask"], 1, dims.cp, r).contiguous()
        return {k: (None if v is None else v.to(self.device)) for k, v in out.items()}

    def _token_logprobs(self, model, local: dict, replay):
        """Token-aligned log-probs of the whole (unsharded) sequences: logp[b, t] = log pi(x_t | x_<t), logp[:, 0]
        = 0; and the forward's output. Context-parallel pieces are gathered; each rank's gradient stays local."""
        out = model(local["input_ids"], position_ids=local["position_ids"], routed_experts=replay, return_routing=True)
        target = self.layout.shift_left(local["input_ids"], 1)
        logp_next = vocab_parallel_logprobs(out.logits, target, self.layout.vocab_group)
        if self.layout.cp > 1:
            gathered = C.gather_from_parallel(logp_next, 1, self.layout.groups.cp_group, grad_is_partial=False)
            logp_next = unshard_sequence(gathered, 1, self.layout.cp)
        return torch.nn.functional.pad(logp_next[:, :-1], (1, 0)), out

    def _padding_sample(self, like: TrainingSample) -> TrainingSample:
        """One pad token with loss mask 0 (and routing to experts 0..k-1 when samples carry routing)."""
        routed = None
        if like.routed_experts is not None:
            routed = torch.arange(self.top_k).expand(like.routed_experts.shape[0], 1, self.top_k).clone()
        return TrainingSample(input_ids=[self.pad_id], loss_mask=[0], behaviour_logprobs=[0.0], advantage=0.0,
                              reward=0.0, group=-1, episode=-1, segment=-1, routed_experts=routed)

    def samples(self, results: list[dict]) -> tuple[list[TrainingSample], object, int]:
        groups = [episodes_of(r) for r in results]
        samples, adv = episodes_to_samples(groups, self.cfg.rl)
        return samples, adv, sum(len(g) for g in groups)

    def backward(self, samples: list[TrainingSample], num_episodes: int) -> dict[str, float]:
        """Forward and backward of this rank's share of the step's samples (gradients accumulate on the
        parameters, not yet reduced over replicas). Returns step-level metrics (reduced over ranks)."""
        cfg, layout = self.cfg, self.layout
        self.model.train()
        constant = cfg.rl.loss_constant or float(max(len(s.input_ids) for s in samples))
        num_tokens = sum(sum(s.loss_mask) for s in samples)
        micro = dp_share(samples, layout.dp_size, layout.dp_rank, cfg.train.micro_batch_size)
        # sums over the ranks holding distinct tokens; whole-sequence terms count 1/cp on each cp rank
        sums: dict[str, float] = {"loss": 0.0, "tokens": 0.0}
        mismatch_max = 0.0
        for chunk in micro:
            if not chunk:  # a dp rank with fewer samples still takes part in every collective of the step
                chunk = [self._padding_sample(samples[0])]
            batch = _pad_to(collate_samples(chunk, pad_id=self.pad_id), self.seq_multiple, self.pad_id, self.top_k)
            local = self._local(batch)
            full = {k: batch[k].to(self.device) for k in ("input_ids", "loss_mask", "behaviour_logp", "advantages")}
            routed = local.get("routed_experts")
            replay = replay_routing(cfg.rl.router_replay, routed) if cfg.rl.router_replay != "r2" else None
            logp, out = self._token_logprobs(self.model, local, replay)
            ref_logp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logp, _ = self._token_logprobs(self.ref_model, local, replay)
            loss, m = self.loss_fn(logp, full["loss_mask"], full["advantages"], full["behaviour_logp"],
                                   ref_logp=ref_logp, num_sequences=num_episodes, num_tokens=num_tokens,
                                   constant=constant)
            loss.backward()
            n = float(full["loss_mask"].sum())
            share = 1.0 / layout.cp
            sums["loss"] += m["loss"] * share
            sums["tokens"] += n * share
            mismatch_max = max(mismatch_max, m.get("mismatch_max", 0.0))
            for k in ("kl", "mismatch_masked_fraction", "ratio_mean", "tis_truncated_fraction"):
                if k in m and math.isfinite(m[k]):
                    sums[k] = sums.get(k, 0.0) + m[k] * n * share
                    sums[f"{k}#n"] = sums.get(f"{k}#n", 0.0) + n * share
            if routed is not None:  # how often the trainer would route differently from the engine
                if replay is None:
                    free = out.routed_experts
                else:
                    with torch.no_grad():
                        free = self.model(local["input_ids"], position_ids=local["position_ids"],
                                          return_routing=True).routed_experts
                n_local = float(local["loss_mask"].sum())
                for k, v in routing_mismatch(free, routed, local["loss_mask"] > 0).items():
                    sums[k] = sums.get(k, 0.0) + v * n_local
                    sums[f"{k}#n"] = sums.get(f"{k}#n", 0.0) + n_local
        keys = sorted(sums)
        vec = layout.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        total = dict(zip(keys, vec.tolist()))
        metrics = {"loss": total["loss"], "train_tokens": total["tokens"]}
        for k in keys:
            if k.endswith("#n") or k in ("loss", "tokens"):
                continue
            metrics[k] = total[k] / max(total[f"{k}#n"], 1.0)
        if layout.world > 1:
            mm = torch.tensor(mismatch_max, dtype=torch.float64)
            dist.all_reduce(mm, op=dist.ReduceOp.MAX)
            mismatch_max = mm.item()
        metrics["mismatch_max"] = mismatch_max
        return metrics

    def step(self, results: list[dict], lr: float) -> dict[str, float]:
        """One optimizer step on the step's groups (identical on every trainer rank). Returns its metrics."""
        samples, adv, num_episodes = self.samples(results)
        metrics = dict(adv.metrics)
        a = adv.advantages
        metrics.update(advantage_mean=a.mean().item(), advantage_std=a.std(unbiased=False).item(),
                       advantage_abs_mean=a.abs().mean().item())
        if not samples:  # every group was filtered (zero variance): nothing to learn from this step
            metrics.update(loss=0.0, train_tokens=0.0, mismatch_max=0.0)
        # the whole step's samples are one call of `backward`: it splits them over the dp ranks and micro-batches
        # itself and returns metrics already reduced over the trainer ranks
        metrics.update(self.core.step(lambda share: (None, self.backward(share, num_episodes)),
                                      [samples] if samples else [], lr, reduce=False))
        metrics["skipped"] = float(metrics["skipped"])
        return metrics


__all__ = ["PolicyLearner", "dp_share", "episodes_of"]
