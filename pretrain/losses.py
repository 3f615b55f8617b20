"""Continued-pretraining losses: next-token cross-entropy and MTP self-distillation.

MTP depth k (1-based; the model's mtp_logits[k-1]) at position t predicts token t+1+k, the same token the
main head predicts at position t+k. Self-distillation trains the MTP head's distribution toward the main
head's distribution there, with the main logits detached so the main head is not pulled toward MTP:
forward KL(main || mtp) by default (mass-covering, matches speculative-decoding acceptance), reverse KL as
an option, plus an optional cross-entropy term on the true token. Pairs (t, t+k) that straddle a document
boundary of a packed row, or whose target is masked, are excluded.

With tensor parallelism the logits are vocab-sharded [.., V/tp]; pass the tp group as `vocab_group` and the
softmaxes, cross-entropies, KL sums and argmaxes are computed across shards (megatron_composer.parallel).

All functions return *sums* and counts; the caller divides by counts reduced over the whole global batch,
so the loss of a step does not depend on how it is split into micro-batches or data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from megatron_composer.config import ConfigError
from megatron_composer.kernels.cross_entropy import cross_entropy
from megatron_composer.kernels.linear_cross_entropy import linear_cross_entropy_sum
from megatron_composer.training.layout import shift_left_local


@dataclass
class MTPLossConfig:
    weight: float = field(
        default=0.2, metadata={"help": "weight of the MTP loss relative to the LM loss (0 disables MTP)"})
    divergence: Literal["forward_kl", "reverse_kl"] = field(
        default="forward_kl", metadata={"help": "forward_kl = KL(main || mtp)"})
    ce_weight: float = field(
        default=0.0, metadata={"help": "extra cross-entropy on the true token, mixed into each depth's loss"})
    temperature: float = field(default=1.0, metadata={"help": "softmax temperature of both distributions in the KL"})

    def validate(self) -> None:
        if self.weight < 0 or self.ce_weight < 0:
            raise ConfigError("mtp.weight and mtp.ce_weight must be >= 0")
        if self.temperature <= 0:
            raise ConfigError(f"mtp.temperature={self.temperature} must be > 0")


def mtp_valid_mask(loss_mask_BS: torch.Tensor, position_ids_BS: torch.Tensor, depth: int,
                   shift_left=shift_left_local) -> torch.Tensor:
    """[B, S] bool: position t has a depth-`depth` target inside its own document with loss on it.

    `shift_left(x, k, fill)` returns x[t + k] for this rank's positions; with context parallelism it is
    cp_shift_left, so pairs that straddle sequence shards are kept exactly.
    """
    same_doc = shift_left(position_ids_BS, depth, -1) == position_ids_BS + depth
    return same_doc & (shift_left(loss_mask_BS, depth, 0) > 0)


def token_counts(batch: dict[str, torch.Tensor], num_mtp_depths: int, shift_left=shift_left_local) -> torch.Tensor:
    """[1 + depths] float: LM tokens with loss, then valid MTP pairs per depth, for global normalisation."""
    counts = [batch["loss_mask"].sum()]
    for k in range(1, num_mtp_depths + 1):
        counts.append(mtp_valid_mask(batch["loss_mask"], batch["position_ids"], k, shift_left).sum())
    return torch.stack([c.float() for c in counts])


def _cross_entropy(logits_NV: torch.Tensor, target_N: torch.Tensor, vocab_group) -> torch.Tensor:
    if vocab_group is None:
        return cross_entropy(logits_NV, target_N)
    from megatron_composer.parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_NV.float(), target_N, vocab_group)


def _log_softmax(logits_NV: torch.Tensor, vocab_group) -> torch.Tensor:
    if vocab_group is None:
        return F.log_softmax(logits_NV, dim=-1)
    from megatron_composer.parallel import vocab_parallel_log_softmax

    return vocab_parallel_log_softmax(logits_NV, vocab_group)


def _vocab_sum(x_NV: torch.Tensor, vocab_group) -> torch.Tensor:
    if vocab_group is None:
        return x_NV.sum(-1)
    from megatron_composer.parallel.collectives import reduce_from_parallel

    return reduce_from_parallel(x_NV.sum(-1), vocab_group)


@torch.no_grad()
def _argmax(logits_NV: torch.Tensor, vocab_group) -> torch.Tensor:
    """Global vocabulary index of the largest logit (ties -> lowest index, as torch.argmax)."""
    value_N, index_N = logits_NV.max(-1)
    if vocab_group is None:
        return index_N
    from megatron_composer.parallel.collectives import all_gather, group_rank

    index_N = index_N + group_rank(vocab_group) * logits_NV.shape[-1]
    values_NR = all_gather(value_N[:, None].contiguous(), 1, vocab_group)
    indices_NR = all_gather(index_N[:, None].contiguous(), 1, vocab_group)
    return indices_NR.gather(1, values_NR.argmax(1, keepdim=True)).squeeze(1)


def lm_loss_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, loss_mask_BS: torch.Tensor,
                vocab_group=None) -> torch.Tensor:
    losses = _cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), vocab_group)
    return (losses * loss_mask_BS.flatten()).sum()


def lm_loss_sum_fused_head(hidden_BSD: torch.Tensor, head_weight_VD: torch.Tensor, labels_BS: torch.Tensor,
                           loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """lm_loss_sum(hidden @ head^T, ...) without ever making the [B, S, V] logits or their gradient."""
    return linear_cross_entropy_sum(hidden_BSD.flatten(0, 1), head_weight_VD, labels_BS.flatten(),
                                    loss_mask_BS.flatten())


def fused_head_applies(model, mtp_cfg: MTPLossConfig, vocab_group=None) -> bool:
    """Whether the trainer may leave the main head to the loss (model(..., logits=False) + head_weight):
    a plain, unsharded Linear head (not vocab-parallel, not FP8) and no MTP self-distillation, whose teacher
    is the main head's whole distribution."""
    mtp_on = mtp_cfg.weight > 0 and model.config.num_mtp_layers > 0
    return vocab_group is None and type(model.output) is torch.nn.Linear and not mtp_on


