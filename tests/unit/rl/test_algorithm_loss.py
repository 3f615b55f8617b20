"""Loss aggregation, mismatch masking, policy-gradient variants, KL estimators and router replay."""

import math

import pytest
import torch

from megatron_composer.config import ConfigError, load_config
from rl.algorithm import (
    PolicyGradientLoss,
    RLObjectiveConfig,
    aggregate_loss,
    kl_estimate,
    mismatch_mask,
    replay_routing,
    reward_to_go,
    routing_mismatch,
    token_logprobs,
)
from rl.algorithm.loss import quantile

LN2 = math.log(2.0)


# ---- aggregation ------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_token_sum_constant():
    assert aggregate_loss(LOSS, MASK, "token_sum_constant").item() == pytest.approx(7 / (2 * 3))
    loss = aggregate_loss(LOSS, MASK, "token_sum_constant", constant=10, num_sequences=4)
    assert loss.item() == pytest.approx(7 / 40)


def test_seq_mean_token_mean_with_empty_response():
    assert aggregate_loss(LOSS, MASK, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4.0) / 2)
    empty = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregate_loss(LOSS, empty, "seq_mean_token_mean").item() == pytest.approx((1.5 + 0.0) / 2)


def test_token_mean():
    assert aggregate_loss(LOSS, MASK, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(LOSS, MASK, "token_mean", num_tokens=7).item() == pytest.approx(1.0)
    assert aggregate_loss(LOSS, torch.zeros_like(MASK), "token_mean").item() == 0.0


def test_aggregation_ignores_nonfinite_masked_tokens():
    x = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss_BT = x * torch.tensor([[1.0, float("inf")]])
    for mode in ("token_sum_constant", "seq_mean_token_mean", "token_mean"):
        loss = aggregate_loss(loss_BT, torch.tensor([[1.0, 0.0]]), mode)
        assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="choose token_sum_constant"):
        aggregate_loss(LOSS, MASK, "sum")


def test_length_bias_of_aggregations():
    # Two sequences with equal per-token loss 1: a long one (4 tokens) and a short one (1 token).
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # token_sum_constant weighs tokens equally regardless of their sequence's length
    assert aggregate_loss(loss, mask, "token_sum_constant", constant=4).item() == pytest.approx(5 / 8)
    # seq_mean_token_mean gives each sequence weight 1, i.e. a token of the short sequence weighs 4x
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(1.0)


# ---- mismatch masking -------------------------------------------------------------------------------------

D = torch.tensor([[0.0, 0.1, 0.2, 0.3, 1.0]])


def test_quantile_matches_torch():
    v = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.5, 0.99, 1.0):
        torch.testing.assert_close(quantile(v, q), torch.quantile(v, q))


def test_mismatch_token_fixed_bound():
    keep, stats = mismatch_mask(D, torch.zeros_like(D), torch.ones_like(D), "token", bound=0.25)
    assert keep.tolist() == [[True, True, True, False, False]]
    assert stats["mismatch_masked_fraction"] == pytest.approx(0.4)
    assert stats["mismatch_threshold"] == 0.25


def test_mismatch_token_quantile():
    # sorted d = [0, .1, .2, .3, 1]; q=0.99 -> position 3.96 -> 0.3 + 0.96 * 0.7 = 0.972
    keep, stats = mismatch_mask(torch.zeros_like(D), -D, torch.ones_like(D), "token", q=0.99)
    assert keep.tolist() == [[True, True, True, True, False]]
    assert stats["mismatch_threshold"] == pytest.approx(0.972)
    assert stats["mismatch_masked_fraction"] == pytest.approx(0.2)
    # masked tokens are neither in the quantile nor kept: valid d = [0, .1, .2, .3] -> tau = 0.297
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    keep, stats = mismatch_mask(D, torch.zeros_like(D), mask, "token", q=0.99)
    assert keep.tolist() == [[True, True, True, False, False]]
    assert stats["mismatch_threshold"] == pytest.approx(0.297)
    assert stats["mismatch_masked_fraction"] == pytest.approx(0.25)


