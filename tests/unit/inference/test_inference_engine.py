"""Inference engine: cache vs recomputation, transformers parity, batch invariance, router replay, speculative
decoding (greedy identity and a chi-square test of the sampled distribution), live weight updates."""


import pytest
import torch

from megatron_composer.inference import (
    CacheError,
    Engine,
    EngineError,
    SamplingError,
    SamplingParams,
    batch_invariant,
)
from megatron_composer.inference.sampling import sampling_probs
from megatron_composer.model import Transformer, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(preset, seed=0, **changes):
    torch.manual_seed(seed)
    return Transformer(get_preset(preset).replace(**changes)).eval()


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy_recompute(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_greedy_with_cache_equals_full_recomputation(preset):
    model = _model(preset)
    prompts = _prompts(model.config.vocab_size, [5, 19, 11])
    engine = Engine(model, max_batch_size=4, cache_memory_bytes=16 << 20, block_size=8)
    results = engine.generate(prompts, max_new_tokens=66)
    for prompt, r in zip(prompts, results):
        assert len(r.token_ids) == 66 and r.finish_reason == "length"
        assert r.token_ids == _greedy_recompute(model, prompt, 66)
        assert r.weight_versions == [0] * 66
        assert r.routed_experts.shape == (66, len(model.moe_layers), model.config.num_experts_per_tok)
    assert engine.cache.free_blocks == engine.cache.usable_blocks  # every block returned


def test_continuous_batching_small_cache_equals_alone():
    """More requests than batch slots and cache blocks: they queue, join and leave between steps."""
    model = _model("tiny-qwen3-moe")
    prompts = _prompts(model.config.vocab_size, [3, 14, 7, 22, 9], seed=1)
    lengths = [20, 5, 12, 8, 16]
    bytes_per_block = Engine(model, cache_memory_bytes=1 << 20).cache.bytes_per_token * 4
    engine = Engine(model, max_batch_size=3, cache_memory_bytes=bytes_per_block * 16, block_size=4)
    assert engine.cache.usable_blocks == 16
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    batch_sizes, results = [], {}
    while engine.has_unfinished():
        for r in engine.step():
            results[r.request_id] = r
        batch_sizes.append(len(engine._running))
    assert max(batch_sizes) <= 3 and len(results) == 5
    for rid, prompt, n in zip(ids, prompts, lengths):
        alone = Engine(model).generate([prompt], max_new_tokens=n)[0]
        assert results[rid].token_ids == alone.token_ids


def test_bad_requests_fail_clearly():
    model = _model("tiny-qwen3-moe", num_layers=1)
    engine = Engine(model, max_seq_len=64, cache_memory_bytes=1 << 20)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request([5, 99999], SamplingParams())
    with pytest.raises(EngineError, match="max_seq_len"):
        engine.add_request([1] * 60, SamplingParams(max_new_tokens=10))
    with pytest.raises(SamplingError, match="top_p"):
        engine.add_request([1], SamplingParams(top_p=0.0))
    with pytest.raises(EngineError, match="MTP"):
        engine.add_request([1], SamplingParams(speculative=True))
    with pytest.raises(EngineError, match="detokenize"):
        engine.add_request([1], SamplingParams(stop_strings=["x"]))
    small = Engine(model, cache_memory_bytes=engine.cache.bytes_per_token * 16, block_size=16)
    with pytest.raises(CacheError, match="cache_memory_bytes"):
        small.add_request([1] * 10, SamplingParams(max_new_tokens=10))


def test_stop_token_ids_and_stop_strings():
    model = _model("tiny-qwen3-moe", num_layers=2)
    prompt = _prompts(model.config.vocab_size, [6])[0]
    free = Engine(model).generate([prompt], max_new_tokens=12)[0].token_ids
    stop_id = free[4]
    r = Engine(model).generate([prompt], max_new_tokens=12, stop_token_ids=[stop_id])[0]
    assert r.token_ids == free[:free.index(stop_id) + 1] and r.finish_reason == "stop"

    def detok(ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)

    text = detok(free)
    stop = text[6:8]
    r = Engine(model, detokenize=detok).generate([prompt], max_new_tokens=12, stop_strings=[stop])[0]
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)]
    assert detok(r.token_ids).endswith(stop) and len(r.token_ids) == text.index(stop) + 2


