"""The RL objective as training uses it: shaped rewards in the advantages, the rope of the weights kept across
stages, the constant Dr. GRPO normaliser, temperature-consistent log-probs, R2 router replay, PPO with TIS and
the KL reward-to-go over a whole summarisation chain."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_composer.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def _learner(rl_assets, tmp_path, **over):
    from megatron_composer.data.tokenizer import load_tokenizer
    from megatron_composer.training.layout import Layout
    from rl.config import RLConfig
    from rl.learner import PolicyLearner

    base = {"model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
            "data.tokenizer": rl_assets / "tok", "rollout.max_seq_len": 128, "train.seed": 3, "run.dir": tmp_path,
            "rl.kl_coef": 0.0, "checkpoint.init_from": "''"}
    base.update(over)
    cfg = load_config(RLConfig, None, [f"{k}={v}" for k, v in base.items()]).validate()
    return PolicyLearner(cfg, load_tokenizer(cfg.data.tokenizer), Layout(cfg.parallel, distributed=False),
                         torch.device("cpu"))


def _segment(mc, P: int, R: int, g: torch.Generator, logp: float = -5.5) -> dict:
    L, E, K = len(mc.moe_layer_ids), mc.num_experts, mc.num_experts_per_tok
    return {"prompt_ids": torch.randint(3, mc.vocab_size, (P,), generator=g).tolist(),
            "response_ids": torch.randint(3, mc.vocab_size, (R,), generator=g).tolist(),
            "response_logprobs": [logp] * R, "response_mask": [1] * R,
            "routed_experts": torch.rand(L, P + R, E, generator=g).argsort(-1)[..., :K]}


# ---- shaped rewards ---------------------------------------------------------------------------------------

MALFORMED = "<tool_call>{not json}</tool_call>"


def test_shaped_reward_is_exactly_what_the_trainer_advantages_use(rl_assets, tmp_path):
    from rl.rollout.episodes import episode_record
    from rl.trainer import group_metrics

    over = {"rl.length_penalty_weight": 0.1, "rl.length_penalty_k": 1.0, "rl.length_penalty_q": 1.0,
            "rl.length_budget": 1000, "rl.behaviour_rewards": "{rl.algorithm.rewards:malformed_tool_calls: -0.2}"}
    learner = _learner(rl_assets, tmp_path, **over)
    g = torch.Generator().manual_seed(0)
    # two passing episodes: 10 tokens, and 5000 tokens with 3 malformed tool calls
    short = episode_record(1.0, [{"role": "assistant", "content": "done"}], [_segment(learner.mc, 4, 6, g)],
                           {"tokens": 10}, learner.cfg.rl)
    long = episode_record(1.0, [{"role": "assistant", "content": MALFORMED * 3}], [_segment(learner.mc, 4, 6, g)],
                          {"tokens": 5000}, learner.cfg.rl)
    want = [1.0 - 0.1 * math.log1p(10 / 1000), 1.0 - 0.2 * 3 - 0.1 * math.log1p(5000 / 1000)]
    assert [short["reward"], long["reward"]] == pytest.approx(want, abs=1e-12)
    assert long["reward_terms"] == pytest.approx({"malformed_tool_calls": -0.6, "length_penalty": -0.1 * math.log(6)})
    samples, adv, _ = learner.samples([{"episodes": [short, long]}])
    mean = sum(want) / 2
    assert [s.advantage for s in samples] == pytest.approx([want[0] - mean, want[1] - mean], abs=1e-6)
    assert [s.reward for s in samples] == pytest.approx(want)
    assert abs(samples[0].advantage) > 0.1  # without shaping both would be 0
    m = group_metrics([{"episodes": [short, long], "infra_faults": 0}])
    assert m["reward_mean"] == pytest.approx(mean) and m["verifier_reward_mean"] == 1.0
    assert m["length_penalty_mean"] == pytest.approx(-0.05 * (math.log1p(0.01) + math.log(6)))
    assert m["malformed_tool_calls_mean"] == pytest.approx(-0.3)
    assert m["reward_mean"] == pytest.approx(m["verifier_reward_mean"] + m["length_penalty_mean"]
                                             + m["malformed_tool_calls_mean"])


def test_length_measure_is_configurable():
    from rl.algorithm import RLObjectiveConfig, episode_reward

    transcript = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "x"},
                  {"role": "assistant", "content": MALFORMED}]
    for measure, x in (("output_tokens", 40.0), ("turns", 2.0), ("tool_calls", 1.0)):
        cfg = RLObjectiveConfig(length_penalty_weight=1.0, length_penalty_q=0.0, length_measure=measure)
        total, terms = episode_reward(0.5, transcript, cfg, num_output_tokens=40)
        assert terms == pytest.approx({"length_penalty": -x}) and total == pytest.approx(0.5 - x)


# ---- the Dr. GRPO constant --------------------------------------------------------------------------------

def test_loss_constant_defaults_to_the_episode_generation_budget(rl_assets, tmp_path):
    from rl.rollout.config import RolloutConfig

    learner = _learner(rl_assets, tmp_path, **{"rollout.max_new_tokens": 12})
    assert learner.loss_constant == 12.0
    assert RolloutConfig(agent_max_turns=5, agent_max_new_tokens=100).episode_token_budget(agent_tasks=True) == 500
    g = torch.Generator().manual_seed(1)
    ep = lambda R: {"reward": float(R % 2), "segments": [_segment(learner.mc, 5, R, g)], "meta": {}}  # noqa: E731
    for lengths in ((3, 4), (30, 9)):  # different longest samples, the same divisor
        samples, _, n = learner.samples([{"episodes": [ep(r) for r in lengths]}])
        assert learner.backward(samples, n)["loss_constant"] == 12.0
        learner.optimizer.zero_grad()


# ---- temperature ------------------------------------------------------------------------------------------

def test_temperature_ratios_are_one_with_equal_weights(rl_assets, tmp_path):
    from megatron_composer.inference import Engine
    from megatron_composer.inference.sampling import SamplingParams
    from rl.rollout.episodes import TokenLedger

    learner = _learner(rl_assets, tmp_path, **{"rollout.temperature": 0.7, "rl.mismatch_mask": "'off'",
                                              "rl.router_replay": "r3"})
    from megatron_composer.model import Transformer

    engine_model = Transformer(learner.mc)
    engine_model.load_state_dict(learner.model.state_dict())
    engine = Engine(engine_model.eval(), max_batch_size=8, max_seq_len=128, cache_memory_bytes=16 << 20, seed=0)
    prompt = list(range(5, 15))
    episodes = []
    for i in range(4):
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=12, temperature=0.7, seed=i))
        while (r := engine.pop_result(rid)) is None:
            engine.step()
        ledger = TokenLedger(prompt)
        ledger.add_generation(r)
        episodes.append({"reward": float(i % 2), "segments": [ledger.segment()], "meta": {}})
    samples, _, n = learner.samples([{"episodes": episodes}])
    m = learner.backward(samples, n)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["mismatch_max"] < 1e-4
    # the temperature-1 log-probs are a different distribution: the ratio would be far from 1
    learner.temperature = 1.0
    assert learner.backward(samples, n)["mismatch_max"] > 0.05


def test_top_p_truncation_is_refused():
    from megatron_composer.config import ConfigError
    from rl.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match="rollout.top_p=0.9"):
        RolloutConfig(top_p=0.9).validate()


# ---- R2 router replay, PPO + TIS, the chain's KL ------------------------------------------------------------

def _groups(mc, seed: int, segments: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    eps = [{"reward": float(i % 2), "meta": {}, "segments": [_segment(mc, 6, 10 + i + s, g) for s in range(segments)]}
           for i in range(4)]
    return [{"episodes": eps}]


def _perturb_router_after_old_pass(learner, monkeypatch):
    """Change the routers between the old-policy pass and the update pass, as an update of a previous micro-batch
    or non-deterministic kernels could: free routing in the update pass then differs from the recorded one."""
    old_pass = learner._old_policy_pass

    def perturbed(micro):
        out = old_pass(micro)
        with torch.no_grad():
            for layer in learner.model.moe_layers:
                layer.feed_forward.router.weight.add_(torch.randn_like(layer.feed_forward.router.weight) * 0.5)
        return out

    monkeypatch.setattr(learner, "_old_policy_pass", perturbed)


@pytest.mark.parametrize("mode", ["r2", "off"])
def test_r2_replays_the_old_policy_pass_routing(rl_assets, tmp_path, monkeypatch, mode):
    learner = _learner(rl_assets, tmp_path, **{"rl.router_replay": f"'{mode}'", "rl.mismatch_bound": "null"})
    torch.manual_seed(0)
    _perturb_router_after_old_pass(learner, monkeypatch)
    samples, _, n = learner.samples(_groups(learner.mc, 2))
    assert learner.needs_old_policy_pass(samples)
    m = learner.backward(samples, n)
    frac = m["update_routing_mismatch_token_fraction"]  # logged in every mode
    assert frac == 0.0 if mode == "r2" else frac > 0.05


def test_ppo_clip_uses_the_old_policy_pass_and_the_tis_cap(rl_assets, tmp_path):
    learner = _learner(rl_assets, tmp_path,
                       **{"rl.pg_loss": "ppo_clip", "rl.tis_cap": 2.0, "rl.mismatch_mask": "'off'"})
    samples, _, n = learner.samples(_groups(learner.mc, 3))
    for s in samples:  # behaviour far below the policy: pi_old / mu > 2 everywhere, so every weight is capped
        s.behaviour_logprobs = [v - 30.0 if m else 0.0 for v, m in zip(s.behaviour_logprobs, s.loss_mask)]
    assert learner.needs_old_policy_pass(samples)
    m = learner.backward(samples, n)
    assert m["tis_truncated_fraction"] == 1.0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_kl_reward_to_go_runs_over_the_whole_chain(rl_assets, tmp_path):
    from rl.algorithm import kl_estimate

    learner = _learner(rl_assets, tmp_path, **{"rl.kl_coef": 0.1, "rl.mismatch_mask": "'off'"})
    with torch.no_grad():  # the policy moved away from the reference
        for p in learner.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    samples, _, n = learner.samples(_groups(learner.mc, 4, segments=3))
    micro = learner._micro_batches(samples)
    old = learner._old_policy_pass(micro)
    tails = torch.cat(learner._chain_kl_tails(samples, micro, old, None))

    def seq_kl(s):  # a segment's summed k1 on its own
        ids = torch.tensor([s.input_ids])
        local = {"input_ids": ids, "position_ids": None, "routed_experts": s.routed_experts[:, None]}
        logp = learner._token_logprobs(learner.model, local, local["routed_experts"])[0]
        ref = learner._token_logprobs(learner.ref_model, local, local["routed_experts"])[0]
        return float((kl_estimate(logp, ref) * torch.tensor([s.loss_mask])).sum())

    with torch.no_grad():
        kls = [seq_kl(s) for s in samples]
    for i, s in enumerate(samples):
        later = sum(kls[j] for j, t in enumerate(samples) if (t.group, t.episode) == (s.group, s.episode)
                    and t.segment > s.segment)
        assert float(tails[i]) == pytest.approx(later, rel=1e-4, abs=1e-6)
    assert float(tails.abs().max()) > 0 and all(float(tails[i]) == 0 for i, s in enumerate(samples) if s.segment == 2)


# ---- rope scaling across stages ---------------------------------------------------------------------------

def test_stage_rope_scaling_inherits_unless_it_extends():
    from megatron_composer.model.args import RopeScaling, stage_rope_scaling

    weights = RopeScaling(factor=64.0, original_max_position_embeddings=4096)
    shorter = RopeScaling(factor=32.0, original_max_position_embeddings=4096)  # 131072 / 4096 recomputed
    assert stage_rope_scaling(shorter, 131072, weights) is weights
    assert stage_rope_scaling(None, 131072, weights) is weights
    longer = RopeScaling(factor=128.0, original_max_position_embeddings=4096)
    assert stage_rope_scaling(longer, 524288, weights) is longer  # a deliberate extension
    assert stage_rope_scaling(shorter, 131072, None) is shorter  # YaRN switched on by this stage



def test_a_checkpoint_loads_into_a_stage_that_extends_its_context_only(tmp_path):
    """check_meta follows stage_rope_scaling: weights without rope scaling, or with a shorter context, start a
    context-extending stage (the demo chain: pretrain 128 -> long context YaRN 2 -> SFT YaRN 8); a stage that
    would shrink or change the weights' rope is refused."""
    import json

    from megatron_composer.checkpoint.dcp import CheckpointError, check_meta

    def rope(factor):
        return None if factor is None else {"factor": factor, "original_max_position_embeddings": 128}

    def check(saved, want):
        (tmp_path / "meta.json").write_text(json.dumps({"model": {"hidden_size": 8, "rope_scaling": rope(saved)}}))
        check_meta(tmp_path, {"model": {"hidden_size": 8, "rope_scaling": rope(want)}})

    check(None, 2.0)
    check(2.0, 8.0)
    check(8.0, 8.0)
    with pytest.raises(CheckpointError, match="YaRN factor 8.0 over 128 .* YaRN factor 2.0 over 128"):
        check(8.0, 2.0)
    with pytest.raises(CheckpointError, match="YaRN factor 2.0 over 128 .* no rope scaling"):
        check(2.0, None)

