"""The transformer: embedding, blocks (attention + MLP or MoE), final norm, output head, and DeepSeek-V3 style
Multi-Token-Prediction modules sharing the embedding and head.

MTP depth k (1-based) at position t: h_k = Block_k(W_k [enorm(Emb(x_{t+k})); hnorm(h_{k-1})]) with h_0 the
main model's normed output; its logits at t predict token t+1+k. The embedding of x_{t+k} comes from
`mtp_shifted_ids`, which context parallelism overrides to fetch ids across shard boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelConfig
from .attention import build_attention, document_ids
from .init import InitRule, init_box, new_init_seed
from .moe import MLP, MoE
from .norms import RMSNorm
from .rope import RotaryEmbedding


@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor]  # None when the forward was asked not to apply the main head
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    routed_experts: Optional[torch.Tensor] = None  # [num_moe_layers, B, S, K]
    aux_loss: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = build_attention(cfg)
        self.attention.layer_id = layer_id  # its KV-cache layer in inference
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.feed_forward = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x_BSD, cos, sin, doc_ids_BS, replay_indices_BSK=None, inference_context=None):
        """Returns (x, chosen experts or None, balance loss or None). With an inference_context attention reads
        and extends the KV cache (see attention.py)."""
        attn_in = self.attention_norm(x_BSD)
        if inference_context is None:
            x_BSD = x_BSD + self.attention(attn_in, cos, sin, doc_ids_BS)
        else:
            x_BSD = x_BSD + self.attention(attn_in, cos, sin, doc_ids_BS, inference_context)
        h = self.ffn_norm(x_BSD)
        if self.is_moe:
            out, indices, aux = self.feed_forward(h, replay_indices_BSK)
            return x_BSD + out, indices, aux
        return x_BSD + self.feed_forward(h), None, None


class MTPModule(nn.Module):
    """One MTP depth; embedding and output head are the main model's."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = TransformerBlock(cfg, layer_id)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h_prev_BSD, emb_BSD, cos, sin, doc_ids_BS, inference_context=None):
        x = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(h_prev_BSD)], dim=-1))
        x, _, aux = self.block(x, cos, sin, doc_ids_BS, inference_context=inference_context)
        return x, aux


def mtp_shifted_ids(input_ids_BS: torch.Tensor, k: int) -> torch.Tensor:
    """Ids shifted left by k (the token at t + k for position t); the last k positions have no target and
    are filled with id 0 (their MTP loss is masked)."""
    return F.pad(input_ids_BS[:, k:], (0, k), value=0)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        # drawn first, before submodules consume the generator (they do on a real device, not on meta)
        self.init_seed = new_init_seed()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.mtp = nn.ModuleList(MTPModule(cfg, cfg.num_layers + k) for k in range(cfg.num_mtp_layers))
        self.mtp_shifted_ids = mtp_shifted_ids
        self.reset_parameters(self.init_seed)

    def init_rule(self, name: str) -> InitRule:
        """The distribution of the tensor `name` (a state-dict name) at initialisation: RMSNorm gains start at
        one, biases (and the router's selection bias) at zero, every other weight (embedding, projections,
        router, experts, output head) is N(0, init_std^2)."""
        if name.endswith("norm.weight"):
            return InitRule("ones")
        if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            return InitRule("zeros")
        return InitRule("normal", self.config.init_std)

    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """Initialise every (non-meta) tensor by `init_rule` under base seed `seed` (None: drawn from torch's
        global generator). The draw of each tensor does not depend on how the model is laid out
        (model/init.py), so a sharded build filling its pieces with the same seed assembles this model."""
        self.init_seed = new_init_seed() if seed is None else seed
        for name, t in list(self.named_parameters()) + [(n, b) for n, b in self.named_buffers()
                                                        if n.endswith("e_score_correction_bias")]:
            if not t.is_meta:
                t.copy_(init_box(self.init_rule(name), t.shape, self.init_seed, name))
        self.reset_buffers()

    def _apply(self, fn, recurse=True):
        # Module._apply (to_empty, .to, .cuda) converts a shared parameter once per module that holds it, which
        # unties the output head from the embedding; tie them again.
        super()._apply(fn, recurse)
        if self.config.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return self

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the derived, non-persistent buffers (rope inverse frequencies), e.g. after to_empty."""
        if not self.rope.inv_freq.is_meta:
            self.rope.inv_freq.copy_(RotaryEmbedding(self.config).inv_freq)

    @property
    def moe_layers(self) -> list[TransformerBlock]:
        return [layer for layer in self.layers if layer.is_moe]

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *,
                routed_experts: Optional[torch.Tensor] = None, return_routing: bool = False,
                mtp: bool = False, return_hidden: bool = False, logits: bool = True, inference_context=None):
        """Logits [B, S, V]; or a ModelOutput when routing, MTP logits or hidden states are requested.

        inference_context (inference/context.py): new tokens over a KV cache at positions position_ids (the
        inference engine's forward; attention writes and reads the cache, packed documents do not apply).

        logits=False leaves out the main head (ModelOutput.logits is None, hidden_states holds the final
        normed states) for a loss that fuses the head, as pretrain.losses does.

        position_ids [B, S] restarting at document boundaries mark packed documents. routed_experts
        [num_moe_layers, B, S, K] replays a recorded routing (main layers; MTP blocks route freely).
        """
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        if routed_experts is not None and routed_experts.shape[0] != len(self.moe_layers):
            raise ValueError(f"routed_experts has {routed_experts.shape[0]} layers; the model has "
                             f"{len(self.moe_layers)} MoE layers")
        doc_ids = document_ids(position_ids) if inference_context is None else None
        h = self.tok_embeddings(input_ids)
        cos, sin = self.rope(position_ids, h.dtype)
        chosen, aux_total, moe_i = [], h.new_zeros((), dtype=torch.float32), 0
        for layer in self.layers:
            replay = None
            if layer.is_moe and routed_experts is not None:
                replay = routed_experts[moe_i]
            h, indices, aux = layer(h, cos, sin, doc_ids, replay, inference_context)
            if indices is not None:
                chosen.append(indices)
                if aux is not None:
                    aux_total = aux_total + aux
                moe_i += 1
        h = self.norm(h)
        main_logits = self.output(h) if logits else None
        if not (return_routing or mtp or return_hidden or not logits):
            return main_logits
        out = ModelOutput(logits=main_logits, aux_loss=aux_total,
                          hidden_states=h if return_hidden or not logits else None)
        if return_routing and chosen:
            out.routed_experts = torch.stack(chosen)
        if mtp:
            h_prev = h
            for k, module in enumerate(self.mtp, start=1):
                emb = self.tok_embeddings(self.mtp_shifted_ids(input_ids, k))
                h_prev, aux = module(h_prev, emb, cos, sin, doc_ids)
                if aux is not None:
                    out.aux_loss = out.aux_loss + aux
                out.mtp_logits.append(self.output(module.norm(h_prev)))
        return out
