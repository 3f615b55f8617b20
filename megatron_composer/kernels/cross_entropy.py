"""Per-token cross-entropy over the vocabulary, computed by blocks of rows, with its reference next to it.

`F.cross_entropy(logits.float(), target, reduction="none")` on [tokens, vocab] logits makes whole-size
float32 passes: the cast, the log-softmax output, a zero-filled gradient for the gather, the log-softmax
backward and the cast back, each tokens x vocab x 4 bytes (32 MB for 1k tokens of an 8k vocabulary) through
memory. Here both directions walk blocks of rows whose float32 working set stays in cache: forward keeps only
the per-token loss (log-softmax of the block, gathered at the targets), backward recomputes the block's
softmax, subtracts one at the target, scales by the incoming gradient and writes the gradient in the
logits' dtype. Same numbers as the reference up to float32 rounding; no [tokens, vocab] float32 tensor is kept.

    cross_entropy(logits [N, V], target [N], ignore_index=-100) -> loss [N] (float32; 0 where ignored)
    reference_cross_entropy(...)  # the same contract through F.cross_entropy, for the tests
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# float32 elements of one block of rows: on CPU ~1 MiB, small enough to stay in a core's L2 between the
# passes; on accelerators ~1 GiB, where the point is only not to hold a whole float32 copy of the logits and
# each block must be large enough to fill the device
_BLOCK_ELEMENTS = {"cpu": 1 << 18}
_DEVICE_BLOCK_ELEMENTS = 1 << 28
_MIN_ROWS = 8


def _rows_per_block(vocab: int, device: torch.device) -> int:
    return max(_MIN_ROWS, _BLOCK_ELEMENTS.get(device.type, _DEVICE_BLOCK_ELEMENTS) // max(vocab, 1))


class _BlockedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, target_N: torch.Tensor, ignore_index: int) -> torch.Tensor:
        N, V = logits_NV.shape
        valid_N = target_N != ignore_index
        safe_N1 = torch.where(valid_N, target_N, 0)[:, None]
        logp_N1 = torch.empty(N, 1, dtype=torch.float32, device=logits_NV.device)
        rows = _rows_per_block(V, logits_NV.device)
        for a in range(0, N, rows):
            b = min(N, a + rows)
            torch.gather(torch.log_softmax(logits_NV[a:b].float(), dim=-1), 1, safe_N1[a:b], out=logp_N1[a:b])
        ctx.save_for_backward(logits_NV, safe_N1, valid_N)
        return torch.where(valid_N, logp_N1.squeeze(1).neg(), 0.0)

    @staticmethod
    def backward(ctx, grad_N: torch.Tensor):
        logits_NV, safe_N1, valid_N = ctx.saved_tensors
        N, V = logits_NV.shape
        scale_N1 = torch.where(valid_N, grad_N.float(), 0.0)[:, None]
        grad_NV = torch.empty_like(logits_NV)
        rows = _rows_per_block(V, logits_NV.device)
        in_place = logits_NV.dtype == torch.float32  # the float32 block is the gradient's own rows
        for a in range(0, N, rows):
            b = min(N, a + rows)
            if in_place:
                p = torch.softmax(logits_NV[a:b], dim=-1, out=grad_NV[a:b])
            else:
                p = torch.softmax(logits_NV[a:b].float(), dim=-1)
            p.scatter_add_(1, safe_N1[a:b], p.new_full((b - a, 1), -1.0)).mul_(scale_N1[a:b])
            if not in_place:
                grad_NV[a:b].copy_(p)
        return grad_NV, None, None


def cross_entropy(logits_NV: torch.Tensor, target_N: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss -log softmax(logits)[target] in float32, 0 where target == ignore_index."""
    if logits_NV.dim() != 2 or target_N.shape != logits_NV.shape[:1]:
        raise ValueError(f"cross_entropy takes logits [N, V] and targets [N]; got {tuple(logits_NV.shape)} and "
                         f"{tuple(target_N.shape)}")
    return _BlockedCrossEntropy.apply(logits_NV, target_N, ignore_index)


def reference_cross_entropy(logits_NV: torch.Tensor, target_N: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return F.cross_entropy(logits_NV.float(), target_N, ignore_index=ignore_index, reduction="none")


__all__ = ["cross_entropy", "reference_cross_entropy"]
