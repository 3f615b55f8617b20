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
  the per-episode generation budget, loss-mask tokens of the step), so micro-batching and the layout do not
  change it; data-parallel gradients are summed (megatron_composer.training.core.finish_gradients);
* log-probs are taken under the rollout temperature (the distribution the engine sampled from);
* an old-policy pass (no grad, the weights the step starts from) runs first when the step needs it whole:
  the mismatch quantile is over every token of the step on every dp rank, R2 replays the routing it
  recorded, ppo_clip uses its log-probs as pi_old, and the KL reward-to-go of a summarisation chain adds the
  KL of the episode's later segments (docs/ARCHITECTURE.md, "The RL objective as trained").
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

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
    kl_estimate,
    mismatch_mask,
    replay_routing,
    routing_mismatch,
)
from rl.algorithm.loss import mismatch_statistics, mismatch_threshold
from rl.model import build_model_meta


def episodes_of(result: dict) -> list[Episode]:
    """The episodes of one finished group (a rollout worker's result) in the algorithm's types; segments still
    in their record file (rl.rollout.records.StoredSegment) stay there until a rank trains on them."""
    out = []
    for ep in result["episodes"]:
        segs = [s if hasattr(s, "load") else
                Segment(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"],
                        response_logprobs=s["response_logprobs"], response_mask=s["response_mask"],
                        routed_experts=s["routed_experts"]) for s in ep["segments"]]
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
                 resuming: bool = False, agent_tasks: bool = False):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.temperature = float(cfg.rollout.temperature)
        # Dr. GRPO's constant: the per-episode generation budget unless set (see rl.algorithm.config)
        self.loss_constant = float(cfg.rl.loss_constant or cfg.rollout.episode_token_budget(agent_tasks))
        self.tokenizer = tokenizer
        self.mc, self.meta = build_model_meta(cfg, tokenizer)
        layout.validate(self.mc, None)
        # the initial weights start a fresh run and are the reference policy; a resume loads the run's own
        # checkpoint next (load)
        init = initial_weights(init_from, self.meta) if not resuming or cfg.rl.kl_coef > 0 else None
        self.core = TrainingCore(self.mc, self.meta, layout, device, optim=cfg.optim, fp8=cfg.fp8, qat=cfg.qat,
                                 seed=cfg.train.seed,
                                 init=None if resuming else init, max_skipped_steps=cfg.train.max_skipped_steps,
                                 async_save=cfg.checkpoint.async_save)
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

    def finish_save(self) -> None:
        """Collective: publish an asynchronous save still in flight (checkpoint.async_save)."""
        self.core.finish_save()

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
        return {k: (None if v is None else v.to(self.device)) for k, v in out.items()}

    def _token_logprobs(self, model, local: dict, replay):
        """Token-aligned log-probs of the whole (unsharded) sequences under the sampling temperature T
        (rollout.temperature): logp[b, t] = log softmax(logits_t / T)[x_t], logp[:, 0] = 0; and the forward's
        output. Context-parallel pieces are gathered; each rank's gradient stays local."""
        out = model(local["input_ids"], position_ids=local["position_ids"], routed_experts=replay, return_routing=True)
        target = self.layout.shift_left(local["input_ids"], 1)
        logits = out.logits
        if self.temperature != 1.0:  # the distribution the engine sampled from: softmax(logits / T)
            logits = logits / self.temperature
        logp_next = vocab_parallel_logprobs(logits, target, self.layout.vocab_group)
        if self.layout.cp > 1:
            gathered = C.gather_from_parallel(logp_next, 1, self.layout.groups.cp_group, grad_is_partial=False)
            logp_next = unshard_sequence(gathered, 1, self.layout.cp)
        return torch.nn.functional.pad(logp_next[:, :-1], (1, 0)), out

    def _reference_logprobs(self, local: dict, replay):
        """The reference policy's token log-probs. It never runs backward, so under FSDP its root unit (kept
        gathered from forward to backward for the policy: embedding, head) is resharded here; otherwise it would
        stay gathered for the whole run."""
        logp = self._token_logprobs(self.ref_model, local, replay)[0]
        if isinstance(self.ref_model, FSDPModule):
            self.ref_model.reshard()
        return logp

    def _padding_sample(self, like: TrainingSample) -> TrainingSample:
        """One pad token with loss mask 0 (and routing to experts 0..k-1 when samples carry routing)."""
        routed = None
        if like.routing_shape is not None:
            routed = torch.arange(self.top_k).expand(like.routing_shape[0], 1, self.top_k).clone()
        return TrainingSample(input_ids=[self.pad_id], loss_mask=[0], behaviour_logprobs=[0.0], advantage=0.0,
                              reward=0.0, group=-1, episode=-1, segment=-1, routed_experts=routed)

    def samples(self, results: list[dict]) -> tuple[list[TrainingSample], object, int]:
        groups = [episodes_of(r) for r in results]
        samples, adv = episodes_to_samples(groups, self.cfg.rl)
        return samples, adv, sum(len(g) for g in groups)

    def needs_old_policy_pass(self, samples: list[TrainingSample]) -> bool:
        """Whether the step runs the old-policy pass (`_old_policy_pass`): for a quantile mismatch filter (its
        threshold is over the whole step), R2 (it records the routing), PPO (pi_old) and the KL reward-to-go
        of summarisation chains (it needs every segment's KL before any update)."""
        rl = self.cfg.rl
        return ((rl.mismatch_mask != "off" and rl.mismatch_bound is None) or rl.router_replay == "r2"
                or rl.pg_loss == "ppo_clip"
                or (rl.kl_coef > 0 and rl.kl_placement == "in_reward" and any(s.segment > 0 for s in samples)))

    def _micro_batches(self, samples: list[TrainingSample]) -> list[tuple[list, dict, dict, dict]]:
        """This dp rank's micro-batches as (chunk, padded batch, this rank's local slice, whole sequences)."""
        layout = self.layout
        out = []
        for chunk in dp_share(samples, layout.dp_size, layout.dp_rank, self.cfg.train.micro_batch_size):
            if not chunk:  # a dp rank with fewer samples still takes part in every collective of the step
                chunk = [self._padding_sample(samples[0])]
            chunk = [s.load() for s in chunk]  # only this rank's samples are read from their record files
            batch = _pad_to(collate_samples(chunk, pad_id=self.pad_id), self.seq_multiple, self.pad_id, self.top_k)
            local = self._local(batch)
            local["loss_mask"] = shard_sequence(batch["loss_mask"], 1, layout.dims.cp, layout.cp_rank).to(self.device)
            full = {k: batch[k].to(self.device) for k in ("input_ids", "loss_mask", "behaviour_logp", "advantages")}
            out.append((chunk, batch, local, full))
        return out

    @torch.no_grad()
    def _old_policy_pass(self, micro: list) -> list[dict]:
        """Before the update, per micro-batch: the policy's log-probs (the old policy, pi_old), the routing it
        chose (R2 replays it in the update pass; under R3 it is the engine's), and the reference log-probs
        under the update pass's routing."""
        rl = self.cfg.rl
        old = []
        for _, _, local, _ in micro:
            replay = replay_routing(rl.router_replay, local.get("routed_experts")) if rl.router_replay == "r3" else None
            logp, out = self._token_logprobs(self.model, local, replay)
            routing = out.routed_experts
            update_replay = routing if rl.router_replay == "r2" else replay
            ref = self._reference_logprobs(local, update_replay) if self.ref_model is not None else None
            old.append({"logp": logp, "routing": routing, "ref_logp": ref})
        return old

    def _chain_kl_tails(self, samples: list[TrainingSample], micro: list, old: list[dict],
                        threshold: float | None) -> list[torch.Tensor]:
        """Per micro-batch [B]: the KL penalty's sum over the *later* segments of each sample's episode (kept
        tokens, old-policy log-probs), so the reward-to-go runs over the whole chain. Collective over dp."""
        rl = self.cfg.rl
        index = {id(s): i for i, s in enumerate(samples)}
        totals = torch.zeros(len(samples), dtype=torch.float64)
        for (chunk, _, _, full), o in zip(micro, old):
            keep, _ = mismatch_mask(o["logp"], full["behaviour_logp"], full["loss_mask"], rl.mismatch_mask,
                                    rl.mismatch_bound, rl.mismatch_quantile, threshold=threshold)
            kl = torch.where(keep, kl_estimate(o["logp"], o["ref_logp"].float(), rl.kl_estimator), 0.0).sum(-1)
            for b, s in enumerate(chunk):
                if id(s) in index:
                    totals[index[id(s)]] = float(kl[b])
        if self.layout.groups is not None and self.layout.dp_size > 1:  # each dp rank filled its own samples
            dist.all_reduce(totals, group=self.layout.groups.group("dp"))
        by_segment: dict[tuple[int, int], dict[int, float]] = {}  # episode -> segment -> its KL sum
        for j, t in enumerate(samples):
            by_segment.setdefault((t.group, t.episode), {})[t.segment] = float(totals[j])
        later: dict[tuple[int, int, int], float] = {}  # (group, episode, segment) -> KL of the later segments
        for (g, e), segs in by_segment.items():
            acc = 0.0
            for seg in sorted(segs, reverse=True):
                later[(g, e, seg)] = acc
                acc += segs[seg]
        return [torch.tensor([later[(s.group, s.episode, s.segment)] if id(s) in index else 0.0 for s in chunk],
                             dtype=torch.float32) for chunk, *_ in micro]

    def backward(self, samples: list[TrainingSample], num_episodes: int) -> dict[str, float]:
        """Forward and backward of this rank's share of the step's samples (gradients accumulate on the
        parameters, not yet reduced over replicas). Returns step-level metrics (reduced over ranks)."""
        layout, rl = self.layout, self.cfg.rl
        self.model.train()
        num_tokens = sum(s.loss_tokens for s in samples)
        micro = self._micro_batches(samples)
        old = self._old_policy_pass(micro) if self.needs_old_policy_pass(samples) else None
        threshold = None  # the step's mismatch threshold, over every token of the step on every dp rank
        if old is not None and rl.mismatch_mask != "off":
            values = [mismatch_statistics(o["logp"], full["behaviour_logp"], full["loss_mask"], rl.mismatch_mask)[1]
                      for (_, _, _, full), o in zip(micro, old)]
            dp_group = layout.groups.group("dp") if layout.groups is not None else None
            threshold = mismatch_threshold(torch.cat(values), rl.mismatch_quantile, rl.mismatch_bound, dp_group)
        tails = None
        if old is not None and rl.kl_coef > 0 and rl.kl_placement == "in_reward" and any(s.segment for s in samples):
            tails = self._chain_kl_tails(samples, micro, old, threshold)
        # sums over the ranks holding distinct tokens; whole-sequence terms count 1/cp on each cp rank
        sums: dict[str, float] = {"loss": 0.0, "tokens": 0.0}
        mismatch_max = 0.0

        def add(key: str, value: float, weight: float) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            sums[f"{key}#n"] = sums.get(f"{key}#n", 0.0) + weight

        for m_i, (chunk, batch, local, full) in enumerate(micro):
            routed = local.get("routed_experts")
            o = old[m_i] if old is not None else None
            if rl.router_replay == "r2":
                replay = replay_routing("r2", old_policy_routed_experts=o["routing"])
            else:
                replay = replay_routing(rl.router_replay, routed)
            logp, out = self._token_logprobs(self.model, local, replay)
            ref_logp = o["ref_logp"] if o is not None else None
            if self.ref_model is not None and ref_logp is None:
                with torch.no_grad():
                    ref_logp = self._reference_logprobs(local, replay)
            loss, m = self.loss_fn(logp, full["loss_mask"], full["advantages"], full["behaviour_logp"],
                                   old_logp=o["logp"] if o is not None else None, ref_logp=ref_logp,
                                   num_sequences=num_episodes, num_tokens=num_tokens, constant=self.loss_constant,
                                   mismatch_threshold=threshold, kl_tail=tails[m_i] if tails is not None else None)
            n_local = float(local["loss_mask"].sum())
            if o is not None and out.routed_experts is not None:  # R2: 0 by construction; logged for every mode
                for k, v in routing_mismatch(out.routed_experts, o["routing"], local["loss_mask"] > 0).items():
                    add(k.replace("routing_mismatch", "update_routing_mismatch"), v, n_local)
            # how often the trainer would route differently from the engine -- before the backward: a forward
            # after it would leave an FSDP root's parameters gathered (its sharded gradients out of sight)
            if routed is not None:
                if rl.router_replay == "off":
                    free = out.routed_experts
                else:
                    with torch.no_grad():
                        free = self.model(local["input_ids"], position_ids=local["position_ids"],
                                          return_routing=True).routed_experts
                for k, v in routing_mismatch(free, routed, local["loss_mask"] > 0).items():
                    add(k, v, n_local)
            loss.backward()
            n = float(full["loss_mask"].sum())
            share = 1.0 / layout.cp
            sums["loss"] += m["loss"] * share
            sums["tokens"] += n * share
            mismatch_max = max(mismatch_max, m.get("mismatch_max", 0.0))
            for k in ("kl", "mismatch_masked_fraction", "ratio_mean", "tis_truncated_fraction", "clip_fraction"):
                if k in m and math.isfinite(m[k]):
                    add(k, m[k], n * share)
        keys = sorted(sums)
        vec = layout.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        total = dict(zip(keys, vec.tolist()))
        metrics = {"loss": total["loss"], "train_tokens": total["tokens"], "loss_constant": float(self.loss_constant)}
        if threshold is not None:
            metrics["mismatch_threshold"] = threshold
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
