"""Blocked cross-entropy (kernels/cross_entropy.py) against F.cross_entropy: losses, gradients, ignored
targets, several vocabulary sizes (one block, many blocks, a ragged last block), float32 and bfloat16."""

import pytest
import torch

from megatron_composer.kernels import cross_entropy as ce


@pytest.mark.parametrize("N,V", [(5, 11), (300, 1000), (97, 40000)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_blocked_cross_entropy_matches_reference(N, V, dtype):
    g = torch.Generator().manual_seed(N + V)
    logits = (3 * torch.randn(N, V, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    target[::4] = -100
    weight = torch.rand(N, generator=g)
    got = ce.cross_entropy(logits, target)
    (got * weight).sum().backward()
    grad, logits.grad = logits.grad, None
    want = ce.reference_cross_entropy(logits, target)
    (want * weight).sum().backward()
    assert got.dtype == torch.float32 and grad.dtype == dtype
    assert torch.all(got[::4] == 0) and torch.all(grad[::4] == 0)
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    torch.testing.assert_close(got, want.float(), atol=tol, rtol=tol)
    gtol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # one bfloat16 rounding of the same float32 gradient
    torch.testing.assert_close(grad.float(), logits.grad.float(), atol=gtol * float(logits.grad.float().abs().max()),
                               rtol=gtol)


def test_blocked_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="logits \\[N, V\\]"):
        ce.cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
