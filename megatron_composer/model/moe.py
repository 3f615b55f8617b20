"""Feed-forward layers: SwiGLU MLP and the mixture of experts (router, grouped experts, shared experts).

Routing follows DeepSeek-V3 / Kimi K2 (sigmoid scores, aux-loss-free bias that only selects, group-limited
top-k, normalised weights times routed_scaling_factor) and Qwen3-MoE (softmax scores, plain top-k).
Experts run on tokens sorted by expert with grouped matmuls: the cost follows the routed load, never a
matmul per expert regardless of load.

Router replay: given `replay_indices_TK` the router uses those experts and recomputes their gate weights
from the current scores, so the router keeps receiving gradient (the RL recipe's R3/R2 replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import router as router_kernel
from ..kernels.grouped_mm import dispatch_sorted, mm_outer, mm_rows, pair_swiglu, swiglu_experts
from .args import ModelConfig


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---- grouped matmul ------------------------------------------------------------------------------------
class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_EFD, offs):
        ctx.save_for_backward(x_TD, w_EFD, offs)
        return mm_rows(x_TD, w_EFD.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, dy_TF):
        x_TD, w_EFD, offs = ctx.saved_tensors
        dy_TF = dy_TF.contiguous()
        dx = mm_rows(dy_TF, w_EFD, offs) if ctx.needs_input_grad[0] else None
        dw = mm_outer(dy_TF, x_TD, offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x_TD: torch.Tensor, w_EFD: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[t] = x[t] @ w[e(t)]^T for tokens sorted by expert; offs = cumulative token counts (int32) per expert."""
    return _GroupedMM.apply(x_TD, w_EFD, offs)


class GroupedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked: w1/w3 [E, F, D], w2 [E, D, F].

    `grouped_mm` is an attribute so quantised (FP8) kernels can replace it. With expert parallelism a rank
    holds a slice of the experts; `expert_offset` is the global id of its first one.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.grouped_mm = grouped_mm
        self.expert_offset = 0
        # What the experts compute with in place of their weights (None: the weights): quantisation-aware
        # training sets it (training/qat.py), each weight [E, out, in] to the grid it will be served on.
        self.weight_transform = None

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as the experts compute with them."""
        if self.weight_transform is None:
            return self.w1, self.w3, self.w2
        return self.weight_transform(self.w1), self.weight_transform(self.w3), self.weight_transform(self.w2)

    def forward(self, x_TD: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x_TD sorted by (local) expert, offs = cumulative counts per local expert."""
        return self._sorted(x_TD, offs, self.weights())

    def _sorted(self, x_TD, offs, weights) -> torch.Tensor:
        # The C++ pass (kernels/grouped_mm.py swiglu_experts) where it can run: the default grouped_mm (a
        # quantised replacement takes the reference), CPU, no torch function mode.
        w1, w3, w2 = weights
        if self.grouped_mm is grouped_mm and (y := swiglu_experts(x_TD, w1, w3, w2, offs)) is not None:
            return y
        return self.reference_forward(x_TD, offs, weights)

    def reference_forward(self, x_TD: torch.Tensor, offs: torch.Tensor, weights=None) -> torch.Tensor:
        w1, w3, w2 = weights if weights is not None else self.weights()
        w13 = torch.cat([w1, w3], dim=1)  # one grouped matmul for gate and up
        gate, up = self.grouped_mm(x_TD, w13, offs).chunk(2, dim=-1)
        return self.grouped_mm(F.silu(gate) * up, w2, offs)

    def forward_pairs(self, x_TD: torch.Tensor, indices_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{indices[t, k]}(x[t]) over experts this module holds all of (no expert
        parallelism): permute tokens by expert, run the grouped experts, weight and sum back per token.

        A method of the module rather than a function reading its weights, so that every kernel choice reads
        them inside the module's own call: FSDP registers it as a forward method of the experts' unit
        (parallel/fsdp.py), which gathers the weights before it runs whichever path is taken."""
        weights = self.weights()
        if self.grouped_mm is grouped_mm and (y := pair_swiglu(x_TD, indices_TK, weights_TK, *weights)) is not None:
            return y  # inference at decode sizes: exactly the chosen (token, expert) pairs in one call
        order, counts = sort_by_expert(indices_TK, self.num_local_experts)
        offs = counts.cumsum(0).to(torch.int32)
        return dispatch_sorted(x_TD, order, weights_TK, lambda rows: self._sorted(rows, offs, weights))


@dataclass
class RouterOutput:
    indices_TK: torch.Tensor  # chosen experts
    weights_TK: torch.Tensor  # combine weights (float32)
    scores_TE: torch.Tensor   # sigmoid/softmax scores (float32), for the balance loss


class Router(nn.Module):
    """Scores tokens against experts in float32 and picks the top-k. (In CPU inference the C++ row kernel
    kernels/router.py route repeats forward()'s operations: change both together.)"""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.score_func, self.n_group, self.topk_group = cfg.score_func, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.expert_bias:
            # Updated outside autograd by the balancing rule; selects experts but never weights them.
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        choice = scores_TE if self.e_score_correction_bias is None else scores_TE + self.e_score_correction_bias
        if self.n_group > 1:
            T = choice.shape[0]
            grouped = choice.view(T, self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(T, -1)
        return choice.topk(self.top_k, dim=-1, sorted=False).indices

    def forward(self, x_TD: torch.Tensor, replay_indices_TK: Optional[torch.Tensor] = None) -> RouterOutput:
        if replay_indices_TK is None and (picked := router_kernel.route(
                x_TD, self.weight, self.e_score_correction_bias, self.score_func == "sigmoid", self.norm_topk_prob,
                self.top_k, self.n_group, self.topk_group, float(self.routed_scaling_factor))) is not None:
            return RouterOutput(*picked)  # inference on the CPU: the same scores and choices in one call
        logits = F.linear(x_TD.float(), self.weight.float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        if replay_indices_TK is None:
            with torch.no_grad():
                indices = self.select(scores.detach())
        else:
            indices = replay_indices_TK.to(device=x_TD.device, dtype=torch.long)
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        return RouterOutput(indices, weights * self.routed_scaling_factor, scores)


def sequence_balance_loss(scores_BSE: torch.Tensor, indices_BSK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (without alpha): per sequence,
    sum_i f_i P_i with f_i = E/(K*S) * #tokens choosing i, P_i = mean_t normalised score of i; mean over B."""
    B, S, K = indices_BSK.shape
    counts_BE = torch.zeros(B, num_experts, device=scores_BSE.device).scatter_add_(
        1, indices_BSK.reshape(B, -1), torch.ones(B, S * K, device=scores_BSE.device))
    f_BE = counts_BE * (num_experts / (K * S))
    p_BE = (scores_BSE / scores_BSE.sum(-1, keepdim=True).clamp_min(1e-20)).mean(1)
    return (f_BE * p_BE).sum(-1).mean()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
                               if cfg.num_shared_experts > 0 else None)
        # Experts dispatch (local by default; expert parallelism swaps in an all-to-all dispatcher).
        self.dispatch = local_dispatch

    def forward(self, x_BSD: torch.Tensor, replay_indices_BSK: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (output, chosen experts [B, S, K], balance loss, or None outside training)."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        replay = None if replay_indices_BSK is None else replay_indices_BSK.reshape(B * S, -1)
        r = self.router(x_TD, replay)
        out_TD = self.dispatch(self.experts, x_TD, r.indices_TK, r.weights_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        if self.aux_loss_coef > 0 and self.training:
            aux = self.aux_loss_coef * sequence_balance_loss(
                r.scores_TE.view(B, S, -1), r.indices_TK.view(B, S, -1), self.num_experts)
        else:
            aux = None
        return out_TD.view(B, S, D), r.indices_TK.view(B, S, -1), aux


def sort_by_expert(indices_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the T*K (token, slot) pairs grouped by expert (stable), and per-expert counts."""
    flat = indices_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def local_dispatch(experts: GroupedExperts, x_TD: torch.Tensor, indices_TK: torch.Tensor,
                   weights_TK: torch.Tensor) -> torch.Tensor:
    """The dispatch without expert parallelism: every chosen expert is on this rank."""
    return experts.forward_pairs(x_TD, indices_TK, weights_TK)
