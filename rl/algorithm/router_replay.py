"""Router replay in training: which experts the training forward pass is told to use.

MoE routing is discontinuous: a tiny numeric difference between the inference engine and the trainer can
flip a token's top-k experts and with it the token's log-probability. Replay feeds recorded expert indices
to the model (``model(ids, routed_experts=...)``); the gate weights are recomputed from the current router
scores over those experts, so the router still learns.

* ``r3``: replay the inference engine's experts (recorded during rollout), the Composer 2 choice.
* ``r2``: replay the routing of the training policy's own old-policy pass (removes drift between the old
  pass and the update passes, not the train/inference difference).
* ``off``: route freely.

Routing tensors are LongTensor [num_moe_layers, B, S, top_k].
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

ReplayMode = Literal["off", "r2", "r3"]


def replay_routing(
    mode: ReplayMode,
    inference_routed_experts: Optional[torch.Tensor] = None,
    old_policy_routed_experts: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """The ``routed_experts`` argument for the training forward pass under ``mode`` (None = route freely)."""
    if mode == "off":
        return None
    if mode == "r3":
        if inference_routed_experts is None:
            raise ValueError("router_replay=r3 needs the inference engine's routed_experts in the rollout batch; "
                             "enable routing capture in the engine or set rl.router_replay=off")
        return inference_routed_experts
    if mode == "r2":
        if old_policy_routed_experts is None:
            raise ValueError("router_replay=r2 needs the old-policy pass's routing (model(..., return_routing=True)); "
                             "run that pass or set rl.router_replay=off")
        return old_policy_routed_experts
    raise ValueError(f"router_replay is {mode!r}; choose off, r2 or r3")


def routing_mismatch(
    routed_a: torch.Tensor,
    routed_b: torch.Tensor,
    mask_BS: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """How often two routings of the same tokens disagree, comparing expert *sets* (order of top-k ignored).

    Returns ``routing_mismatch_token_fraction``: fraction of (masked-in) tokens routed differently in at
    least one MoE layer, and ``routing_mismatch_layer_fraction``: fraction of (layer, token) pairs that
    differ. With no valid tokens both are 0.
    """
    if routed_a.shape != routed_b.shape or routed_a.dim() != 4:
        raise ValueError(f"routings must both be [layers, B, S, top_k]; got {tuple(routed_a.shape)} "
                         f"and {tuple(routed_b.shape)}")
    differs_LBS = (routed_a.sort(-1).values != routed_b.sort(-1).values).any(-1)
    if mask_BS is None:
        mask_BS = torch.ones(differs_LBS.shape[1:], dtype=torch.bool, device=differs_LBS.device)
    mask_BS = mask_BS.bool()
    n_tok = int(mask_BS.sum())
    if n_tok == 0:
        return {"routing_mismatch_token_fraction": 0.0, "routing_mismatch_layer_fraction": 0.0}
    token_differs_BS = differs_LBS.any(0) & mask_BS
    layer_differs = (differs_LBS & mask_BS).sum().item()
    return {
        "routing_mismatch_token_fraction": token_differs_BS.sum().item() / n_tok,
        "routing_mismatch_layer_fraction": layer_differs / (n_tok * differs_LBS.shape[0]),
    }