def mtp_self_distillation_sums(
    main_logits_BSV: torch.Tensor,
    mtp_logits: list[torch.Tensor],
    labels_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    position_ids_BS: torch.Tensor,
    cfg: MTPLossConfig,
    shift_left=shift_left_local,
    vocab_group=None,
) -> list[dict[str, torch.Tensor]]:
    """Per depth: sums over valid pairs of the trained loss, KL, CE and top-1 agreement with the main head."""
    out = []
    main_detached = main_logits_BSV.detach()
    for k, mtp_BSV in enumerate(mtp_logits, start=1):
        valid = mtp_valid_mask(loss_mask_BS, position_ids_BS, k, shift_left).flatten().float()
        student_NV = mtp_BSV.flatten(0, 1).float()
        teacher_NV = shift_left(main_detached, k, 0).flatten(0, 1).float()
        target_N = shift_left(labels_BS, k, 0).flatten()
        logq = _log_softmax(student_NV / cfg.temperature, vocab_group)
        logp = _log_softmax(teacher_NV / cfg.temperature, vocab_group)
        if cfg.divergence == "forward_kl":
            kl_N = _vocab_sum(logp.exp() * (logp - logq), vocab_group)
        else:
            kl_N = _vocab_sum(logq.exp() * (logq - logp), vocab_group)
        ce_N = _cross_entropy(student_NV, target_N, vocab_group)
        loss_N = kl_N + cfg.ce_weight * ce_N if cfg.ce_weight else kl_N
        agree_N = (_argmax(student_NV, vocab_group) == _argmax(teacher_NV, vocab_group)).float()
        out.append({
            "loss": (loss_N * valid).sum(),
            "kl": (kl_N.detach() * valid).sum(),
            "ce": (ce_N.detach() * valid).sum(),
            "agree": (agree_N * valid).sum(),
        })
    return out


def pretrain_loss(output, batch: dict[str, torch.Tensor], mtp_cfg: MTPLossConfig, global_counts: torch.Tensor,
                  shift_left=shift_left_local, vocab_group=None, head_weight=None):
    """Loss to backpropagate for one micro-batch (already divided by global counts) and detached stats.

    `output` is the model's ModelOutput (logits, mtp_logits, aux_loss); `global_counts` is the sum over the
    global batch of token_counts(). Returns (loss, stats) where stats holds this micro-batch's contribution to
    each logged metric (summing stats over micro-batches and ranks gives the step's values).
    When the model ran without its main head (output.logits None, see fused_head_applies), `head_weight`
    is that head's weight and the LM loss applies it fused with the cross-entropy.
    """
    if output.logits is None:
        if head_weight is None or output.hidden_states is None:
            raise ValueError("pretrain_loss: the model output has no logits; "
                             "pass head_weight and the output's hidden_states "
                             "(model(..., logits=False)) or run the model with its head")
        lm_sum = lm_loss_sum_fused_head(output.hidden_states, head_weight, batch["labels"], batch["loss_mask"])
    else:
        lm_sum = lm_loss_sum(output.logits, batch["labels"], batch["loss_mask"], vocab_group)
    lm = lm_sum / global_counts[0].clamp(min=1)
    loss = lm
    stats = {"lm_loss": lm.detach()}
    mtp_logits = list(getattr(output, "mtp_logits", None) or [])
    if mtp_logits and mtp_cfg.weight > 0:
        if output.logits is None:
            raise ValueError("MTP self-distillation needs the main logits as its teacher: run the model with its head")
        per_depth = mtp_self_distillation_sums(output.logits, mtp_logits, batch["labels"], batch["loss_mask"],
                                               batch["position_ids"], mtp_cfg, shift_left, vocab_group)
        mtp_total = 0.0
        for k, d in enumerate(per_depth, start=1):
            n = global_counts[k].clamp(min=1)
            mtp_total = mtp_total + d["loss"] / n
            stats[f"mtp{k}_kl"] = d["kl"] / n
            stats[f"mtp{k}_ce"] = d["ce"] / n
            stats[f"mtp{k}_top1"] = d["agree"] / n
        loss = loss + mtp_cfg.weight * mtp_total / len(per_depth)
    aux = getattr(output, "aux_loss", None)
    if aux is not None and torch.is_tensor(aux):
        # aux_loss is a per-micro-batch mean (already weighted by the model config); average over micro-batches
        share = batch["loss_mask"].sum() / global_counts[0].clamp(min=1)
        loss = loss + aux * share
        stats["aux_loss"] = (aux * share).detach()
    return loss, stats
