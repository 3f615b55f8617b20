"""The CPU causal-attention kernel against its SDPA reference: values and gradients, MHA/GQA, packed
documents, both backward strategies (saved probabilities and recomputation), several block sizes; each for the
Python kernel and the C++ one (csrc/causal_attention.cpp), and the C++ kernel against the Python one."""

import pytest
import torch

from megatron_composer.kernels import causal_attention as ca

_CPP = ca._compiled()
needs_cpp = pytest.mark.skipif(_CPP is None, reason="the C++ kernel could not be built here (no compiler)")


@pytest.fixture(params=["python", pytest.param("cpp", marks=needs_cpp)])
def impl(request, monkeypatch):
    """Runs a test once with the Python kernel and once with the C++ kernel behind causal_attention."""
    if request.param == "python":
        monkeypatch.setattr(ca, "_compiled", lambda: None)
    return request.param


def _inputs(B, H, KV, S, Dq, Dv, dtype, docs, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, Dq, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(B, KV, S, Dq, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, KV, S, Dv, generator=g, dtype=dtype).requires_grad_()
    doc = None
    if docs:
        # random document lengths per row, including length-1 documents
        doc = torch.stack([torch.randint(0, docs, (S,), generator=g).sort().values for _ in range(B)])
    dout = torch.randn(B, H, S, Dv, generator=g, dtype=dtype)
    return q, k, v, doc, dout


@pytest.mark.parametrize("saved_probs", [True, False])
@pytest.mark.parametrize("B,H,KV,S,Dq,Dv,docs", [
    (2, 4, 4, 100, 16, 8, 0),      # MHA, v narrower than q/k (MLA-like)
    (2, 4, 2, 77, 16, 16, 3),      # GQA, packed documents
    (1, 8, 1, 130, 24, 8, 5),      # MQA, many documents
    (3, 6, 3, 64, 8, 8, 0),
])
def test_matches_reference_float64(impl, monkeypatch, saved_probs, B, H, KV, S, Dq, Dv, docs):
    if not saved_probs:
        monkeypatch.setattr(ca, "_SAVED_PROB_ELEMENTS", 0)
    q, k, v, doc, dout = _inputs(B, H, KV, S, Dq, Dv, torch.float64, docs)
    out = ca.causal_attention(q, k, v, 0.3, doc)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = ca.reference_attention(q, k, v, 0.3, doc)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert out.dtype == torch.float64 and out.shape == (B, H, S, Dv)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)


def test_small_blocks_and_long_rows(impl, monkeypatch):
    """Blocks of a few rows (what long sequences get) give the same result as the default blocking."""
    q, k, v, doc, dout = _inputs(2, 4, 2, 90, 8, 8, torch.float64, 4, seed=1)
    want = ca.causal_attention(q, k, v, 0.5, doc)
    monkeypatch.setattr(ca, "_BLOCK_ELEMENTS", 2 * 2 * 90 * 3)  # forces 1-3 rows per block
    assert ca._rows_per_block(4, 2, 90) < 4
    got = ca.causal_attention(q, k, v, 0.5, doc)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_follow_float32_reference(impl, dtype):
    q, k, v, doc, dout = _inputs(2, 4, 4, 64, 16, 8, dtype, 2, seed=2)
    out = ca.causal_attention(q, k, v, 0.25, doc)
    dq, = torch.autograd.grad(out, (q,), dout)
    assert out.dtype == dtype and dq.dtype == dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ca.reference_attention(q64, k64, v64, 0.25, doc)
    ref_dq, = torch.autograd.grad(ref, (q64,), dout.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: only the output rounding (computed in float32)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dq.double(), ref_dq, atol=tol * 4, rtol=tol * 4)


def test_documents_never_attend_across(impl):
    """Changing a token of an earlier document leaves every later document's outputs unchanged."""
    q, k, v, _, _ = _inputs(1, 2, 2, 40, 8, 8, torch.float64, 0, seed=3)
    doc = torch.tensor([[0] * 15 + [1] * 25])
    out = ca.causal_attention(q, k, v, 0.3, doc)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, :15] += 1.0
    v2[:, :, :15] -= 2.0
    out2 = ca.causal_attention(q, k2, v2, 0.3, doc)
    assert torch.equal(out[:, :, 15:], out2[:, :, 15:])
    assert not torch.allclose(out[:, :, :15], out2[:, :, :15])


