"""Self-summarisation chains: one episode, several training samples, one reward.

When a rollout reaches its context trigger the model summarises and continues from a condensed context
(system + task + summary). The episode is the list of those segments, each with its own context
(``prompt_ids``) and its own sampled tokens (``response_ids``, the summary included). The episode's final
reward is the reward of every segment: the group advantage of episode i (computed over the G episodes of
its prompt, never over segments) is attached to every segment of episode i, so summaries are trained like
any other sampled tokens.

For ``token_sum_constant`` aggregation pass ``num_sequences = number of episodes`` to the loss so that an
episode's segments share one sequence's normaliser and chains do not shrink everyone else's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from rl.algorithm.advantages import AdvantageResult, advantages_from_config


@dataclass
class Segment:
    """One context window of an episode."""

    prompt_ids: list[int]  # system + task (+ previous summary)
    response_ids: list[int]  # tokens after the prompt: sampled tokens and any tool observations
    response_logprobs: Optional[list[float]] = None  # behaviour log-prob per response token (0 for observations)
    response_mask: Optional[list[int]] = None  # 1 for sampled tokens, 0 for tool observations; default all 1
    routed_experts: Optional[torch.Tensor] = None  # [layers, len(prompt) + len(response), top_k] from inference

    def __post_init__(self):
        n = len(self.response_ids)
        for name in ("response_logprobs", "response_mask"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"segment {name} has {len(v)} entries for {n} response tokens")
        total = len(self.prompt_ids) + n
        routed = self.routed_experts
        if routed is not None and (routed.dim() != 3 or routed.shape[1] != total):
            raise ValueError(f"segment routed_experts must be [layers, {total}, top_k], got {tuple(routed.shape)}")


@dataclass
class Episode:
    segments: list[Segment]
    reward: float
    metadata: dict = field(default_factory=dict)


@dataclass
class TrainingSample:
    """A token-aligned training sequence (position t holds token t and its log-prob given tokens < t).

    A sample of a stored segment (``stored``: one with ``load()`` and its lengths, e.g. a record file's
    segment) carries its sizes only until `load()` reads its arrays, so a trainer rank reads just its share."""

    input_ids: Optional[list[int]]
    loss_mask: Optional[list[int]]
    behaviour_logprobs: Optional[list[float]]
    advantage: float
    reward: float
    group: int
    episode: int  # index of the episode within its group
    segment: int
    routed_experts: Optional[torch.Tensor] = None
    stored: Optional[object] = field(default=None, repr=False)

    @property
    def loaded(self) -> bool:
        return self.input_ids is not None

    @property
    def loss_tokens(self) -> int:
        return int(sum(self.loss_mask)) if self.loaded else self.stored.loss_tokens

    @property
    def routing_shape(self) -> Optional[tuple[int, int]]:
        """(layers, top_k) of its recorded routing, None without."""
        if self.loaded:
            return None if self.routed_experts is None else (self.routed_experts.shape[0], self.routed_experts.shape[2])
        shape = self.stored.routing_shape
        return None if shape is None else (shape[0], shape[2])

    def load(self) -> "TrainingSample":
        """Read a stored sample's arrays (in place: the sample stays the same object)."""
        if not self.loaded:
            seg = self.stored.load()
            P = len(seg["prompt_ids"])
            self.input_ids = list(seg["prompt_ids"]) + list(seg["response_ids"])
            self.loss_mask = [0] * P + [int(m) for m in seg["response_mask"]]
            self.behaviour_logprobs = [0.0] * P + [float(v) for v in seg["response_logprobs"]]
            self.routed_experts = seg["routed_experts"]
        return self


def episodes_to_samples(groups: list[list[Episode]], cfg) -> tuple[list[TrainingSample], AdvantageResult]:
    """Expand groups of episodes (all of the same size G) into per-segment samples.

    Advantages come from `advantages_from_config` on the episode rewards [num_groups, G]; samples of
    filtered (zero-variance) groups are left out. An episode with no segments contributes no samples but
    still counts in its group's baseline. Returns (samples, advantage result with ``num_episodes`` and
    ``num_segments`` added to its metrics).
    """
    if not groups:
        raise ValueError("episodes_to_samples got no groups")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError("every group must hold the same number of episodes (fixed group size); "
                         f"got sizes {sorted(sizes)}")
    rewards_NG = torch.tensor([[float(ep.reward) for ep in g] for g in groups], dtype=torch.float32)
    result = advantages_from_config(rewards_NG, cfg)
    samples: list[TrainingSample] = []
    for gi, group in enumerate(groups):
        for ei, episode in enumerate(group):
            if not result.keep[gi, ei]:
                continue
            for si, seg in enumerate(episode.segments):
                if hasattr(seg, "load"):  # stored: its arrays are read by the rank that trains on it
                    samples.append(TrainingSample(None, None, None, advantage=float(result.advantages[gi, ei]),
                                                  reward=float(episode.reward), group=gi, episode=ei, segment=si,
                                                  stored=seg))
                    continue
                P, n = len(seg.prompt_ids), len(seg.response_ids)
                resp_mask = seg.response_mask if seg.response_mask is not None else [1] * n
                resp_logp = seg.response_logprobs if seg.response_logprobs is not None else [0.0] * n
                samples.append(TrainingSample(
                    input_ids=list(seg.prompt_ids) + list(seg.response_ids),
                    loss_mask=[0] * P + [int(m) for m in resp_mask],
                    behaviour_logprobs=[0.0] * P + [float(v) for v in resp_logp],
                    advantage=float(result.advantages[gi, ei]),
                    reward=float(episode.reward),
                    group=gi, episode=ei, segment=si,
                    routed_experts=seg.routed_experts,
                ))
    result.metrics["num_episodes"] = float(rewards_NG.numel())
    result.metrics["num_segments"] = float(sum(len(ep.segments) for g in groups for ep in g))
    return samples, result


def collate_samples(samples: list[TrainingSample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch: input_ids, loss_mask, behaviour_logp [B, S], advantages, rewards [B],
    and routed_experts [layers, B, S, top_k] when every sample has it (padding routes to experts 0..k-1)."""
    if not samples:
        raise ValueError("collate_samples got no samples")
    B, S = len(samples), max(len(s.input_ids) for s in samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, S), dtype=torch.float32)
    behaviour_logp = torch.zeros((B, S), dtype=torch.float32)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[b, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        loss_mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour_logp[b, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    batch = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "behaviour_logp": behaviour_logp,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
    }
    if all(s.routed_experts is not None for s in samples):
        L, _, K = samples[0].routed_experts.shape
        routed = torch.arange(K, dtype=torch.long).expand(L, B, S, K).clone()
        for b, s in enumerate(samples):
            if s.routed_experts.shape[0] != L or s.routed_experts.shape[2] != K:
                raise ValueError(f"sample {b} routed_experts {tuple(s.routed_experts.shape)} disagrees with "
                                 f"[{L}, *, {K}] of sample 0")
            routed[:, b, : s.routed_experts.shape[1]] = s.routed_experts
        batch["routed_experts"] = routed
    return batch
