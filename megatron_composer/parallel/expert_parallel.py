"""Expert parallelism: an all-to-all token dispatcher for `MoE.dispatch`.

Each rank of the expert-parallel group holds E/ep consecutive experts. A rank sorts its (token, slot) pairs by
global expert id, which also groups them by destination rank; exchanges per-expert counts; sends the token
rows with one all_to_all_single (uneven splits); runs its local experts on the received rows with one grouped
matmul; sends the outputs back with the reverse all-to-all; and combines them with the gate weights on the
token's own rank. Dropless by default: every routed pair is computed, whatever the load; with a capacity
factor each rank sends at most ceil(factor * its slots / experts) pairs to an expert, keeping the
highest-weight ones. The routing decision (including
a replayed one) is made on the token's rank and travels as the expert a row is sent to.

Balanced routing (`balanced_routing = True`, see `assume_balanced_routing`): the per-expert row counts take their
balanced values -- this rank's slots spread evenly over the experts, every rank sending the same -- instead of
being counted from the routing and exchanged. Only the dry run (training/dry_run.py) sets it: there the tensors
hold no values, and the all-to-all sizes must still be those of an evenly loaded step.

With tensor parallelism and without sequence parallelism the tokens at an MoE layer are replicated over tp;
each tp rank then dispatches a disjoint 1/tp slice and the outputs are all-gathered, so no expert computes a
token twice.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_composer.parallel import collectives as C


class AllToAllDispatcher:
    """Callable with MoE.dispatch's signature: (experts, x_TD, indices_TK, weights_TK) -> out_TD."""

    def __init__(self, ep_group, num_experts: int, tp_group=None, slice_tokens_over_tp: bool = False,
                 capacity_factor: Optional[float] = None):
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity factor {capacity_factor} must be > 0 (or None for dropless)")
        self.capacity_factor = capacity_factor
        self.ep_group, self.num_experts = ep_group, num_experts
        self.ep = C.group_size(ep_group)
        self.tp_group, self.slice_tp = tp_group, slice_tokens_over_tp and C.group_size(tp_group) > 1
        if num_experts % self.ep != 0:
            raise ValueError(f"{num_experts} experts do not split over ep={self.ep}; change parallel.ep")
        self.local_experts = num_experts // self.ep
        self.balanced_routing = False

    def __call__(self, experts, x_TD, indices_TK, weights_TK):
        if self.slice_tp:
            T = x_TD.shape[0]
            n = C.group_size(self.tp_group)
            pad = (-T) % n  # pad so the token set splits evenly; padded rows carry zero weight
            if pad:
                x_TD = torch.cat([x_TD, x_TD.new_zeros(pad, x_TD.shape[1])])
                indices_TK = torch.cat([indices_TK, indices_TK[:1].expand(pad, -1)])
                weights_TK = torch.cat([weights_TK, weights_TK.new_zeros(pad, weights_TK.shape[1])])
            x_TD = C.scatter_to_parallel(x_TD, 0, self.tp_group)
            weights_TK = C.scatter_to_parallel(weights_TK, 0, self.tp_group)
            indices_TK = C.split(indices_TK, 0, self.tp_group)
            out = self.dispatch(experts, x_TD, indices_TK, weights_TK)
            return C.gather_from_parallel(out, 0, self.tp_group)[:T]
        return self.dispatch(experts, x_TD, indices_TK, weights_TK)

    def dispatch(self, experts, x_TD, indices_TK, weights_TK):
        K = indices_TK.shape[1]
        flat = indices_TK.reshape(-1)
        if self.balanced_routing:
            order = torch.argsort(flat, stable=True)
            send_counts_RL, recv_counts_RL, send_splits, recv_splits = self.balanced_counts(flat.numel(), flat.device)
        else:
            if self.capacity_factor is None:
                order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
                counts_E = torch.bincount(flat, minlength=self.num_experts)
            else:
                order, counts_E = self.keep_within_capacity(flat, weights_TK.reshape(-1).detach())
            send_counts_RL = counts_E.view(self.ep, self.local_experts)
            # recv_counts_RL[s, e]: rows rank s sends to this rank's local expert e
            recv_counts_RL = C.exchange_splits(send_counts_RL.contiguous(), self.ep_group).view(self.ep, -1)
            send_splits = send_counts_RL.sum(1).tolist()
            recv_splits = recv_counts_RL.sum(1).tolist()
        token_of_slot = order // K
        x_send = x_TD.index_select(0, token_of_slot)
        x_recv = C.all_to_all_autograd(x_send, recv_splits, send_splits, self.ep_group)
        # received rows are grouped by source rank, then expert; the grouped matmul wants expert-major
        n_rows = self.ep * self.local_experts
        src_expert = torch.arange(n_rows, device=x_TD.device).view(self.ep, -1) % self.local_experts
        row_expert = torch.repeat_interleave(src_expert.reshape(-1), recv_counts_RL.reshape(-1),
                                             output_size=sum(recv_splits))
        by_expert = torch.argsort(row_expert, stable=True)
        offs = recv_counts_RL.sum(0).cumsum(0).to(torch.int32)
        y_sorted = experts(x_recv[by_expert], offs)
        unsort = torch.empty_like(by_expert)
        unsort[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        y_recv = y_sorted[unsort]
        y_back = C.all_to_all_autograd(y_recv, send_splits, recv_splits, self.ep_group)
        y_back = y_back * weights_TK.reshape(-1)[order, None].to(y_back.dtype)
        return torch.zeros_like(x_TD).index_add_(0, token_of_slot, y_back)

    def balanced_counts(self, slots: int, device):
        """Per-expert rows of an evenly loaded step: this rank's `slots` (token, expert) pairs spread evenly over
        the experts (the first `slots % experts` get one more), and every rank of the group sending the same.
        Returns send_counts_RL and recv_counts_RL as dispatch uses them, and their row sums (Python ints)."""
        per, extra = divmod(slots, self.num_experts)
        counts_E = [per + (e < extra) for e in range(self.num_experts)]
        L, me = self.local_experts, C.group_rank(self.ep_group)
        send = [counts_E[r * L:(r + 1) * L] for r in range(self.ep)]
        recv = [counts_E[me * L:(me + 1) * L]] * self.ep
        return (torch.tensor(send, device=device), torch.tensor(recv, device=device), [sum(row) for row in send],
                [sum(row) for row in recv])

    def keep_within_capacity(self, expert_of_slot: torch.Tensor, weight_of_slot: torch.Tensor):
        """Slots sorted by expert keeping, per expert, the `capacity` highest-weight ones, where capacity =
        ceil(capacity_factor * slots / experts) of this rank's slots; dropped slots contribute nothing (their
        token keeps its other experts and the residual)."""
        capacity = math.ceil(self.capacity_factor * expert_of_slot.numel() / self.num_experts)
        by_weight = torch.argsort(-weight_of_slot, stable=True)
        order = by_weight[torch.argsort(expert_of_slot[by_weight], stable=True)]
        counts_E = torch.bincount(expert_of_slot, minlength=self.num_experts)
        starts_E = counts_E.cumsum(0) - counts_E
        position = torch.arange(order.numel(), device=order.device) - starts_E[expert_of_slot[order]]
        return order[position < capacity], counts_E.clamp(max=capacity)


def assume_balanced_routing(model: torch.nn.Module) -> int:
    """Give every MoE layer of `model` a dispatcher with balanced per-expert counts (module docstring); a layer
    still on the local dispatch (one expert-parallel rank) gets a one-rank AllToAllDispatcher, which does the
    same permutation, grouped experts and combine. Returns the number of MoE layers."""
    from megatron_composer.model.moe import MoE

    n = 0
    for m in model.modules():
        if isinstance(m, MoE):
            if not isinstance(m.dispatch, AllToAllDispatcher):
                m.dispatch = AllToAllDispatcher(None, m.num_experts)
            m.dispatch.balanced_routing = True
            n += 1
    return n


__all__ = ["AllToAllDispatcher", "assume_balanced_routing"]
