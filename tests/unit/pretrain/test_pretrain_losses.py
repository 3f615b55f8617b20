"""LM + MTP self-distillation losses and their normalisation."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pretrain.losses import MTPLossConfig, mtp_self_distillation_sums, mtp_valid_mask, pretrain_loss, token_counts


def _batch(B=2, S=12, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S + 1), generator=g)
    pos = torch.arange(S).repeat(B, 1)
    pos[0, 5:] = torch.arange(S - 5)  # a second document starts at t=5 in row 0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(B, S), "position_ids": pos}


def test_valid_mask_excludes_pairs_across_documents():
    b = _batch()
    m = mtp_valid_mask(b["loss_mask"], b["position_ids"], 1)
    assert m.shape == (2, 12)
    assert not m[0, 4] and not m[:, 11].any()  # t=4 is the last token of doc 1; its depth-1 target (t+1=5) is in doc 2
    assert m[0, 3] and m[0, 5] and m[1, :11].all()


def test_kl_is_zero_and_agreement_one_when_mtp_matches_shifted_main():
    b = _batch()
    main = torch.randn(2, 12, 11)
    mtp = torch.zeros_like(main)
    mtp[:, :-1] = main[:, 1:]  # depth 1 at t = main at t+1
    (d,) = mtp_self_distillation_sums(main, [mtp], b["labels"], b["loss_mask"], b["position_ids"], MTPLossConfig())
    n = mtp_valid_mask(b["loss_mask"], b["position_ids"], 1).sum()
    assert abs(float(d["kl"])) < 1e-5 and float(d["agree"]) == float(n)


def test_main_head_is_detached_and_kl_directions():
    b = _batch()
    main = torch.randn(2, 12, 11, requires_grad=True)
    mtp = torch.randn(2, 12, 11, requires_grad=True)
    for divergence in ("forward_kl", "reverse_kl"):
        (d,) = mtp_self_distillation_sums(main, [mtp], b["labels"], b["loss_mask"], b["position_ids"],
                                          MTPLossConfig(divergence=divergence))
        gm, gq = torch.autograd.grad(d["loss"], [main, mtp], allow_unused=True)
        assert gm is None and gq.abs().sum() > 0
    # forward KL(main || mtp) by hand at one valid position
    p, q = F.softmax(main[1, 3].detach(), -1), F.softmax(mtp[1, 2].detach(), -1)
    kl = (p * (p.log() - q.log())).sum()
    single = {k: v.clone() for k, v in b.items()}
    single["loss_mask"] = torch.zeros(2, 12)
    single["loss_mask"][1, 3] = 1
    (d,) = mtp_self_distillation_sums(main, [mtp], b["labels"], single["loss_mask"], b["position_ids"], MTPLossConfig())
    assert torch.allclose(d["kl"], kl, atol=1e-5)


def test_loss_does_not_depend_on_micro_batch_split():
    b = _batch(B=4, seed=1)
    b["loss_mask"][2, :7] = 0
    V = 11
    logits = torch.randn(4, 12, V)
    mtp = [torch.randn(4, 12, V)]
    cfg = MTPLossConfig(weight=0.3, ce_weight=0.5)
    whole = pretrain_loss(SimpleNamespace(logits=logits, mtp_logits=mtp, aux_loss=None), b, cfg, token_counts(b, 1))[0]
    counts = token_counts(b, 1)
    parts = 0
    for sl in (slice(0, 1), slice(1, 4)):
        sub = {k: v[sl] for k, v in b.items()}
        out = SimpleNamespace(logits=logits[sl], mtp_logits=[mtp[0][sl]], aux_loss=None)
        parts = parts + pretrain_loss(out, sub, cfg, counts)[0]
    assert torch.allclose(whole, parts, atol=1e-6)
    lm = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
    mask = b["loss_mask"].flatten()
    _, stats = pretrain_loss(SimpleNamespace(logits=logits, mtp_logits=[], aux_loss=None), b, cfg, counts)
    assert torch.allclose(stats["lm_loss"], (lm * mask).sum() / mask.sum())