def _hf_deepseek(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=12, routed_scaling_factor=2.5,
        max_position_embeddings=256, initializer_range=0.1)
    return DeepseekV3ForCausalLM(cfg).eval()


def _hf_qwen(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                         initializer_range=0.1)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("build", [_hf_deepseek, _hf_qwen], ids=["deepseek-v3", "qwen3-moe"])
def test_greedy_equals_transformers_generate(tmp_path, build):
    pytest.importorskip("transformers")
    from megatron_composer.checkpoint.hf import load_hf_checkpoint

    ref = build(tmp_path)
    ref.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like the engine
    ref.save_pretrained(tmp_path / "hf")
    ours = load_hf_checkpoint(tmp_path / "hf", dtype=torch.float32, progress=False).eval()
    prompts = _prompts(97, [4, 13], seed=3)
    results = Engine(ours, max_batch_size=4).generate(prompts, max_new_tokens=64)
    for prompt, r in zip(prompts, results):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert r.token_ids == out[0, len(prompt):].tolist()


def test_batch_invariant_training_attention_is_the_decode_row_product_with_mla_head_dims():
    # MLA: v_head_dim < qk_head_dim. Under the mode the training core must attend with the real v (not the
    # zero-padded one flash kernels get): a padded Dv changes the GEMM and the last bits of decode rows.
    from megatron_composer.inference.batch_invariant import attend_row
    from megatron_composer.kernels.causal_attention import sdpa_attention
    torch.manual_seed(0)
    H, S, Dqk, Dv = 4, 21, 48, 32
    q, k, v = torch.randn(1, H, S, Dqk), torch.randn(1, H, S, Dqk), torch.randn(1, H, S, Dv)
    with torch.no_grad(), batch_invariant():
        out = sdpa_attention(q, k, v, 0.125, None)
    assert out.shape == (1, H, S, Dv)
    for t in range(S):
        row = attend_row(q[0, :, t:t + 1], k[0, :, :t + 1], v[0, :, :t + 1], 0.125)
        assert torch.equal(out[0, :, t:t + 1], row), t


