"""torchrun worker: the inference engine over a tensor-parallel model against the one-rank engine.

Per preset (MLA and GQA), every rank builds the same full model, keeps an unsharded copy for the one-rank
reference engine, and shards the other with parallelize_model (tp = world size). Cases compare, on every
rank: greedy tokens (fast path and batch-invariant path), seeded sampling, MTP speculative decoding, and
a live weight update (full state dict, then an XOR delta) mid-generation; and check that all ranks
returned the same results.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import init, run_cases  # noqa: E402

from megatron_composer.inference import Engine, SamplingParams  # noqa: E402
from megatron_composer.model import Transformer, get_preset  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.parallelize import parallelize_model  # noqa: E402

NEW_TOKENS = 40
LENGTHS = [5, 17, 9]


def expert_parallel_case(preset: str):
    """ep = 2 (experts split, everything else replicated): every rank runs the same requests and the
    experts' tokens travel by the model's all-to-all dispatcher."""
    def run():
        groups = ParallelDims(dist.get_world_size(), ep=dist.get_world_size()).build()
        ref, par = _models(preset, groups)
        prompts = _prompts(ref.config.vocab_size)
        one = Engine(ref).generate(prompts, max_new_tokens=NEW_TOKENS)
        engine = Engine(par)
        out = _compare(one, engine.generate(prompts, max_new_tokens=NEW_TOKENS))
        out["local_experts"] = par.moe_layers[0].feed_forward.experts.num_local_experts
        return out
    return run


def _models(preset: str, groups, seed: int = 0):
    cfg = get_preset(preset).replace(num_layers=3)
    torch.manual_seed(seed)
    ref = Transformer(cfg).eval()
    par = parallelize_model(copy.deepcopy(ref), groups).eval()
    return ref, par


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _summary(results) -> list[dict]:
    return [{"tokens": r.token_ids, "logprobs": r.logprobs, "versions": r.weight_versions,
             "routes": None if r.routed_experts is None else r.routed_experts.tolist(),
             "prompt_routes": None if r.prompt_routed_experts is None else r.prompt_routed_experts.tolist()}
            for r in results]


def _compare(ref, got) -> dict:
    """Differences between the one-rank and the tensor-parallel results, and whether all ranks agree."""
    mine = _summary(got)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {"ranks_agree": all(o == everyone[0] for o in everyone), "tokens_equal": True, "routes_equal": True,
           "versions_equal": True, "max_logprob_diff": 0.0, "num_tokens": 0}
    for a, b in zip(_summary(ref), mine):
        out["tokens_equal"] &= a["tokens"] == b["tokens"]
        out["routes_equal"] &= a["routes"] == b["routes"] and a["prompt_routes"] == b["prompt_routes"]
        out["versions_equal"] &= a["versions"] == b["versions"]
        if a["tokens"] == b["tokens"]:
            diff = (torch.tensor(a["logprobs"], dtype=torch.float64) - torch.tensor(b["logprobs"], dtype=torch.float64))
            out["max_logprob_diff"] = max(out["max_logprob_diff"], float(diff.abs().max()))
        out["num_tokens"] += len(b["tokens"])
    return out


def generation_case(preset: str, batch_invariant: bool = False, **kw):
    def run():
        groups = ParallelDims(dist.get_world_size(), tp=dist.get_world_size()).build()
        ref, par = _models(preset, groups)
        prompts = _prompts(ref.config.vocab_size)
        one = Engine(ref, batch_invariant=batch_invariant).generate(prompts, max_new_tokens=NEW_TOKENS, **kw)
        engine = Engine(par, batch_invariant=batch_invariant)
        tp = engine.generate(prompts, max_new_tokens=NEW_TOKENS, **kw)
        out = _compare(one, tp)
        # the engine saw the tensor-parallel group; GQA caches this rank's kv heads only
        out["engine_tp"] = engine.tp
        out["cache_row"] = [list(t.shape[1:]) for t in engine.cache.layers[0]]
        out["full_cache_row"] = [list(t.shape[1:]) for t in Engine(ref).cache.layers[0]]
        return out
    return run


def speculative_case(preset: str):
    def run():
        groups = ParallelDims(dist.get_world_size(), tp=dist.get_world_size()).build()
        ref, par = _models(preset, groups)
        prompts = _prompts(ref.config.vocab_size)
        plain = Engine(ref).generate(prompts, max_new_tokens=NEW_TOKENS)
        engine = Engine(par)
        spec = engine.generate(prompts, max_new_tokens=NEW_TOKENS, speculative=True, num_draft_tokens=2)
        out = _compare(plain, spec)
        out["drafted"] = engine.stats["draft_tokens"]
        return out
    return run


def weight_update_case(preset: str):
    """Update mid-generation: a full state dict (version 3), then an XOR delta back to the first weights
    (version 4); the tensor-parallel engine gets the same unsharded tensors as the one-rank engine."""
    def run():
        groups = ParallelDims(dist.get_world_size(), tp=dist.get_world_size()).build()
        ref, par = _models(preset, groups)
        first = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        torch.manual_seed(7)
        new = {k: v.detach().clone() for k, v in Transformer(ref.config).state_dict().items()}
        int_type = {4: torch.int32, 2: torch.int16}
        delta = {k: new[k].view(int_type[v.element_size()]) ^ first[k].view(int_type[v.element_size()])
                 for k, v in first.items() if v.is_floating_point()}
        prompts = _prompts(ref.config.vocab_size, seed=1)
        results = []
        for model in (ref, par):
            engine = Engine(model)
            rids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
            for _ in range(10):
                engine.step()
            engine.update_weights(new, version=3)
            for _ in range(10):
                engine.step()
            engine.update_weights(delta, version=4, delta=True, recompute_cache=True)
            while engine.has_unfinished():
                engine.step()
            results.append([engine.pop_result(r) for r in rids])
        out = _compare(*results)
        out["versions_seen"] = sorted({v for r in results[1] for v in r.weight_versions})
        # the delta restored the first weights on this rank's shards
        restored = parallelize_model(copy.deepcopy(ref), groups).state_dict()
        out["delta_restored"] = all(torch.equal(restored[k], v) for k, v in par.state_dict().items())
        return out
    return run


def lockstep_case(preset: str):
    """Rank 0 alone drives the engine through Lockstep (sampled requests with engine-drawn seeds, steps, a
    weight update sent as a version that rank 1 fetches itself); rank 0's results equal a one-rank engine
    given rank 0's resolved seeds and the same update between the same steps. Before it, a version rank 1
    cannot fetch is refused on both ranks (WeightsRefused on rank 0; no rank applies it)."""
    def run():
        from megatron_composer.inference import Lockstep, follow
        from megatron_composer.inference.lockstep import WeightsRefused

        groups = ParallelDims(dist.get_world_size(), tp=dist.get_world_size()).build()
        ref, par = _models(preset, groups)
        torch.manual_seed(9)
        new = {k: v.detach().clone() for k, v in Transformer(ref.config).state_dict().items()}
        prompts = _prompts(ref.config.vocab_size, seed=2)
        engine = Engine(par)
        if dist.get_rank() != 0:
            def fetch(version):
                if version != 5:
                    raise RuntimeError(f"version {version} is corrupt in the store (injected)")
                return new
            follow(engine, fetch=fetch)
            return {"rank": 1}
        drive = Lockstep(engine, seed=0)
        rids = [drive.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)) for p in prompts]
        seeds = [s.params.seed for s in engine._waiting]
        for _ in range(12):
            drive.step()
        try:
            drive.update_weights(new, version=4, broadcast=False)
            refused = False
        except WeightsRefused:
            refused = engine.weight_version == 0
        drive.update_weights(new, version=5, broadcast=False)
        while engine.has_unfinished():
            drive.step()
        drive.stop()
        got = [engine.pop_result(r) for r in rids]
        one = Engine(ref)
        ids = [one.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=sd))
               for p, sd in zip(prompts, seeds)]
        for _ in range(12):
            one.step()
        one.update_weights(new, version=5)
        while one.has_unfinished():
            one.step()
        want = [one.pop_result(r) for r in ids]
        return {"refused": refused, "tokens_equal": [a.token_ids for a in got] == [b.token_ids for b in want],
                "versions_equal": [a.weight_versions for a in got] == [b.weight_versions for b in want],
                "versions_seen": sorted({v for r in got for v in r.weight_versions}),
                "max_logprob_diff": max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs))}
    return run


MLA, GQA = "tiny-deepseek-v3", "tiny-qwen3-moe"
CASES = {
    "mla_greedy": generation_case(MLA),
    "gqa_greedy": generation_case(GQA),
    "mla_greedy_batch_invariant": generation_case(MLA, batch_invariant=True),
    "mla_sampled": generation_case(MLA, temperature=1.0, top_p=0.9, seed=11),
    "gqa_sampled": generation_case(GQA, temperature=0.8, top_k=50, seed=12),
    "mla_speculative": speculative_case(MLA),
    "mla_weight_update": weight_update_case(MLA),
    "gqa_weight_update": weight_update_case(GQA),
    "mla_lockstep": lockstep_case(MLA),
    "mla_ep2_greedy": expert_parallel_case(MLA),
    "gqa_ep2_greedy": expert_parallel_case(GQA),
}

if __name__ == "__main__":
    run_cases(init(), CASES)
