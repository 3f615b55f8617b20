"""Sampling parameters, the sampling distribution, and the speculative-decoding acceptance rule.

Two log-probabilities are reported per generated token:
- `logprob`: log p(token) under the model at temperature 1 with no truncation, i.e. log_softmax(logits).
  This is what the trainer recomputes, so importance ratios and mismatch filters compare like with like.
- `sampling_logprob`: log of the probability the token actually had in the distribution it was drawn
  from (after temperature, top-k and top-p). 0.0 for greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


class SamplingError(ValueError):
    """Sampling parameters are invalid; the message names the field and the fix."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)  # needs the engine's detokenize callback
    seed: Optional[int] = None  # per-request generator; None draws one from the engine's generator
    speculative: bool = False  # draft with the MTP heads, verify with the main model
    num_draft_tokens: int = 2

    def validate(self, vocab_size: int) -> "SamplingParams":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise SamplingError(msg)

        need(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        need(self.temperature >= 0.0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        bad = [t for t in self.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        need(not bad, f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        need(all(isinstance(s, str) and s for s in self.stop_strings), "stop_strings must be non-empty strings")
        need(self.num_draft_tokens >= 1, f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from (float32): softmax(logits / T) truncated by top-k and top-p.
    For greedy decoding, a one-hot on the argmax."""
    if params.greedy:
        logits = logits_V.float()
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return sampling_probs_rows(logits_V[None], [params])[0]


def sampling_probs_rows(logits_RV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`sampling_probs` for R rows at once, each with its own (non-greedy) parameters: row-wise operations
    only, so a row's distribution does not depend on the other rows."""
    R, V = logits_RV.shape
    dev = logits_RV.device
    logits = logits_RV.float() / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        top = logits.topk(max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=dev)[:, None]
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw_rows(probs_RV: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row by inverse CDF, with one uniform number from each row's own generator (so a row's
    draw depends on its seed and distribution alone). Zero-probability tokens are never drawn."""
    u_R = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(probs_RV.device)
    cdf = probs_RV.cumsum(-1)
    token = (cdf <= (u_R * cdf[:, -1])[:, None]).sum(-1)
    # u * total can round up to total: fall back to the last token with probability > 0
    last = probs_RV.shape[-1] - 1 - (probs_RV.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(token, last)


def draw(probs_V: torch.Tensor, generator: torch.Generator) -> int:
    return int(draw_rows(probs_V[None], [generator])[0])


def sample_rows(logits_RV: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [R] for non-greedy rows and their log-probabilities under the sampling distribution [R]."""
    probs = sampling_probs_rows(logits_RV, params)
    token = draw_rows(probs, generators)
    return token, probs.gather(1, token[:, None]).squeeze(1).log()


def accept_drafts(target_logits_RV: torch.Tensor, draft_tokens: list[int], draft_probs: list[torch.Tensor],
                  params: SamplingParams, generator: torch.Generator) -> list[int]:
    """Standard speculative rejection rule (Leviathan et al. 2023, Chen et al. 2023).

    target_logits_RV has D + 1 rows: row j is the main model's distribution for the position of draft j
    (row D follows the last draft). Draft j is accepted with probability min(1, p_j(d) / q_j(d)); the first
    rejection is replaced by a sample from normalise(max(0, p_j - q_j)); if all D are accepted a bonus token
    is drawn from row D. The emitted tokens are distributed exactly as sampling from the main model.
    Greedy: accept while the draft equals the main model's argmax, then emit the argmax.
    Returns the emitted tokens (1 .. D + 1 of them).
    """
    if params.greedy:
        best = target_logits_RV[:len(draft_tokens) + 1].float().argmax(-1).tolist()
        n = 0
        while n < len(draft_tokens) and draft_tokens[n] == best[n]:
            n += 1
        return best[:n + 1]
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        p = sampling_probs(target_logits_RV[j], params)
        q = draft_probs[j]
        u = float(torch.rand((), generator=generator, device=generator.device))
        if q[d] > 0 and u * float(q[d]) < float(p[d]):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        out.append(draw(residual / total, generator) if total > 0 else draw(p, generator))
        return out
    out.append(draw(sampling_probs(target_logits_RV[len(draft_tokens)], params), generator))
    return out