def test_batch_invariant_mixed_batch_equals_each_alone_bit_exactly():
    model = _model("tiny-deepseek-v3")
    prompts = _prompts(model.config.vocab_size, [4, 23, 9])
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.9)
    engine = Engine(model, max_batch_size=4, batch_invariant=True)
    batched = engine.generate(prompts, seed=[11, 12, 13], **kw)
    for i, prompt in enumerate(prompts):
        alone = Engine(model, batch_invariant=True).generate([prompt], seed=11 + i, **kw)[0]
        b = batched[i]
        assert alone.token_ids == b.token_ids
        assert alone.logprobs == b.logprobs and alone.sampling_logprobs == b.sampling_logprobs
        assert torch.equal(alone.routed_experts, b.routed_experts)
        assert torch.equal(alone.prompt_routed_experts, b.prompt_routed_experts)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_routing_replay_in_training_forward_reproduces_engine_logprobs(preset):
    model = _model(preset)
    prompts = _prompts(model.config.vocab_size, [7, 12])
    results = Engine(model, batch_invariant=True).generate(prompts, max_new_tokens=20, temperature=1.0, seed=5)
    for prompt, r in zip(prompts, results):
        ids = torch.tensor([prompt + r.token_ids[:-1]])
        routing = r.routing_for_training()
        assert routing.shape == (len(model.moe_layers), ids.shape[1], model.config.num_experts_per_tok)
        tokens = torch.tensor(r.token_ids)
        rows = torch.arange(len(prompt) - 1, ids.shape[1])
        with torch.no_grad(), batch_invariant():
            out = model(ids, routed_experts=routing[:, None], return_routing=True)
            free = model(ids, return_routing=True)
        logp = torch.log_softmax(out.logits[0, rows].float(), -1)[torch.arange(len(tokens)), tokens]
        assert logp.tolist() == r.logprobs  # bit for bit
        # the engine recorded what the router chooses on its own, as sets per token
        assert torch.equal(free.routed_experts[:, 0].sort(-1).values, routing.sort(-1).values)
        # the default (fast) training forward agrees to float tolerance
        with torch.no_grad():
            fast = model(ids, routed_experts=routing[:, None])
        fast_logp = torch.log_softmax(fast[0, rows].float(), -1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(fast_logp, torch.tensor(r.logprobs), atol=1e-4)


def test_speculative_greedy_equals_plain():
    # a small vocabulary so that random MTP drafts are sometimes right and acceptance paths run
    model = _model("tiny-deepseek-v3", vocab_size=7, init_std=0.2)
    prompts = _prompts(7, [3, 10])
    for invariant in (True, False):
        plain = Engine(model, batch_invariant=invariant).generate(prompts, max_new_tokens=32)
        engine = Engine(model, batch_invariant=invariant)
        spec = engine.generate(prompts, max_new_tokens=32, speculative=True, num_draft_tokens=3)
        for a, b in zip(plain, spec):
            assert a.token_ids == b.token_ids
            if invariant:
                assert a.logprobs == b.logprobs and torch.equal(a.routed_experts, b.routed_experts)
        assert engine.stats["accepted_tokens"] > 0
        assert 0 < sum(r.num_accepted_tokens for r in spec) < sum(r.num_draft_tokens for r in spec)


def _run(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_result(i) for i in ids]


def test_speculative_greedy_mixed_requests_equal_plain():
    # greedy requests drafting 1, 2 and 4 tokens in one batch, one of them stopping on a token, next to a sampled
    # request that finishes early: the batch verifies on the general path first, then (all greedy) on the fast
    # path's one-call step where the C++ kernels build
    model = _model("tiny-deepseek-v3", vocab_size=7, init_std=0.2)
    prompts = _prompts(7, [3, 10, 6, 4])
    stop = Engine(model).generate(prompts[1:2], max_new_tokens=24)[0].token_ids[12]
    greedy = [dict(max_new_tokens=24), dict(max_new_tokens=24, stop_token_ids=[stop]), dict(max_new_tokens=17)]
    for invariant in (True, False):
        plain = _run(Engine(model, batch_invariant=invariant), prompts[:3], [SamplingParams(**g) for g in greedy])
        engine = Engine(model, batch_invariant=invariant)
        spec = _run(engine, prompts, [SamplingParams(**g, speculative=True, num_draft_tokens=d)
                                      for g, d in zip(greedy, (1, 2, 4))]
                    + [SamplingParams(max_new_tokens=3, temperature=1.0, speculative=True, seed=0)])
        for a, b in zip(plain, spec):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)
        assert spec[1].finish_reason == "stop" and len(spec[3].token_ids) == 3
        assert 0 < engine.stats["accepted_tokens"] < engine.stats["draft_tokens"]


