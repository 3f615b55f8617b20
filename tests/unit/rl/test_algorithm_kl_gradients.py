"""Which gradient each KL estimator/placement gives, on small categorical policies.

The expected gradient E_{y~pi}[grad l(y)] is computed two ways: exactly, by enumerating every action with
weight sg(pi(y)), and by Monte Carlo over sampled actions through the loss module (within 5 standard
errors). Targets: the reverse KL(pi||ref) gradient, the forward KL(ref||pi) gradient, or zero.
"""

import pytest
import torch

from megatron_composer.config import ConfigError
from rl.algorithm import PolicyGradientLoss, RLObjectiveConfig, kl_estimate

K = 5
GEN = torch.Generator().manual_seed(1234)
THETA0 = torch.randn(K, generator=GEN)
REF_LOGP = torch.log_softmax(torch.randn(K, generator=GEN), -1)


def reverse_kl_grad(theta0=THETA0):
    theta = theta0.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    (logp.exp() * (logp - REF_LOGP)).sum().backward()
    return theta.grad


def forward_kl_grad(theta0=THETA0):
    theta = theta0.clone().requires_grad_()
    (REF_LOGP.exp() * (REF_LOGP - torch.log_softmax(theta, -1))).sum().backward()
    return theta.grad


def token_loss_fn(kind, placement, weighting):
    """Per-sample loss l(actions) [N] as the loss module computes it (A = 0, beta = 1, on-policy)."""
    if placement == "in_loss" and weighting == "plain" and kind == "k1":
        # The config refuses this combination; the module would compute exactly this term.
        return lambda logp, ref: kl_estimate(logp, ref, "k1")
    cfg = RLObjectiveConfig(kl_coef=1.0, kl_estimator=kind, kl_placement=placement, kl_loss_weighting=weighting,
                            mismatch_mask="off", loss_aggregation="token_mean")
    module = PolicyGradientLoss(cfg)

    def fn(logp_N, ref_N):
        out = module.token_losses(logp_N[:, None], torch.ones(len(logp_N), 1), torch.zeros(len(logp_N)),
                                  ref_logp=ref_N[:, None])
        return out.loss_BT[:, 0]
    return fn


def expected_gradient(loss_fn):
    theta = THETA0.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    actions = torch.arange(K)
    (logp.exp().detach() * loss_fn(logp[actions], REF_LOGP[actions])).sum().backward()
    return theta.grad


def per_action_gradients(loss_fn):
    rows = []
    for a in range(K):
        theta = THETA0.clone().requires_grad_()
        logp = torch.log_softmax(theta, -1)
        loss_fn(logp[a:a + 1], REF_LOGP[a:a + 1]).sum().backward()
        rows.append(theta.grad)
    return torch.stack(rows)  # [action, K]


def monte_carlo_check(loss_fn, target, n=200_000):
    gen = torch.Generator().manual_seed(99)
    theta = THETA0.clone().requires_grad_()
    logp = torch.log_softmax(theta, -1)
    actions = torch.multinomial(logp.exp().detach(), n, replacement=True, generator=gen)
    loss_fn(logp[actions], REF_LOGP[actions]).mean().backward()
    g_AK = per_action_gradients(loss_fn)
    per_sample = g_AK[actions]
    stderr = per_sample.std(0) / n ** 0.5
    assert (theta.grad - target).abs().le(5 * stderr + 1e-6).all(), (theta.grad, target, stderr)


REVERSE = [("k1", "in_reward", "ratio"), ("k3", "in_loss", "ratio"), ("k1", "in_loss", "ratio"),
           ("k2", "in_loss", "plain")]


@pytest.mark.parametrize("kind,placement,weighting", REVERSE)
def test_placements_that_give_the_reverse_kl_gradient(kind, placement, weighting):
    fn = token_loss_fn(kind, placement, weighting)
    target = reverse_kl_grad()
    torch.testing.assert_close(expected_gradient(fn), target, atol=1e-6, rtol=1e-5)
    monte_carlo_check(fn, target)


def test_k3_plain_in_loss_gives_the_forward_kl_gradient():
    fn = token_loss_fn("k3", "in_loss", "plain")
    target = forward_kl_grad()
    torch.testing.assert_close(expected_gradient(fn), target, atol=1e-6, rtol=1e-5)
    monte_carlo_check(fn, target)
    assert (target - reverse_kl_grad()).abs().max() > 0.05  # the policies are far enough apart to tell


def test_k1_plain_in_loss_has_zero_expected_gradient():
    fn = token_loss_fn("k1", "in_loss", "plain")
    torch.testing.assert_close(expected_gradient(fn), torch.zeros(K), atol=1e-6, rtol=0)
    monte_carlo_check(fn, torch.zeros(K))
    with pytest.raises(ConfigError, match="zero expected gradient"):
        RLObjectiveConfig(kl_coef=1.0, kl_placement="in_loss", kl_loss_weighting="plain").validate()


def test_k1_in_reward_reward_to_go_gives_the_sequence_kl_gradient():
    """Two-token sequences: pi(y1) pi(y2|y1). The reward-to-go penalty gives grad KL of the sequence law."""
    V = 3
    gen = torch.Generator().manual_seed(5)
    th1_0, th2_0 = torch.randn(V, generator=gen), torch.randn(V, V, generator=gen)
    ref1 = torch.log_softmax(torch.randn(V, generator=gen), -1)
    ref2 = torch.log_softmax(torch.randn(V, V, generator=gen), -1)
    y1, y2 = torch.arange(V).repeat_interleave(V), torch.arange(V).repeat(V)  # all V*V sequences

    def exact():
        th1, th2 = th1_0.clone().requires_grad_(), th2_0.clone().requires_grad_()
        l1, l2 = torch.log_softmax(th1, -1), torch.log_softmax(th2, -1)
        kl = (l1.exp() * (l1 - ref1)).sum() + (l1.exp() * (l2.exp() * (l2 - ref2)).sum(-1)).sum()
        kl.backward()
        return torch.cat([th1.grad, th2.grad.flatten()])

    def expected(per_token_only):
        th1, th2 = th1_0.clone().requires_grad_(), th2_0.clone().requires_grad_()
        l1, l2 = torch.log_softmax(th1, -1), torch.log_softmax(th2, -1)
        logp_BT = torch.stack([l1[y1], l2[y1, y2]], -1)
        ref_BT = torch.stack([ref1[y1], ref2[y1, y2]], -1)
        weight_B = logp_BT.sum(-1).exp().detach()
        if per_token_only:  # the penalty of each token alone, without the later tokens' KL
            loss_BT = (logp_BT - ref_BT).detach() * logp_BT
        else:
            cfg = RLObjectiveConfig(kl_coef=1.0, mismatch_mask="off")
            loss_BT = PolicyGradientLoss(cfg).token_losses(logp_BT, torch.ones_like(logp_BT), torch.zeros(V * V),
                                                           ref_logp=ref_BT).loss_BT
        (weight_B[:, None] * loss_BT).sum().backward()
        return torch.cat([th1.grad, th2.grad.flatten()])

    target = exact()
    torch.testing.assert_close(expected(per_token_only=False), target, atol=1e-6, rtol=1e-5)
    assert (expected(per_token_only=True) - target).abs().max() > 1e-2
