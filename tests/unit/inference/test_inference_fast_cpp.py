"""The engine with the C++ CPU leaf kernels (kernels/cpu/csrc/decode.cpp: paged latent attention, experts over a few
rows, the head's row kernels; and the training kernels the model's modules use) against their references
(MEGATRON_COMPOSER_CPP=0): the same generations, log-probs, routing and cache contents, for every attention and
feed-forward form."""

import pytest
import torch

from megatron_composer.inference import Engine
from megatron_composer.kernels.cpu import cpp
from megatron_composer.model import Transformer, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(preset, seed=0, dtype=torch.float32, **changes):
    torch.manual_seed(seed)
    model = Transformer(get_preset(preset).replace(**changes))
    with torch.no_grad():  # biases and expert-selection biases that matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    return model.to(dtype).eval()


class _WithoutCpp:
    """An engine whose every call runs with the C++ kernels off (their references instead)."""

    def __init__(self, engine, monkeypatch):
        self.engine, self.monkeypatch = engine, monkeypatch

    def __getattr__(self, name):
        value = getattr(self.engine, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            with self.monkeypatch.context() as m:
                m.setenv("MEGATRON_COMPOSER_CPP", "0")
                return value(*args, **kwargs)
        return call


def _engines(model, monkeypatch):
    if cpp.load("decode") is None:
        pytest.skip("no C++ compiler: the engine runs the Python references only")
    fast = Engine(model, cache_memory_bytes=1 << 24)
    monkeypatch.setenv("MEGATRON_COMPOSER_CPP", "0")
    reference = Engine(model, cache_memory_bytes=1 << 24)
    monkeypatch.delenv("MEGATRON_COMPOSER_CPP")
    assert fast.row_kernels is not None and reference.row_kernels is None
    return fast, _WithoutCpp(reference, monkeypatch)


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


CASES = {
    "mla-folded-moe": ("tiny-deepseek-v3", {}),
    "mla-unfolded": ("tiny-deepseek-v3", dict(kv_lora_rank=96)),
    "mla-no-q-compression-halves-bias": ("tiny-deepseek-v3", dict(q_lora_rank=None, rope_interleave=False,
                                                                    attention_bias=True)),
    "mla-many-experts-softmax": ("tiny-kimi-k2.5", dict(num_experts=24, score_func="softmax", n_group=1,
                                                        topk_group=1, norm_topk_prob=False)),
    "gqa-qk-norm": ("tiny-qwen3-moe", {}),
    "gqa-bias-no-norm": ("tiny-qwen3-moe", dict(qk_norm=False, attention_bias=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpp_fast_path_equals_python(case, monkeypatch):
    preset, changes = CASES[case]
    model = _model(preset, num_layers=3, **changes)
    fast, reference = _engines(model, monkeypatch)
    V = model.config.vocab_size
    # batch 1 (decode-size experts over the chosen pairs; sorted tokens at prefill), a mixed-length batch of 16
    # (padded prefill rows, every-expert form where experts are few), and speculative verification (several new
    # tokens per request, the MTP block)
    for lengths, spec in [([7], False), ([3, 9, 5, 12] * 4, False), ([6, 11], True)]:
        if spec and model.config.num_mtp_layers == 0:
            continue
        prompts = _prompts(V, lengths, seed=len(lengths))
        kw = dict(max_new_tokens=12, speculative=spec)
        ours, ref = fast.generate(prompts, **kw), reference.generate(prompts, **kw)
        for a, b in zip(ours, ref):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)
            if a.routed_experts is not None:
                assert torch.equal(a.routed_experts, b.routed_experts)
                assert torch.equal(a.prompt_routed_experts, b.prompt_routed_experts)
    # the caches hold the same keys/values (blocks are handed out in the same order by both engines), past the
    # scratch block 0 that rows nobody reads are written to
    scratch = fast.cache.block_size
    for layer_a, layer_b in zip(fast.cache.layers, reference.cache.layers):
        for a, b in zip(layer_a, layer_b):
            torch.testing.assert_close(a[scratch:], b[scratch:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_cpp_fast_path_bfloat16_close_to_python(preset, monkeypatch):
    model = _model(preset, num_layers=2, dtype=torch.bfloat16)
    fast, reference = _engines(model, monkeypatch)
    prompts = _prompts(model.config.vocab_size, [4, 10, 7])
    ours, ref = fast.generate(prompts, max_new_tokens=1), reference.generate(prompts, max_new_tokens=1)
    for a, b in zip(ours, ref):  # prefill of a padded batch: the same function up to bfloat16 rounding
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.05
    for layer_a, layer_b in zip(fast.cache.layers, reference.cache.layers):
        for a, b in zip(layer_a, layer_b):
            torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)


def test_cpp_fast_path_follows_weight_updates(monkeypatch):
    model = _model("tiny-deepseek-v3", num_layers=2)
    fast, reference = _engines(model, monkeypatch)
    prompts = _prompts(model.config.vocab_size, [5, 8])
    torch.manual_seed(3)
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items() if v.is_floating_point()}
    for engine in (fast, reference):
        engine.update_weights(new, version=1)
    ours, ref = fast.generate(prompts, max_new_tokens=8), reference.generate(prompts, max_new_tokens=8)
    assert [r.token_ids for r in ours] == [r.token_ids for r in ref]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)
    assert all(v == 1 for r in ours for v in r.weight_versions)


def test_cpp_fast_path_off_the_cpu():
    """Models on another device keep the references (the C++ loops read host memory)."""
    model = Transformer(get_preset("tiny-deepseek-v3").replace(num_layers=2)).to("meta")
    assert Engine(model, cache_memory_bytes=1 << 20).row_kernels is None


def test_cpp_greedy_rows_equals_argmax_and_log_softmax():
    """Argmax (first of equal maxima) and its log-probability per row, for vocabularies with and without a
    multiple-of-8 tail, large logits, ties, and rows holding NaN or infinities (which take ATen's result)."""
    decode = cpp.load("decode")
    if decode is None:
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(0)
    for V in (7, 8, 97, 4096):
        for scale in (0.1, 3.0, 300.0):
            x = torch.randn(6, V, generator=g) * scale
            x[2, V // 2] = x[2].max()  # a tie: the first maximum wins
            token, logp = decode.greedy_rows(x)
            assert torch.equal(token, x.argmax(-1))
            want = torch.log_softmax(x, -1).gather(1, token[:, None])[:, 0]
            torch.testing.assert_close(logp, want, atol=2e-6, rtol=0)
    x = torch.randn(3, 40, generator=g)
    x[0, 7], x[1, 3], x[2] = float("nan"), float("inf"), float("-inf")
    x[2, 30] = 0.0
    token, logp = decode.greedy_rows(x)
    assert token.tolist() == [7, 3, 30] and logp[0].isnan() and logp[1].isnan() and logp[2] == 0.0


def test_cpp_small_linear_equals_linear():
    """The few-rows matmul (AVX2 dot products up to 4 rows, at::linear beyond) against F.linear, with and without
    bias, widths with and without a multiple-of-8 tail, row counts not a multiple of the kernel's blocks."""
    decode = cpp.load("decode")
    if decode is None:
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(0)
    for rows, n in [(112, 128), (7, 20), (4096, 128), (13, 3)]:
        w, b = torch.randn(rows, n, generator=g), torch.randn(rows, generator=g)
        for T in (1, 2, 3, 5):
            x = torch.randn(T, 1, n, generator=g)
            torch.testing.assert_close(decode.small_linear(x, w), torch.nn.functional.linear(x, w),
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(decode.small_linear(x, w, b), torch.nn.functional.linear(x, w, b),
                                       atol=1e-5, rtol=1e-5)
