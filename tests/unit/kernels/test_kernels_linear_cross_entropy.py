"""The fused output head + weighted cross-entropy sum against its unfused reference, and the trainer's use of it."""

import pytest
import torch

from megatron_composer.kernels import linear_cross_entropy as lce
from megatron_composer.kernels.cpu import cpp
from megatron_composer.kernels.linear_cross_entropy import linear_cross_entropy_sum, reference_linear_cross_entropy_sum
from megatron_composer.model import Transformer, get_preset
from pretrain.losses import MTPLossConfig, fused_head_applies, pretrain_loss, token_counts


def _inputs(N=37, D=24, V=53, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    tw = torch.rand(N, generator=g) + 0.5
    tw[::5] = 0
    target[::5] = -100  # ignored tokens carry an out-of-range id; weight 0 keeps it from being read
    return h, w, target, tw


def _loss_and_grads(fn, h, w, target, tw, scale=1.0):
    h.grad = w.grad = None
    loss = fn(h, w, target, tw)
    (loss * scale).backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("rows_path", ["cpp", "torch"])  # the C++ row pass and its torch reference
# block_elements: several blocks with a ragged last one; one block
@pytest.mark.parametrize("block_elements", [53 * 16, 53 * 20, 1 << 21])
def test_matches_reference_float32(monkeypatch, block_elements, rows_path):
    monkeypatch.setitem(lce._BLOCK_ELEMENTS, "cpu", block_elements)
    if rows_path == "torch":
        monkeypatch.setattr(lce, "_rows_kernel", lambda device: None)
    elif cpp.load("cross_entropy") is None:
        pytest.skip(f"C++ kernel unavailable: {cpp.failure('cross_entropy')}")
    h, w, target, tw = _inputs()
    ref = _loss_and_grads(reference_linear_cross_entropy_sum, h, w, target, tw, scale=2.5)
    got = _loss_and_grads(linear_cross_entropy_sum, h, w, target, tw, scale=2.5)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    assert got[1][::5].abs().max() == 0  # weight-0 tokens get no gradient


def _cpp_rows():
    module = cpp.load("cross_entropy")
    if module is None:
        pytest.skip(f"C++ kernel unavailable: {cpp.failure('cross_entropy')}")
    return module


@pytest.mark.parametrize("V", [1, 16, 8192 + 7])  # one column, whole vectors, a ragged tail
def test_cpp_row_pass_matches_torch(V):
    rows = _cpp_rows()
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g) * 30  # large logits: the max subtraction matters
    target = torch.randint(0, V, (9,), generator=g)
    weight = torch.rand(9, generator=g)
    weight[3] = 0
    logp_ref = torch.log_softmax(x, -1)
    grad_ref = (logp_ref.exp() - torch.nn.functional.one_hot(target, V)) * weight[:, None]
    y = x.clone()
    logp = rows.log_softmax_grad_rows(y, target, weight, True)
    torch.testing.assert_close(logp, logp_ref.gather(1, target[:, None])[:, 0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(y, grad_ref, rtol=1e-5, atol=1e-7)
    assert rows.log_softmax_grad_rows(x.clone(), target, weight, False).equal(logp)  # loss only: same log-probs


def test_cpp_row_pass_propagates_nan_and_checks_targets():
    rows = _cpp_rows()
    x = torch.zeros(2, 40)
    x[1, 7] = float("nan")
    logp = rows.log_softmax_grad_rows(x, torch.tensor([0, 0]), torch.ones(2), True)
    assert logp[0] == pytest.approx(-torch.log(torch.tensor(40.0)).item()) and logp[1].isnan()
    with pytest.raises(RuntimeError, match="target 40 outside the vocabulary"):
        rows.log_softmax_grad_rows(torch.zeros(1, 40), torch.tensor([40]), torch.ones(1), True)


def test_matches_reference_bfloat16(monkeypatch):
    monkeypatch.setitem(lce._BLOCK_ELEMENTS, "cpu", 53 * 16)
    h, w, target, tw = _inputs(dtype=torch.bfloat16)
    ref = _loss_and_grads(reference_linear_cross_entropy_sum, h, w, target, tw)
    got = _loss_and_grads(linear_cross_entropy_sum, h, w, target, tw)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=2e-2, atol=2e-2)


def test_autocast_runs_the_head_in_the_autocast_dtype():
    h, w, target, tw = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(reference_linear_cross_entropy_sum, h, w, target, tw)
        got = _loss_and_grads(linear_cross_entropy_sum, h, w, target, tw)
    assert got[1].dtype == got[2].dtype == torch.float32  # gradients in the parameters' dtype
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], ref[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2], ref[2], rtol=2e-2, atol=2e-2)
    # and it differs from the float32 result: the head really ran in bfloat16
    assert not torch.equal(got[0], reference_linear_cross_entropy_sum(h, w, target, tw).detach())