def test_mismatch_sequence_level():
    d = torch.tensor([[0.0, 0.1], [0.0, 0.5], [2.0, 0.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # last sequence: empty response
    keep, stats = mismatch_mask(d, torch.zeros_like(d), mask, "sequence", bound=0.4)
    assert keep.tolist() == [[True, True], [False, False], [False, False], [False, False]]
    assert stats["mismatch_masked_fraction"] == pytest.approx(4 / 6)
    # quantile over the three non-empty sequences' max d = [.1, .5, 2]; q=0.5 -> 0.5
    keep, stats = mismatch_mask(d, torch.zeros_like(d), mask, "sequence", q=0.5)
    assert keep.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert stats["mismatch_threshold"] == pytest.approx(0.5)


def test_mismatch_off_and_no_tokens():
    keep, stats = mismatch_mask(D, torch.zeros_like(D), torch.ones_like(D), "off")
    assert keep.all() and stats["mismatch_masked_fraction"] == 0.0
    keep, stats = mismatch_mask(D, torch.zeros_like(D), torch.zeros_like(D), "token")
    assert not keep.any() and stats["mismatch_masked_fraction"] == 0.0
    # identical log-probs: nothing is dropped even at the quantile
    keep, stats = mismatch_mask(D, D, torch.ones_like(D), "token")
    assert keep.all() and stats["mismatch_threshold"] == 0.0


# ---- policy gradient --------------------------------------------------------------------------------------

def _loss(cfg_kwargs, logp_value, adv, behaviour, old=None, ref=None):
    cfg = RLObjectiveConfig(**{"kl_coef": 0.0, "mismatch_mask": "off", "loss_aggregation": "token_mean", **cfg_kwargs})
    logp = torch.tensor([[logp_value]], requires_grad=True)
    t = lambda v: None if v is None else torch.tensor([[v]])  # noqa: E731
    loss, metrics = PolicyGradientLoss(cfg)(logp, torch.ones(1, 1), torch.tensor([adv]), t(behaviour), t(old), t(ref))
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


def test_importance_sampling_ratio_against_behaviour():
    # rho = pi/mu = 2: loss -rho A, gradient -rho A
    loss, grad, m = _loss({}, -LN2, 1.0, -2 * LN2)
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0) and m["ratio_mean"] == pytest.approx(2.0)
    loss, grad, _ = _loss({}, -LN2, -0.5, -2 * LN2)
    assert loss == pytest.approx(1.0) and grad == pytest.approx(1.0)


def test_truncated_importance_sampling():
    # rho = 2 truncated at C = 1.5: value -1.5 A and gradient -1.5 A (the gradient is kept, not clipped away)
    loss, grad, m = _loss({"tis_cap": 1.5}, -LN2, 1.0, -2 * LN2)
    assert loss == pytest.approx(-1.5) and grad == pytest.approx(-1.5)
    assert m["tis_truncated_fraction"] == 1.0
    loss, grad, m = _loss({"tis_cap": 1.5}, -2 * LN2, 1.0, -LN2)  # rho = 0.5 is below the cap
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5) and m["tis_truncated_fraction"] == 0.0


def test_on_policy_default_is_plain_policy_gradient():
    loss, grad, m = _loss({}, -1.3, 0.7, None)
    assert loss == pytest.approx(-0.7) and grad == pytest.approx(-0.7) and m["ratio_mean"] == 1.0


@pytest.mark.parametrize("rho,adv,loss_value,grad,clipped", [
    (1.5, 1.0, -1.2, 0.0, 1.0),    # A > 0, ratio above 1 + eps: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5, 0.0),    # A < 0, ratio above: unclipped term is the max
    (0.5, -1.0, 0.8, 0.0, 1.0),    # A < 0, ratio below 1 - eps: clipped
    (0.5, 1.0, -0.5, -0.5, 0.0),   # A > 0, ratio below: unclipped
    (1.1, 1.0, -1.1, -1.1, 0.0),   # inside the trust region
])
def test_ppo_clip(rho, adv, loss_value, grad, clipped):
    loss, g, m = _loss({"pg_loss": "ppo_clip"}, math.log(rho), adv, 0.0)
    assert loss == pytest.approx(loss_value) and g == pytest.approx(grad, abs=1e-7)
    assert m["clip_fraction"] == clipped


def test_ppo_clip_high_and_old_policy_with_tis():
    # asymmetric clip-higher: upper bound 1.28
    loss, _, _ = _loss({"pg_loss": "ppo_clip", "ppo_clip_high": 0.28}, math.log(1.5), 1.0, 0.0)
    assert loss == pytest.approx(-1.28)
    # ratio against the old-policy pass (rho = 1.1); TIS weight pi_old/mu = 3 truncated at 2
    loss, grad, m = _loss({"pg_loss": "ppo_clip", "tis_cap": 2.0}, math.log(1.1), 1.0, -math.log(3.0), old=0.0)
    assert loss == pytest.approx(-2.2) and grad == pytest.approx(-2.2) and m["tis_truncated_fraction"] == 1.0
    # without an old-policy pass, pi_old is the behaviour policy and no TIS weight applies
    loss, _, _ = _loss({"pg_loss": "ppo_clip", "tis_cap": 2.0}, math.log(1.1), 1.0, 0.0)
    assert loss == pytest.approx(-1.1)


def test_mismatch_masking_inside_the_loss():
    cfg = RLObjectiveConfig(kl_coef=0.0, mismatch_bound=0.5, loss_aggregation="token_mean")
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.2, -300.0]])  # last token: extreme mismatch (rho would overflow)
    loss, m = PolicyGradientLoss(cfg)(logp, torch.ones(1, 3), torch.tensor([1.0]), behaviour)
    loss.backward()
    rho = math.exp(0.2)
    assert loss.item() == pytest.approx(-(1 + rho) / 2)
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, -rho / 2, 0.0])
    assert m["mismatch_masked_fraction"] == pytest.approx(1 / 3)


