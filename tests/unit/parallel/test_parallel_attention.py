"""Blockwise (flash-style) attention used by context parallelism against PyTorch SDPA with a dense mask."""

import pytest
import torch
import torch.nn.functional as F

from megatron_composer.parallel.context_parallel import blockwise_attention, global_token_index


@pytest.mark.parametrize("H, KV, Dq, Dv", [(4, 4, 16, 16), (4, 2, 16, 16), (4, 4, 24, 16)])
@pytest.mark.parametrize("block", [3, 64])
def test_blockwise_attention_matches_sdpa(H, KV, Dq, Dv, block):
    torch.manual_seed(0)
    B, S, cp, r = 2, 16, 2, 1
    q_idx = global_token_index(S * cp, cp, r)  # this rank's queries (head-tail chunks of the full sequence)
    k_idx = torch.cat([global_token_index(S * cp, cp, x) for x in range(cp)])  # gathered keys, rank order
    doc = torch.zeros(B, S * cp, dtype=torch.long)
    doc[1, 11:] = 1  # row 1 packs two documents
    doc[1, 27:] = 2
    q = torch.randn(B, H, S, Dq, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, KV, S * cp, Dq, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, KV, S * cp, Dv, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, H, S, Dv, dtype=torch.float64)
    out = blockwise_attention(q, k, v, 0.3, q_idx, k_idx, doc[:, q_idx], doc[:, k_idx], block=block)
    (out * w).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = (q_idx[:, None] >= k_idx[None, :]) & (doc[:, q_idx, None] == doc[:, None, k_idx])
    rep = H // KV
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask[:, None], scale=0.3)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=1e-9, atol=1e-9)


def test_blockwise_attention_in_bf16_rounds_once_as_the_float32_run():
    """bf16 inputs: K/V are cast to float32 a key block at a time and dk/dv are written in bf16 per block, which
    must give bit for bit the float32 computation on the same values cast to bf16 once at the end."""
    torch.manual_seed(0)
    B, H, KV, S, cp, r, Dq, Dv = 1, 4, 2, 16, 2, 0, 24, 16
    q_idx = global_token_index(S * cp, cp, r)
    k_idx = torch.cat([global_token_index(S * cp, cp, x) for x in range(cp)])
    doc = torch.zeros(B, S * cp, dtype=torch.long)
    doc[0, 9:] = 1
    q, k, v = (torch.randn(B, n, L, D).to(torch.bfloat16)
               for n, L, D in ((H, S, Dq), (KV, S * cp, Dq), (KV, S * cp, Dv)))
    w = torch.randn(B, H, S, Dv).to(torch.bfloat16).float()  # the bf16 output's incoming gradient is exact
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        args = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = blockwise_attention(*args, 0.3, q_idx, k_idx, doc[:, q_idx], doc[:, k_idx], block=5)
        (out.float() * w).sum().backward()
        results.append((out, [t.grad for t in args]))
    (out16, grads16), (out32, grads32) = results
    assert torch.equal(out16, out32.to(torch.bfloat16))
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == torch.bfloat16 and torch.equal(g16, g32.to(torch.bfloat16))
