"""Causal (document-aware) softmax attention for CPU, by query blocks, with its reference next to it.

Why not `scaled_dot_product_attention` on CPU: its flash kernel walks small q/k tiles whose per-tile work is
dominated by overhead at the head dims of MoE models (MLA: 192/128, the tiny configs 48/32), and with a
document mask it falls back to materialising [B, H, S, S]. Here each block of query rows is one batched
matmul against exactly the keys it may see (from the earliest document start in the block up to the
block's last row), a float32 softmax, and one batched matmul with V. Backward reuses the probabilities when
they are small (short sequences: saves a matmul and an exp per score) and otherwise recomputes them from the
saved log-sum-exp, so memory stays O(S) per head beyond one block of scores.

GQA without repeating K/V: queries are laid out [B*KV, S, H/KV, D], so the H/KV heads sharing a K/V head
are extra rows of the same matmul.

The same function is compiled from csrc/causal_attention.cpp (kernels/cpu/cpp.py) and runs whenever it could be
built: the Python blocks' many small torch ops parallelise poorly past one thread, while the C++ kernel splits
the work into tasks (batch x kv-head x query block) that threads take largest first. The Python autograd
function below stays the reference and the fallback (no compiler, MEGATRON_COMPOSER_CPP=0, mixed dtypes).

    sdpa_attention(q, k, v, scale, doc_ids)  # the entry point: causal_attention on CPU, SDPA elsewhere
    causal_attention(q [B,H,S,Dqk], k [B,KV,S,Dqk], v [B,KV,S,Dv], scale, doc_ids [B,S] or None) -> [B,H,S,Dv]
    reference_attention(...)  # same contract through SDPA with an explicit mask, for the tests
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .cpu import cpp

# Scores of one query block are kept under this many float32 elements (rows x keys x batch*kv-heads).
_BLOCK_ELEMENTS = 1 << 22
# Probabilities of a whole call are kept for backward (instead of recomputed) up to this many elements.
_SAVED_PROB_ELEMENTS = 1 << 24


def _rows_per_block(n: int, rep: int, seq: int) -> int:
    """Query positions per block: about 64 matmul rows (q heads sharing a K/V head count as rows), fewer
    when the whole block of scores would pass _BLOCK_ELEMENTS."""
    rows = max(1, 64 // rep)
    while rows > 1 and n * rows * rep * seq > _BLOCK_ELEMENTS:
        rows //= 2
    return rows


def _doc_starts(doc_ids_BS: Optional[torch.Tensor], S: int) -> Optional[torch.Tensor]:
    """Index of the first token of each token's document [B, S], or None for one document per row."""
    if doc_ids_BS is None:
        return None
    idx = torch.arange(S, device=doc_ids_BS.device).expand_as(doc_ids_BS)
    new_doc = F.pad(doc_ids_BS[:, 1:] != doc_ids_BS[:, :-1], (1, 0), value=True)
    return torch.where(new_doc, idx, torch.zeros_like(idx)).cummax(dim=1).values


class _Blocks:
    """The query blocks of one call as (first row, end row, first key, first masked key); their masks are
    rebuilt when used (`drop`), so backward holds the document ids, never O(S^2) masks."""

    def __init__(self, B: int, KV: int, rep: int, S: int, doc_ids_BS: Optional[torch.Tensor]):
        rows = _rows_per_block(B * KV, rep, S)
        starts = _doc_starts(doc_ids_BS, S)
        self.doc_ids_BS = doc_ids_BS
        self.items = []
        for s0 in range(0, S, rows):
            e = min(S, s0 + rows)
            k0 = 0 if starts is None else int(starts[:, s0].min())  # keys before every row's document: skipped
            m0 = s0 if doc_ids_BS is None else k0  # without documents only the block's own square is masked
            self.items.append((s0, e, k0, m0))
        self.prob_elements = B * KV * rep * sum((e - k0) * (e - s0) for s0, e, k0, _ in self.items)

    def drop(self, s0: int, e: int, m0: int, device) -> torch.Tensor:
        """Mask of keys m0:e that rows s0:e may not see, as [B or 1, 1, rows, 1, keys] against scores viewed
        [B, KV, rows, rep, keys]."""
        q_pos = torch.arange(s0, e, device=device)
        k_pos = torch.arange(m0, e, device=device)
        keep = (k_pos[None, :] <= q_pos[:, None])[None]
        if self.doc_ids_BS is not None:
            keep = keep & (self.doc_ids_BS[:, s0:e, None] == self.doc_ids_BS[:, None, m0:e])
        return ~keep[:, None, :, None, :]


def _block_scores(q_NRD, k_NLD, blocks, s0, e, k0, m0, scale, B, KV, rep):
    """Scores of rows s0:e against keys k0:e, scaled and masked: [N, (e-s0)*rep, e-k0] float32."""
    s = torch.bmm(q_NRD[:, s0 * rep:e * rep], k_NLD[:, k0:e].transpose(1, 2)).mul_(scale)
    s.view(B, KV, e - s0, rep, e - k0)[..., m0 - k0:].masked_fill_(blocks.drop(s0, e, m0, s.device), float("-inf"))
    return s


