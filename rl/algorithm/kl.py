"""KL-to-reference estimators and where they enter the objective.

With tokens y sampled from the policy pi_theta and r = pi_ref(y) / pi_theta(y) (log r = ref_logp - logp):

* k1 = -log r                      unbiased for KL(pi_theta || pi_ref), variance grows only like the log-ratio
* k2 = (log r)^2 / 2               biased, low variance
* k3 = (r - 1) - log r             unbiased and non-negative, but E[r^2] explodes as the policies separate

Placement (what the gradient of the objective is, for a single sampled token; see tests):

* ``in_reward``: the detached penalty beta * k is folded into the per-token advantage. For a sequence,
  token t receives the reward-to-go  A_t = A - beta * sum_{t' >= t} k_{t'}, so with k1 the expected
  policy gradient is exactly beta * grad KL(pi_theta || pi_ref) of the whole sequence distribution. This is
  the correct place for k1.
* ``in_loss``: beta * k is added to the per-token loss as a differentiable term.
  - ``weighting="plain"`` (GRPO's kl loss): E[grad k1] = 0 (k1 does nothing), E[grad k2] = grad KL(pi||ref)
    (exact reverse KL), E[grad k3] = grad KL(pi_ref||pi) (the *forward* KL; it matches the reverse-KL
    gradient only to first order near pi_ref).
  - ``weighting="ratio"``: the term is rho * k with rho = pi_theta / sg(pi_behaviour) (value ~1), which
    adds the score-function part, so the expected gradient is that of E_{pi_theta}[k]: exact reverse KL for
    k1 and k3 (both unbiased estimators of it); for k2 it is the gradient of E[k2], not of the KL.
  Per-token in-loss terms treat each token's context as fixed (the per-token KL); only ``in_reward`` with
  the reward-to-go differentiates the KL of the whole sequence distribution.
"""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3"]
KL_KINDS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token KL estimate with r = p_ref / p_theta: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.

    Differentiable in both arguments; detach ``logp`` for a reward-side penalty.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must have the same shape")
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        # expm1 keeps (r - 1) accurate when r is close to 1.
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl kind is {kind!r}; choose one of {list(KL_KINDS)}")


def reward_to_go(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """out[b, t] = sum_{t' >= t} values[b, t'] * mask[b, t'] (masked positions contribute nothing)."""
    masked = values_BT * mask_BT.to(values_BT.dtype)
    return masked.flip(-1).cumsum(-1).flip(-1)