# ---- KL -----------------------------------------------------------------------------------------------------

def test_kl_estimators_hand_values():
    logp, ref = torch.log(torch.tensor([0.5, 0.25, 0.3])), torch.log(torch.tensor([0.25, 0.5, 0.3]))
    # r = [0.5, 2, 1]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([LN2, -LN2, 0.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([LN2 ** 2 / 2, LN2 ** 2 / 2, 0.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 - 1 + LN2, 2 - 1 - LN2, 0.0]))
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_estimate(logp, ref[:2], "k1")


def test_reward_to_go():
    v = torch.tensor([[1.0, 2.0, 4.0]])
    assert reward_to_go(v, torch.ones(1, 3)).tolist() == [[7.0, 6.0, 4.0]]
    assert reward_to_go(v, torch.tensor([[1.0, 0.0, 1.0]])).tolist() == [[5.0, 4.0, 4.0]]


def test_kl_in_reward_folds_reward_to_go_into_advantage():
    # k1 = logp - ref = [0.5, 1, -0.5]; token 1 is masked out -> reward-to-go [0, -0.5, -0.5]
    cfg = RLObjectiveConfig(kl_coef=0.1, mismatch_mask="off")
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -0.5]])
    out = PolicyGradientLoss(cfg).token_losses(logp, torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([1.0]), ref_logp=ref)
    torch.testing.assert_close(out.loss_BT.detach(), torch.tensor([[-1.0, -1.05, -1.05]]))
    assert out.metrics["kl"] == pytest.approx(0.0)  # (0.5 - 0.5) / 2 valid tokens


