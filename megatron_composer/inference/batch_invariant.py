"""Batch-invariant numerics: a token's results do not depend on what else is in the batch.

Why results move with the batch on CPU (and GPU): a matmul's reduction order depends on the whole problem
shape (BLAS picks a gemv for one row and blocked gemm kernels for many, with different blocking per M);
fused attention kernels split the key axis into blocks whose sums are associated differently for
different key lengths or masks; and transcendental elementwise ops (sigmoid, exp, cos, silu) run SIMD
code on whole vectors but scalar code, rounding differently, on the tail of a buffer, so the last token
of a batch gets different bits. Row-wise reductions over the last dimension (RMSNorm, softmax,
log-softmax, for rows below ~32k elements), arithmetic, top-k, gathers and `index_add_` are already
independent of the batch.

The approach: run every shape-sensitive op with one fixed shape per token.
- `F.linear`, `torch.matmul` / `mm` / `bmm` (functions and tensor methods) and `torch._grouped_mm` are
  computed as a batch of independent one-row products (a bmm whose entries are all [1, K] x [K, N]), so a
  token's projection is the same whether it is alone, in a batch of 16, or one of 500 prompt tokens.
- Transcendental elementwise ops run on inputs padded to whole SIMD vectors (`_pointwise`).
- Attention is computed one query at a time over exactly the keys it may see (`attend_row`): scores
  [H, 1, L], a float32 softmax over L, and [H, 1, L] x [H, L, Dv]; a decode step with a KV cache of length
  L and the training forward's row t (keys 0..t, L = t + 1) make the identical call.

`batch_invariant()` is a torch function mode, so the same model code runs invariantly on both sides:
the inference engine enters it for its forward passes, and the training forward pass does
`with batch_invariant(): model(ids, routed_experts=...)` to get log-probabilities bit-identical to the
engine's. It is slower (one-row products, a Python loop over attention rows): a correctness mode for RL
numerics and tests, not for speed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def attend_row(q_H1D: torch.Tensor, k_HLD: torch.Tensor, v_HLD: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row against L keys, with shapes fixed by L alone: [H, 1, Dqk] x [H, L, Dqk] -> [H, 1, Dv].
    Runs the raw kernels whether or not the mode is active, so the engine and the training side agree."""
    with torch._C.DisableTorchFunction():
        k_HLD, v_HLD = k_HLD.contiguous(), v_HLD.contiguous()
        scores_H1L = torch.bmm(q_H1D.contiguous(), k_HLD.transpose(-1, -2)) * scale
        probs_H1L = torch.softmax(scores_H1L.float(), dim=-1).to(v_HLD.dtype)
        return torch.bmm(probs_H1L, v_HLD)


def _row_mm(a_TK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """a @ b computed as T independent [1, K] x [K, N] products: a batched matmul whose every batch entry
    has the same shape, so row t's result cannot depend on T or on the other rows."""
    T, K = a_TK.shape
    with torch._C.DisableTorchFunction():
        return torch.bmm(a_TK[:, None, :], b_KN.expand(T, K, b_KN.shape[-1]))[:, 0]


def _linear(x, weight, bias=None):
    x_TK = x.reshape(-1, x.shape[-1])
    out = _row_mm(x_TK, weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _batched_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., M, K] x [..., K, N] (broadcast batch dims) with every row computed by _row_mm."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.stack([_row_mm(a3[i], b3[i]) for i in range(a3.shape[0])])
    return out.view(*batch, a.shape[-2], b.shape[-1])


def _matmul(a, b, *, out=None):
    if a.dim() == 1 or b.dim() == 1:
        result = torch.matmul(a, b)  # vector products reduce one row: nothing to vary
    elif a.dim() == 2 and b.dim() == 2:
        result = _row_mm(a, b)
    else:
        result = _batched_rows(a, b)
    if out is not None:
        return out.copy_(result)
    return result


def _grouped_mm(a_TK, b_GKN, *, offs=None, bias=None, out_dtype=None):
    if a_TK.dim() != 2 or b_GKN.dim() != 3 or offs is None or bias is not None:
        raise NotImplementedError("batch_invariant() supports torch._grouped_mm(a [T,K], b [G,K,N], offs=...) only")
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out.append(_row_mm(a_TK[start:end], b_GKN[g]))
        start = end
    y = torch.cat(out) if out else a_TK.new_zeros(0, b_GKN.shape[-1])
    if y.shape[0] < a_TK.shape[0]:  # rows past the last offset are zero, as in the fused kernel
        y = torch.cat([y, y.new_zeros(a_TK.shape[0] - y.shape[0], y.shape[1])])
    return y.to(out_dtype) if out_dtype is not None else y


_CHUNK = 1 << 15  # elements per call: below ATen's parallel grain, and a multiple of every SIMD width


def _pointwise(fn):
    """Wrap a transcendental elementwise op (sigmoid, exp, cos, ...) so every element takes the SIMD path.
    ATen computes the whole vectors of a buffer with SIMD kernels and the leftover tail with scalar code
    whose rounding differs, so an element's value would depend on where the tensor ends (e.g. the last
    token of a batch). Padding the flat input to whole vectors, in chunks below the parallel grain size,
    removes the tail."""
    def run(x, *args, **kwargs):
        kwargs.pop("inplace", None)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return fn(x, *args, **kwargs)
        n = x.numel()
        flat = F.pad(x.reshape(-1), (0, (-n) % 64))
        parts = [fn(flat[i:i + _CHUNK], *args, **kwargs) for i in range(0, flat.numel(), _CHUNK)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out[:n].view(x.shape)
    return run


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
    """Routes shape-sensitive ops to per-row implementations (see module docstring). Everything else,
    including the bodies of custom autograd Functions (which run their ops under the mode), is unchanged."""

    _HANDLERS = {
        F.linear: _linear,
        torch.matmul: _matmul, torch.Tensor.matmul: _matmul, torch.Tensor.__matmul__: _matmul,
        torch.mm: _matmul, torch.Tensor.mm: _matmul,
        torch.bmm: _matmul, torch.Tensor.bmm: _matmul,
        F.scaled_dot_product_attention: _sdpa,
    }
    for _fn in (torch.sigmoid, torch.exp, torch.expm1, torch.log, torch.log1p, torch.cos, torch.sin, torch.tanh,
                torch.erf, torch.rsqrt, F.silu, F.gelu, F.softplus):
        _HANDLERS[_fn] = _pointwise(_fn)
        _method = getattr(torch.Tensor, _fn.__name__, None)
        if _method is not None:
            _HANDLERS[_method] = _pointwise(_method)
    del _fn, _method
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