def _kimi_tokenizer():
    class VocabOnly:  # model_config only checks the tokenizer fits the vocabulary
        vocab_size = 151936  # fits both families' vocabularies

        def check_fits_model(self, vocab_size):
            assert vocab_size >= self.vocab_size

    return VocabOnly()


@pytest.mark.parametrize("family,rope", [("kimi_k25", (64.0, 4096)), ("qwen3_30b_a3b", (8.0, 32768))])
@pytest.mark.parametrize("name", ["long_context_256k.yaml", "sft.yaml", "rl.yaml"])
def test_shipped_stages_after_the_long_context_stage_keep_its_rope(family, rope, name):
    """Kimi K2.5: SFT (128k) and RL run at the 256k stage's factor 64, not 131072 / 4096 = 32."""
    from megatron_composer.training.config import model_config
    from pretrain.trainer import PretrainConfig
    from rl.config import RLConfig
    from rl.model import rl_model_config

    path = ROOT / "examples" / family / name
    if name == "rl.yaml":
        mc = rl_model_config(load_config(RLConfig, path), _kimi_tokenizer())
    else:
        mc = model_config(load_config(PretrainConfig, path), _kimi_tokenizer())
    assert (mc.rope_scaling.factor, mc.rope_scaling.original_max_position_embeddings) == rope