def test_frozen_head_and_no_grad():
    h, w, target, tw = _inputs()
    w_frozen = w.detach()
    loss = linear_cross_entropy_sum(h, w_frozen, target, tw)
    loss.backward()
    ref_h = h.detach().clone().requires_grad_()
    reference_linear_cross_entropy_sum(ref_h, w_frozen, target, tw).backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        value = linear_cross_entropy_sum(h, w, target, tw)
    assert not value.requires_grad
    torch.testing.assert_close(value, reference_linear_cross_entropy_sum(h, w, target, tw).detach(),
                               rtol=1e-6, atol=1e-5)


def test_bad_shapes_are_named():
    h, w, target, tw = _inputs()
    with pytest.raises(ValueError, match=r"h \[N, D\], weight \[V, D\]"):
        linear_cross_entropy_sum(h, w[:, :-1], target, tw)
    with pytest.raises(ValueError, match="token_weight"):
        linear_cross_entropy_sum(h, w, target, tw[:-1])


def _tiny_batch(model, B=2, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (B, S), generator=g)
    position_ids = torch.cat([torch.arange(10), torch.arange(S - 10)]).expand(B, S)  # two packed documents
    mask = torch.ones(B, S)
    mask[:, -1] = 0
    mask[1, :3] = 0
    return {"tokens": tokens, "position_ids": position_ids, "labels": torch.roll(tokens, -1, 1), "loss_mask": mask}


def test_trainer_loss_with_fused_head_equals_the_logits_path():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-deepseek-v3")).train()
    batch = _tiny_batch(model)
    cfg = MTPLossConfig(weight=0.0)
    counts = token_counts(batch, 0)
    assert fused_head_applies(model, cfg)
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(batch["tokens"], batch["position_ids"], logits=not fused, return_hidden=True)
        assert (out.logits is None) == fused
        loss, stats = pretrain_loss(out, batch, cfg, counts, head_weight=model.output.weight if fused else None)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), stats["lm_loss"], grads))
    (l0, s0, g0), (l1, s1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s1, s0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys() and "output.weight" in g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_head_only_where_it_is_exact():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-deepseek-v3"))
    assert model.config.num_mtp_layers > 0
    assert not fused_head_applies(model, MTPLossConfig(weight=0.2))  # MTP's teacher is the main logits
    assert fused_head_applies(model, MTPLossConfig(weight=0.0))
    assert not fused_head_applies(model, MTPLossConfig(weight=0.0), vocab_group=object())  # vocab-parallel head
    batch = _tiny_batch(model)
    out = model(batch["tokens"], batch["position_ids"], logits=False)
    torch.testing.assert_close(model.output(out.hidden_states), model(batch["tokens"], batch["position_ids"]))
    with pytest.raises(ValueError, match="head_weight"):
        pretrain_loss(out, batch, MTPLossConfig(weight=0.0), token_counts(batch, 0))
