"""Model definition: presets, router replay, packed documents, MTP, grouped experts, bad configs."""

import pytest
import torch

from megatron_composer.kernels.grouped_mm import reference_mm_rows
from megatron_composer.model import ModelConfigError, Transformer, count_parameters, get_preset
from megatron_composer.model.moe import Router, grouped_mm, local_dispatch


def _model(name="tiny-deepseek-v3", seed=0, **changes):
    torch.manual_seed(seed)
    return Transformer(get_preset(name).replace(vocab_size=128, **changes))


# ---- presets and parameter counts ---------------------------------------------------------------------
@pytest.mark.parametrize("name,total,active,tol_total,tol_active", [
    # Published figures: DeepSeek-V3 671B/37B; Qwen3-30B-A3B 30.5B/3.3B; Kimi K2(.5) "1.04T"/"32B".
    # Our counts are exact (embedding and head included in active, MTP excluded): 671.03B/37.55B,
    # 30.53B/3.35B, 1026.4B/32.86B. Vendors round (Qwen rounds 3.35B down to 3.3B; Moonshot quotes 1.04T,
    # our count of the released shape is 1.026T), so the tolerances state how far each published figure is.
    ("deepseek-v3", 671e9, 37e9, 0.01, 0.02),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.01, 0.02),
    ("kimi-k2.5", 1.04e12, 32e9, 0.015, 0.03),
])
def test_real_presets_parameter_counts_on_meta_device(name, total, active, tol_total, tol_active):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    built = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    counts = count_parameters(cfg)
    assert built == counts["total"]  # the analytic count is the built model's
    assert abs(counts["total"] / total - 1) <= tol_total
    assert abs(counts["active"] / active - 1) <= tol_active


def test_kimi_preset_shape():
    cfg = get_preset("kimi-k2.5")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_experts,
            cfg.num_experts_per_tok) == (61, 7168, 64, 384, 8)
    assert cfg.moe_layer_ids[0] == 1 and len(cfg.moe_layer_ids) == 60
    assert cfg.rope_scaling.factor * cfg.rope_scaling.original_max_position_embeddings == 262144


def test_bad_configs_name_the_field():
    with pytest.raises(ModelConfigError, match="unknown model preset 'tiny-llama'"):
        get_preset("tiny-llama")
    with pytest.raises(ModelConfigError, match="num_kv_heads"):
        Transformer(get_preset("tiny-qwen3-moe").replace(num_kv_heads=3))
    with pytest.raises(ModelConfigError, match="n_group"):
        Transformer(get_preset("tiny-deepseek-v3").replace(n_group=3))
    with pytest.raises(ModelConfigError, match="topk_group"):
        Transformer(get_preset("tiny-deepseek-v3").replace(num_experts_per_tok=4, topk_group=1, n_group=4))
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        Transformer(get_preset("tiny-deepseek-v3").replace(qk_rope_head_dim=7))


# ---- router -------------------------------------------------------------------------------------------
def test_group_limited_routing_and_bias_selects_but_does_not_weight():
    cfg = get_preset("tiny-deepseek-v3").replace(num_experts=8, n_group=4, topk_group=1, num_experts_per_tok=2,
                                                 routed_scaling_factor=1.0)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(64, cfg.hidden_size)
    out = router(x)
    groups = out.indices_TK // 2
    assert torch.all(groups[:, 0] == groups[:, 1])  # both experts from the single kept group
    # a large bias on expert 5 makes every token pick it, but its weight stays its own score, normalised
    router.e_score_correction_bias[5] = 100.0
    out = router(x)
    assert torch.all((out.indices_TK == 5).any(-1))
    scores = torch.sigmoid(x @ router.weight.t())
    picked = scores.gather(1, out.indices_TK)
    torch.testing.assert_close(out.weights_TK, picked / picked.sum(-1, keepdim=True))


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_router_replay(name):
    model = _model(name)
    ids = torch.randint(0, 128, (2, 24))
    rec = model(ids, return_routing=True)
    assert rec.routed_experts.shape == (len(model.moe_layers), 2, 24, model.config.num_experts_per_tok)
    replay = model(ids, routed_experts=rec.routed_experts, return_routing=True)
    assert torch.equal(replay.logits, rec.logits)
    assert torch.equal(replay.routed_experts, rec.routed_experts)
    other = (rec.routed_experts + 1) % model.config.num_experts
    changed = model(ids, routed_experts=other)
    assert (changed - rec.logits).abs().max() > 1e-3
    # gradients reach every router in replay
    changed.float().pow(2).mean().backward()
    for layer in model.moe_layers:
        g = layer.feed_forward.router.weight.grad
        assert g is not None and g.abs().sum() > 0


