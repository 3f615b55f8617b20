"""torchrun worker (4 ranks): the inference engine over a model sharded tp = 2 x ep = 2 by parallelize_model
(heads, FFN columns and vocabulary over tp; the routed experts over ep, their tokens sent by the model's
all-to-all dispatcher, the same MoE dispatch hook training uses) against the one-rank engine: greedy tokens,
log-probs, routing capture (prompt and generated) and weight versions, on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import init, run_cases  # noqa: E402
from inference_tp_worker import NEW_TOKENS, _compare, _models, _prompts  # noqa: E402

from megatron_composer.inference import Engine  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402


def tp_ep_case(preset: str, **kw):
    def run():
        groups = ParallelDims(dist.get_world_size(), tp=2, ep=2).build()
        ref, par = _models(preset, groups)
        prompts = _prompts(ref.config.vocab_size)
        one = Engine(ref).generate(prompts, max_new_tokens=NEW_TOKENS, **kw)
        engine = Engine(par)
        out = _compare(one, engine.generate(prompts, max_new_tokens=NEW_TOKENS, **kw))
        out["engine_tp"] = engine.tp
        out["local_experts"] = par.moe_layers[0].feed_forward.experts.num_local_experts
        out["drafted"] = engine.stats["draft_tokens"]
        return out
    return run


MLA, GQA = "tiny-deepseek-v3", "tiny-qwen3-moe"
CASES = {
    "mla_tp2_ep2_greedy": tp_ep_case(MLA),
    "gqa_tp2_ep2_greedy": tp_ep_case(GQA),
    "mla_tp2_ep2_speculative": tp_ep_case(MLA, speculative=True, num_draft_tokens=2),
}

if __name__ == "__main__":
    run_cases(init(), CASES)
