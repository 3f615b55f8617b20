"""Policy-gradient loss: importance ratios, PPO clipping, TIS, mismatch masking, KL terms, aggregation.

Tensors are token-aligned: ``x_BT[b, t]`` belongs to token t of sequence b (``token_logprobs`` gives
log pi(token_t | tokens_<t) at position t), and ``mask_BT`` marks the tokens the policy sampled (response
tokens; prompts, padding and tool observations are 0). ``sg`` below is stop-gradient.

Per-token policy-gradient losses, with A_t the (possibly KL-shaped) advantage and mu the behaviour
(inference) policy:

* ``is`` (default):  l_t = -w_t A_t, w_t = rho_t * sg(min(rho_t, C) / rho_t), rho_t = pi_theta / sg(mu).
  Its value is -min(rho, C) A and its gradient -min(rho, C) A grad log pi_theta: plain importance sampling
  when C (``tis_cap``) is None, truncated importance sampling otherwise.
* ``ppo_clip``:      l_t = -v_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t) with
  rho_t = pi_theta / sg(pi_old); pi_old is the old-policy pass's log-probs when given, else mu. With an
  old-policy pass, v_t = sg(min(pi_old / mu, C)) (C = ``tis_cap``, untruncated when None) corrects for the
  train/inference mismatch and staleness (Yao et al., 2025); without one, v_t = 1 (the clip is against mu
  itself). The RL learner always runs the old-policy pass for ``ppo_clip``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from rl.algorithm.config import RLObjectiveConfig
from rl.algorithm.kl import kl_estimate, reward_to_go

Aggregation = Literal["token_sum_constant", "seq_mean_token_mean", "token_mean"]


def token_logprobs(logits_BSV: torch.Tensor, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """logp[b, t] = log softmax(logits[b, t - 1])[input_ids[b, t]] in float32; logp[:, 0] = 0 (no context)."""
    if logits_BSV.shape[:2] != input_ids_BS.shape:
        raise ValueError(f"logits {tuple(logits_BSV.shape)} and input_ids {tuple(input_ids_BS.shape)} "
                         "disagree on [B, S]")
    logp_BSV = torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
    picked_BS = logp_BSV.gather(-1, input_ids_BS[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked_BS, (1, 0))


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: Aggregation = "token_sum_constant",
    constant: Optional[float] = None,
    num_sequences: Optional[int] = None,
    num_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Reduce per-token losses to the batch loss.

    * ``token_sum_constant`` (Dr. GRPO, default): sum_{b,t} m l / (N * C), N = ``num_sequences`` (default B),
      C = ``constant`` (default T). Per group of G this is sum / (G * C): no 1/|o_i| length normalisation.
    * ``seq_mean_token_mean`` (GRPO): (1/N) sum_b [sum_t m l / max(sum_t m, 1)]; empty responses add 0.
    * ``token_mean``: sum_{b,t} m l / max(num_tokens or sum m, 1).

    Pass the global ``num_sequences`` / ``num_tokens`` of the optimizer step when the batch is split into
    micro-batches or data-parallel shards, so that the per-micro-batch losses add up to the step's loss.
    """
    if loss_BT.shape != mask_BT.shape or loss_BT.dim() != 2:
        raise ValueError(f"loss {tuple(loss_BT.shape)} and mask {tuple(mask_BT.shape)} must both be [B, T]")
    m_BT = mask_BT.to(loss_BT.dtype)
    # where() rather than multiply: a masked-out token may hold inf/nan (e.g. an overflowing ratio).
    masked_BT = torch.where(m_BT > 0, loss_BT * m_BT, torch.zeros_like(loss_BT))
    B, T = loss_BT.shape
    if mode == "token_sum_constant":
        n = B if num_sequences is None else num_sequences
        c = T if constant is None else constant
        if n <= 0 or c <= 0:
            raise ValueError(f"token_sum_constant needs num_sequences > 0 and constant > 0, got {n} and {c}")
        return masked_BT.sum() / (n * c)
    if mode == "seq_mean_token_mean":
        n = B if num_sequences is None else num_sequences
        if n <= 0:
            raise ValueError(f"seq_mean_token_mean needs num_sequences > 0, got {n}")
        per_seq_B = masked_BT.sum(-1) / m_BT.sum(-1).clamp(min=1)
        return per_seq_B.sum() / n
    if mode == "token_mean":
        denom = m_BT.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return masked_BT.sum() / denom.clamp(min=1)
    raise ValueError(f"loss aggregation is {mode!r}; choose token_sum_constant, seq_mean_token_mean or token_mean")


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolation quantile of a 1-D tensor (torch.quantile's default), without its size limit."""
    n = values.numel()
    if n == 0:
        raise ValueError("quantile of an empty tensor")
    pos = q * (n - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    v = values.float().flatten()
    v_lo = torch.kthvalue(v, lo + 1).values
    v_hi = v_lo if hi == lo else torch.kthvalue(v, hi + 1).values
    return v_lo + (pos - lo) * (v_hi - v_lo)


def mismatch_statistics(
    logp_train_BT: torch.Tensor,
    logp_infer_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    level: Literal["off", "token", "sequence"] = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [B, T], values): d_t = |logp_train_t - logp_infer_t| on valid tokens (0 elsewhere), and the values the
    threshold is a quantile of: d of every valid token (``token``) or each non-empty sequence's max_t d_t
    (``sequence``); empty for ``off``."""
    valid_BT = mask_BT.bool()
    d_BT = torch.where(valid_BT, (logp_train_BT.detach() - logp_infer_BT.detach()).abs().float(),
                       torch.zeros((), device=valid_BT.device))
    if level == "off":
        return d_BT, d_BT.new_zeros(0)
    if level == "token":
        return d_BT, d_BT[valid_BT]
    if level == "sequence":
        return d_BT, d_BT.amax(-1)[valid_BT.any(-1)]
    raise ValueError(f"mismatch level is {level!r}; choose off, token or sequence")


def mismatch_threshold(values: torch.Tensor, q: float = 0.99, bound: Optional[float] = None,
                       group=None) -> float:
    """tau of the mismatch filter for one optimizer step: ``bound`` when given, else the q-quantile of the
    statistic over *all* of the step's values -- this rank's ``values`` (every micro-batch of it) gathered with
    those of the other ranks of ``group`` (the data-parallel group: ranks holding distinct samples). The same
    tau on every rank whatever the micro-batching, so the dropped fraction is the step's, not a per-batch
    artefact (a quantile of 2 tokens always drops one). NaN when the step has no values."""
    if bound is not None:
        return float(bound)
    values = values.detach().float().flatten()
    if group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        import torch.distributed as dist

        n = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
        counts = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, n, group=group)
        longest = max(int(c) for c in counts)
        padded = torch.nn.functional.pad(values, (0, longest - values.numel()))
        pieces = [torch.zeros_like(padded) for _ in counts]
        dist.all_gather(pieces, padded, group=group)
        values = torch.cat([p[: int(c)] for p, c in zip(pieces, counts)])
    if values.numel() == 0:
        return float("nan")
    return float(quantile(values, q))


def mismatch_mask(
    logp_train_BT: torch.Tensor,
    logp_infer_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    level: Literal["off", "token", "sequence"] = "token",
    bound: Optional[float] = None,
    q: float = 0.99,
    threshold: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Keep-mask [B, T] that drops tokens with extreme train/inference disagreement, and its statistics.

    d_t = |logp_train_t - logp_infer_t| on valid tokens. The threshold tau is ``threshold`` (the step's, from
    `mismatch_threshold`), else ``bound``, else the q-quantile of this batch's statistic. ``token``: drop
    tokens with d_t > tau. ``sequence``: a sequence's statistic is max_t d_t; drop whole sequences whose
    statistic exceeds tau (the quantile is over sequences). Returns (mask & keep,
    {"mismatch_masked_fraction": dropped valid tokens / valid tokens, "mismatch_threshold": tau,
    "mismatch_max": max d}).
    """
    valid_BT = mask_BT.bool()
    d_BT, stat_values = mismatch_statistics(logp_train_BT, logp_infer_BT, mask_BT, level)
    n_valid = int(valid_BT.sum())
    stats = {"mismatch_masked_fraction": 0.0, "mismatch_threshold": float("nan"),
             "mismatch_max": d_BT.max().item() if n_valid else 0.0}
    if level == "off" or n_valid == 0:
        return valid_BT, stats
    if threshold is None:
        threshold = bound if bound is not None else float(quantile(stat_values, q))
    tau = torch.tensor(float(threshold), device=d_BT.device)
    if level == "token":
        keep_BT = valid_BT & (d_BT <= tau)
    else:
        keep_BT = valid_BT & (d_BT.amax(-1) <= tau)[:, None]
    stats["mismatch_threshold"] = float(tau)
    stats["mismatch_masked_fraction"] = 1.0 - keep_BT.sum().item() / n_valid
    return keep_BT, stats


def importance_weight(logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                      cap: Optional[float] = None) -> torch.Tensor:
    """w = rho * sg(min(rho, C) / rho), rho = exp(logp - sg(behaviour_logp)): value min(rho, C), gradient
    min(rho, C) * grad logp. Masked-out positions hold 1 so that an extreme log-ratio cannot overflow."""
    log_rho_BT = torch.where(mask_BT.bool(), logp_BT - behaviour_logp_BT.detach(), torch.zeros_like(logp_BT))
    if cap is None:
        return torch.exp(log_rho_BT)
    log_w_BT = torch.clamp(log_rho_BT.detach(), max=math.log(cap))
    # exp(log_rho) * exp(log_w - sg(log_rho)) without forming rho itself (which may overflow).
    return torch.exp(log_rho_BT - log_rho_BT.detach() + log_w_BT)


@dataclass
class TokenLosses:
    """Per-token loss, the mask it is valid on (after mismatch masking) and the metrics of its terms."""

    loss_BT: torch.Tensor
    mask_BT: torch.Tensor
    metrics: dict[str, float]


class PolicyGradientLoss(torch.nn.Module):
    """The RL objective of `RLObjectiveConfig` as a loss module (no parameters).

    ``forward(logp, loss_mask, advantages, behaviour_logp, old_logp=None, ref_logp=None, ...)`` returns
    (scalar loss, metrics). ``logp`` [B, T] carries the gradient; ``advantages`` is [B] (one per sample, e.g.
    from `group_advantages`) or [B, T]; ``behaviour_logp`` are the inference engine's log-probs (None means
    fully on-policy: sg(logp)); ``old_logp`` the old-policy training pass's (PPO's pi_old, and the
    train side of the mismatch measure when given); ``ref_logp`` the reference policy's (needed when
    kl_coef > 0). Without an old-policy pass the mismatch is measured against sg(logp).
    """

    def __init__(self, cfg: RLObjectiveConfig):
        super().__init__()
        self.cfg = cfg.validate()

    def token_losses(
        self,
        logp: torch.Tensor,
        loss_mask: torch.Tensor,
        advantages: torch.Tensor,
        behaviour_logp: Optional[torch.Tensor] = None,
        old_logp: Optional[torch.Tensor] = None,
        ref_logp: Optional[torch.Tensor] = None,
        mismatch_threshold: Optional[float] = None,
        kl_tail: Optional[torch.Tensor] = None,
    ) -> TokenLosses:
        cfg = self.cfg
        if logp.dim() != 2 or loss_mask.shape != logp.shape:
            raise ValueError(f"logp {tuple(logp.shape)} and loss_mask {tuple(loss_mask.shape)} must both be [B, T]")
        for name, t in (("behaviour_logp", behaviour_logp), ("old_logp", old_logp), ("ref_logp", ref_logp)):
            if t is not None and t.shape != logp.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; it must match logp {tuple(logp.shape)}")
        if cfg.kl_coef > 0 and ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp from the reference model; pass it or set rl.kl_coef=0")
        logp = logp.float()
        behaviour_logp = logp.detach() if behaviour_logp is None else behaviour_logp.float()
        if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
            advantages = advantages[:, None].expand_as(logp)
        if advantages.shape != logp.shape:
            raise ValueError(f"advantages must be [B] or [B, T]; got {tuple(advantages.shape)} "
                             f"for logp {tuple(logp.shape)}")
        adv_BT = advantages.detach().float()

        train_side_BT = old_logp if old_logp is not None else logp.detach()
        mask_BT, metrics = mismatch_mask(train_side_BT, behaviour_logp, loss_mask, level=cfg.mismatch_mask,
                                         bound=cfg.mismatch_bound, q=cfg.mismatch_quantile,
                                         threshold=mismatch_threshold)
        m_BT = mask_BT.float()
        n_tok = m_BT.sum().clamp(min=1)

        def masked_mean(x_BT: torch.Tensor) -> float:
            x_BT = torch.where(mask_BT, x_BT.detach().float(), torch.zeros((), device=x_BT.device))
            return (x_BT.sum() / n_tok).item()

        kl_loss_BT = torch.zeros_like(logp)
        if cfg.kl_coef > 0:
            if cfg.kl_placement == "in_reward":
                kl_BT = kl_estimate(logp.detach(), ref_logp.detach().float(), cfg.kl_estimator)
                kl_BT = torch.where(mask_BT, kl_BT, torch.zeros_like(kl_BT))
                to_go_BT = reward_to_go(kl_BT, mask_BT)
                if kl_tail is not None:  # the KL of the chain's later segments (samples of the same episode)
                    to_go_BT = to_go_BT + kl_tail.detach().float().to(to_go_BT.device)[:, None]
                adv_BT = adv_BT - cfg.kl_coef * to_go_BT
            else:
                ref_BT = ref_logp.detach().float()
                # Masked-out tokens get log r = 0 so an extreme value there cannot turn the gradient into nan.
                kl_BT = kl_estimate(torch.where(mask_BT, logp, ref_BT), ref_BT, cfg.kl_estimator)
                if cfg.kl_loss_weighting == "ratio":
                    kl_loss_BT = cfg.kl_coef * importance_weight(logp, behaviour_logp, mask_BT, cfg.tis_cap) * kl_BT
                else:
                    kl_loss_BT = cfg.kl_coef * kl_BT
            metrics["kl"] = masked_mean(kl_BT)

        if cfg.pg_loss == "is":
            w_BT = importance_weight(logp, behaviour_logp, mask_BT, cfg.tis_cap)
            pg_BT = -w_BT * adv_BT
            log_rho_BT = logp.detach() - behaviour_logp
            metrics["ratio_mean"] = masked_mean(w_BT)
            metrics["tis_truncated_fraction"] = (
                masked_mean((log_rho_BT > math.log(cfg.tis_cap)).float()) if cfg.tis_cap is not None else 0.0)
        elif cfg.pg_loss == "ppo_clip":
            prox_BT = (old_logp if old_logp is not None else behaviour_logp).detach().float()
            log_rho_BT = torch.where(mask_BT, logp - prox_BT, torch.zeros_like(logp))
            rho_BT = torch.exp(log_rho_BT)
            clipped_BT = rho_BT.clamp(1.0 - cfg.ppo_clip_low, 1.0 + cfg.ppo_clip_high)
            pg_BT = -torch.minimum(rho_BT * adv_BT, clipped_BT * adv_BT)
            if old_logp is not None:  # decoupled PPO: the clip is against pi_old, pi_old/mu corrects the rest
                log_v_BT = torch.where(mask_BT, old_logp.float() - behaviour_logp, torch.zeros_like(logp)).detach()
                cap = math.inf if cfg.tis_cap is None else math.log(cfg.tis_cap)
                pg_BT = torch.exp(log_v_BT.clamp(max=cap)) * pg_BT
                metrics["tis_truncated_fraction"] = masked_mean((log_v_BT > cap).float())
            else:
                metrics["tis_truncated_fraction"] = 0.0
            rho_d = rho_BT.detach()
            clipped = ((adv_BT > 0) & (rho_d > 1 + cfg.ppo_clip_high)) | ((adv_BT < 0) & (rho_d < 1 - cfg.ppo_clip_low))
            metrics["ratio_mean"] = masked_mean(rho_d)
            metrics["clip_fraction"] = masked_mean(clipped.float())
        else:
            raise ValueError(f"pg_loss is {cfg.pg_loss!r}; choose 'is' or 'ppo_clip'")

        metrics["pg_loss_token_mean"] = masked_mean(pg_BT)
        if cfg.kl_coef > 0 and cfg.kl_placement == "in_loss":
            metrics["kl_loss_token_mean"] = masked_mean(kl_loss_BT)
        metrics["num_tokens"] = float(mask_BT.sum())
        return TokenLosses(loss_BT=pg_BT + kl_loss_BT, mask_BT=mask_BT, metrics=metrics)

    def forward(
        self,
        logp: torch.Tensor,
        loss_mask: torch.Tensor,
        advantages: torch.Tensor,
        behaviour_logp: Optional[torch.Tensor] = None,
        old_logp: Optional[torch.Tensor] = None,
        ref_logp: Optional[torch.Tensor] = None,
        num_sequences: Optional[int] = None,
        num_tokens: Optional[int] = None,
        constant: Optional[float] = None,
        mismatch_threshold: Optional[float] = None,
        kl_tail: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``num_sequences`` / ``num_tokens`` / ``constant``: the step's counts (see `aggregate_loss`); ``constant``
        defaults to rl.loss_constant. ``mismatch_threshold``: the step's tau (`mismatch_threshold`) instead of
        this batch's own quantile. ``kl_tail`` [B]: with the KL in the reward, the summed per-token KL of the
        later segments of each sample's episode, added to its reward-to-go so that the penalty runs over the
        whole chain."""
        out = self.token_losses(logp, loss_mask, advantages, behaviour_logp, old_logp, ref_logp,
                                mismatch_threshold, kl_tail)
        loss = aggregate_loss(out.loss_BT, out.mask_BT, self.cfg.loss_aggregation,
                              self.cfg.loss_constant if constant is None else constant,
                              num_sequences=num_sequences, num_tokens=num_tokens)
        out.metrics["loss"] = loss.item()
        return loss, out.metrics
