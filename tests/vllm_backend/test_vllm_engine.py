"""rollout.backend=vllm against the project's engine, on vLLM's CPU build (`make test-vllm` makes its environment;
without vLLM these tests are skipped with the reason).

On a tiny Qwen3-MoE in float32: greedy tokens and log-probs, and the log-probs of tokens vLLM sampled at
temperature 0.7, equal our engine's (|Δ| <= 1e-5); after each of 5 versions published to the weight store by the
trainer's publisher (XOR deltas, a snapshot interval of 3) and fetched by a rollout subscriber, vLLM's greedy
tokens and log-probs equal the trainer's weights'; vLLM's routed experts (per MoE layer, prompt and generated
positions, logical ids) equal our router's choices on the same tokens, before and after an update; an RL run on
vLLM rollouts with router replay of vLLM's experts (R3) trains on them."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in its own environment")

from megatron_composer.inference import Engine  # noqa: E402
from megatron_composer.inference.vllm_engine import VLLMEngine, cpu_serving_problem  # noqa: E402
from megatron_composer.model import Transformer, get_preset  # noqa: E402

TOL = 1e-5
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = get_preset("tiny-qwen3-moe")
    model = Transformer(cfg).eval()
    engine = VLLMEngine(cfg, dtype=torch.float32, max_batch_size=8, max_seq_len=256, cache_memory_bytes=32 << 20,
                        seed=0)
    return cfg, model, engine


def _logprobs_of(model, prompt, tokens, temperature):
    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens]))
        logits = (out.logits if hasattr(out, "logits") else out)[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _same_greedy(model, engine):
    ours = Engine(model).generate(PROMPTS, max_new_tokens=8)
    theirs = engine.generate(PROMPTS, max_new_tokens=8)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
    return theirs


def test_greedy_and_sampled_logprobs_equal_our_engine(tiny):
    cfg, model, engine = tiny
    engine.update_weights({k: t.detach().clone() for k, t in model.state_dict().items()}, 0)
    out = _same_greedy(model, engine)
    assert all(r.weight_versions == [0] * len(r.token_ids) for r in out)
    for prompt, r in zip(PROMPTS, engine.generate(PROMPTS, max_new_tokens=8, temperature=0.7, seed=11)):
        want = _logprobs_of(model, prompt, r.token_ids, 0.7)
        assert (want - torch.tensor(r.sampling_logprobs)).abs().max().item() <= TOL


def _same_routing(model, engine, temperature=0.0):
    ours = Engine(model).generate(PROMPTS, max_new_tokens=8)
    theirs = engine.generate(PROMPTS, max_new_tokens=8)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert b.prompt_routed_experts.shape == a.prompt_routed_experts.shape
        assert b.routed_experts.shape == a.routed_experts.shape == (8, len(model.config.moe_layer_ids),
                                                                      model.config.num_experts_per_tok)
        assert torch.equal(a.routing_for_training().sort(-1).values, b.routing_for_training().sort(-1).values)


def test_routed_experts_equal_our_router(tiny):
    cfg, model, engine = tiny
    engine.update_weights({k: t.detach().clone() for k, t in model.state_dict().items()}, 0)
    _same_routing(model, engine)
    with torch.no_grad():  # the routers follow an update of their weights
        for name, p in model.named_parameters():
            if "router" in name or "gate" in name:
                p.add_(0.05 * torch.randn_like(p))
    engine.update_weights({k: t.detach().clone() for k, t in model.state_dict().items()}, 1)
    _same_routing(model, engine)
    # sampled tokens: the routing of the sequence vLLM sampled equals our router's on that sequence
    for prompt, r in zip(PROMPTS, engine.generate(PROMPTS, max_new_tokens=8, temperature=0.9, seed=3)):
        with torch.no_grad():
            out = model(torch.tensor([prompt + r.token_ids[:-1]]), return_routing=True)
        ours = out.routed_experts[:, 0]  # [layers, S, K]
        assert torch.equal(ours.sort(-1).values, r.routing_for_training().sort(-1).values)


def _publish_steps(model, publisher, versions, seed=1):
    g = torch.Generator().manual_seed(seed)
    for version in versions:
        with torch.no_grad():  # a tiny RL step
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        publisher.publish(model, version)
        yield version


def test_published_versions_reach_vllm_exactly(tiny, tmp_path):
    """The production path: vLLM's worker subscribes to the store itself (engine.subscription), prefetches in
    its own thread, and applies a version when the engine says so; no weights pass through the driver."""
    import time

    import cloudpickle

    from rl.weight_sync import ObjectStore
    from rl.weight_sync.config import WeightSyncConfig

    cfg, model, engine = tiny
    sync = WeightSyncConfig(dtype="float32", snapshot_interval=3)
    store = ObjectStore(f"file://{tmp_path}/store")
    publisher = sync.publisher(store)
    with torch.device("meta"):
        names_only = Transformer(cfg)  # what a vLLM rollout worker subscribes with (rl.model.rollout_model)
    rpc = engine.llm.collective_rpc
    # as vLLM's multi-process executor sends them: every call to the workers travels pickled
    engine.llm.collective_rpc = lambda fn, *a, **kw: rpc(cloudpickle.loads(cloudpickle.dumps(fn)), *a, **kw)
    subscription = engine.subscription(sync.subscriber(store, names_only))
    deltas = 0
    for version in _publish_steps(model, publisher, range(1, 4)):
        update = subscription.prepare(version)
        deltas += int(update.delta)
        engine.update_weights(update, version)
        update.commit()
        out = _same_greedy(model, engine)
        assert all(r.weight_versions == [version] * len(r.token_ids) for r in out)
    subscription.start(0.05)  # versions 4 and 5 arrive through the workers' background prefetch
    try:
        for version in _publish_steps(model, publisher, range(4, 6), seed=2):
            deadline = time.monotonic() + 60
            while (ready := subscription.pop_ready()) is None or ready.version < version:
                assert time.monotonic() < deadline, f"v{version} was not prefetched"
                time.sleep(0.05)
            deltas += int(ready.delta)
            engine.update_weights(ready, ready.version)
            ready.commit()
            out = _same_greedy(model, engine)
            assert all(r.weight_versions == [version] * len(r.token_ids) for r in out)
    finally:
        subscription.stop()
        engine.llm.collective_rpc = rpc
    assert deltas >= 3  # most versions arrived as XOR deltas on the held version


def test_a_worker_holds_only_its_experts(tmp_path):
    """With expert parallelism a vLLM worker's boxes are the non-expert tensors and its own experts: its
    subscriber fetches and its base holds those alone (here a worker holding experts 2, 3 and 6 of 128)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    from megatron_composer.inference.vllm_engine import VLLMWorkerWeights, _ranges
    from rl.weight_sync import ObjectStore
    from rl.weight_sync.config import WeightSyncConfig
    from rl.weight_sync.subscriber import WeightSubscriber

    class Placed(MoERunner):  # the expert placement vLLM gives a worker under EP, without building a layer
        def __init__(self, layer_id, expert_map):
            torch.nn.Module.__init__(self)
            self._layer, self._map = layer_id, expert_map

        layer_id = property(lambda self: self._layer)
        expert_map = property(lambda self: self._map)

    assert _ranges([6, 2, 3]) == [(2, 4), (6, 7)]
    torch.manual_seed(0)
    cfg = get_preset("tiny-qwen3-moe").replace(num_layers=2, num_experts=128)
    mine = torch.full((cfg.num_experts,), -1)
    mine[[2, 3, 6]] = torch.arange(3)
    runner = SimpleNamespace(model=torch.nn.ModuleList([Placed(i, mine) for i in cfg.moe_layer_ids]))
    worker = VLLMWorkerWeights(runner, cfg, torch.float32)
    expert = "layers.1.feed_forward.experts.w1"
    assert [box[0] for box in worker.wants[expert][1]] == [(2, 4), (6, 7)]
    assert worker.wants["layers.1.attention.wq.weight"][1] == [tuple((0, n) for n in worker.shapes[
        "layers.1.attention.wq.weight"])]

    model = Transformer(cfg)
    store = ObjectStore(f"file://{tmp_path}/store")
    WeightSyncConfig(dtype="float32", chunk_mb=1).publisher(store).publish(model, 1)
    worker.subscribe(lambda wants: WeightSubscriber(store, wants, max_refetch=0))
    worker.prepare(1)
    update = worker.staged
    full = model.state_dict()
    for name, boxes in update.bits.items():
        for box, bits in boxes.items():
            want = full[name][tuple(slice(lo, hi) for lo, hi in box)]
            assert torch.equal(bits.view(want.dtype), want)
    held = sum(b.numel() for boxes in update.bits.values() for b in boxes.values())
    experts = sum(full[n].numel() for n in full if ".experts." in n)
    assert held == sum(t.numel() for t in full.values()) - experts + experts * 3 // cfg.num_experts
    assert update.bytes_read < 0.5 * update.version_bytes  # the chunks of only other workers' experts: not fetched


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_int4_experts_reach_vllm_in_the_released_format(tmp_path, preset):
    """rollout.quantize_experts=int4 (Kimi K2.5 served as released), on the tiny Qwen3-MoE and the tiny
    DeepSeek-shaped model (MLA, dense first layer, shared expert, MTP): the trainer publishes the routed experts as
    their packed INT4 words and scales (WeightPublisher experts="int4"); a worker subscribes to those, keeps them
    as its base (no worker quantises) and hands vLLM's reload, for each of 5 versions after AdamW steps (XOR
    deltas of the served bytes), tensor for tensor what our INT4 export of that version writes (compressed-tensors
    pack-quantized experts, the rest in the engine's dtype; transformers + compressed-tensors read it with logits
    equal to ours: tests/unit/checkpoint/test_checkpoint_int4.py). vLLM's CPU build has no kernel for this scheme
    (its CPU INT4 MoE takes another), so the reload is captured. The worker's base equals the plan's
    (cost.rollout_update_plan) within 5%, and a staged delta is never larger than its boxes."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from megatron_composer.checkpoint.hf import save_hf_checkpoint
    from megatron_composer.inference.vllm_engine import VLLMWorkerWeights
    from megatron_composer.parallel.cost import RolloutEngine, rollout_update_plan
    from rl.weight_sync import ObjectStore, WeightPublisher
    from rl.weight_sync.subscriber import WeightSubscriber

    torch.manual_seed(0)
    cfg = get_preset(preset).replace(num_layers=3 if preset == "tiny-deepseek-v3" else 2)  # DeepSeek: dense first
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    handed = {}
    runner = SimpleNamespace(model=torch.nn.Module(),
                             reload_weights=lambda weights_iterator: handed.update(dict(weights_iterator)))
    worker = VLLMWorkerWeights(runner, cfg, torch.bfloat16, quantize_experts="int4")
    store = ObjectStore(f"file://{tmp_path}/store")
    publisher = WeightPublisher(store, snapshot_interval=3, dtype=torch.bfloat16, experts="int4")
    worker.subscribe(lambda wants: WeightSubscriber(store, wants, max_refetch=0, sparse_deltas=True))
    g = torch.Generator().manual_seed(1)
    deltas = 0
    for version in range(6):
        if version:
            tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        publisher.publish(model, version)
        info = worker.prepare(version)
        staged = worker.staged
        deltas += info["delta"]
        held_before = worker.held_bytes()
        handed.clear()
        worker.apply_version(version)
        worker.commit(version)
        save_hf_checkpoint(model, tmp_path / f"export{version}", dtype=torch.bfloat16, quantize="int4-experts",
                           progress=False)
        exported = {k: t for k, t in load_file(str(tmp_path / f"export{version}" / "model.safetensors")).items()
                    if not k.startswith(tuple(f"model.layers.{cfg.num_layers + i}." for i in range(8)))}  # no MTP
        assert set(handed) == set(exported)
        assert any(k.endswith(".weight_packed") for k in handed)
        for k, t in exported.items():
            # the engine runs in the published dtype: DeepSeek's router, fp32 in the export, arrives in bf16
            want = t.to(torch.bfloat16).to(t.dtype) if t.dtype == torch.float32 else t
            assert torch.equal(handed[k].to(t.dtype), want), (version, k)
    assert deltas == 5
    # host bytes: the base (vLLM's CPU build cannot hold it) as planned, and the staged delta only its changes
    plan = rollout_update_plan(cfg, RolloutEngine(gpus=1, weights="int4"), gpus_per_node=1, base="host")
    assert abs(held_before - plan["host"]["base"]) <= 0.05 * plan["host"]["base"], (held_before, plan["host"])
    # at this lr nearly every bf16 element changes: boxes stay dense where positions would cost more
    assert staged.delta and staged.staged_bytes <= held_before


def test_a_deepseek_shaped_model_loads_generates_and_updates():
    """MLA, a dense first layer, sigmoid group-limited routing with a bias, a shared expert, MTP weights: on the
    CPU build in bf16 (its MLA kernels take nothing else; latent + rope = 320, the smallest head they serve).
    Through 2 updates the log-probs of the tokens vLLM sampled stay within bf16 noise of our model's on the
    same weights (measured max 0.11, mean 0.015 nats; a fresh engine given the last version directly returns
    the same numbers), the routed experts cover the MoE layers, every token carries its version."""
    torch.manual_seed(0)
    cfg = get_preset("tiny-deepseek-v3").replace(kv_lora_rank=256, qk_rope_head_dim=64)
    if (why := cpu_serving_problem(cfg)) is not None:
        pytest.skip(why)
    model = Transformer(cfg).eval().to(torch.bfloat16)
    engine = VLLMEngine(cfg, dtype=torch.bfloat16, max_batch_size=8, max_seq_len=256, cache_memory_bytes=32 << 20,
                        seed=0)
    g = torch.Generator().manual_seed(0)
    for version in range(3):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
        engine.update_weights({k: t.detach().clone() for k, t in model.state_dict().items()}, version)
        out = engine.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=5)
        gap = torch.cat([(_logprobs_of(model.float(), p, r.token_ids, 1.0) - torch.tensor(r.sampling_logprobs)).abs()
                         for p, r in zip(PROMPTS, out)])
        model.to(torch.bfloat16)
        assert gap.max().item() < 0.25 and gap.mean().item() < 0.04, (version, gap.max().item(), gap.mean().item())
        for p, r in zip(PROMPTS, out):
            assert r.weight_versions == [version] * len(r.token_ids)
            assert r.routing_for_training().shape == (len(cfg.moe_layer_ids), len(p) + len(r.token_ids) - 1,
                                                       cfg.num_experts_per_tok)


def test_rl_run_with_vllm_rollouts(tmp_path):
    """run_rl with rollout.backend=vllm (an embedded worker) and R3 (the trainer replays vLLM's routed experts):
    groups come back with tokens of later weight versions, and on the first step (tokens and trainer both at v0)
    the trainer's log-probs are vLLM's behaviour log-probs (importance ratio 1, mismatch <= 1e-5)."""
    import json

    from megatron_composer.config import load_config
    from rl.config import RLConfig
    from rl.launch import run_rl
    from tests.rl_assets import write_rl_assets

    # checks a random tiny model passes about half the time, so groups have reward variance to train on
    assets = write_rl_assets(tmp_path, [(f"Write {w}.", r"[\s\S]*[{c}][\s\S]*") for w, c in
                                        (("a letter", "ea"), ("a word", "ti"), ("a line", "or"), ("a name", "sn"))])
    over = {"run.dir": tmp_path / "run", "data.tokenizer": assets / "tok", "data.tasks": assets / "tasks",
            "model.preset": "tiny-qwen3-moe", "model.overrides": "{num_layers: 2}", "rollout.backend": "vllm",
            "rl.router_replay": "r3", "train.steps": 4, "train.groups_per_step": 1, "train.micro_batch_size": 8,
            "rollout.group_size": 4, "rollout.max_new_tokens": 8, "rollout.max_inflight_groups": 2,
            "rollout.max_staleness": 2, "rollout.max_seq_len": 128, "rollout.cache_memory_mb": 16,
            "rollout.lease_s": 60, "rollout.heartbeat_s": 1, "rollout.group_timeout_s": 300, "optim.lr": 1e-3,
            "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-3, "checkpoint.interval": 100,
            "logging.interval": 1, "weight_sync.dtype": "float32", "weight_sync.poll_seconds": 0.1,
            "checkpoint.init_from": "''"}
    run_rl(load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "ratio_mean" in r]
    assert len(steps) == 4
    assert max(max(r["token_versions"]) for r in steps) >= 1  # later groups were sampled with published updates
    first = steps[0]  # tokens of v0, trained from v0: the trainer's log-probs are vLLM's
    assert first["token_versions"] == [0] and first["train_tokens"] > 0
    assert abs(first["ratio_mean"] - 1) < 1e-5 and first["mismatch_max"] < 1e-5, (first["ratio_mean"],
                                                                                   first["mismatch_max"])


def test_a_closed_engine_leaves_vllm_clean_for_the_next():
    """close() releases vLLM's per-process state (its model-parallel groups): a later engine in the same process
    starts and generates as the first did."""
    cfg = get_preset("tiny-qwen3-moe").replace(num_layers=2)
    outputs = []
    for _ in range(2):
        engine = VLLMEngine(cfg, dtype=torch.float32, max_batch_size=4, max_seq_len=64, cache_memory_bytes=8 << 20,
                            seed=0)
        outputs.append([r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=4)])
        engine.close()
        engine.close()  # a second close is a no-op
    assert outputs[0] == outputs[1]
