"""Group-relative advantages.

Every prompt gets a group of G sampled responses with scalar rewards R_1..R_G. The advantage of response i
is its reward minus a baseline computed from the group:

* ``mean`` (default, the Composer 2 / Dr. GRPO choice):  A_i = R_i - (1/G) sum_j R_j
* ``leave_one_out`` (RLOO):                               A_i = R_i - (1/(G-1)) sum_{j != i} R_j
                                                              = G/(G-1) * (R_i - mean_j R_j)

Optionally (GRPO) the centred rewards are divided by the group's standard deviation:
A_i <- A_i / (std_j R_j + eps), with the unbiased (G-1) std as TRL and verl compute it. The recipe leaves
this off because it inflates the weight of near-uniform groups.

A group of one has no baseline information: its advantage is 0 under every option. A group whose rewards
are all equal (zero variance) also gets A = 0 everywhere; such groups carry no policy-gradient signal, and
``zero_variance_groups`` reports them so the trainer can log the fraction and optionally drop them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Baseline = Literal["mean", "leave_one_out"]


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be shaped [num_groups, group_size], got shape {tuple(rewards.shape)}; "
            "reshape with rewards.view(num_groups, group_size)"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or Inf; fix the reward function before computing advantages")
    return rewards


def group_advantages(
    rewards: torch.Tensor,
    std_normalize: bool = False,
    baseline: Baseline = "mean",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages [num_groups, group_size] from rewards [num_groups, group_size].

    A_i = R_i - b_i with b_i the group mean (``baseline="mean"``) or the mean of the other G-1 rewards
    (``"leave_one_out"``); with ``std_normalize`` A_i is then divided by (unbiased group std + eps).
    Groups of one and all-equal groups give A = 0.
    """
    rewards_NG = _check_rewards(rewards)
    group_size = rewards_NG.shape[1]
    if group_size == 1:
        return torch.zeros_like(rewards_NG)
    centred_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if baseline == "mean":
        adv_NG = centred_NG
    elif baseline == "leave_one_out":
        adv_NG = centred_NG * (group_size / (group_size - 1))
    else:
        raise ValueError(f"baseline is {baseline!r}; choose 'mean' or 'leave_one_out'")
    if std_normalize:
        std_N1 = rewards_NG.std(dim=1, keepdim=True, unbiased=True)
        adv_NG = adv_NG / (std_N1 + eps)
    # Exactly zero for all-equal groups (the mean can leave rounding residue such as 1e-17).
    return torch.where(zero_variance_groups(rewards_NG)[:, None], torch.zeros_like(adv_NG), adv_NG)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool [num_groups]: True where every reward in the group is identical (including groups of one)."""
    rewards_NG = _check_rewards(rewards)
    return (rewards_NG == rewards_NG[:, :1]).all(dim=1)


@dataclass
class AdvantageResult:
    """Advantages plus which samples stay in the loss and the metrics to log."""

    advantages: torch.Tensor  # [num_groups, group_size]
    keep: torch.Tensor  # bool [num_groups, group_size]; False for samples of filtered groups
    metrics: dict[str, float]


def compute_advantages(
    rewards: torch.Tensor,
    std_normalize: bool = False,
    baseline: Baseline = "mean",
    filter_zero_variance: bool = False,
    eps: float = 1e-6,
) -> AdvantageResult:
    """`group_advantages` plus zero-variance group filtering and its metrics.

    Metrics: ``reward_mean``, ``reward_std`` (over all samples), ``zero_variance_group_fraction`` (always
    reported) and ``filtered_sample_fraction`` (fraction of samples dropped; 0 unless filtering is on).
    """
    rewards_NG = _check_rewards(rewards)
    adv_NG = group_advantages(rewards_NG, std_normalize=std_normalize, baseline=baseline, eps=eps)
    zero_var_N = zero_variance_groups(rewards_NG)
    keep_NG = torch.ones_like(rewards_NG, dtype=torch.bool)
    if filter_zero_variance:
        keep_NG &= ~zero_var_N[:, None]
    metrics = {
        "reward_mean": rewards_NG.mean().item(),
        "reward_std": rewards_NG.std(unbiased=False).item(),
        "zero_variance_group_fraction": zero_var_N.float().mean().item(),
        "filtered_sample_fraction": 1.0 - keep_NG.float().mean().item(),
    }
    return AdvantageResult(advantages=adv_NG, keep=keep_NG, metrics=metrics)


def advantages_from_config(rewards: torch.Tensor, cfg) -> AdvantageResult:
    """`compute_advantages` with an `RLObjectiveConfig`'s choices; ``cfg.advantage_fn`` (an importable
    ``module:function`` taking (rewards[N, G], cfg)) replaces the built-in advantages when set."""
    result = compute_advantages(rewards, std_normalize=cfg.advantage_std_normalize, baseline=cfg.advantage_baseline,
                                filter_zero_variance=cfg.filter_zero_variance_groups, eps=cfg.advantage_eps)
    if cfg.advantage_fn is not None:
        from rl.algorithm.rewards import resolve_function

        custom = torch.as_tensor(resolve_function(cfg.advantage_fn)(_check_rewards(rewards), cfg), dtype=torch.float32)
        if custom.shape != result.advantages.shape:
            raise ValueError(f"advantage_fn '{cfg.advantage_fn}' returned shape {tuple(custom.shape)}; "
                             f"expected {tuple(result.advantages.shape)} like its rewards input")
        result.advantages = custom
    return result
