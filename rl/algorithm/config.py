"""The RL objective's configuration: every algorithmic choice of the recipe is a switch here.

Defaults are the Composer 2 recipe: mean-baseline group advantages without std normalisation, token losses
summed per sequence and divided by a constant (Dr. GRPO), importance ratios against the inference engine's
log-probabilities, p99 train/inference mismatch masking per token, k1 KL folded into the reward, router
replay of the inference engine's experts (R3). Each field's ``help`` metadata is shown by ``--help``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_composer.config import ConfigError


def _f(default, help: str, **kw):
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class RLObjectiveConfig:
    # Advantages
    advantage_baseline: Literal["mean", "leave_one_out"] = _f(
        "mean", "group baseline: mean of the group or of the others")
    advantage_std_normalize: bool = _f(False, "divide group advantages by the group std (GRPO); off in the recipe")
    advantage_eps: float = _f(1e-6, "added to the group std before dividing")
    filter_zero_variance_groups: bool = _f(False, "drop groups whose rewards are all equal from the loss")
    refill_groups: int = _f(
        0, "dynamic sampling: per step, draw up to this many more groups to replace groups whose rewards are all "
           "equal (they carry no signal); 0 = train on the groups as drawn")
    advantage_fn: Optional[str] = _f(
        None, "importable 'module:function' (rewards[N,G], cfg) -> advantages[N,G] replacing the built-in")

    # Loss aggregation
    loss_aggregation: Literal["token_sum_constant", "seq_mean_token_mean", "token_mean"] = _f(
        "token_sum_constant", "how token losses become the batch loss")
    loss_constant: Optional[float] = _f(
        None, "token_sum_constant: C in sum/(num_sequences*C); null = the per-episode generation budget "
              "(rollout.max_new_tokens, or agent_max_turns*agent_max_new_tokens with agent tasks) in the RL "
              "trainer, the padded length in a bare loss call. Constant across steps, so the step size does not "
              "move with the batch's longest sample")

    # Policy gradient
    pg_loss: Literal["is", "ppo_clip"] = _f(
        "is", "is: importance-weighted PG against behaviour log-probs; ppo_clip: PPO clipped surrogate")
    ppo_clip_low: float = _f(0.2, "ppo_clip: ratio lower bound is 1 - ppo_clip_low")
    ppo_clip_high: float = _f(0.2, "ppo_clip: ratio upper bound is 1 + ppo_clip_high (0.28 = DAPO clip-higher)")
    tis_cap: Optional[float] = _f(
        None, "truncated importance sampling cap C. is: weight min(pi/mu, C); ppo_clip with an old-policy pass: "
              "extra weight min(pi_old/mu, C); null = untruncated")

    # Train/inference mismatch masking
    mismatch_mask: Literal["off", "token", "sequence"] = _f(
        "token", "drop tokens (or whole sequences, by their worst token) with extreme |logp_train - logp_infer|")
    mismatch_bound: Optional[float] = _f(
        None, "fixed bound on |logp_old - logp_infer|; null = the quantile over the whole step's tokens (all "
              "micro-batches and data-parallel ranks)")
    mismatch_quantile: float = _f(0.99, "quantile of the step's mismatch above which tokens are dropped")

    # KL to the reference policy
    kl_coef: float = _f(0.001, "beta; 0 disables the KL term and the reference forward pass")
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k1", "k1=-log r, k2=(log r)^2/2, k3=r-1-log r, r=p_ref/p_theta")
    kl_placement: Literal["in_reward", "in_loss"] = _f(
        "in_reward", "in_reward: detached penalty in the advantage (reward-to-go); in_loss: differentiable term")
    kl_loss_weighting: Literal["ratio", "plain"] = _f(
        "ratio", "in_loss: 'ratio' multiplies the term by pi_theta/sg(pi_behaviour) (exact reverse-KL gradient "
                 "for k1/k3); 'plain' differentiates the estimator alone (GRPO)")

    # Router replay
    router_replay: Literal["off", "r2", "r3"] = _f(
        "r3", "r3: use the inference engine's experts; r2: the old-policy pass's routing; off: route freely")

    # Reward shaping
    length_penalty_weight: float = _f(0.0, "reward -= weight * length_penalty(x / budget, k, q); 0 = off")
    length_penalty_k: float = _f(1.0, "k of C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))")
    length_penalty_q: float = _f(1.0, "q: 0 linear, 1 logarithmic, > 1 saturating at 1/(k (q - 1))")
    length_measure: Literal["output_tokens", "turns", "tool_calls"] = _f("output_tokens", "what x counts")
    length_budget: float = _f(1.0, "x is the measure divided by this budget")
    behaviour_rewards: dict[str, float] = _f(
        {}, "importable 'module:function' (transcript) -> float mapped to its weight; reward += weight * value")

    def validate(self) -> "RLObjectiveConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.advantage_eps >= 0, f"rl.advantage_eps must be >= 0, got {self.advantage_eps}")
        need(self.refill_groups >= 0, f"rl.refill_groups must be >= 0, got {self.refill_groups}")
        need(self.loss_constant is None or self.loss_constant > 0,
             f"rl.loss_constant must be positive (e.g. max_new_tokens), got {self.loss_constant}")
        need(0 <= self.ppo_clip_low < 1, f"rl.ppo_clip_low must be in [0, 1), got {self.ppo_clip_low}")
        need(self.ppo_clip_high >= 0, f"rl.ppo_clip_high must be >= 0, got {self.ppo_clip_high}")
        need(self.tis_cap is None or self.tis_cap > 0, f"rl.tis_cap must be positive or null, got {self.tis_cap}")
        need(self.mismatch_bound is None or self.mismatch_bound >= 0,
             f"rl.mismatch_bound must be >= 0 or null, got {self.mismatch_bound}")
        need(0 < self.mismatch_quantile <= 1, f"rl.mismatch_quantile must be in (0, 1], got {self.mismatch_quantile}")
        need(self.kl_coef >= 0, f"rl.kl_coef must be >= 0, got {self.kl_coef}")
        need(not (self.kl_coef > 0 and self.kl_placement == "in_loss" and self.kl_estimator == "k1"
                  and self.kl_loss_weighting == "plain"),
             "rl.kl_estimator=k1 with kl_placement=in_loss and kl_loss_weighting=plain has zero expected gradient; "
             "use kl_placement=in_reward, kl_loss_weighting=ratio, or kl_estimator=k2/k3")
        need(self.length_penalty_k >= 0, f"rl.length_penalty_k must be >= 0, got {self.length_penalty_k}")
        need(self.length_budget > 0, f"rl.length_budget must be positive, got {self.length_budget}")
        for path in [self.advantage_fn, *self.behaviour_rewards]:
            if path is not None:
                from rl.algorithm.rewards import resolve_function

                try:
                    resolve_function(path)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        return self
