"""The engine's fast forward pass over cached tokens: the same function as the model's blocks with fewer,
larger operations, for decoding where per-operation overhead, not arithmetic, sets the speed.

What differs from calling the modules (results equal to float tolerance, not bit for bit; the
batch-invariant path of engine.py calls the modules and is the bit-exact one):
- Projections that read the same input are one matmul: MLA's q and kv down-projections (q_a | kv_a), GQA's
  q | k | v, SwiGLU's gate | up (dense MLP, shared experts, and every routed expert). `PackedWeights`
  holds these fused copies (one extra copy of those tensors) and is rebuilt by `refresh()` whenever the
  engine loads new weights.
- MLA attends straight from the latent cache (DeepSeek's decoding form): scores are q_lat . c_kv + q_rope .
  k_rope with q_lat = q_nope W_uk per head, and the output is (p . c_kv) W_uv. Where a folded product is no
  larger than its two factors (true for small latents, false for DeepSeek-V3's), W_uk is folded into the
  query up-projection and W_uv into the output projection, so each is one matmul. Query rows are ordered
  (position, head), so [B, 1, H, C] is a [B, H, C] matrix with no transposes; the latent and the rope key
  share one cache row ([C + R]), so scores are one batched matmul and the mask is added inside it.
- RoPE rotates q and k in one call; norms use the fused `F.rms_norm`.
- Routed experts run on tokens sorted by expert: one grouped matmul where torch has it for the device,
  else one matmul per expert that received tokens. With few experts per choice (E <= 4 K, so at most 4x
  the routed arithmetic) and a batch that reaches them all but gives each only a few rows
  (E <= T K <= 16 E: decoding, not prefill), every token runs every expert in two matmuls and the
  unchosen ones get gate 0: cheaper than E small matmuls when per-call overhead dominates (never the case for DeepSeek-V3's 256 experts, top-8). Without tensor parallelism the shared
  experts join that form as more experts with gate 1. The router is the model's own module
  (decode.cpp repeats Router.forward's operations in the same order), so the recorded routing is what the
  model's router chooses.

C++: `kernels/csrc/decode.cpp` is this module's block() as one compiled call per forward pass (all layers,
the same ATen operations in the same order, RMSNorm, RoPE and the router's top-k selection as loops), used when
it builds (a C++ compiler is present; MEGATRON_COMPOSER_CPP=0 turns it off), the model is unsharded and float32
or bfloat16. Decoding a few requests costs per-operation dispatch, ~40 Python-level operations per layer here;
the C++ call removes that overhead, and this Python code stays the reference it is tested against
(tests/test_inference_fast_cpp.py). Where it differs in arithmetic (float32 on x86-64 with AVX2/FMA; equal to
float rounding): at decode sizes (T K <= 16 E) the routed and shared experts run as dot products over exactly
the chosen (token, expert) pairs (a third of the every-expert form's arithmetic at top-2 of 8), and MLA with at
most 4 new positions per request reads its scores and values straight from the paged cache rows instead of
gathering them into a copy first; matmuls of at most 4 rows (the projections, router and head when decoding one
or two requests) are AVX2 dot products, about twice as fast as a BLAS call there. Speculative decoding has two more
compiled calls: `mtp_draft` (the MTP module's input, block, norm, head and argmax) and, for greedy requests,
`verify_draft`, a whole step of the engine's _verify and _draft (its token layouts built in C++ from the slot
table, the MTP forward reusing the main forward's rotations).

Tensor parallelism: every weight here is this rank's shard (heads, FFN columns, vocabulary rows), read from
the parallel layers parallelize_model installed. Row-parallel outputs (attention, MLP, shared experts) are
all-reduced over the tensor-parallel group; routed experts that are all local (ep = 1) run on every rank
over all tokens (the same result everywhere, no collective); with expert parallelism the model's
dispatcher (all-to-all) is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_composer.kernels import cpp
from megatron_composer.model.rope import apply_rope
from megatron_composer.parallel import collectives as C


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, as the model's: normalise, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def _fused(*weights: Optional[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return torch.cat([w.detach() for w in weights], dim=dim).contiguous()


def _fused_bias(linears) -> Optional[torch.Tensor]:
    if all(getattr(m, "bias", None) is None for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                      for m in linears])


@dataclass
class _MLA:
    H: int
    Q: int                   # rows of the q part of w_down (q_lora_rank, or H * qk_head_dim without it)
    q_lora: bool
    C: int
    R: int
    Dn: int
    Dv: int
    w_down: torch.Tensor     # [Q + C + R, D]
    b_down: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    kv_norm: torch.Tensor
    eps: float
    w_q: torch.Tensor        # folded [H * (C + R), q_lora] or plain wq_b [H * (Dn + R), q_lora]
    q_folded: bool
    w_uk: torch.Tensor       # [H, Dn, C] (view of wkv_b)
    w_uv: torch.Tensor       # [H, C, Dv]
    w_o: torch.Tensor        # folded [D, H * C] or plain wo [D, H * Dv]
    b_o: Optional[torch.Tensor]
    o_folded: bool
    scale: float
    interleave: bool


@dataclass
class _GQA:
    H: int
    KV: int
    Dh: int
    w_qkv: torch.Tensor
    b_qkv: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    eps: float
    w_o: torch.Tensor
    scale: float


@dataclass
class _SwiGLU:
    w13: torch.Tensor        # [2F, D] (gate rows, then up rows)
    w2: torch.Tensor         # [D, F]


@dataclass
class _MoE:
    module: torch.nn.Module
    local: bool              # every routed expert is on this rank
    w13: Optional[torch.Tensor]  # [E, 2F, D]
    w2: Optional[torch.Tensor]   # [E, D, F]
    w2_all: Optional[torch.Tensor]  # [D, (E + S) * F] for the every-expert form (few experts only)
    w13_all: Optional[torch.Tensor]  # [E + S, 2F, D]: the routed experts, then S shared ones folded in
    gate_init: Optional[torch.Tensor]  # [E + S]: 0 for routed experts (scattered in), 1 for shared ones
    shared: Optional[_SwiGLU]


@dataclass
class _Block:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    eps: float
    attn: object
    ffn: object              # _SwiGLU or _MoE


class PackedWeights:
    """Fused views of the model's weights for the fast path; `refresh()` after the weights change."""

    def __init__(self, model, tp_group=None):
        self.model, self.tp_group = model, tp_group
        self.blocks: list[_Block] = []
        self.refresh()

    def refresh(self) -> None:
        blocks = list(self.model.layers) + [m.block for m in self.model.mtp[:1]]
        with torch.no_grad():
            self.blocks = [self._pack_block(b) for b in blocks]

    # ---- packing ----------------------------------------------------------------------------------------
    def _pack_block(self, block) -> _Block:
        attn = block.attention
        packed_attn = self._pack_mla(attn) if hasattr(attn, "wkv_b") else self._pack_gqa(attn)
        ff = block.feed_forward
        if block.is_moe:
            experts = ff.experts
            local = experts.num_local_experts == ff.num_experts
            few = local and ff.num_experts <= 4 * ff.router.top_k
            shared = self._pack_mlp(ff.shared_experts) if ff.shared_experts is not None else None
            w13 = _fused(experts.w1, experts.w3, dim=1) if local else None
            w2 = experts.w2.detach() if local else None
            w2_all = w13_all = gate_init = None
            if few:
                E, F_, D = experts.w1.shape
                w13_all, w2_all = w13, w2.permute(1, 0, 2).reshape(D, E * F_)
                # shared experts (unsharded ones) join as S = width / F more experts with gate 1
                S = 0
                if shared is not None and self.tp_group is None and shared.w2.shape[1] % F_ == 0:
                    S = shared.w2.shape[1] // F_
                    w1s, w3s = shared.w13.chunk(2)
                    w13_all = torch.cat([w13, torch.cat([w1s.view(S, F_, D), w3s.view(S, F_, D)], dim=1)])
                    w2_all = torch.cat([w2_all, shared.w2], dim=1)
                    w13 = w13_all[:E]
                w2_all = w2_all.contiguous()
                gate_init = torch.cat([w13.new_zeros(E), w13.new_ones(S)])
            ffn = _MoE(ff, local, w13, w2, w2_all, w13_all, gate_init, shared)
        else:
            ffn = self._pack_mlp(ff)
        return _Block(block.attention_norm.weight.detach(), block.ffn_norm.weight.detach(),
                      block.attention_norm.eps, packed_attn, ffn)

    @staticmethod
    def _pack_mlp(mlp) -> _SwiGLU:
        return _SwiGLU(_fused(mlp.w1.weight, mlp.w3.weight), mlp.w2.weight.detach())

    @staticmethod
    def _pack_mla(attn) -> _MLA:
        Dn, R, Dv, C = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
        q_lora = hasattr(attn, "wq_a")
        q_up = attn.wq_b if q_lora else attn.wq
        H = q_up.weight.shape[0] // (Dn + R)  # this rank's heads
        first = attn.wq_a if q_lora else attn.wq
        w_down = _fused(first.weight, attn.wkv_a.weight)
        b_down = _fused_bias([first, attn.wkv_a])
        w_kv = attn.wkv_b.weight.detach().view(H, Dn + Dv, C)
        w_uk, w_uv = w_kv[:, :Dn], w_kv[:, Dn:].transpose(1, 2)  # [H, Dn, C], [H, C, Dv]
        D = attn.wo.weight.shape[0]
        w_o = attn.wo.weight.detach()
        # fold when the product is no larger than its factors (then it is also no more arithmetic)
        q_folded = q_lora and attn.wq_b.weight.shape[1] * C <= attn.wq_b.weight.shape[1] * Dn + Dn * C
        o_folded = C * D <= Dv * D + C * Dv
        if q_folded:
            wq_b = attn.wq_b.weight.detach().view(H, Dn + R, -1)
            q_lat = torch.matmul(w_uk.transpose(1, 2).float(), wq_b[:, :Dn].float()).to(w_down.dtype)  # [H, C, Q]
            w_q = torch.cat([q_lat, wq_b[:, Dn:]], dim=1).reshape(H * (C + R), -1).contiguous()
        else:
            w_q = q_up.weight.detach()
        if o_folded:
            wo_HDV = w_o.view(D, H, Dv).permute(1, 0, 2)  # [H, D, Dv]
            w_o = torch.matmul(wo_HDV.float(), w_uv.transpose(1, 2).float()).permute(1, 0, 2).reshape(D, H * C)
            w_o = w_o.to(w_down.dtype).contiguous()
        b_o = attn.wo.bias.detach() if attn.wo.bias is not None else None
        return _MLA(H, first.weight.shape[0], q_lora, C, R, Dn, Dv, w_down, b_down,
                    attn.q_norm.weight.detach() if q_lora else None, attn.kv_norm.weight.detach(), attn.kv_norm.eps,
                    w_q, q_folded, w_uk, w_uv, w_o, b_o, o_folded, attn.scale, attn.rope_interleave)

    @staticmethod
    def _pack_gqa(attn) -> _GQA:
        Dh = attn.head_dim
        H, KV = attn.wq.weight.shape[0] // Dh, attn.wk.weight.shape[0] // Dh
        norm = not isinstance(attn.q_norm, torch.nn.Identity)
        return _GQA(H, KV, Dh, _fused(attn.wq.weight, attn.wk.weight, attn.wv.weight),
                    _fused_bias([attn.wq, attn.wk, attn.wv]),
                    attn.q_norm.weight.detach() if norm else None, attn.k_norm.weight.detach() if norm else None,
                    attn.q_norm.eps if norm else 0.0, attn.wo.weight.detach(), attn.scale)