def _as_rows(x_BHSD: torch.Tensor, KV: int, ct: torch.dtype) -> torch.Tensor:
    """[B, H, S, D] -> [B*KV, S*H/KV, D] in dtype ct: rows ordered (position, head within the K/V group)."""
    B, H, S, D = x_BHSD.shape
    return x_BHSD.to(ct).view(B, KV, H // KV, S, D).transpose(2, 3).reshape(B * KV, S * (H // KV), D)


class _CausalAttention(torch.autograd.Function):
    """Saves the inputs in their own dtype, the output (written straight into the [B, S, H, Dv] layout the
    output projection reads, so the two share one tensor), the log-sum-exp, and the probabilities when small."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BKSD, v_BKSD, scale, doc_ids_BS):
        B, H, S, _ = q_BHSD.shape
        KV, Dv = k_BKSD.shape[1], v_BKSD.shape[-1]
        rep = H // KV
        ct = torch.promote_types(q_BHSD.dtype, torch.float32)
        q, k, v = _as_rows(q_BHSD, KV, ct), _as_rows(k_BKSD, KV, ct), _as_rows(v_BKSD, KV, ct)
        blocks = _Blocks(B, KV, rep, S, doc_ids_BS)
        out_BSHD = q_BHSD.new_empty(B, S, H, Dv)
        out_BSKRD = out_BSHD.view(B, S, KV, rep, Dv)
        lse = q.new_empty(B * KV, S * rep)
        keep_probs = blocks.prob_elements <= _SAVED_PROB_ELEMENTS
        probs = []
        for s0, e, k0, m0 in blocks.items:
            p = _block_scores(q, k, blocks, s0, e, k0, m0, scale, B, KV, rep)
            m = p.amax(dim=-1, keepdim=True)  # every row sees at least itself: finite
            denom = p.sub_(m).exp_().sum(dim=-1, keepdim=True)
            p.div_(denom)
            lse[:, s0 * rep:e * rep] = (m + denom.log()).squeeze(-1)
            o = torch.bmm(p, v[:, k0:e]).view(B, KV, e - s0, rep, Dv)
            out_BSKRD[:, s0:e].copy_(o.transpose(1, 2))
            if keep_probs:
                probs.append(p)
        ctx.save_for_backward(q_BHSD, k_BKSD, v_BKSD, out_BSHD, lse, *probs)
        ctx.blocks, ctx.scale = blocks, scale
        return out_BSHD.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout_BHSD):
        q_BHSD, k_BKSD, v_BKSD, out_BSHD, lse, *probs = ctx.saved_tensors
        B, H, S, _ = q_BHSD.shape
        KV = k_BKSD.shape[1]
        rep, scale, ct = H // KV, ctx.scale, lse.dtype
        q, k, v = _as_rows(q_BHSD, KV, ct), _as_rows(k_BKSD, KV, ct), _as_rows(v_BKSD, KV, ct)
        do = _as_rows(dout_BHSD, KV, ct)
        delta_BHS = (dout_BHSD.to(ct) * out_BSHD.transpose(1, 2).to(ct)).sum(-1)
        delta = delta_BHS.view(B, KV, rep, S).transpose(2, 3).reshape(B * KV, S * rep)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i, (s0, e, k0, m0) in enumerate(ctx.blocks.items):
            r0, r1 = s0 * rep, e * rep
            if probs:
                p = probs[i]
            else:
                p = _block_scores(q, k, ctx.blocks, s0, e, k0, m0, scale, B, KV, rep).sub_(lse[:, r0:r1, None]).exp_()
            dv[:, k0:e] += torch.bmm(p.transpose(1, 2), do[:, r0:r1])
            ds = torch.bmm(do[:, r0:r1], v[:, k0:e].transpose(1, 2))
            ds.sub_(delta[:, r0:r1, None]).mul_(p).mul_(scale)
            torch.bmm(ds, k[:, k0:e], out=dq[:, r0:r1])
            dk[:, k0:e] += torch.bmm(ds.transpose(1, 2), q[:, r0:r1])
        dq = dq.view(B, KV, S, rep, -1).transpose(2, 3).reshape(B, H, S, -1).to(q_BHSD.dtype)
        return dq, dk.view(B, KV, S, -1).to(k_BKSD.dtype), dv.view(B, KV, S, -1).to(v_BKSD.dtype), None, None


class _CausalAttentionCpp(torch.autograd.Function):
    """The C++ kernel with the same saved state as _CausalAttention: inputs in their own dtype, the output
    ([B, S, H, Dv], shared with the output projection), the log-sum-exp, and the probabilities when small."""

    @staticmethod
    def forward(ctx, kernel, q_BHSD, k_BKSD, v_BKSD, scale, doc_ids_BS, keep_prob_elements):
        rows = _rows_per_block(1, q_BHSD.shape[1] // k_BKSD.shape[1], q_BHSD.shape[2])
        out_BSHD, lse, probs = kernel.forward(q_BHSD, k_BKSD, v_BKSD, scale, doc_ids_BS, rows, keep_prob_elements)
        ctx.save_for_backward(q_BHSD, k_BKSD, v_BKSD, out_BSHD, lse, probs)
        ctx.kernel, ctx.scale, ctx.doc_ids_BS, ctx.rows = kernel, scale, doc_ids_BS, rows
        return out_BSHD.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout_BHSD):
        q_BHSD, k_BKSD, v_BKSD, out_BSHD, lse, probs = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout_BHSD, q_BHSD, k_BKSD, v_BKSD, out_BSHD, lse, probs, ctx.scale,
                                         ctx.doc_ids_BS, ctx.rows)
        return None, dq, dk, dv, None, None, None


_CPP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _compiled():
    """The C++ kernel, or None where it cannot be built (kernels/cpu/cpp.py builds it with OpenMP: ATen's
    parallel_for is a header template that only runs on the ATen threads when compiled with OpenMP)."""
    return cpp.load("causal_attention")


def causal_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, scale: float,
                     doc_ids_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention within documents; k/v may have fewer heads than q (GQA). Computes in float32 (or
    float64 for float64 inputs) and returns q's dtype. Documents are contiguous runs of equal doc_ids (as
    model.attention.document_ids labels them). Runs the C++ kernel where it is built, else the Python one."""
    H, KV = q_BHSD.shape[1], k_BKSD.shape[1]
    if H % KV:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({KV})")
    kernel = _compiled()
    if (kernel is not None and q_BHSD.device.type == "cpu" and q_BHSD.dtype in _CPP_DTYPES
            and q_BHSD.dtype == k_BKSD.dtype == v_BKSD.dtype and q_BHSD.shape[0] * KV > 0):
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSD, k_BKSD, v_BKSD))
        keep = _SAVED_PROB_ELEMENTS if needs_grad else 0
        return _CausalAttentionCpp.apply(kernel, q_BHSD, k_BKSD, v_BKSD, scale, doc_ids_BS, keep)
    return _CausalAttention.apply(q_BHSD, k_BKSD, v_BKSD, scale, doc_ids_BS)