def test_rejects_bad_head_counts(impl):
    q, k, v, _, _ = _inputs(1, 6, 4, 8, 8, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ca.causal_attention(q, k, v, 1.0)


# The C++ kernel against the Python one it reproduces.

def _python_and_cpp(q, k, v, scale, doc, dout, keep=ca._SAVED_PROB_ELEMENTS):
    """(out, dq, dk, dv) of the Python kernel and of the C++ kernel for the same inputs."""
    results = []
    for run in (lambda: ca._CausalAttention.apply(q, k, v, scale, doc),
                lambda: ca._CausalAttentionCpp.apply(_CPP, q, k, v, scale, doc, keep)):
        out = run()
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    return results


_SHAPES = [  # B, H, KV, S, Dqk, Dv, docs
    (2, 4, 4, 100, 16, 8, 0),     # MHA, Dqk != Dv
    (2, 8, 2, 77, 16, 24, 3),     # GQA, packed documents, odd length, Dv > Dqk
    (1, 8, 1, 131, 24, 8, 6),     # MQA, many documents, odd length
    (3, 2, 1, 200, 8, 8, 40),     # GQA with short documents (many length-1 runs)
    (1, 2, 2, 1, 8, 4, 0),        # a single token
    (1, 1, 1, 700, 12, 8, 0),     # one head: the backward splits each head's blocks into runs
]


@needs_cpp
@pytest.mark.parametrize("saved_probs", [True, False])
@pytest.mark.parametrize("B,H,KV,S,Dq,Dv,docs", _SHAPES)
def test_cpp_matches_python_float64(saved_probs, B, H, KV, S, Dq, Dv, docs):
    q, k, v, doc, dout = _inputs(B, H, KV, S, Dq, Dv, torch.float64, docs, seed=S)
    want, got = _python_and_cpp(q, k, v, 0.35, doc, dout, keep=1 << 30 if saved_probs else 0)
    assert got[0].shape == (B, H, S, Dv) and [g.shape for g in got[1:]] == [q.shape, k.shape, v.shape]
    for a, b in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@needs_cpp
@pytest.mark.parametrize("B,H,KV,S,Dq,Dv,docs", _SHAPES[:4])
def test_cpp_matches_python_float32(B, H, KV, S, Dq, Dv, docs):
    q, k, v, doc, dout = _inputs(B, H, KV, S, Dq, Dv, torch.float32, docs, seed=S)
    want, got = _python_and_cpp(q, k, v, 0.35, doc, dout)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,KV,S,Dq,Dv,docs", _SHAPES[:4])
def test_cpp_matches_python_half_precision(dtype, B, H, KV, S, Dq, Dv, docs):
    """Both compute in float32 from the same 16-bit inputs; they differ by float32 rounding, then the 16-bit
    rounding of the results (one ulp where a value lands near a rounding boundary)."""
    q, k, v, doc, dout = _inputs(B, H, KV, S, Dq, Dv, dtype, docs, seed=S)
    want, got = _python_and_cpp(q, k, v, 0.35, doc, dout)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=1e-2)
        assert (a.float() - b.float()).abs().mean() < 1e-3  # nearly all equal


@needs_cpp
def test_cpp_broadcast_output_gradient():
    """out.sum().backward() hands the kernel a gradient expanded from one element (all strides 0)."""
    q, k, v, doc, _ = _inputs(2, 4, 2, 50, 8, 8, torch.float64, 3, seed=5)
    grads = []
    for run in (lambda: ca._CausalAttention.apply(q, k, v, 0.5, doc),
                lambda: ca._CausalAttentionCpp.apply(_CPP, q, k, v, 0.5, doc, 0)):
        grads.append(torch.autograd.grad(run().sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@needs_cpp
def test_cpp_model_layouts_and_no_grad():
    """Inputs as the model passes them ([B, S, H, D] storage viewed [B, H, S, D], v a slice of a wider
    tensor), and a call without autograd (no saved probabilities), give the same values."""
    g = torch.Generator().manual_seed(7)
    B, H, S = 2, 4, 96
    q = torch.randn(B, S, H, 24, generator=g, dtype=torch.float64).transpose(1, 2)
    kv = torch.randn(B, S, H, 24 + 16, generator=g, dtype=torch.float64)
    k, v = kv[..., :24].transpose(1, 2), kv[..., 24:].transpose(1, 2)
    doc = torch.tensor([[0] * 30 + [1] * 66, [0] * 96])
    dout = torch.randn(B, H, S, 16, generator=g, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want, got = _python_and_cpp(q, k, v, 0.2, doc, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(ca.causal_attention(q, k, v, 0.2, doc), want[0], atol=1e-12, rtol=1e-12)


@needs_cpp
def test_cpp_thread_count_does_not_change_results():
    """Forward tasks are independent of the thread count (bitwise); the backward's dk/dv sums may be split
    differently across threads, so they agree to rounding."""
    q, k, v, doc, dout = _inputs(1, 4, 2, 150, 16, 8, torch.float32, 3, seed=11)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = ca._CausalAttentionCpp.apply(_CPP, q, k, v, 0.3, doc, 0)
            results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_cpp
def test_mixed_dtypes_use_the_python_kernel():
    q, k, v, _, dout = _inputs(1, 2, 2, 20, 8, 8, torch.float32, 0)
    out = ca.causal_attention(q, k.detach().double(), v.detach().double(), 0.5)
    assert out.grad_fn is not None and "CausalAttentionBackward" in type(out.grad_fn).__name__
    assert "Cpp" not in type(out.grad_fn).__name__


def test_empty_batch_returns_empty():
    q, k = torch.zeros(0, 4, 16, 8), torch.zeros(0, 2, 16, 8)
    assert ca.causal_attention(q, k, k, 0.3).shape == (0, 4, 16, 8)