class FastForward:
    """Blocks over new tokens with cached attention (see the module docstring). The engine supplies the
    batch layout (`_Batch`: write/read slots and the additive mask) and the cache."""

    def __init__(self, model, tp_group=None, use_cpp: bool = True):
        self.weights = PackedWeights(model, tp_group)
        self.tp_group = tp_group
        self.rope = model.rope
        # the C++ twin of block() (kernels/csrc/decode.cpp): one call per forward pass, where it applies
        self._cpp = cpp.load("decode") if use_cpp and self._cpp_applies(model) else None
        self._cpp_blocks: list = []
        self._cpp_cache = None
        self._cpp_heads = None
        if self._cpp is not None:
            self._cpp_blocks = [self._cpp_block(b) for b in self.weights.blocks]
            self._cpp_heads = self._cpp_heads_of(model)

    def _cpp_applies(self, model) -> bool:
        """Unsharded model (no collectives inside a block) on the CPU, float32 or bfloat16."""
        weight = model.tok_embeddings.weight
        return (self.tp_group is None and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and all(b.ffn.local for b in self.weights.blocks if isinstance(b.ffn, _MoE)))

    @property
    def uses_cpp(self) -> bool:
        return self._cpp is not None

    def refresh(self) -> None:
        self.weights.refresh()
        if self._cpp is not None:
            self._cpp_blocks = [self._cpp_block(b) for b in self.weights.blocks]
            self._cpp_heads = self._cpp_heads_of(self.weights.model)
            self._cpp_cache = None

    def _cpp_heads_of(self, model):
        """The embedding, final norm and head, and the first MTP module's input and norm, for the C++ twin."""
        h = self._cpp.Heads()
        h.embed_w = model.tok_embeddings.weight.detach()
        h.norm_w, h.norm_eps = model.norm.weight.detach(), model.norm.eps
        h.out_w = model.output.weight.detach()
        h.out_b = None if model.output.bias is None else model.output.bias.detach()
        if len(model.mtp):
            module = model.mtp[0]
            h.enorm_w, h.enorm_eps = module.enorm.weight.detach(), module.enorm.eps
            h.hnorm_w, h.hnorm_eps = module.hnorm.weight.detach(), module.hnorm.eps
            h.eh_w = module.eh_proj.weight.detach()
            h.mtp_norm_w, h.mtp_norm_eps = module.norm.weight.detach(), module.norm.eps
        return h

    def _cpp_block(self, p: _Block):
        b = self._cpp.Block()
        b.attn_norm, b.ffn_norm, b.eps = p.attn_norm, p.ffn_norm, p.eps
        a = p.attn
        if isinstance(a, _MLA):
            b.mla = True
            b.H, b.Q, b.C, b.R, b.Dn, b.Dv = a.H, a.Q, a.C, a.R, a.Dn, a.Dv
            b.q_lora, b.q_folded, b.o_folded, b.interleave = a.q_lora, a.q_folded, a.o_folded, a.interleave
            b.w_down, b.b_down, b.q_norm, b.kv_norm, b.q_eps = a.w_down, a.b_down, a.q_norm, a.kv_norm, a.eps
            b.w_q, b.w_uk, b.w_uv, b.w_o, b.b_o, b.scale = a.w_q, a.w_uk, a.w_uv, a.w_o, a.b_o, a.scale
        else:
            b.mla = False
            b.H, b.KV, b.Dh = a.H, a.KV, a.Dh
            b.w_qkv, b.b_qkv, b.q_norm, b.k_norm, b.q_eps = a.w_qkv, a.b_qkv, a.q_norm, a.k_norm, a.eps
            b.w_o, b.scale = a.w_o, a.scale
        f = p.ffn
        if isinstance(f, _MoE):
            r = f.module.router
            b.moe = True
            b.w13, b.w2, b.w13_all, b.w2_all, b.gate_init = f.w13, f.w2, f.w13_all, f.w2_all, f.gate_init
            if f.shared is not None:
                b.shared_w13, b.shared_w2 = f.shared.w13, f.shared.w2
            # the router's own tensors (not copies): the expert-bias balancing rule updates them in place
            b.router_w, b.router_bias = r.weight.detach(), r.e_score_correction_bias
            b.sigmoid, b.norm_topk = r.score_func == "sigmoid", r.norm_topk_prob
            b.E, b.top_k, b.n_group, b.topk_group = r.num_experts, r.top_k, r.n_group, r.topk_group
            b.routed_scale = float(r.routed_scaling_factor)
        else:
            b.moe = False
            b.w13, b.w2 = f.w13, f.w2
        return b

    def rms_norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm module `norm` applied to x."""
        return norm(x) if self._cpp is None else self._cpp.rms_norm(x, norm.weight.detach(), norm.eps)

    def argmax_rows(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """logits_BV.argmax(-1) (the first of equal maxima)."""
        return logits_BV.argmax(-1) if self._cpp is None else self._cpp.argmax_rows(logits_BV)

    def linear(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """An unsharded nn.Linear `layer` on x; the C++ twin runs AVX2 dot products for a few rows (faster than a
        BLAS call for one or two tokens) and at::linear otherwise."""
        if self._cpp is None:
            return layer(x)
        return self._cpp.small_linear(x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())

    def greedy_rows(self, logits_RV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the argmax (the first of equal maxima) and its log_softmax log-probability (float32); the
        C++ twin computes max, position and log-sum-exp in one pass over each row instead of writing the whole
        log-softmax (equal to float rounding)."""
        if self._cpp is not None:
            return self._cpp.greedy_rows(logits_RV)
        token_R = logits_RV.argmax(-1)
        return token_R, torch.log_softmax(logits_RV.float(), dim=-1).gather(1, token_R[:, None])[:, 0]

    def mtp_input(self, module: torch.nn.Module, emb_BND: torch.Tensor, h_prev_BND: torch.Tensor) -> torch.Tensor:
        """An MTP module's block input: eh_proj([enorm(embedding), hnorm(previous hidden)])."""
        if self._cpp is None:
            return module.eh_proj(torch.cat([module.enorm(emb_BND), module.hnorm(h_prev_BND)], dim=-1))
        return self._cpp.mtp_input(emb_BND, h_prev_BND, module.enorm.weight.detach(), module.enorm.eps,
                                   module.hnorm.weight.detach(), module.hnorm.eps, module.eh_proj.weight.detach())

    def mtp_draft(self, ids_BN: torch.Tensor, h_prev_BND: torch.Tensor, batch, cache):
        """One drafting forward of the first MTP module over (token, previous hidden) pairs at batch.pos_BN: its
        block output at each sequence's last pair [B, D], the logits there (its norm, then the model's head; an
        unsharded model's) [B, V] and their argmax [B]. The C++ twin is one call."""
        model = self.weights.model
        module, first = model.mtp[0], len(model.layers)
        if self._cpp is None:
            x = self.mtp_input(module, model.tok_embeddings(ids_BN), h_prev_BND)
            x_last = batch.last_rows(self.forward_blocks(first, first + 1, x, batch, cache)[0])
            logits = self.linear(model.output, self.rms_norm(module.norm, x_last))
            return x_last, logits, self.argmax_rows(logits)
        self._bind_cache(cache)
        return self._cpp.mtp_draft(self._cpp_blocks, first, self._cpp_heads, ids_BN, h_prev_BND, batch.last_T,
                                   batch.pos_BN, self.rope.inv_freq, float(self.rope.attention_factor),
                                   batch.write_slots_T, batch.rows_T, batch.read_slots_BL)

    def verify_draft(self, inputs: list[list[int]], starts: list[int], limits: list[int], num_drafts: list[int],
                     slot_table_BW: torch.Tensor, cache):
        """A greedy speculative step in one C++ call (needs `uses_cpp`): the main model over each sequence's newest
        token and its drafts (inputs[b] at positions starts[b]..), the argmax and its log-probability at every
        position, the accepted drafts (those equal to the argmax before the first that is not), then the first MTP
        module's catch-up over the emitted tokens' positions and the next num_drafts[b] drafts; the same operations
        as the engine's _verify and _draft for greedy requests. A sequence emitting limits[b] tokens or more
        finishes and drafts nothing. Returns (routes [num_moe_layers, B, N, K] or None, argmax [B, N],
        log-probability [B, N], drafts [B, max(num_drafts)])."""
        self._bind_cache(cache)
        routes, *rest = self._cpp.verify_draft(self._cpp_blocks, len(self.weights.model.layers), self._cpp_heads,
                                               inputs, starts, limits, num_drafts, slot_table_BW, self.rope.inv_freq,
                                               float(self.rope.attention_factor))
        return (torch.stack(routes) if routes else None), *rest

    def _bind_cache(self, cache) -> None:
        if self._cpp_cache is not cache:  # the blocks attend to this cache's tensors
            for i, b in enumerate(self._cpp_blocks):
                b.cache = cache.layers[i]
            self._cpp_cache = cache

    def forward_blocks(self, first: int, last: int, h_BND: torch.Tensor, batch, cache):
        """Blocks [first, last) (main layers, then MTP) over new tokens at batch.pos_BN; returns (h, [chosen
        experts [B, N, K] per MoE block])."""
        if self._cpp is None:
            cos, sin = self.rope(batch.pos_BN, h_BND.dtype)
            routes = []
            for i in range(first, last):
                h_BND, indices = self.block(i, h_BND, cos, sin, batch, cache)
                if indices is not None:
                    routes.append(indices)
            return h_BND, routes
        self._bind_cache(cache)
        return self._cpp.forward_blocks(self._cpp_blocks, first, last, h_BND, batch.pos_BN, self.rope.inv_freq,
                                        float(self.rope.attention_factor), batch.write_slots_T, batch.rows_T,
                                        batch.read_slots_BL)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return C.all_reduce(x, self.tp_group)

    def block(self, index: int, h_BND: torch.Tensor, cos, sin, batch, cache):
        """One transformer block; returns (h, chosen experts [B, N, K] or None)."""
        p = self.weights.blocks[index]
        x = _rms(h_BND, p.attn_norm, p.eps)
        attn = self._mla(p.attn, index, x, cos, sin, batch, cache) if isinstance(p.attn, _MLA) else \
            self._gqa(p.attn, index, x, cos, sin, batch, cache)
        h_BND = h_BND + attn
        x = _rms(h_BND, p.ffn_norm, p.eps)
        if isinstance(p.ffn, _MoE):
            out, indices = self._moe(p.ffn, x)
            return h_BND + out, indices
        return h_BND + self._reduce(self._swiglu(p.ffn, x)), None

    # ---- attention ----------------------------------------------------------------------------------
    @staticmethod
    def _rope(x_BNHR: torch.Tensor, cos, sin, interleaved: bool, batch) -> torch.Tensor:
        """RoPE on q and k heads together. Interleaved pairs (DeepSeek's layout) rotate as complex numbers in
        one multiply and stay interleaved (the model's apply_rope de-interleaves them): every query and key
        of this path has the same layout, so their dot products are the model's."""
        if not interleaved:
            return apply_rope(x_BNHR, cos, sin, False)
        pairs = torch.view_as_complex(x_BNHR.float().reshape(*x_BNHR.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * batch.rotation(cos, sin)).flatten(-2).to(x_BNHR.dtype)

    def _mla(self, p: _MLA, layer: int, x_BND, cos, sin, batch, cache) -> torch.Tensor:
        B, N, _ = x_BND.shape
        H, C, R = p.H, p.C, p.R
        q_in, c_kv, k_rope = F.linear(x_BND, p.w_down, p.b_down).split([p.Q, C, R], dim=-1)
        if p.q_lora:
            q_in = F.linear(_rms(q_in, p.q_norm, p.eps), p.w_q)
        c_kv = _rms(c_kv, p.kv_norm, p.eps)
        if p.q_folded and p.interleave and x_BND.dtype == torch.float32 and (p.Q + C + R) % 2 == 0:
            # rotate the rope parts in place: q's rows are then already the [latent | rope] score rows
            q = q_in.view(B, N, H, C + R)
            rotation = batch.rotation(cos, sin)
            torch.view_as_complex(q[..., C:].unflatten(-1, (-1, 2))).mul_(rotation)
            torch.view_as_complex(k_rope.unflatten(-1, (-1, 2))).mul_(rotation[:, :, 0])
            q_MX, kv_new = q.view(B, N * H, C + R), torch.cat([c_kv, k_rope], dim=-1)
        else:
            q_MX, kv_new = self._mla_query(p, q_in, k_rope, c_kv, cos, sin, batch)
        cache.write(layer, batch.write_slots_T, batch.valid_rows(kv_new))
        kv_BLX = cache.read(layer, batch.read_slots_BL, batch.read_slots_flat())[0]
        scores = torch.baddbmm(batch.bias_rows(H, x_BND.dtype), q_MX, kv_BLX.transpose(1, 2), alpha=p.scale)
        probs = torch.softmax(scores, dim=-1) if scores.dtype == torch.float32 else \
            torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        o_lat = torch.bmm(probs, kv_BLX[..., :C])  # [B, N * H, C]
        if p.o_folded:
            out = F.linear(o_lat.view(B, N, H * C), p.w_o)
        else:
            o = torch.bmm(o_lat.view(B * N, H, C).transpose(0, 1), p.w_uv)  # [H, B * N, Dv]
            out = F.linear(o.transpose(0, 1).reshape(B, N, H * p.Dv), p.w_o)
        out = self._reduce(out)
        return out if p.b_o is None else out + p.b_o

    def _mla_query(self, p: _MLA, q_in, k_rope, c_kv, cos, sin, batch):
        """Score rows [B, N * H, C + R] (rows (position, head)) and the new cache rows [B, N, C + R]."""
        B, N = q_in.shape[:2]
        H, C, R = p.H, p.C, p.R
        if p.q_folded:
            q = q_in.view(B, N, H, C + R)
            q_lat, q_rope = q[..., :C], q[..., C:]
        else:
            q = q_in.view(B, N, H, p.Dn + R)
            q_rope = q[..., p.Dn:]
            q_lat = torch.bmm(q[..., :p.Dn].reshape(B * N, H, p.Dn).transpose(0, 1), p.w_uk)
            q_lat = q_lat.transpose(0, 1).reshape(B, N, H, C)
        roped = self._rope(torch.cat([q_rope, k_rope.unsqueeze(2)], dim=2), cos, sin, p.interleave, batch)
        return torch.cat([q_lat, roped[:, :, :H]], dim=-1).view(B, N * H, C + R), torch.cat([c_kv, roped[:, :, H]], dim=-1)

    def _gqa(self, p: _GQA, layer: int, x_BND, cos, sin, batch, cache) -> torch.Tensor:
        B, N, _ = x_BND.shape
        H, KV, Dh = p.H, p.KV, p.Dh
        q, k, v = F.linear(x_BND, p.w_qkv, p.b_qkv).view(B, N, H + 2 * KV, Dh).split([H, KV, KV], dim=2)
        if p.q_norm is not None:
            q, k = _rms(q, p.q_norm, p.eps), _rms(k, p.k_norm, p.eps)
        qk = self._rope(torch.cat([q, k], dim=2), cos, sin, False, batch)
        cache.write(layer, batch.write_slots_T, batch.valid_rows(qk[:, :, H:]), batch.valid_rows(v))
        k_BLKD, v_BLKD = (t.to(x_BND.dtype) for t in cache.read(layer, batch.read_slots_BL, batch.read_slots_flat()))
        L, rep = k_BLKD.shape[1], H // KV
        # query heads grouped by their kv head, rows (head in group, position): [B, KV, rep * N, Dh]
        q_BKMD = qk[:, :, :H].reshape(B, N, KV, rep, Dh).permute(0, 2, 3, 1, 4).reshape(B, KV, rep * N, Dh)
        bias = batch.bias_BNL(x_BND.dtype)[:, None, None].expand(B, 1, rep, N, L).reshape(B, 1, rep * N, L)
        scores = torch.matmul(q_BKMD, k_BLKD.permute(0, 2, 3, 1)) * p.scale + bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x_BND.dtype)
        o = torch.matmul(probs, v_BLKD.transpose(1, 2))  # [B, KV, rep * N, Dh]
        o = o.view(B, KV, rep, N, Dh).permute(0, 3, 1, 2, 4).reshape(B, N, H * Dh)
        return self._reduce(F.linear(o, p.w_o))

    # ---- feed-forward -------------------------------------------------------------------------------
    @staticmethod
    def _swiglu(p: _SwiGLU, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, p.w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, p.w2)

    def _moe(self, p: _MoE, x_BND: torch.Tensor):
        B, N, D = x_BND.shape
        x_TD = x_BND.reshape(-1, D)
        r = p.module.router(x_TD)
        T, K = r.indices_TK.shape
        E = p.module.num_experts
        if p.w2_all is not None and E <= T * K <= 16 * E:
            out = self._every_expert(p, x_TD, r.indices_TK, r.weights_TK)
            shared_done = p.w13_all.shape[0] > p.w13.shape[0]
        else:
            if p.local:
                out = self._experts(p, x_TD, r.indices_TK, r.weights_TK)
            else:
                out = p.module.dispatch(p.module.experts, x_TD, r.indices_TK, r.weights_TK)
            shared_done = False
        if p.shared is not None and not shared_done:
            out = out + self._reduce(self._swiglu(p.shared, x_TD))
        return out.view(B, N, D), r.indices_TK.view(B, N, -1)

    @staticmethod
    def _every_expert(p: _MoE, x_TD: torch.Tensor, indices_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Every token through every expert (and the folded shared ones), unchosen experts gated 0."""
        T = x_TD.shape[0]
        gate, up = F.linear(x_TD, p.w13_all.view(-1, x_TD.shape[1])).view(T, p.w13_all.shape[0], -1).chunk(2, dim=-1)
        gates_TE = p.gate_init.repeat(T, 1).scatter_(1, indices_TK, weights_TK.to(x_TD.dtype))
        return F.linear(((F.silu(gate) * up) * gates_TE[:, :, None]).view(T, -1), p.w2_all)

    @staticmethod
    def _experts(p: _MoE, x_TD: torch.Tensor, indices_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        K, E = indices_TK.shape[1], p.w13.shape[0]
        flat = indices_TK.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_slot = order // K
        x_SD = x_TD.index_select(0, token_of_slot)
        counts = torch.bincount(flat, minlength=E)
        if x_TD.is_cuda and hasattr(torch, "_grouped_mm"):
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(x_SD, p.w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y_SD = torch._grouped_mm(F.silu(gate) * up, p.w2.transpose(1, 2), offs=offs)
        else:  # one matmul per expert that received tokens
            spans, start = [], 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    spans.append((e, start, start + n))
                    start += n
            h = x_SD.new_empty(x_SD.shape[0], p.w13.shape[1])
            for e, a, b in spans:
                torch.mm(x_SD[a:b], p.w13[e].t(), out=h[a:b])
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
            y_SD = x_SD.new_empty(x_SD.shape)
            for e, a, b in spans:
                torch.mm(act[a:b], p.w2[e].t(), out=y_SD[a:b])
        y_SD = y_SD * weights_TK.reshape(-1).index_select(0, order)[:, None].to(y_SD.dtype)
        return torch.zeros_like(x_TD).index_add_(0, token_of_slot, y_SD)


__all__ = ["FastForward", "PackedWeights"]