def sdpa_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, scale: float,
                   doc_ids_BS: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention (within documents when doc_ids_BS is given). k/v may have fewer heads (GQA).

    The device-neutral entry point (the model's default attention core): on CPU the query-block kernel
    (causal_attention above: C++ where built) is faster than SDPA's and skips keys of earlier documents; on
    other devices, and under a torch function mode (batch-invariant numerics, tracing: the mode must see the
    standard op), torch's SDPA."""
    if q_BHSD.device.type == "cpu" and not torch._C._is_torch_function_mode_enabled():
        return causal_attention(q_BHSD, k_BHSD, v_BHSD, scale, doc_ids_BS)
    if k_BHSD.shape[1] != q_BHSD.shape[1]:
        rep = q_BHSD.shape[1] // k_BHSD.shape[1]
        k_BHSD = k_BHSD.repeat_interleave(rep, dim=1)
        v_BHSD = v_BHSD.repeat_interleave(rep, dim=1)
    if doc_ids_BS is None:
        dv, dqk = v_BHSD.shape[-1], q_BHSD.shape[-1]
        if dv < dqk and not torch._C._is_torch_function_mode_enabled():
            # Flash kernels want one head dim for q, k and v (MLA has v_head_dim < qk_head_dim): zero-pad v
            # and drop the padding, which is exact and avoids the materialised-softmax fallback. Not under a
            # mode: it gets the real v, so batch-invariant attention makes the same [1, L] x [L, Dv] product
            # as the engine's cached decode (a padded Dv changes the GEMM's blocking and the last bits).
            out = F.scaled_dot_product_attention(q_BHSD, k_BHSD, F.pad(v_BHSD, (0, dqk - dv)), is_causal=True,
                                                 scale=scale)
            return out[..., :dv]
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=scale)
    S = q_BHSD.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q_BHSD.device).tril()
    mask_B1SS = (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :]) & causal
    return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=mask_B1SS[:, None], scale=scale)


def reference_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, scale: float,
                        doc_ids_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same function through SDPA with an explicit [B, 1, S, S] mask (the test oracle)."""
    rep = q_BHSD.shape[1] // k_BKSD.shape[1]
    k, v = k_BKSD.repeat_interleave(rep, dim=1), v_BKSD.repeat_interleave(rep, dim=1)
    S = q_BHSD.shape[2]
    keep = torch.ones(S, S, dtype=torch.bool, device=q_BHSD.device).tril()[None]
    if doc_ids_BS is not None:
        keep = keep & (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :])
    return F.scaled_dot_product_attention(q_BHSD, k, v, attn_mask=keep[:, None], scale=scale)
