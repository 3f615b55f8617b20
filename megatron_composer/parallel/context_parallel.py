"""Context parallelism: each sequence is cut into 2*cp chunks and rank r keeps chunks r and 2cp-1-r (head-tail),
so every rank has the same amount of causal attention work.

Attention all-gathers K/V over the cp group (for MLA the compressed latent and the rope key are gathered
before their up-projection, which is 1/(heads) of the traffic) and runs a blockwise (flash-style) exact
attention masked by global token index and global document id, so packed documents and causality hold across
shards without an [S/cp, S] mask or score matrix in memory. RoPE needs nothing special: the
position ids are sharded with the tokens. MTP's shifted ids are fetched across shard boundaries by gathering
the (integer) ids over cp.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_composer.parallel import collectives as C

KEY_BLOCK = 1024  # keys per score block of the blockwise core (its [Sq, KEY_BLOCK] float32 scores per head)


def shard_sequence(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Chunks cp_rank and 2*cp-1-cp_rank of `dim` (split into 2*cp equal chunks), concatenated."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp) != 0:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2*cp = {2 * cp}; "
                         f"change the sequence length or parallel.cp")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim)


def global_token_index(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Index in the full sequence of each local token."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp, cp_rank)


def unshard_sequence(x_gathered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Inverse of shard_sequence applied to the cp shards concatenated in rank order."""
    if cp == 1:
        return x_gathered
    pieces = x_gathered.chunk(2 * cp, dim=dim)  # rank r contributed pieces 2r (chunk r) and 2r+1 (chunk 2cp-1-r)
    ordered = [None] * (2 * cp)
    for r in range(cp):
        ordered[r], ordered[2 * cp - 1 - r] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat(ordered, dim=dim)


def _document_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    from megatron_composer.model.attention import document_ids  # the model's rule for packed rows

    doc = document_ids(position_ids_BS)
    return torch.zeros_like(position_ids_BS) if doc is None else doc


def cp_shift_left(x: torch.Tensor, k: int, dim: int, cp_group, fill=0) -> torch.Tensor:
    """For head-tail sharded x, the local view of the full sequence shifted left by k: y[t] = x[t + k]
    (positions past the end get `fill`). Only the first k entries of every chunk cross ranks (one small
    all-gather), e.g. the main-head logits or position ids at t + k for the MTP loss at t."""
    cp, r = C.group_size(cp_group), C.group_rank(cp_group)
    n_chunks = 2 * cp
    chunk = x.shape[dim] // 2
    if k > chunk:
        raise ValueError(f"shift {k} exceeds the context-parallel chunk length {chunk}; use a shorter MTP depth or "
                         f"a smaller parallel.cp")
    mine = x.split(chunk, dim=dim)  # chunks r and 2cp-1-r
    heads = torch.cat([mine[0].narrow(dim, 0, k), mine[1].narrow(dim, 0, k)], dim=dim)
    all_heads = C.gather_from_parallel(heads, dim, cp_group, grad_is_partial=True).split(k, dim=dim)
    head_of_chunk = {}
    for src in range(cp):
        head_of_chunk[src], head_of_chunk[n_chunks - 1 - src] = all_heads[2 * src], all_heads[2 * src + 1]
    out = []
    for c, local in zip((r, n_chunks - 1 - r), mine):
        if c + 1 < n_chunks:
            nxt = head_of_chunk[c + 1]
        else:
            shape = list(local.shape)
            shape[dim] = k
            nxt = torch.full(shape, fill, dtype=x.dtype, device=x.device)
        out.append(torch.cat([local.narrow(dim, k, chunk - k), nxt], dim=dim))
    return torch.cat(out, dim=dim)


