"""The CPU causal-attention kernel against its SDPA reference: values and gradients, MHA/GQA, packed
documents, both backward strategies (saved probabilities and recomputation), several block sizes."""

import pytest
import torch

from megatron_composer.kernels import causal_attention as ca


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
def test_matches_reference_float64(monkeypatch, saved_probs, B, H, KV, S, Dq, Dv, docs):
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


def test_small_blocks_and_long_rows(monkeypatch):
    """Blocks of a few rows (what long sequences get) give the same result as the default blocking."""
    q, k, v, doc, dout = _inputs(2, 4, 2, 90, 8, 8, torch.float64, 4, seed=1)
    want = ca.causal_attention(q, k, v, 0.5, doc)
    monkeypatch.setattr(ca, "_BLOCK_ELEMENTS", 2 * 2 * 90 * 3)  # forces 1-3 rows per block
    assert ca._rows_per_block(4, 2, 90) < 4
    got = ca.causal_attention(q, k, v, 0.5, doc)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_follow_float32_reference(dtype):
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


def test_documents_never_attend_across():
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


def test_rejects_bad_head_counts():
    q, k, v, _, _ = _inputs(1, 6, 4, 8, 8, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ca.causal_attention(q, k, v, 1.0)