def test_shipped_tiny_stages_share_one_rope():
    """The tiny chain: long-context at 256 (YaRN factor 2 over 128); SFT extends to 1024 for the agent episodes
    (factor 8); its RL run starts from SFT and runs with its rope whatever its own sequence length. The agentic
    chain's RL starts from that chain's SFT, at its context and plain rope."""
    from megatron_composer.data.tokenizer import load_tokenizer  # noqa: F401  (the tiny tokenizer may be absent)
    from megatron_composer.model.args import RopeScaling, stage_rope_scaling
    from pretrain.trainer import PretrainConfig
    from rl.config import RLConfig

    def rope(cfg):
        return (cfg.data.seq_length / cfg.model.yarn_original_length, cfg.model.yarn_original_length)

    lc = load_config(PretrainConfig, ROOT / "examples/tiny/long_context.yaml")
    sft = load_config(PretrainConfig, ROOT / "examples/tiny/sft.yaml")
    assert rope(lc) == (2.0, 128) and rope(sft) == (8.0, 128)
    sft_rope = RopeScaling(factor=8.0, original_max_position_embeddings=128)
    rl = load_config(RLConfig, ROOT / "examples/tiny/rl.yaml")
    assert rl.checkpoint.init_from == sft.run.dir
    configured = RopeScaling(factor=rope(rl)[0], original_max_position_embeddings=128)
    assert stage_rope_scaling(configured, rl.data.seq_length, sft_rope) == sft_rope
    # the agentic chain (make demo-agent): pretraining at 128, its SFT at 512 with plain rope, RL as its SFT
    agent_sft = load_config(PretrainConfig, ROOT / "examples/tiny/agent/sft.yaml")
    agent_rl = load_config(RLConfig, ROOT / "examples/tiny/rl_agent.yaml")
    assert agent_rl.checkpoint.init_from == agent_sft.run.dir
    assert agent_rl.model.yarn_original_length == agent_sft.model.yarn_original_length == 0
    assert agent_rl.data.seq_length == agent_sft.data.seq_length == agent_rl.rollout.max_seq_len


