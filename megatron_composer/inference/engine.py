"""Inference engine on the shared model: paged KV cache, continuous batching, exact log-probs, routing capture,
MTP speculative decoding and live weight updates.

The engine runs the model's own modules: each forward pass is `model(ids, positions, inference_context=ctx)`
(and the first MTP module with the same context), where the context (context.py) carries the paged cache,
the new tokens' positions and slots, and the mode; attention writes and reads the cache, MLA attending in the
latent space (DeepSeek's absorbed form) with the model's own weights, so the engine holds no second copy of
any weight and serves whatever the model's parameters hold. On the CPU the hot leaves run as C++ kernels
(kernels/cpu/csrc/decode.cpp: paged latent attention, experts over a few rows, the router's selection, the head's
row kernels) with their references beside their callers. With `batch_invariant=True` (see
batch_invariant.py) the same modules run under the batch-invariant mode, MLA expands the cached latent with
`expand_kv` and attention runs one row at a time, exactly as the training forward does in that mode, so
engine and trainer log-probabilities agree bit for bit.

Parallelism: on a model sharded by `parallel.parallelize_model` (without sequence or context parallelism) the
modules run this rank's heads / FFN columns / vocabulary rows / experts with the model's own collectives and
MoE dispatch hook (tensor parallel: row-parallel all-reduces; expert parallel: the all-to-all dispatcher).
GQA caches this rank's kv heads, MLA the whole latent row (every head reads it); logits are gathered over the
vocabulary, so every rank samples the same tokens from identically seeded generators. Every rank must make
the same calls (generate, add_request, step, update_weights with the full tensors).

Scheduling (`step`): waiting requests are admitted in arrival order while the batch has room and the cache
can reserve their whole budget; admitted prompts are prefilled together (padded batch) and sample their
first token; then every running request advances by one decode step (or one speculative verify step).
Finished requests release their blocks, so requests join and leave between decode steps.

Per generated token i the result holds: the id, `logprobs[i]` (temperature-1 log-probability, what the
trainer recomputes), `sampling_logprobs[i]` (under the distribution it was drawn from), `routed_experts[i]`
([num_moe_layers, top_k] experts of the forward position that produced it, i.e. the position of the
token before it) and `weight_versions[i]`. `GenerationResult.routing_for_training()` lays prompt and
generated routing out for `model(prompt + token_ids[:-1], routed_experts=...)`.

Speculative decoding: the first MTP module drafts D tokens (used recurrently beyond the first: its output
hidden state stands in for the main model's at the next position, as vLLM reuses MTP layers); the main
model scores the last token and the D drafts in one forward; `sampling.accept_drafts` applies the standard
rejection rule, so outputs are distributed exactly as the main model's. The MTP module keeps its own KV
cache: entries at positions whose next token is known are exact; draft-time entries beyond are provisional
and overwritten on the next step. The MTP catch-up over the positions a step emitted runs in the same forward
as the next draft, on the verify pass's hidden states. Greedy speculative output equals plain decoding token
for token in batch-invariant mode, in any dtype. Otherwise a verify forward scores several positions per
sequence where plain decoding scores one, so its rounding differs: in float32 the outputs agree on every tested
model, while in bfloat16 an argmax whose top two logits lie within rounding of each other can go either way (as
it can between plain decoding and a full recomputation).

Static decode shapes (`decode_buckets`, on by default on CUDA): a decode step pads its batch to the next size
in DECODE_BUCKETS (1, 2, 4, ..., capped by max_batch_size) and its cache read width to the next power of two
(capped by the slot table), so a step's tensors take one of a few fixed shapes per bucket, which is what
`torch.compile` (no recompiles) and CUDA graphs (one graph per bucket) need. Padding rows decode token 0 at
position 0, write only the scratch block and read only it (their slot-table rows are zeros); their logits and
routing are dropped. Real rows' results do not depend on the padding: bit for bit in batch-invariant mode,
within rounding otherwise.

Weight updates (`update_weights`) take effect between steps. By default the KV cache of tokens computed
under the old weights is kept: in-flight requests continue at once, attending to old-version keys/values,
and their later tokens carry the new version (the choice asynchronous RL pipelines make; the importance
ratio against training log-probs corrects it). With recompute_cache=True every running request's cache is
rebuilt from its tokens with the new weights first, so its next tokens equal a fresh engine's.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

from megatron_composer.kernels.cpu import cpp
from megatron_composer.model import Transformer
from megatron_composer.parallel import collectives as C
from megatron_composer.parallel.layers import ColumnParallelLinear
from megatron_composer.parallel.slices import full_shape, local_pieces, local_tensor

from .batch_invariant import batch_invariant as batch_invariant_mode
from .context import InferenceContext
from .kv_cache import CacheError, PagedKVCache
from .sampling import SamplingParams, accept_drafts, draw_rows, sample_rows, sampling_probs, sampling_probs_rows

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def decode_bucket(batch: int, max_batch_size: int) -> int:
    """The padded batch of a decode step over `batch` sequences: the next DECODE_BUCKETS size, at most
    max_batch_size (and never below `batch`)."""
    return max(batch, min(next((b for b in DECODE_BUCKETS if b >= batch), batch), max_batch_size))


class EngineError(ValueError):
    """A request or weight update the engine cannot take; the message says why and how to fix it."""


@dataclass
class GenerationResult:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)           # temperature 1, untruncated
    sampling_logprobs: list[float] = field(default_factory=list)  # under the sampling distribution
    routed_experts: Optional[torch.Tensor] = None                 # [T, num_moe_layers, top_k]
    prompt_routed_experts: Optional[torch.Tensor] = None          # [P - 1, num_moe_layers, top_k]
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None                           # "stop" | "length"
    text: Optional[str] = None                                    # with a detokenize callback
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def routing_for_training(self) -> Optional[torch.Tensor]:
        """[num_moe_layers, S, top_k] for the training input prompt + token_ids[:-1] (S = P + T - 1)."""
        if self.routed_experts is None:
            return None
        return torch.cat([self.prompt_routed_experts, self.routed_experts]).permute(1, 0, 2).contiguous()


class _Sequence:
    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, generator: torch.Generator,
                 blocks: list[int]):
        self.rid, self.params, self.generator, self.blocks = rid, params, generator, blocks
        self.tokens = list(prompt)
        self.result = GenerationResult(rid, list(prompt))
        self.routes: list[list[int]] = []  # per generated token: num_moe_layers x top_k expert ids, flat
        self.processed = 0  # positions held in the main cache; tokens[processed:] not yet fed
        self.text_len = 0
        # speculative state: the MTP cache holds positions [0, mtp_valid); each draft catches it up to processed
        self.mtp_valid = 0
        self.drafts: list[int] = []
        self.draft_probs: list[torch.Tensor] = []

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None


def _tensor_parallel_group(model: Transformer):
    """The tensor-parallel group of a model sharded by parallel.parallelize_model (None when unsharded).
    Inference shards heads, FFN columns and the vocabulary over it; sequence and context parallelism split
    one sequence's tokens, which decoding one token per request cannot use."""
    head = model.output
    if not isinstance(head, ColumnParallelLinear):
        return None
    if head.sp:
        raise EngineError("the model was parallelised with sequence_parallel=True; build the inference model "
                          "with parallel.sequence_parallel=false (decoding has one token per request)")
    if any(type(b.attention.core).__name__ == "ContextParallelAttention" for b in model.layers):
        raise EngineError("the model was parallelised with context parallelism; use parallel.cp=1 for inference")
    return head.group if C.group_size(head.group) > 1 else None