def test_kl_in_loss_values_and_gradients():
    logp = torch.tensor([[math.log(0.25)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.5)]])  # r = 2
    cfg = RLObjectiveConfig(kl_coef=0.5, kl_estimator="k3", kl_placement="in_loss", kl_loss_weighting="plain",
                            mismatch_mask="off", loss_aggregation="token_mean")
    loss, m = PolicyGradientLoss(cfg)(logp, torch.ones(1, 1), torch.tensor([0.0]), ref_logp=ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1 - LN2))
    assert logp.grad.item() == pytest.approx(0.5 * (1 - 2))  # d k3 / d logp = 1 - r
    # ratio weighting adds the score term k3 * d log pi: gradient 0.5 * (1 - r + k3)
    logp.grad = None
    cfg = RLObjectiveConfig(kl_coef=0.5, kl_estimator="k3", kl_placement="in_loss", mismatch_mask="off",
                            loss_aggregation="token_mean")
    loss, _ = PolicyGradientLoss(cfg)(logp, torch.ones(1, 1), torch.tensor([0.0]), ref_logp=ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1 - LN2))
    assert logp.grad.item() == pytest.approx(0.5 * (1 - 2 + 1 - LN2))


def test_kl_config_errors():
    with pytest.raises(ConfigError, match="zero expected gradient"):
        load_config(RLObjectiveConfig, None, ["kl_placement=in_loss", "kl_loss_weighting=plain"])
    with pytest.raises(ConfigError, match="kl_estimator"):
        load_config(RLObjectiveConfig, None, ["kl_estimator=k5"])
    with pytest.raises(ValueError, match="ref_logp"):
        PolicyGradientLoss(RLObjectiveConfig())(torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1))


def test_shape_errors():
    loss = PolicyGradientLoss(RLObjectiveConfig(kl_coef=0.0))
    with pytest.raises(ValueError, match="behaviour_logp"):
        loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="advantages"):
        loss(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))


def test_token_logprobs_alignment():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = math.log(3.0)  # position 0 predicts token 1: p(2) = 3 / 6
    ids = torch.tensor([[1, 2, 0]])
    logp = token_logprobs(logits, ids)
    torch.testing.assert_close(logp, torch.tensor([[0.0, math.log(0.5), math.log(0.25)]]))


# ---- router replay ------------------------------------------------------------------------------------------

def test_replay_routing_modes():
    inf, old = torch.zeros(1, 1, 2, 2, dtype=torch.long), torch.ones(1, 1, 2, 2, dtype=torch.long)
    assert replay_routing("off", inf, old) is None
    assert replay_routing("r3", inf, old) is inf
    assert replay_routing("r2", inf, old) is old
    with pytest.raises(ValueError, match="inference engine"):
        replay_routing("r3", None, old)
    with pytest.raises(ValueError, match="old-policy"):
        replay_routing("r2", inf, None)


def test_routing_mismatch_fractions():
    # 2 layers, 1 sequence, 3 tokens, top-2. Token 0: same sets in another order; token 1 differs in layer 1;
    # token 2 differs in both layers.
    a = torch.tensor([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [2, 3], [4, 5]]]])
    b = torch.tensor([[[[1, 0], [2, 3], [4, 6]]], [[[0, 1], [2, 7], [5, 6]]]])
    m = routing_mismatch(a, b)
    assert m["routing_mismatch_token_fraction"] == pytest.approx(2 / 3)
    assert m["routing_mismatch_layer_fraction"] == pytest.approx(3 / 6)
    m = routing_mismatch(a, b, torch.tensor([[1, 1, 0]]))
    assert m["routing_mismatch_token_fraction"] == pytest.approx(1 / 2)
    assert m["routing_mismatch_layer_fraction"] == pytest.approx(1 / 4)
    assert routing_mismatch(a, b, torch.zeros(1, 3))["routing_mismatch_token_fraction"] == 0.0
    with pytest.raises(ValueError, match="layers, B, S, top_k"):
        routing_mismatch(a, b[:1])