def test_resumed_stages_keep_the_rope_of_their_weights(rl_assets, tmp_path):
    """A long-context stage (YaRN factor 2 over 32 positions) writes a checkpoint; an SFT-like stage at a
    shorter context and an RL run starting from it keep factor 2 instead of recomputing a smaller factor; a
    stage that forces another rope on those weights is refused naming both."""
    import sys

    from megatron_composer.checkpoint.dcp import CheckpointError
    from megatron_composer.data.tokenizer import load_tokenizer
    from pretrain.trainer import PretrainConfig, run_stage
    from rl.config import RLConfig
    from rl.model import rl_model_config

    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\nimport os\nclass A{i}:\n    pass\n" * 6)
    corpus = tmp_path / "code"
    assert preprocess_data.main(["--input", str(src), "--tokenizer", str(rl_assets / "tok"), "--output-prefix",
                                 str(corpus), "--workers", "1"]) == 0

    def stage(run: str, seq: int, init: str, **extra):
        over = {"run.dir": tmp_path / run, "model.preset": "tiny-deepseek-v3",
                "model.overrides": "{num_layers: 2, num_mtp_layers: 0}", "model.yarn_original_length": 32,
                "data.tokenizer": rl_assets / "tok", "data.paths": f"[{corpus}]", "data.seq_length": seq,
                "data.split": "'100,0,0'", "train.steps": 1, "train.global_batch_tokens": seq * 2,
                "train.micro_batch_size": 2, "train.eval_samples": 0, "checkpoint.interval": 1, **extra}
        cfg = load_config(PretrainConfig, None, [f"{k}={v}" for k, v in over.items()])
        cfg.validate()
        return run_stage(cfg, init_from=init)

    def rope(run: str):
        meta = json.loads((tmp_path / run / "checkpoints/step_1/meta.json").read_text())
        scaling = meta["model"]["rope_scaling"]
        return scaling["factor"], scaling["original_max_position_embeddings"]

    stage("long", 64, "")
    assert rope("long") == (2.0, 32)
    stage("sft", 32, str(tmp_path / "long"))  # 32 / 32 would be factor 1
    assert rope("sft") == (2.0, 32)
    stage("sft", 32, "")  # resumes run.dir: its own rope again (no step to take)
    rl = load_config(RLConfig, None, ["model.preset=tiny-deepseek-v3", "model.yarn_original_length=32",
                                      "model.overrides={num_layers: 2, num_mtp_layers: 0}",
                                      f"data.tokenizer={rl_assets / 'tok'}",
                                      "data.seq_length=32", f"run.dir={tmp_path / 'rl'}",
                                      f"checkpoint.init_from={tmp_path / 'sft'}"])
    mc = rl_model_config(rl, load_tokenizer(rl.data.tokenizer))
    assert (mc.rope_scaling.factor, mc.rope_scaling.original_max_position_embeddings) == (2.0, 32)
    # the weights' rope is checked on load: another rope forced on them is an error naming both
    import dataclasses

    from megatron_composer.checkpoint.dcp import check_meta
    from megatron_composer.training.config import architecture

    forced = dataclasses.replace(mc, rope_scaling=dataclasses.replace(mc.rope_scaling, factor=1.0))
    with pytest.raises(CheckpointError, match="YaRN factor 2.0 over 32 .* YaRN factor 1.0 over 32"):
        check_meta(tmp_path / "sft/checkpoints/step_1", {"model": architecture(forced)})