def _chi2_sf(stat, dof):
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_speculative_sampling_preserves_the_distribution():
    V, n = 5, 2000
    # the latent size this draft acceptance rate was set for (a random MTP head's acceptance depends on it)
    model = _model("tiny-deepseek-v3", vocab_size=V, init_std=0.3, num_layers=2, kv_lora_rank=32, qk_rope_head_dim=16)
    prompt = [1, 3, 0, 2]
    params = dict(temperature=0.8, top_k=4)
    engine = Engine(model, max_batch_size=250, cache_memory_bytes=64 << 20)
    results = engine.generate([prompt] * n, max_new_tokens=3, speculative=True, num_draft_tokens=2,
                              seed=1000, **params)
    rate = engine.stats["accepted_tokens"] / engine.stats["draft_tokens"]
    assert 0.05 < rate < 0.95  # both the accept and the reject branch are exercised
    # exact joint of the first two tokens and marginal of the third under the main model
    sp = SamplingParams(**params)
    with torch.no_grad():
        p1 = sampling_probs(model(torch.tensor([prompt]))[0, -1], sp)
        seqs2 = torch.tensor([prompt + [a] for a in range(V)])
        p2 = torch.stack([sampling_probs(row, sp) for row in model(seqs2)[:, -1]])
        joint = p1[:, None] * p2
        seqs3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = torch.stack([sampling_probs(row, sp) for row in model(seqs3)[:, -1]])
        third = (joint.reshape(-1, 1) * p3).sum(0)
    counts12 = torch.zeros(V, V)
    counts3 = torch.zeros(V)
    for r in results:
        counts12[r.token_ids[0], r.token_ids[1]] += 1
        counts3[r.token_ids[2]] += 1
    for counts, probs in ((counts12.flatten(), joint.flatten()), (counts3, third)):
        keep = probs > 0
        assert counts[~keep].sum() == 0  # nothing outside the top-k support
        expected = probs[keep] * n
        stat = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert _chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (stat, counts, expected)
    # the test has power: the drafts' own distribution is rejected
    with torch.no_grad():
        out = model(torch.tensor([prompt + [a] for a in range(V)]), mtp=True)
    q2 = torch.stack([sampling_probs(row, sp) for row in out.mtp_logits[0][:, -2]])
    wrong = (p1[:, None] * q2).flatten()
    keep = wrong > 1e-3
    stat = float(((counts12.flatten()[keep] - wrong[keep] * n) ** 2 / (wrong[keep] * n)).sum())
    assert _chi2_sf(stat, int(keep.sum()) - 1) < 1e-6


def _new_weights(model, seed):
    torch.manual_seed(seed)
    other = Transformer(model.config)
    return {k: v.detach().clone() for k, v in other.state_dict().items()}


@pytest.mark.parametrize("recompute", [False, True])
def test_weight_update_mid_generation(recompute):
    model = _model("tiny-deepseek-v3")
    prompts = _prompts(model.config.vocab_size, [6, 15])
    new = _new_weights(model, seed=7)
    engine = Engine(model, batch_invariant=True)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    for _ in range(8):
        engine.step()
    before = {s.rid: list(s.result.token_ids) for s in engine._running}
    engine.update_weights(new, version=3, recompute_cache=recompute)
    while engine.has_unfinished():
        engine.step()
    fresh_model = _model("tiny-deepseek-v3")
    fresh_model.load_state_dict(new)
    for rid, prompt in zip(rids, prompts):
        r = engine.pop_result(rid)
        k = len(before[rid])
        assert r.weight_versions == [0] * k + [3] * (20 - k)
        assert r.token_ids[:k] == before[rid]
        fresh = Engine(fresh_model, batch_invariant=True).generate([prompt + before[rid]], max_new_tokens=20 - k)[0]
        if recompute:
            assert r.token_ids[k:] == fresh.token_ids
            assert r.logprobs[k:] == fresh.logprobs
        else:  # later tokens attend to keys/values cached under the old weights
            assert r.logprobs[k:] != fresh.logprobs


