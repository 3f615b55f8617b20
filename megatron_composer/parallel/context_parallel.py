"""Context parallelism: each sequence is cut into 2*cp chunks and rank r keeps chunks r and 2cp-1-r (head-tail),
so every rank has the same amount of causal attention work.

Attention all-gathers K/V over the cp group (for MLA the compressed latent and the rope key are gathered
before their up-projection, which is 1/(heads) of the traffic) and masks with the global token index and the
global document id, so packed documents and causality hold across shards. RoPE needs nothing special: the
position ids are sharded with the tokens. MTP's shifted ids are fetched across shard boundaries by gathering
the (integer) ids over cp.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_composer.parallel import collectives as C


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


class ContextParallelAttention:
    """Replacement for an attention module's `core` (q/k/v [B, H, S, D], scale, doc ids) under cp > 1.

    `set_positions` must see each forward's local position ids first (a forward pre-hook on the model does
    it): the local doc ids the model computes cannot know about documents on other ranks.
    """

    def __init__(self, cp_group):
        self.group = cp_group
        self.cp, self.cp_rank = C.group_size(cp_group), C.group_rank(cp_group)
        self.q_idx = self.k_idx = self.mask_B1QK = None

    @torch.no_grad()
    def set_positions(self, position_ids_BS: torch.Tensor) -> None:
        S_local = position_ids_BS.shape[1]
        S = S_local * self.cp
        self.q_idx = global_token_index(S, self.cp, self.cp_rank, position_ids_BS.device)
        self.k_idx = torch.cat([global_token_index(S, self.cp, r, position_ids_BS.device) for r in range(self.cp)])
        full_pos = unshard_sequence(C.all_gather(position_ids_BS, 1, self.group), 1, self.cp)
        doc = _document_ids(full_pos)
        # one mask per forward, shared by every layer: causal by global index, within documents
        causal = self.q_idx[:, None] >= self.k_idx[None, :]
        self.mask_B1QK = (causal & (doc[:, self.q_idx, None] == doc[:, None, self.k_idx]))[:, None]

    def gather_kv(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather along the sequence; gradients from every rank's queries are summed back."""
        return C.gather_from_parallel(t, dim, self.group, grad_is_partial=True)

    def __call__(self, q_BHSD, k_BHSD, v_BHSD, scale: float, doc_ids_BS: Optional[torch.Tensor] = None):
        if self.q_idx is None:
            raise RuntimeError("context-parallel attention ran without position ids; call the parallelised model "
                               "with the sharded position_ids")
        if k_BHSD.shape[2] == q_BHSD.shape[2]:  # not gathered upstream (GQA); MLA gathers its latent instead
            k_BHSD, v_BHSD = self.gather_kv(k_BHSD, 2), self.gather_kv(v_BHSD, 2)
        if k_BHSD.shape[1] != q_BHSD.shape[1]:
            rep = q_BHSD.shape[1] // k_BHSD.shape[1]
            k_BHSD = k_BHSD.repeat_interleave(rep, dim=1)
            v_BHSD = v_BHSD.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=self.mask_B1QK, scale=scale)


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


__all__ = ["shard_sequence", "unshard_sequence", "global_token_index", "cp_shift_left",
           "sharded_sequence_balance_loss", "ContextParallelAttention",
           "ContextParallelShiftedIds"]