# update_weights reads each piece in boxes of at most this many elements (whole rows): a process loading its
# weights holds them plus one such box (16 MiB in float32), not a second copy of its largest tensor
UPDATE_CHUNK_ELEMENTS = 1 << 20


def _row_chunks(pieces, local_shape: Sequence[int], max_elements: int):
    """(local box, full box) pairs covering the pieces, each piece cut along dim 0 into runs of whole rows of
    at most max_elements elements (one row when a row alone is larger)."""
    for piece in pieces:
        if not piece.local:  # a 0-dim tensor
            yield piece.local, piece.full
            continue
        lo, hi, _ = piece.local[0].indices(local_shape[0])
        full_lo = piece.full[0].start or 0
        row = 1
        for s, n in zip(piece.local[1:], local_shape[1:]):
            row *= len(range(*s.indices(n)))
        step = max(1, max_elements // max(row, 1))
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            yield ((slice(a, b), *piece.local[1:]),
                   (slice(full_lo + a - lo, full_lo + b - lo), *piece.full[1:]))


class _TensorsReader:
    """Boxes of a mapping of full tensors (what update_weights reads a state dict through)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors, self.names = tensors, list(tensors)

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][box]


class Engine:
    """`Engine(model).generate(prompts, max_new_tokens, temperature=0.0, ...)`; see the module docstring."""

    def __init__(self, model: Transformer, *, max_batch_size: int = 64, max_seq_len: Optional[int] = None,
                 cache_memory_bytes: int = 1 << 30, block_size: int = 16, batch_invariant: bool = False,
                 detokenize: Optional[Callable[[list[int]], str]] = None, seed: int = 0,
                 decode_buckets: Optional[bool] = None):
        self.model = model.eval()
        self.cfg = model.config
        self.tp_group = _tensor_parallel_group(model)
        self.tp = C.group_size(self.tp_group)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or self.cfg.max_position_embeddings
        self.batch_invariant = batch_invariant
        self.detokenize = detokenize
        self.weight_version = 0
        p = next(model.parameters())
        self.device, self.dtype = p.device, model.tok_embeddings.weight.dtype
        # static decode shapes per batch bucket (module docstring); default on where graphs/compile apply
        self.decode_buckets = self.device.type == "cuda" if decode_buckets is None else decode_buckets
        self.num_mtp = len(model.mtp)
        self.cache = PagedKVCache(self.cfg, self.cfg.num_layers + min(self.num_mtp, 1), block_size,
                                  cache_memory_bytes, max_batch_size * self.max_seq_len, self.dtype, self.device,
                                  tp=self.tp)
        # row kernels for the head and greedy selection (kernels/cpu/csrc/decode.cpp), on the CPU outside
        # batch-invariant mode
        self.row_kernels = None if batch_invariant or self.device.type != "cpu" else cpp.load("decode")
        self._generator = torch.Generator().manual_seed(seed)
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._finished: dict[int, GenerationResult] = {}
        self._next_id = 0
        self._slot_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._lock = threading.RLock()
        self.stats = {"draft_tokens": 0, "accepted_tokens": 0, "decode_steps": 0}

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; it joins the running batch at the next step with room. Returns its id."""
        V = self.cfg.vocab_size
        if len(prompt) == 0:
            raise EngineError("prompt is empty; give at least one token id")
        prompt = [int(t) for t in prompt]
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise EngineError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        params.validate(V)
        if params.stop_strings and self.detokenize is None:
            raise EngineError("stop_strings need a detokenize callback: Engine(model, detokenize=tokenizer.decode)")
        if params.speculative and self.num_mtp == 0:
            raise EngineError("speculative decoding needs MTP modules; this model has num_mtp_layers=0")
        budget = self._token_budget(len(prompt), params)
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise EngineError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                              f"max_seq_len {self.max_seq_len}; shorten the prompt or lower max_new_tokens")
        if self.cache.blocks_for(budget) > self.cache.usable_blocks:
            raise CacheError(f"request needs {self.cache.blocks_for(budget)} cache blocks but the cache has "
                             f"{self.cache.usable_blocks}; raise cache_memory_bytes or lower max_new_tokens")
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**62, (), generator=self._generator))
            seq = _Sequence(rid, prompt, params, torch.Generator(device=self.device).manual_seed(seed), [])
            self._waiting.append(seq)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def pop_result(self, rid: int) -> Optional[GenerationResult]:
        with self._lock:
            return self._finished.pop(rid, None)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, temperature: float = 0.0, *,
                 top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), seed: Optional[int | Sequence[int]] = None,
                 speculative: bool = False, num_draft_tokens: int = 2) -> list[GenerationResult]:
        """Generate for every prompt (token id lists); returns one GenerationResult per prompt, in order.
        seed: one int (prompt i uses seed + i), a list (one per prompt) or None (drawn from the engine)."""
        if isinstance(seed, int) or seed is None:
            seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        else:
            seeds = list(seed)
            if len(seeds) != len(prompts):
                raise EngineError(f"got {len(seeds)} seeds for {len(prompts)} prompts; give one per prompt")
        ids = [self.add_request(p, SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            stop_token_ids=list(stop_token_ids), stop_strings=list(stop_strings), seed=s,
            speculative=speculative, num_draft_tokens=num_draft_tokens)) for p, s in zip(prompts, seeds)]
        pending = set(ids)
        while pending - self._finished.keys():
            self.step()
        return [self.pop_result(i) for i in ids]

    # ---- scheduling --------------------------------------------------------------------------------
    def _token_budget(self, prompt_len: int, params: SamplingParams) -> int:
        return prompt_len + params.max_new_tokens + (params.num_draft_tokens if params.speculative else 0)

    def step(self) -> list[GenerationResult]:
        """Admit and prefill waiting requests, advance every running one; returns those finished now."""
        # inference_mode: no autograd bookkeeping per op; results leave it as ordinary tensors (see _finish)
        with self._lock, torch.inference_mode(), batch_invariant_mode(self.batch_invariant):
            admitted = []
            while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
                seq = self._waiting[0]
                blocks = self.cache.allocate(self._token_budget(len(seq.tokens), seq.params))
                if blocks is None:
                    break
                seq.blocks = blocks
                admitted.append(self._waiting.popleft())
            if admitted:
                self._prefill(admitted)
            self._running.extend(s for s in admitted if not s.finished)
            plain = [s for s in self._running if not s.params.speculative and not s.finished]
            spec = [s for s in self._running if s.params.speculative and not s.finished]
            if plain:
                self._decode(plain)
            if spec:
                self._verify(spec)
            if plain or spec:
                self.stats["decode_steps"] += 1
            done = [s for s in admitted + self._running if s.finished]
            self._running = [s for s in self._running if not s.finished]
            for s in done:
                self.cache.release(s.blocks)
                s.blocks = []
        with self._lock:
            for s in done:
                self._finish(s)
        return [s.result for s in done]

    def _finish(self, seq: _Sequence) -> None:
        """Outside inference mode, so the routing tensors can be saved for backward by a replaying trainer."""
        r = seq.result
        L = len(self.model.moe_layers)
        if L:
            K = self.cfg.num_experts_per_tok
            r.routed_experts = torch.tensor(seq.routes, dtype=torch.long).view(-1, L, K)
            if r.prompt_routed_experts is not None:
                r.prompt_routed_experts = r.prompt_routed_experts.clone()
        if self.detokenize is not None and r.text is None:
            r.text = self.detokenize(r.token_ids)
        self._finished[seq.rid] = r

    # ---- emitting tokens ---------------------------------------------------------------------------
    def _emit(self, seq: _Sequence, token: int, logprob: float, sampling_logprob: float,
              route: Optional[list[float]]) -> None:
        r, p = seq.result, seq.params
        seq.tokens.append(token)
        r.token_ids.append(token)
        r.logprobs.append(logprob)
        r.sampling_logprobs.append(sampling_logprob)
        r.weight_versions.append(self.weight_version)
        if route is not None:
            seq.routes.append(route)
        if token in p.stop_token_ids:
            r.finish_reason = "stop"
        if p.stop_strings and r.finish_reason is None:
            text = self.detokenize(r.token_ids)
            for s in p.stop_strings:
                at = text.find(s, max(0, seq.text_len - len(s) + 1))
                if at >= 0:
                    r.finish_reason, r.text = "stop", text[:at]  # the text ends before the stop string
                    break
            seq.text_len = len(text)
        if r.finish_reason is None and (len(r.token_ids) >= p.max_new_tokens or len(seq.tokens) >= self.max_seq_len):
            r.finish_reason = "length"

    def _sample_rows(self, seqs: list[_Sequence], logits_BV: torch.Tensor, routes: Optional[torch.Tensor]) -> None:
        token_B, logp_B = self._greedy(logits_BV)
        sampling_logp = [0.0] * len(seqs)
        sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
        if sampled:  # every sampled row at once, each from its own generator
            rows = torch.tensor(sampled, device=token_B.device)
            logits_SV = logits_BV.index_select(0, rows)
            token_S, slp_S = sample_rows(logits_SV, [seqs[b].params for b in sampled],
                                         [seqs[b].generator for b in sampled])
            token_B = token_B.index_copy(0, rows, token_S)
            logp_S = torch.log_softmax(logits_SV.float(), dim=-1).gather(1, token_S[:, None])[:, 0]
            logp_B = logp_B.index_copy(0, rows, logp_S)
            for b, slp in zip(sampled, slp_S.tolist()):
                sampling_logp[b] = slp
        # a few small host lists (packing them into one float64 tensor first costs more than it saves)
        tokens, logps = token_B.tolist(), logp_B.tolist()
        route_rows = None if routes is None else routes.reshape(len(seqs), -1).tolist()
        for b, seq in enumerate(seqs):
            self._emit(seq, tokens[b], logps[b], sampling_logp[b], None if routes is None else route_rows[b])

    # ---- forward passes ----------------------------------------------------------------------------
    def _slot_table(self, seqs: list[_Sequence], pad_rows: int = 0) -> torch.Tensor:
        """[B + pad_rows, W] cache slot of every position each sequence reserved (0-padded: the scratch block;
        padding rows are all scratch). Built once per batch composition and reused by every decode step until
        a request joins or leaves."""
        key = (*(s.rid for s in seqs), -pad_rows)
        table = self._slot_tables.get(key)
        if table is None:
            if len(self._slot_tables) >= 8:
                self._slot_tables.clear()
            bs = self.cache.block_size
            offsets = torch.arange(bs, device=self.device)
            rows = [(torch.tensor(s.blocks, device=self.device)[:, None] * bs + offsets).reshape(-1) for s in seqs]
            rows += [rows[0].new_zeros(bs)] * pad_rows
            table = self._slot_tables[key] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        return table

    def _context(self, seqs: list[_Sequence], starts: list[int], token_lists: list[list[int]],
                 pad_rows: int = 0) -> InferenceContext:
        """The layout of new tokens token_lists[b] at positions starts[b].. of seqs[b], then `pad_rows` padding
        rows (one token 0 at position 0 each, written to and reading only the scratch slot 0) with the read
        width padded to the next power of two (static decode shapes, see the module docstring)."""
        table_BW = self._slot_table(seqs, pad_rows)
        lengths = [len(t) for t in token_lists] + [1] * pad_rows
        starts = list(starts) + [0] * pad_rows
        token_lists = list(token_lists) + [[0]] * pad_rows
        N, L = max(lengths), max(a + n for a, n in zip(starts, lengths))
        if pad_rows:
            L = min(1 << (L - 1).bit_length(), table_BW.shape[1])
        bs, B = self.cache.block_size, len(seqs) + pad_rows
        # ids, positions, write slots (valid rows only) and row indices from host lists in one copy
        ids = [t for tokens in token_lists for t in tokens + [0] * (N - len(tokens))]
        pos = [a + j for a in starts for j in range(N)]
        write = [s.blocks[p // bs] * bs + p % bs for s, a, n in zip(seqs, starts, lengths) for p in range(a, a + n)]
        write += [0] * pad_rows
        ragged = min(lengths) != N
        rows = [b * N + j for b, n in enumerate(lengths) for j in range(n)] if ragged else []
        last = [b * N + n - 1 for b, n in enumerate(lengths)] if ragged else []
        host = torch.tensor(ids + pos + write + rows + last, device=self.device)
        BN, T = B * N, len(write)
        # rows past a sequence's length are padding: their slots are never written, their outputs unused
        return InferenceContext(self.cache, host[:BN].view(B, N), host[BN:2 * BN].view(B, N), table_BW[:, :L], lengths,
                                starts, host[2 * BN:2 * BN + T], host[2 * BN + T:2 * BN + 2 * T] if ragged else None,
                                host[2 * BN + 2 * T:] if ragged else None, self.batch_invariant)

    def _argmax(self, logits_RV: torch.Tensor) -> torch.Tensor:
        return logits_RV.argmax(-1) if self.row_kernels is None else self.row_kernels.argmax_rows(logits_RV)

    def _greedy(self, logits_RV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the argmax and its temperature-1 log-probability (float32). Batch-invariant mode takes torch's
        log_softmax, bit for bit what the trainer computes; the row kernel skips writing it out."""
        if self.row_kernels is not None:
            return self.row_kernels.greedy_rows(logits_RV)
        token_R = logits_RV.argmax(-1)
        return token_R, torch.log_softmax(logits_RV.float(), dim=-1).gather(1, token_R[:, None])[:, 0]

    def _logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (the head's vocabulary shards gathered under TP)."""
        head = self.model.output
        if self.tp_group is None:
            if self.row_kernels is not None:  # AVX2 dot products for a few rows, at::linear beyond
                return self.row_kernels.small_linear(h_ND, head.weight, head.bias)
            return head(h_ND)
        return C.all_gather(head(h_ND), h_ND.dim() - 1, self.tp_group)

    def _main_forward(self, seqs: list[_Sequence], token_lists: list[list[int]], starts: list[int], pad_rows: int = 0):
        """The model over new tokens at positions start.. of each sequence (then `pad_rows` padding rows),
        writing the cache. Returns (normed hidden [B, N, D], routing [num_moe_layers, B, N, K] or None, context)."""
        ctx = self._context(seqs, starts, token_lists, pad_rows)
        out = self.model(ctx.ids_BN, ctx.pos_BN, inference_context=ctx, logits=False, return_routing=True)
        return out.hidden_states, out.routed_experts, ctx

    def _mtp_draft(self, seqs: list[_Sequence], h_prev_BND: torch.Tensor, token_lists: list[list[int]],
                   starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First MTP module over (previous hidden [B, N, D], rows past a sequence's tokens padding, next token)
        pairs at positions starts..; returns its block output at each sequence's last pair [B, D], the draft
        logits there [B, V] and their argmax [B]."""
        ctx = self._context(seqs, starts, token_lists)
        module = self.model.mtp[0]
        emb = self.model.tok_embeddings(ctx.ids_BN)
        cos, sin = self.model.rope(ctx.pos_BN, emb.dtype)
        x, _ = module(h_prev_BND, emb, cos, sin, None, inference_context=ctx)
        x_last = ctx.last_rows(x)
        logits = self._logits(module.norm(x_last))
        return x_last, logits, self._argmax(logits)

    # ---- prefill / decode / verify -----------------------------------------------------------------
    def _prefill(self, seqs: list[_Sequence]) -> None:
        lengths = [len(s.tokens) for s in seqs]
        hidden, routes, _ = self._main_forward(seqs, [s.tokens for s in seqs], [0] * len(seqs))
        last = torch.tensor(lengths, device=self.device) - 1
        rows = torch.arange(len(seqs), device=self.device)
        logits_BV = self._logits(hidden[rows, last])
        for b, s in enumerate(seqs):
            s.processed = lengths[b]
            if routes is not None:
                s.result.prompt_routed_experts = routes[:, b, :lengths[b] - 1].permute(1, 0, 2).clone()
            s.mtp_valid = 0
        self._sample_rows(seqs, logits_BV, None if routes is None else routes[:, rows, last].transpose(0, 1))
        self._draft_live(seqs, hidden)

    def _decode(self, seqs: list[_Sequence]) -> None:
        B = len(seqs)
        pad = decode_bucket(B, self.max_batch_size) - B if self.decode_buckets else 0
        hidden, routes, _ = self._main_forward(seqs, [[s.tokens[-1]] for s in seqs], [s.processed for s in seqs], pad)
        for s in seqs:
            s.processed += 1
        logits_BV = self._logits(hidden[:, 0])  # the whole bucket: one shape per bucket; padding rows dropped next
        self._sample_rows(seqs, logits_BV[:B] if pad else logits_BV,
                          None if routes is None else routes[:, :B, 0].transpose(0, 1))

    def _verify(self, seqs: list[_Sequence]) -> None:
        inputs = [[s.tokens[-1]] + s.drafts for s in seqs]
        starts = [s.processed for s in seqs]
        hidden, routes, _ = self._main_forward(seqs, inputs, starts)
        logits = self._logits(hidden)
        # sampled rows need the whole distribution; greedy rows only the argmax and its log-prob at every position
        logp = torch.log_softmax(logits.float(), dim=-1) if any(not s.params.greedy for s in seqs) else None
        best_T, best_logp_T = self._greedy(logits.flatten(0, 1))
        best_BN, best_logp_BN = best_T.view(logits.shape[:2]), best_logp_T.view(logits.shape[:2])
        best, best_logp = best_BN.tolist(), best_logp_BN.tolist()  # [B][N]
        route_rows = None if routes is None else routes.permute(1, 2, 0, 3).flatten(2).tolist()  # [B][N][layers*K]
        for b, s in enumerate(seqs):
            D = len(s.drafts)
            if s.params.greedy:  # accept while the draft is the main model's argmax, then emit the argmax
                n = 0
                while n < D and s.drafts[n] == best[b][n]:
                    n += 1
                emitted = best[b][:n + 1]
            else:
                emitted = accept_drafts(logits[b, :D + 1], s.drafts, s.draft_probs, s.params, s.generator)
            accepted = len(emitted) - 1
            s.result.num_draft_tokens += D
            s.result.num_accepted_tokens += accepted
            self.stats["draft_tokens"] += D
            self.stats["accepted_tokens"] += accepted
            for j, tok in enumerate(emitted):
                if s.params.greedy:
                    lp, slp = best_logp[b][j], 0.0
                else:
                    lp = float(logp[b, j, tok])
                    slp = float(sampling_probs(logits[b, j], s.params)[tok].log())
                self._emit(s, tok, lp, slp, None if routes is None else route_rows[b][j])
                if s.finished:
                    break
            s.processed += len(emitted)
        self._draft_live(seqs, hidden)

    def _draft_live(self, seqs: list[_Sequence], hidden_BND: torch.Tensor) -> None:
        """Draft for the unfinished speculative sequences of a forward whose row b of hidden_BND holds the main
        model's hidden states at positions mtp_valid.. of seqs[b] (rows past processed are ignored)."""
        live = [b for b, s in enumerate(seqs) if s.params.speculative and not s.finished]
        if not live:
            return
        if len(live) < len(seqs):
            hidden_BND = hidden_BND.index_select(0, torch.tensor(live, device=self.device))
            seqs = [seqs[b] for b in live]
        self._draft(seqs, hidden_BND)

    def _draft(self, seqs: list[_Sequence], hidden_BND: torch.Tensor) -> None:
        """Propose num_draft_tokens per sequence with the first MTP module (see module docstring). Row b of
        hidden_BND holds the main model's hidden states at positions mtp_valid.. of seqs[b]: the MTP cache
        first catches up over positions [mtp_valid, processed), in the same forward as the first draft."""
        starts = [s.mtp_valid for s in seqs]
        # position t pairs the main hidden at t with the token at t + 1 (the last one is the newest token)
        tokens = [s.tokens[s.mtp_valid + 1:s.processed + 1] for s in seqs]
        N = max(len(t) for t in tokens)
        self._extend_drafts(seqs, *self._mtp_draft(seqs, hidden_BND[:, :N], tokens, starts))

    def _extend_drafts(self, seqs: list[_Sequence], x_prev: torch.Tensor, logits: torch.Tensor,
                       drafts: torch.Tensor) -> None:
        """The drafts of seqs whose MTP cache is now complete up to processed, from the MTP forward there (block
        output [B, D], logits [B, V], argmax [B] at each newest position): the first draft, then the others
        recurrently."""
        for s in seqs:
            s.mtp_valid = s.processed
            s.drafts, s.draft_probs = [], []
        for j in range(max(s.params.num_draft_tokens for s in seqs)):
            active = [b for b, s in enumerate(seqs) if len(s.drafts) < s.params.num_draft_tokens]
            every = len(active) == len(seqs)
            rows = None if every else torch.tensor(active, device=self.device)
            if j > 0:  # logits and drafts of the active rows
                sub = seqs if every else [seqs[b] for b in active]
                x_sub = x_prev if every else x_prev.index_select(0, rows)
                x_new, logits, drafts = self._mtp_draft(sub, x_sub[:, None],
                                                        [[seqs[b].drafts[-1]] for b in active],
                                                        [seqs[b].processed - 1 + j for b in active])
                x_prev = x_new if every else x_prev.index_copy(0, rows, x_new)
            sampled = [row for row, b in enumerate(active) if not seqs[b].params.greedy]
            if sampled:  # greedy acceptance compares tokens only; sampled rows keep their draft distribution
                at = torch.tensor(sampled, device=self.device)
                q = sampling_probs_rows(logits.index_select(0, at), [seqs[active[r]].params for r in sampled])
                drafts = drafts.index_copy(0, at, draw_rows(q, [seqs[active[r]].generator for r in sampled]))
                for i, row in enumerate(sampled):
                    seqs[active[row]].draft_probs.append(q[i])
            for b, tok in zip(active, drafts.tolist()):
                seqs[b].drafts.append(tok)

    # ---- weights -----------------------------------------------------------------------------------
    def update_weights(self, weights, version: int, *, delta: bool = False, recompute_cache: bool = False) -> None:
        """Load new weights between steps and tag later tokens with `version`.

        weights: parameter/buffer name -> full (unsharded) tensor, the whole state dict or any part of it, as
        trainers publish them; or a reader of boxes of the full tensors (`names`, `shape(name)`, `read(name, box)`:
        a weight-sync version's VersionReader), from which each rank reads only the slices it holds
        (parallel/slices.py's local_pieces). On a sharded model every rank passes the same weights and takes its own
        pieces. With delta=True each tensor is a bitwise XOR delta (an integer tensor of the parameter's element
        size, e.g. int16 for bfloat16) against the current values, the lossless format of the weight-sync pipeline
        (an XOR delta shards like the tensor); a reader's deltas (a weight-sync BoxUpdate) are checked as each box
        is read. Names and shapes are checked before anything is changed. Each piece is read in boxes of whole rows
        of at most UPDATE_CHUNK_ELEMENTS elements, so loading holds one such box beside the weights. See the module
        docstring for recompute_cache.
        """
        reader = weights if hasattr(weights, "read") else _TensorsReader(weights)
        state = self.model.state_dict(keep_vars=True)
        names = list(reader.names)
        unknown = sorted(set(names) - set(state))
        if unknown:
            raise EngineError(f"update_weights got names the model does not have: {unknown[:5]}; "
                              "use the model's state_dict names")
        int_of_size = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        for name in names:
            cur, shape = state[name], list(reader.shape(name))
            if shape != list(full_shape(cur)):
                raise EngineError(f"update_weights: '{name}' has shape {tuple(shape)}, the model's is "
                                  f"{tuple(full_shape(cur))}")
            if delta and isinstance(reader, _TensorsReader) and weights[name].dtype != int_of_size[cur.element_size()]:
                raise EngineError(f"update_weights(delta=True): '{name}' must be {int_of_size[cur.element_size()]} "
                                  f"(XOR of the raw {cur.dtype} bits), got {weights[name].dtype}")
        with self._lock, torch.no_grad():
            for name in names:
                cur = state[name]
                local = local_tensor(cur)
                for local_box, full_box in _row_chunks(local_pieces(cur), local.shape, UPDATE_CHUNK_ELEMENTS):
                    src = reader.read(name, full_box)
                    if delta:  # a reader's XOR deltas: integer tensors of the element size (checked as read)
                        bits = local[local_box].view(int_of_size[cur.element_size()])
                        if src.is_floating_point() or src.element_size() != bits.element_size():
                            raise EngineError(f"update_weights(delta=True): '{name}' needs XOR bits of "
                                              f"{bits.element_size()} bytes, got {src.dtype}")
                        bits.bitwise_xor_(src.view(bits.dtype).to(bits.device))
                    else:
                        local[local_box].copy_(src)
            self.weight_version = version
            if recompute_cache:
                self._recompute_cache()

    def _recompute_cache(self) -> None:
        seqs = [s for s in self._running if not s.finished]
        if not seqs:
            return
        with batch_invariant_mode(self.batch_invariant):
            hidden, _, _ = self._main_forward(seqs, [s.tokens[:s.processed] for s in seqs], [0] * len(seqs))
            for s in seqs:
                s.mtp_valid = 0
            # the MTP cache is rebuilt from the new hidden states, and the drafts with it
            self._draft_live(seqs, hidden)