def test_weight_update_xor_delta_and_validation():
    model = _model("tiny-qwen3-moe", num_layers=2)
    engine = Engine(model)
    target = _new_weights(model, seed=3)
    name = "layers.0.attention.wq.weight"
    cur = model.state_dict()[name]
    delta = cur.view(torch.int32) ^ target[name].view(torch.int32)
    engine.update_weights({name: delta}, version=1, delta=True)
    assert torch.equal(model.state_dict()[name], target[name]) and engine.weight_version == 1
    with pytest.raises(EngineError, match="does not have"):
        engine.update_weights({"nope.weight": cur}, version=2)
    with pytest.raises(EngineError, match="shape"):
        engine.update_weights({name: cur[:1]}, version=2)
    with pytest.raises(EngineError, match="int32"):
        engine.update_weights({name: cur}, version=2, delta=True)
    assert engine.weight_version == 1


def test_weight_update_reads_bounded_row_boxes(monkeypatch):
    """update_weights reads each tensor in boxes of whole rows of at most UPDATE_CHUNK_ELEMENTS elements (one
    row where a row is larger) and assembles exactly the full tensors, for full values and XOR deltas."""
    import megatron_composer.inference.engine as engine_module

    monkeypatch.setattr(engine_module, "UPDATE_CHUNK_ELEMENTS", 100)
    model = _model("tiny-deepseek-v3", num_layers=2)
    engine = Engine(model)
    target = _new_weights(model, seed=7)
    boxes = []

    class Reader:
        names = list(target)

        def shape(self, name):
            return list(target[name].shape)

        def read(self, name, box):
            boxes.append((name, box))
            return target[name][box]

    engine.update_weights(Reader(), version=1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in target.items())
    for name, box in boxes:
        t = target[name]
        got = t[box]
        row = t[0].numel() if t.dim() else 1
        assert got.numel() <= max(100, row), (name, box)
        assert t.dim() == 0 or got.shape[1:] == t.shape[1:]  # whole rows
    big = "tok_embeddings.weight"
    assert sum(n == big for n, _ in boxes) > 1  # a tensor larger than the bound is read in several boxes
    back = {k: v.view(torch.int32) ^ target[k].view(torch.int32) for k, v in _new_weights(model, seed=0).items()}
    engine.update_weights(back, version=2, delta=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in _new_weights(model, seed=0).items())


def test_fast_path_sees_weight_updates():
    """The engine serves the model's parameters as update_weights leaves them (full tensors and XOR deltas)."""
    model = _model("tiny-deepseek-v3", num_layers=2)
    prompts = _prompts(model.config.vocab_size, [6, 11])
    new = _new_weights(model, seed=5)
    fresh_model = _model("tiny-deepseek-v3", num_layers=2)
    fresh_model.load_state_dict(new)
    want = Engine(fresh_model).generate(prompts, max_new_tokens=12)
    engine = Engine(model)
    engine.update_weights(new, version=1)
    got = engine.generate(prompts, max_new_tokens=12)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5) for a, b in zip(got, want))
    back = {k: v.view(torch.int32) ^ model.state_dict()[k].view(torch.int32)
            for k, v in _new_weights(model, seed=0).items()}
    engine.update_weights(back, version=2, delta=True)
    original = Engine(_model("tiny-deepseek-v3", num_layers=2)).generate(prompts, max_new_tokens=12)
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=12)] == [r.token_ids for r in original]