def test_replay_with_wrong_layer_count_is_rejected():
    model = _model()
    with pytest.raises(ValueError, match="MoE layers"):
        model(torch.zeros(1, 4, dtype=torch.long), routed_experts=torch.zeros(1, 1, 4, 2, dtype=torch.long))


# ---- packed documents ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-qwen3-moe", "tiny-kimi-k2.5"])
def test_packed_documents_equal_separate_runs(name):
    model = _model(name).eval()
    lengths = [7, 13, 4, 8]
    docs = [torch.randint(0, 128, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = model(packed, pos, mtp=True)
        start = 0
        for d in docs:
            alone = model(d[None], mtp=True)
            sl = slice(start, start + len(d))
            torch.testing.assert_close(out.logits[0, sl], alone.logits[0], atol=1e-5, rtol=1e-5)
            start += len(d)


# ---- MTP ----------------------------------------------------------------------------------------------
def test_mtp_logits_depend_only_on_the_prefix_and_the_next_k_tokens():
    model = _model(num_mtp_layers=2).eval()
    ids = torch.randint(0, 128, (1, 20))
    with torch.no_grad():
        out = model(ids, mtp=True)
        assert len(out.mtp_logits) == 2
        changed = ids.clone()
        changed[0, 12] = (changed[0, 12] + 1) % 128
        out2 = model(changed, mtp=True)
    # depth k at position t sees tokens <= t + k
    for k, (a, b) in enumerate(zip(out.mtp_logits, out2.mtp_logits), start=1):
        # (not bit-equal: a changed later token regroups the expert matmuls)
        torch.testing.assert_close(a[0, : 12 - k], b[0, : 12 - k], atol=1e-5, rtol=1e-5)
        assert (a[0, 12 - k] - b[0, 12 - k]).abs().max() > 1e-3


# ---- grouped experts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_per_expert_matmuls(dtype):
    torch.manual_seed(0)
    E, D, F = 5, 16, 12
    counts = torch.tensor([3, 0, 7, 1, 0])  # empty experts included
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), D, dtype=dtype, requires_grad=True)
    w = torch.randn(E, F, D, dtype=dtype, requires_grad=True)
    y = grouped_mm(x, w, offs)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([xs @ ref_w[e].t() for e, xs in enumerate(torch.split(ref_x, counts.tolist()))])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y, ref, **tol)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)
    torch.testing.assert_close(w.grad, ref_w.grad, **tol)
    assert torch.all(w.grad[1] == 0) and torch.all(w.grad[4] == 0)
    torch.testing.assert_close(reference_mm_rows(x.detach(), w.detach().transpose(-2, -1), offs), y.detach(), **tol)


def test_local_dispatch_equals_dense_reference():
    model = _model()
    moe = model.moe_layers[0].feed_forward
    x = torch.randn(30, model.config.hidden_size)
    r = moe.router(x)
    got = local_dispatch(moe.experts, x, r.indices_TK, r.weights_TK)
    want = torch.zeros_like(x)
    ex = moe.experts
    for t in range(x.shape[0]):
        for k in range(r.indices_TK.shape[1]):
            e = r.indices_TK[t, k]
            h = torch.nn.functional.silu(x[t] @ ex.w1[e].t()) * (x[t] @ ex.w3[e].t())
            want[t] += r.weights_TK[t, k] * (h @ ex.w2[e].t())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_balance_loss_is_reported_and_differentiable():
    model = _model(aux_loss_coef=0.01).train()
    out = model(torch.randint(0, 128, (2, 16)), return_routing=True)
    assert out.aux_loss.item() > 0
    out.aux_loss.backward()
    assert model.moe_layers[0].feed_forward.router.weight.grad.abs().sum() > 0


def test_bf16_forward_backward():
    model = _model().to(torch.bfloat16)
    logits = model(torch.randint(0, 128, (2, 16)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    logits.float().mean().backward()


def test_tied_embeddings_stay_one_tensor_when_the_model_is_materialised_or_cast():
    """to_empty (how every trainer, loader and engine materialises a meta-built model) and .to() keep the output head
    and the embedding one parameter, so one gradient and one optimizer state train both."""
    from megatron_composer.parallel.layers import to_empty

    cfg = get_preset("tiny-qwen3-moe").replace(num_layers=1, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg)
    to_empty(model, "cpu")
    assert model.output.weight is model.tok_embeddings.weight
    model.reset_parameters(seed=0)
    model = model.to(torch.bfloat16).to(torch.float32)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())  # one parameter: one optimizer state
    model(torch.tensor([[5, 6, 7]])).sum().backward()
    assert model.output.weight.grad is model.tok_embeddings.weight.grad
    untied = Transformer(cfg.replace(tie_word_embeddings=False)).to(torch.bfloat16)
    assert untied.output.weight is not untied.tok_embeddings.weight
