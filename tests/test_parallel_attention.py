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