# ---- a run with a strong length penalty ---------------------------------------------------------------------

def _run(rl_assets, run_dir: Path, **extra) -> list[dict]:
    from rl.config import RLConfig
    from rl.launch import run_rl

    tasks = run_dir.parent / "tasks"  # the prompts four times over: an epoch of 12 steps
    if not tasks.is_dir():
        tasks.mkdir()
        lines = (rl_assets / "tasks/tasks.jsonl").read_text().splitlines()
        (tasks / "tasks.jsonl").write_text("".join(
            json.dumps({**json.loads(line), "id": f"r{k}_{i}"}) + "\n"
            for k in range(4) for i, line in enumerate(lines)))
    over = {"run.dir": run_dir, "data.tokenizer": rl_assets / "tok", "data.tasks": tasks,
            "model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
            "train.steps": 12, "train.groups_per_step": 2, "train.micro_batch_size": 16, "train.seed": 7,
            # synchronous (max_staleness 0, a step's groups in flight): every group is generated with the weights
            # that train on it, so the run is the same however loaded the machine is
            "rollout.group_size": 8, "rollout.max_new_tokens": 24, "rollout.max_inflight_groups": 2,
            "rollout.max_staleness": 0, "rollout.max_seq_len": 128, "rollout.cache_memory_mb": 16,
            "rollout.lease_s": 30, "rollout.heartbeat_s": 1, "rollout.group_timeout_s": 300,
            "optim.lr": 1e-2, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-2,
            "checkpoint.interval": 100, "logging.interval": 100, "weight_sync.dtype": "float32",
            "checkpoint.init_from": "''", "rl.kl_coef": 0.0, **extra}
    run_rl(load_config(RLConfig, None, [f"{k}={v}" for k, v in over.items()]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.e2e
def test_a_strong_length_penalty_lowers_the_reward_and_shortens_generations(rl_assets, tmp_path):
    plain = _run(rl_assets, tmp_path / "plain")
    again = _run(rl_assets, tmp_path / "again")  # synchronous: the same run, whatever the machine's load
    facts = lambda rows: [(r["reward_mean"], r["generated_tokens"], r["loss"]) for r in rows]  # noqa: E731
    assert facts(again) == facts(plain)
    penalised = _run(rl_assets, tmp_path / "penalised", **{"rl.length_penalty_weight": 1.0,
                                                          "rl.length_penalty_q": 0.0, "rl.length_budget": 24})
    assert all(r["reward_mean"] < r["verifier_reward_mean"] and r["length_penalty_mean"] < 0 for r in penalised)
    assert all("length_penalty_mean" not in r and r["reward_mean"] == r["verifier_reward_mean"] for r in plain)
    per_episode = lambda rows: sum(r["generated_tokens"] for r in rows) / sum(r["episodes"] for r in rows)  # noqa: E731
    assert per_episode(penalised[-4:]) < 0.8 * per_episode(plain[-4:])