def sharded_sequence_balance_loss(scores_BSE: torch.Tensor, indices_BSK: torch.Tensor, num_experts: int,
                                  seq_group, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss when each sequence is split over `seq_group` (context and/or
    sequence parallel ranks; ParallelGroups kind "cp_tp" covers both): expert counts and summed normalised
    scores are all-reduced over the sequence's shards. Each rank returns 1/n of the loss, so summing the ranks'
    losses (as their gradients are summed) gives the single-process loss and gradient."""
    B, S_local, K = indices_BSK.shape
    n = C.group_size(seq_group)
    counts_BE = torch.zeros(B, num_experts, device=scores_BSE.device).scatter_add_(
        1, indices_BSK.reshape(B, -1), torch.ones(B, S_local * K, device=scores_BSE.device))
    counts_BE = C.all_reduce(counts_BE, seq_group)
    f_BE = counts_BE * (num_experts / (K * seq_len))
    p_sum_BE = (scores_BSE / scores_BSE.sum(-1, keepdim=True).clamp_min(1e-20)).sum(1)
    # every rank uses the total in its own (later summed) 1/n share: all-reduce forward and backward
    p_BE = C.copy_to_parallel(C.reduce_from_parallel(p_sum_BE, seq_group), seq_group) / seq_len
    return (f_BE * p_BE).sum(-1).mean() / n


def _block_mask(q_idx, k_idx, doc_q, doc_k):
    """[B, 1, 1, Sq, Sk] causal-within-document mask for one key block (global token indices)."""
    return ((q_idx[:, None] >= k_idx[None, :]) & (doc_q[:, :, None] == doc_k[:, None, :]))[:, None, None]


def _forward_blocks(qg, k, v, scale, q_idx, k_idx, doc_q, doc_k, block, m, l, acc):
    """Online-softmax accumulation of one K/V shard, `block` keys at a time (updates m, l, acc). K/V stay in their
    own dtype and are cast to qg's one block at a time: a whole-shard float32 copy of a gathered MLA K/V is
    several GiB at long context."""
    for j in range(0, k.shape[2], block):
        kb, vb = k[:, :, None, j:j + block].to(qg.dtype), v[:, :, None, j:j + block].to(qg.dtype)
        s = (qg @ kb.transpose(-1, -2)).mul_(scale)  # one [Sq, block] score block per head, reused in place
        s.masked_fill_(~_block_mask(q_idx, k_idx[j:j + block], doc_q, doc_k[:, j:j + block]), float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = s.sub_(shift[..., None]).exp_()
        corr = torch.exp(m - shift)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + p @ vb
        m = m_new
        del s, p
    return m, l, acc


def _backward_blocks(qg, k, v, do, delta, lse, scale, q_idx, k_idx, doc_q, doc_k, block, grad_dtype=None):
    """Gradients (dq contribution, dk, dv) of one K/V shard, recomputing probabilities from the lse. K/V are cast
    to qg's dtype a block at a time, and dk, dv are made in `grad_dtype` (None: k's and v's own dtypes, when they
    are final; the ring's accumulators pass float32); each key block's rows are written once, so casting them per
    block rounds exactly as one cast at the end would. At most two [Sq, block] score blocks per head are live
    (the probabilities and their gradient, computed in place)."""
    dq = torch.zeros_like(qg)
    dk, dv = torch.zeros_like(k, dtype=grad_dtype), torch.zeros_like(v, dtype=grad_dtype)
    for j in range(0, k.shape[2], block):
        kb, vb = k[:, :, None, j:j + block].to(qg.dtype), v[:, :, None, j:j + block].to(qg.dtype)
        mask = _block_mask(q_idx, k_idx[j:j + block], doc_q, doc_k[:, j:j + block])
        p = (qg @ kb.transpose(-1, -2)).mul_(scale).sub_(lse[..., None]).exp_().masked_fill_(~mask, 0.0)
        dv[:, :, j:j + block] = (p.transpose(-1, -2) @ do).sum(2)
        ds = (do @ vb.transpose(-1, -2)).sub_(delta[..., None]).mul_(p).mul_(scale)
        del p
        dq += ds @ kb
        dk[:, :, j:j + block] = (ds.transpose(-1, -2) @ qg).sum(2)
        del ds
    return dq, dk, dv


def _init_state(q, k, v):
    B, H, Sq, Dq = q.shape
    KV, Dv = k.shape[1], v.shape[3]
    ct = torch.promote_types(q.dtype, torch.float32)  # accumulate in at least fp32
    qg = q.to(ct).reshape(B, KV, H // KV, Sq, Dq)
    m = qg.new_full((B, KV, H // KV, Sq), float("-inf"))
    return qg, m, torch.zeros_like(m), qg.new_zeros((B, KV, H // KV, Sq, Dv))


class _BlockwiseAttention(torch.autograd.Function):
    """Exact softmax attention over key blocks with an online softmax (flash-attention style, in PyTorch):
    the [Sq, Sk] scores and mask exist one key block at a time, and backward recomputes them from the saved
    log-sum-exp. q [B, H, Sq, Dq]; k [B, KV, Sk, Dq], v [B, KV, Sk, Dv] with H a multiple of KV (GQA shares
    each K/V head with H/KV query heads). Masks come from global token indices and document ids."""

    @staticmethod
    def forward(ctx, q, k, v, scale, q_idx, k_idx, doc_q, doc_k, block):
        qg, m, l, acc = _init_state(q, k, v)
        m, l, acc = _forward_blocks(qg, k, v, scale, q_idx, k_idx, doc_q, doc_k, block, m, l, acc)
        out = acc / l[..., None]  # every query sees at least itself, so l > 0
        ctx.save_for_backward(q, k, v, out, m + l.log(), q_idx, k_idx, doc_q, doc_k)
        ctx.scale, ctx.block = scale, block
        return out.reshape(q.shape[:3] + (v.shape[3],)).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_idx, k_idx, doc_q, doc_k = ctx.saved_tensors
        qg = q.to(out.dtype).reshape(out.shape[:4] + (q.shape[3],))
        do = dout.to(out.dtype).reshape(out.shape)
        delta = (do * out).sum(-1)
        dq, dk, dv = _backward_blocks(qg, k, v, do, delta, lse, ctx.scale, q_idx, k_idx, doc_q, doc_k, ctx.block)
        return (dq.reshape(q.shape).to(q.dtype), dk, dv,
                None, None, None, None, None, None)


class _RingAttention(torch.autograd.Function):
    """Blockwise attention where each rank starts with its own K/V shard and passes it to the next rank of the
    cp ring cp-1 times; backward sends the shards round again with their gradient accumulators, which arrive
    back at their owner after cp passes. Holds one remote shard at a time instead of the gathered sequence."""

    @staticmethod
    def forward(ctx, q, k, v, scale, q_idx, doc_q, k_idx_of, doc_k_of, block, group):
        n, r = C.group_size(group), C.group_rank(group)
        qg, m, l, acc = _init_state(q, k, v)
        kb, vb = k, v  # travel in their own dtype
        for step in range(n):
            origin = (r - step) % n
            if step < n - 1:
                pending = C.ring_exchange_start([kb, vb], group)
            m, l, acc = _forward_blocks(qg, kb, vb, scale, q_idx, k_idx_of[origin], doc_q, doc_k_of[origin], block,
                                        m, l, acc)
            if step < n - 1:
                kb, vb = C.ring_exchange_finish(pending)
        out = acc / l[..., None]
        ctx.save_for_backward(q, k, v, out, m + l.log(), q_idx, doc_q)
        ctx.k_idx_of, ctx.doc_k_of, ctx.scale, ctx.block, ctx.group = k_idx_of, doc_k_of, scale, block, group
        return out.reshape(q.shape[:3] + (v.shape[3],)).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_idx, doc_q = ctx.saved_tensors
        group = ctx.group
        n, r = C.group_size(group), C.group_rank(group)
        qg = q.to(out.dtype).reshape(out.shape[:4] + (q.shape[3],))
        do = dout.to(out.dtype).reshape(out.shape)
        delta = (do * out).sum(-1)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k, dtype=out.dtype), torch.zeros_like(v, dtype=out.dtype)
        dq = torch.zeros_like(qg)
        for step in range(n):
            origin = (r - step) % n
            dq_part, dk_part, dv_part = _backward_blocks(qg, kb, vb, do, delta, lse, ctx.scale, q_idx,
                                                         ctx.k_idx_of[origin], doc_q, ctx.doc_k_of[origin], ctx.block,
                                                         grad_dtype=out.dtype)
            dq += dq_part
            dkb, dvb = dkb + dk_part, dvb + dv_part
            if step < n - 1:
                kb, vb, dkb, dvb = C.ring_exchange_finish(C.ring_exchange_start([kb, vb, dkb, dvb], group))
            else:  # the accumulators travel one last hop, home to the shard's owner
                dkb, dvb = C.ring_exchange_finish(C.ring_exchange_start([dkb, dvb], group))
        return (dq.reshape(q.shape).to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype),
                None, None, None, None, None, None, None)


def blockwise_attention(q_BHSD, k_BKSD, v_BKSD, scale: float, q_idx, k_idx, doc_q_BS, doc_k_BS,
                        block: int = KEY_BLOCK):
    """Causal attention within documents by global token index, without materialising [Sq, Sk] tensors."""
    return _BlockwiseAttention.apply(q_BHSD.contiguous(), k_BKSD.contiguous(), v_BKSD.contiguous(), scale,
                                     q_idx, k_idx, doc_q_BS, doc_k_BS, block)


class ContextParallelAttention:
    """Replacement for an attention module's `core` (q/k/v [B, H, S, D], scale, doc ids) under cp > 1.

    kv_exchange "allgather": K/V (for MLA the latent, gathered upstream by the plan) are all-gathered;
    "ring": each rank's K/V shard is passed around the cp ring (memory for one remote shard at a time).
    `set_positions` must see each forward's local position ids first (a forward pre-hook on the model does
    it): the local doc ids the model computes cannot know about documents on other ranks.
    """

    def __init__(self, cp_group, block: int = KEY_BLOCK, kv_exchange: str = "allgather"):
        if kv_exchange not in ("allgather", "ring"):
            raise ValueError(f"kv_exchange is {kv_exchange!r}; use allgather or ring")
        self.group, self.kv_exchange = cp_group, kv_exchange
        self.cp, self.cp_rank = C.group_size(cp_group), C.group_rank(cp_group)
        self.q_idx = self.k_idx = self.doc_q = self.doc_k = None
        self.k_idx_of = self.doc_k_of = None
        self.block = block

    @torch.no_grad()
    def set_positions(self, position_ids_BS: torch.Tensor) -> None:
        S_local = position_ids_BS.shape[1]
        S = S_local * self.cp
        self.q_idx = global_token_index(S, self.cp, self.cp_rank, position_ids_BS.device)
        self.k_idx = torch.cat([global_token_index(S, self.cp, r, position_ids_BS.device) for r in range(self.cp)])
        full_pos = unshard_sequence(C.all_gather(position_ids_BS, 1, self.group), 1, self.cp)
        doc = _document_ids(full_pos)
        self.doc_q, self.doc_k = doc[:, self.q_idx].contiguous(), doc[:, self.k_idx].contiguous()
        self.k_idx_of = self.k_idx.chunk(self.cp)  # keys of the shard that originated on each rank
        self.doc_k_of = [d.contiguous() for d in self.doc_k.chunk(self.cp, dim=1)]

    def gather_kv(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather along the sequence; gradients from every rank's queries are summed back."""
        return C.gather_from_parallel(t, dim, self.group, grad_is_partial=True)

    def __call__(self, q_BHSD, k_BHSD, v_BHSD, scale: float, doc_ids_BS: Optional[torch.Tensor] = None):
        if self.q_idx is None:
            raise RuntimeError("context-parallel attention ran without position ids; call the parallelised model "
                               "with the sharded position_ids")
        if self.kv_exchange == "ring":
            return _RingAttention.apply(q_BHSD.contiguous(), k_BHSD.contiguous(), v_BHSD.contiguous(), scale,
                                        self.q_idx, self.doc_q, self.k_idx_of, self.doc_k_of, self.block, self.group)
        if k_BHSD.shape[2] == q_BHSD.shape[2]:  # not gathered upstream (GQA); MLA gathers its latent instead
            k_BHSD, v_BHSD = self.gather_kv(k_BHSD, 2), self.gather_kv(v_BHSD, 2)
        return blockwise_attention(q_BHSD, k_BHSD, v_BHSD, scale, self.q_idx, self.k_idx, self.doc_q, self.doc_k,
                                   self.block)


class ContextParallelShiftedIds:
    """Replacement for the model's `mtp_shifted_ids`: shift within the full sequence, then re-shard, so the
    ids that cross a shard boundary come from the rank holding the next chunk."""

    def __init__(self, cp_group, shifted_ids_fn):
        self.group, self.fn = cp_group, shifted_ids_fn
        self.cp, self.cp_rank = C.group_size(cp_group), C.group_rank(cp_group)

    @torch.no_grad()
    def __call__(self, input_ids_BS: torch.Tensor, k: int) -> torch.Tensor:
        full = unshard_sequence(C.all_gather(input_ids_BS, 1, self.group), 1, self.cp)
        return shard_sequence(self.fn(full, k), 1, self.cp, self.cp_rank)


__all__ = ["shard_sequence", "unshard_sequence", "global_token_index", "cp_shift_left", "blockwise_attention",
           "sharded_sequence_balance_loss", "ContextParallelAttention",
           "ContextParallelShiftedIds"]
