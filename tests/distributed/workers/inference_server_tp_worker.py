"""torchrun worker: the OpenAI-compatible server over a tensor-parallel engine. Rank 0 serves HTTP on localhost
and drives the other rank (inference.lockstep.follow); concurrent completions (greedy and seeded sampling),
sent before and after an idle spell (heartbeats) and after a live weight update (full unsharded tensors,
applied on both ranks between the same steps), must equal the one-rank engine's."""

from __future__ import annotations

import copy
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import init, run_cases  # noqa: E402

from megatron_composer.data.tokenizer import load_tokenizer  # noqa: E402
from megatron_composer.inference import Engine  # noqa: E402
from megatron_composer.inference.lockstep import follow  # noqa: E402
from megatron_composer.inference.server import InferenceServer  # noqa: E402
from megatron_composer.model import Transformer, get_preset  # noqa: E402
from megatron_composer.parallel.dims import ParallelDims  # noqa: E402
from megatron_composer.parallel.parallelize import parallelize_model  # noqa: E402

ARGS = init()
REQUESTS = [
    {"prompt": "hello world", "max_tokens": 20, "temperature": 0},
    {"prompt": "list the files", "max_tokens": 16, "temperature": 0},
    {"prompt": "the files hello", "max_tokens": 20, "temperature": 0.8, "seed": 5},
]


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant system tool list the files hello world"] * 10, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def serve_case():
    groups = ParallelDims(dist.get_world_size(), tp=dist.get_world_size()).build()
    tok_dir = Path(ARGS.out) / "tokenizer"
    if dist.get_rank() == 0:
        _write_tokenizer(tok_dir)
    dist.barrier()
    tok = load_tokenizer(tok_dir)
    torch.manual_seed(0)
    ref = Transformer(get_preset("tiny-qwen3-moe").replace(vocab_size=320, num_layers=2)).eval()
    engine = Engine(parallelize_model(copy.deepcopy(ref), groups), max_batch_size=8, cache_memory_bytes=8 << 20)
    if dist.get_rank() != 0:
        follow(engine)
        return {}
    server = InferenceServer(engine, tok, "tiny").start()
    try:
        answers = [None] * len(REQUESTS)

        def ask(i):
            answers[i] = _post(server.url, REQUESTS[i])["choices"][0]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2.5)  # idle: rank 0 sends heartbeats
        answers.append(_post(server.url, REQUESTS[0])["choices"][0])
        torch.manual_seed(1)
        new = {k: v.detach().clone() for k, v in Transformer(ref.config).state_dict().items()}
        server.update_weights(new, version=2)
        answers.append(_post(server.url, REQUESTS[0])["choices"][0])
    finally:
        server.stop()
    updated = copy.deepcopy(ref)
    updated.load_state_dict(new)
    out = {"tokens_equal": True, "max_logprob_diff": 0.0, "num_tokens": 0,
           "versions": [sorted(set(a["weight_versions"])) for a in answers]}
    for i, (body, got) in enumerate(zip(REQUESTS + REQUESTS[:1] * 2, answers)):
        want = Engine(updated if i == len(answers) - 1 else ref).generate(
            [tok.encode(body["prompt"])], max_new_tokens=body["max_tokens"], temperature=body["temperature"],
            seed=body.get("seed"), stop_token_ids=[tok.eod])[0]
        out["tokens_equal"] &= got["token_ids"] == want.token_ids
        if got["token_ids"] == want.token_ids:
            diff = torch.tensor(got["token_logprobs"]) - torch.tensor(want.logprobs)
            out["max_logprob_diff"] = max(out["max_logprob_diff"], float(diff.abs().max()))
        out["num_tokens"] += len(got["token_ids"])
    return out


if __name__ == "__main__":
    run_cases(ARGS, {"serve": serve_case})
