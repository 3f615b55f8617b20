"""Batch-invariant numerics: a token's results do not depend on what else is in the batch.

Why results move with the batch on CPU (and GPU): a matmul's reduction order depends on the whole problem
shape (BLAS picks a gemv for one row and blocked gemm kernels for many, with different blocking per M),
and fused attention kernels split the key axis into blocks whose sums are associated differently for
different key lengths or masks. Elementwise ops, row-wise reductions over the last dimension (RMSNorm,
softmax, log-softmax, for rows below ~32k elements), top-k, gathers and `index_add_` are already
independent of the batch.

The approach: run every shape-sensitive op with one fixed shape per token.
- `F.linear` / 2-D `torch.matmul` / `torch._grouped_mm` are computed one row at a time (M = 1), so a
  token's projection is the same whether it is alone, in a batch of 16, or one of 500 prompt tokens.
- Attention is computed one query at a time over exactly the keys it may see (`attend_row`): scores
  [H, 1, L], a float32 softmax over L, and [H, 1, L] x [H, L, Dv]; a decode step with a KV cache of length
  L and the training forward's row t (keys 0..t, L = t + 1) make the identical call.

`batch_invariant()` is a torch function mode, so the same model code runs invariantly on both sides:
the inference engine enters it for its forward passes, and the training forward pass does
`with batch_invariant(): model(ids, routed_experts=...)` to get log-probabilities bit-identical to the
engine's. It is slow (a Python loop over rows): a correctness mode for RL numerics and tests, not for speed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def attend_row(q_H1D: torch.Tensor, k_HLD: torch.Tensor, v_HLD: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row against L keys, with shapes fixed by L alone: [H, 1, Dqk] x [H, L, Dqk] -> [H, 1, Dv]."""
    k_HLD, v_HLD = k_HLD.contiguous(), v_HLD.contiguous()
    scores_H1L = torch.matmul(q_H1D.contiguous(), k_HLD.transpose(-1, -2)) * scale
    probs_H1L = torch.softmax(scores_H1L.float(), dim=-1).to(v_HLD.dtype)
    return torch.matmul(probs_H1L, v_HLD)


def _rows(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply fn to each row of a 2-D x separately (M = 1) and stack."""
    if x.shape[0] == 0:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def _linear(x, weight, bias=None):
    x_TK = x.reshape(-1, x.shape[-1])
    out = _rows(lambda r: F.linear(r, weight, bias), x_TK)
    return out.view(*x.shape[:-1], weight.shape[0])


def _matmul(a, b, *, out=None):
    if a.dim() != 2 or b.dim() != 2:
        return torch.matmul(a, b, out=out)
    result = _rows(lambda r: torch.matmul(r, b), a)
    if out is not None:
        return out.copy_(result)
    return result


def _grouped_mm(a_TK, b_GKN, *, offs=None, bias=None, out_dtype=None):
    if a_TK.dim() != 2 or b_GKN.dim() != 3 or offs is None or bias is not None:
        raise NotImplementedError("batch_invariant() supports torch._grouped_mm(a [T,K], b [G,K,N], offs=...) only")
    ends = offs.tolist()
    group_of_row = torch.bucketize(torch.arange(a_TK.shape[0], device=offs.device), offs, right=True).tolist()
    rows = [torch.matmul(a_TK[i:i + 1], b_GKN[g]) for i, g in enumerate(group_of_row) if i < ends[-1]]
    out = torch.cat(rows) if rows else a_TK.new_empty(0, b_GKN.shape[-1])
    if out.shape[0] < a_TK.shape[0]:  # rows past the last offset are left as zeros, as in the fused kernel
        out = torch.cat([out, out.new_zeros(a_TK.shape[0] - out.shape[0], out.shape[1])])
    return out.to(out_dtype) if out_dtype is not None else out


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p != 0.0:
        raise NotImplementedError("batch_invariant() attention does not support dropout")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise NotImplementedError("batch_invariant() attention supports boolean masks only")
    B, H, S, D = q.shape
    L = k.shape[2]
    if k.shape[1] != H:
        if not enable_gqa:
            raise ValueError(f"q has {H} heads but k has {k.shape[1]}; pass enable_gqa=True or repeat k/v")
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    scale = D ** -0.5 if scale is None else scale
    out = q.new_empty(B, H, S, v.shape[-1])
    for b in range(B):
        for t in range(S):
            if attn_mask is not None:
                m = attn_mask[b if attn_mask.shape[0] > 1 else 0]
                if m.shape[0] != 1:
                    raise NotImplementedError("batch_invariant() attention needs a mask shared by all heads")
                keys = m[0, t if m.shape[1] > 1 else 0].nonzero().squeeze(-1)
                if is_causal:
                    keys = keys[keys <= t + L - S]
                k_HLD, v_HLD = k[b].index_select(1, keys), v[b].index_select(1, keys)
            elif is_causal:
                stop = t + L - S + 1
                k_HLD, v_HLD = k[b, :, :stop], v[b, :, :stop]
            else:
                k_HLD, v_HLD = k[b], v[b]
            out[b, :, t:t + 1] = attend_row(q[b, :, t:t + 1], k_HLD, v_HLD, scale)
    return out


class BatchInvariantMode(TorchFunctionMode):
    """Routes shape-sensitive ops to per-row implementations (see module docstring)."""

    _HANDLERS = {
        F.linear: _linear,
        torch.matmul: _matmul,
        F.scaled_dot_product_attention: _sdpa,
    }
    if hasattr(torch, "_grouped_mm"):
        _HANDLERS[torch._grouped_mm] = _grouped_mm

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self._HANDLERS.get(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Run the enclosed model code batch-invariantly (no-op when enabled is False)."""
    if not enabled:
        yield
        return
    with BatchInvariantMode():
        yield
