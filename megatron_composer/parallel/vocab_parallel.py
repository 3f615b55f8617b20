"""Losses on vocabulary-sharded logits, without ever gathering the vocabulary.

Logits are [..., V/tp] on each tensor-parallel rank (the output of a ColumnParallelLinear head). Only
per-token scalars cross ranks: the running max, the softmax denominator, the target logit and E_p[z].
Every function returns the same values on all tp ranks, and the gradients match the unsharded ones.
"""

from __future__ import annotations

import torch

from megatron_composer.parallel import collectives as C


def _vocab_range(logits: torch.Tensor, group) -> tuple[int, int]:
    v_local = logits.shape[-1]
    start = C.group_rank(group) * v_local
    return start, start + v_local


def _local_target_logit(z: torch.Tensor, target: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    start, end = _vocab_range(z, group)
    outside = (target < start) | (target >= end)
    local_t = (target - start).masked_fill(outside, 0)
    picked = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return picked, ~outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token CE; saves only the local softmax (as Megatron does), not the log-softmax graph."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        z = logits.float()
        z = z - C.all_reduce_max(z.max(dim=-1).values, group).unsqueeze(-1)
        valid = target != ignore_index
        t = target.masked_fill(~valid, 0)
        picked, inside = _local_target_logit(z, t, group)
        picked = C.all_reduce(picked, group)
        exp = z.exp_()
        sum_exp = C.all_reduce(exp.sum(dim=-1), group)
        loss = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        start, _ = _vocab_range(logits, group)
        ctx.save_for_backward(softmax, (t - start).masked_fill(~inside, 0), inside & valid, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, hit, valid = ctx.saved_tensors
        grad = softmax.mul_((g * valid).unsqueeze(-1))
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(g * hit).unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy [...] from vocab-sharded logits [..., V/tp]; ignored targets give 0."""
    if C.group_size(group) == 1:
        return torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction="none",
        ).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)


def vocab_parallel_log_softmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Local slice [..., V/tp] of log_softmax over the full vocabulary (differentiable)."""
    z = logits.float()
    m = C.all_reduce_max(z.detach().max(dim=-1).values, group).unsqueeze(-1)
    # Every rank uses the total in its own (later summed) terms, so its gradient is partial: all-reduce it
    # in backward too (copy_to after reduce_from), unlike a replicated consumer of an all-reduce.
    sum_exp = C.copy_to_parallel(C.reduce_from_parallel((z - m).exp().sum(dim=-1, keepdim=True), group), group)
    return z - m - sum_exp.log()


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """log p(target) per token from vocab-sharded logits (differentiable, as RL losses need)."""
    return -vocab_parallel_cross_entropy(logits, target, group)


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, target: torch.Tensor, group
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy of p) per token, both differentiable, from vocab-sharded logits."""
    logp = vocab_parallel_log_softmax(logits, group)
    picked, _ = _local_target_logit(logp, target, group)
    target_logp = C.reduce_from_parallel(picked, group)
    entropy = -C.reduce_from_parallel((logp.exp() * logp).sum(dim=-1), group)
    return target_logp, entropy


def vocab_parallel_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, group) -> torch.Tensor:
    """Per-token KL(p || q) between two vocab-sharded distributions (e.g. main head vs MTP head)."""
    logp = vocab_parallel_log_softmax(logits_p, group)
    logq = vocab_parallel_log_softmax(logits_q, group)
    return C.reduce_from_parallel((logp.exp() * (logp - logq)).sum(dim=-1), group)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, group) -> torch.Tensor:
    """Global vocabulary index of the largest logit per token (ties go to the lowest index, as torch.argmax)."""
    start, _ = _vocab_range(logits, group)
    local_max, local_idx = logits.float().max(dim=-1)
    best = C.all_reduce_max(local_max, group)
    # among ranks holding the maximum, the lowest global index wins
    none = torch.full_like(local_idx, torch.iinfo(torch.long).max)
    candidate = torch.where(local_max == best, local_idx + start, none)
    return -C.all_reduce_max(-candidate, group)


__all__ = ["vocab_parallel_argmax", "vocab_parallel_cross_entropy", "vocab_parallel_log_softmax",
           "vocab_parallel_logprobs",
           "vocab_parallel_logprobs_entropy", "vocab_parallel_kl"]