def test_vectorised_sampling_rows_are_independent_and_exact():
    from megatron_composer.inference.sampling import sample_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9), (2.0, 1, 1.0)]]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(5)]
    tokens, slp = sample_rows(logits, params, gens)
    for i in range(5):  # a row's draw depends on its own seed and logits only
        alone, alone_slp = sample_rows(logits[i:i + 1], params[i:i + 1], [torch.Generator().manual_seed(100 + i)])
        assert int(alone) == int(tokens[i]) and float(alone_slp) == float(slp[i])
        probs = sampling_probs(logits[i], params[i])
        assert probs[tokens[i]] > 0 and abs(float(probs[tokens[i]].log()) - float(slp[i])) < 1e-6
    assert int(tokens[4]) == int(logits[4].argmax())  # top_k = 1
    # many draws of one row follow its truncated distribution (chi-square)
    n, row = 4000, 3
    gen = torch.Generator().manual_seed(7)
    draws = torch.cat([sample_rows(logits[row:row + 1].expand(400, -1), [params[row]] * 400, [gen] * 400)[0]
                       for _ in range(n // 400)])
    probs = sampling_probs(logits[row], params[row])
    counts = torch.bincount(draws, minlength=40).float()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    expected = probs[keep] * n
    assert _chi2_sf(float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1) > 1e-3


@pytest.mark.parametrize("preset,changes", [
    ("tiny-deepseek-v3", dict(kv_lora_rank=96)), ("tiny-deepseek-v3", dict(q_lora_rank=None)),
    ("tiny-deepseek-v3", dict(rope_interleave=False, attention_bias=True)),
    ("tiny-qwen3-moe", dict(qk_norm=False, attention_bias=True, init_std=0.05))],
    ids=["mla-unfolded-absorption", "mla-no-q-compression", "mla-rope-halves-bias", "gqa-no-qk-norm-bias"])
def test_fast_path_variants_equal_recomputation(preset, changes):
    """The cached attention's other forms: an MLA latent larger than the head dims (as DeepSeek-V3's), MLA
    queries straight from wq, RoPE on halves instead of interleaved pairs, biases."""
    model = _model(preset, num_layers=2, **changes)
    if changes.get("attention_bias"):  # make the biases matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") and "attention" in name:
                    p.normal_(0.0, 0.1)
    prompts = _prompts(model.config.vocab_size, [5, 12])
    for prompt, r in zip(prompts, Engine(model).generate(prompts, max_new_tokens=24)):
        assert r.token_ids == _greedy_recompute(model, prompt, 24)


def test_decode_buckets_pad_the_batch_without_changing_results():
    """Static decode shapes: the batch padded to its bucket (3 -> 4, then 2, 1 as requests finish) and the read
    width to a power of two give the tokens, log-probs and routing of unpadded decoding (float32: log-probs
    within 1e-5; batch-invariant mode: bit for bit, and still equal to each request alone)."""
    from megatron_composer.inference.engine import decode_bucket

    assert [decode_bucket(b, 64) for b in (1, 2, 3, 5, 9, 33, 64)] == [1, 2, 4, 8, 16, 64, 64]
    assert decode_bucket(5, 6) == 6 and decode_bucket(7, 6) == 7
    for preset in ("tiny-deepseek-v3", "tiny-qwen3-moe"):
        model = _model(preset)
        prompts = _prompts(model.config.vocab_size, [4, 23, 9])
        budgets = [24, 12, 5]  # the batch shrinks 3 -> 2 -> 1 while decoding

        def run(engine):
            ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
            while engine.has_unfinished():
                engine.step()
            return [engine.pop_result(i) for i in ids]

        plain = run(Engine(model, decode_buckets=False))
        bucketed_engine = Engine(model, decode_buckets=True)
        padded = []
        real_forward = bucketed_engine._main_forward
        bucketed_engine._main_forward = lambda *a: padded.append(a[3] if len(a) > 3 else 0) or real_forward(*a)
        bucketed = run(bucketed_engine)
        assert 1 in padded  # the batch of 3 decoded as a bucket of 4
        for a, b in zip(plain, bucketed):
            assert a.token_ids == b.token_ids and torch.equal(a.routed_experts, b.routed_experts)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        invariant = [run(Engine(model, batch_invariant=True, decode_buckets=flag)) for flag in (False, True)]
        for i, (a, b) in enumerate(zip(*invariant)):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
            assert torch.equal(a.routed_experts, b.routed_experts)
            alone = Engine(model, batch_invariant=True, decode_buckets=True).generate([prompts[i]],
                                                                                    max_new_tokens=budgets[i])[0]
            assert alone.token_ids == b.token_ids and alone.logprobs == b.logprobs
