"""Self-summarisation chains in real rollouts: the rollout worker's engine writes the summaries, every segment
(summary included) becomes a training sample of its episode with the episode's advantage, and the counts reach
the metrics log.

The tiny model is random except for one change: the output head favours the <tool_call> token, so its turns open
(unterminated) tool calls and the agent loop goes on turn after turn, as a model that works on a task does,
instead of ending at the first turn without a call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_composer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
TRIGGER = 1660  # the bundled task's first context is ~1640 tokens of this tokenizer: a summary after every turn


def _overrides(rl_assets: Path, tasks: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "run.dir": run_dir, "data.tokenizer": rl_assets / "tok", "data.tasks": tasks,
        "model.preset": "tiny-deepseek-v3", "model.overrides": "{num_layers: 2, num_mtp_layers: 0}",
        "train.steps": 2, "train.groups_per_step": 1, "train.micro_batch_size": 4, "train.seed": 7,
        "rollout.group_size": 2, "rollout.max_seq_len": 2048, "rollout.cache_memory_mb": 64,
        "rollout.agent_max_turns": 6, "rollout.agent_max_new_tokens": 12, "rollout.summary_trigger_tokens": TRIGGER,
        "rollout.summary_max_new_tokens": 16, "rollout.lease_s": 60, "rollout.group_timeout_s": 300,
        "optim.lr": 1e-3, "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.min_lr": 1e-3,
        "rl.loss_constant": 64, "checkpoint.interval": 2, "checkpoint.keep_last": 0, "logging.interval": 1,
        "weight_sync.dtype": "float32", "checkpoint.init_from": "''",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _tool_calling_model(cfg, tok):
    """The tiny model with its output head leaning to <tool_call> (about even odds at every position)."""
    from rl.model import full_model

    torch.manual_seed(0)
    model, meta = full_model(cfg, tok)
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] += 50.0  # a residual direction present at every position
        d = model.config.hidden_size
        model.output.weight[tok.token_to_id("<tool_call>"), 0] = 6.0 / d ** 0.5
    return model, meta


@pytest.fixture(scope="module")
def setup(rl_assets, tmp_path_factory):
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.config import RLConfig
    from rl.sandbox import LocalBackend, SandboxError

    try:
        LocalBackend()
    except SandboxError as e:
        pytest.skip(f"no isolated sandbox on this host: {e}")
    root = tmp_path_factory.mktemp("summaries")
    tasks = root / "tasks"
    for name in ("python-roman-numerals", "python-interval-merge"):
        shutil.copytree(ROOT / "examples/tasks" / name, tasks / name)
    cfg = load_config(RLConfig, None, _overrides(rl_assets, tasks, root / "run")).validate()
    tok = load_tokenizer(cfg.data.tokenizer)
    model, meta = _tool_calling_model(cfg, tok)
    return cfg, tok, model, meta, root, rl_assets, tasks


def test_rollout_summaries_become_trained_segments_of_the_episode(setup):
    from megatron_composer.data.chat_template import IM_END
    from megatron_composer.training.layout import Layout
    from rl.envs.agent import SUMMARY_REQUEST
    from rl.learner import PolicyLearner
    from rl.orchestrator import WorkItem
    from rl.rollout.tasks import load_rl_tasks
    from rl.rollout.worker import RolloutWorker

    cfg, tok, model, _, _, _, tasks = setup
    worker = RolloutWorker("t", cfg.rollout, model, tok, load_rl_tasks(tasks), queue=None, subscriber=None)
    result = worker.run_group(WorkItem(0, 0))
    episodes = result["episodes"]
    assert all(len(ep["segments"]) >= 2 for ep in episodes), [len(ep["segments"]) for ep in episodes]
    request_ids = tok.encode(SUMMARY_REQUEST)
    im_end = tok.token_to_id(IM_END)
    for ep in episodes:
        meta, segs = ep["meta"], ep["segments"]
        # every segment but the last ends with a summary; the last one too when the budget ran out after it
        assert meta["segments"] == len(segs) and len(segs) - 1 <= meta["summaries"] <= len(segs)
        assert meta["tokens"] == sum(sum(s["response_mask"]) for s in segs)
        for seg, nxt in zip(segs, segs[1:]):
            ids, mask = seg["response_ids"], seg["response_mask"]
            # the segment ends: summary request (context, mask 0), then the sampled summary (mask 1)
            n_summary = next(i for i, m in enumerate(reversed(mask)) if m == 0)
            assert n_summary >= 1
            tail = len(ids) - n_summary
            head = ids[:tail]
            where = max(i for i in range(len(head) - len(request_ids) + 1)
                        if head[i:i + len(request_ids)] == request_ids)
            assert set(mask[where:tail]) == {0}
            assert len(seg["response_logprobs"]) == len(ids) and all(v <= 0 for v in seg["response_logprobs"][tail:])
            assert seg["routed_experts"].shape[1] == len(seg["prompt_ids"]) + len(ids)
            # the next segment starts from system + task + this summary
            summary = tok.decode([t for t in ids[tail:] if t != im_end])
            assert summary.strip() and summary.strip() in tok.decode(nxt["prompt_ids"])
            assert 0 in mask[:where], "no tool observation (context tokens) before the summary request"
        assert all(len(s["weight_versions"]) == sum(s["response_mask"]) for s in segs)

    # the episode's reward reaches every one of its segments through the group advantage
    for ep, reward in zip(episodes, (1.0, 0.0)):
        ep["reward"] = reward  # the random model fails the task's tests; give the two episodes distinct rewards
    learner = PolicyLearner(cfg, tok, Layout(cfg.parallel, distributed=False), torch.device("cpu"))
    learner.model.load_state_dict(model.state_dict())
    samples, adv, n_episodes = learner.samples([result])
    assert n_episodes == 2 and len(samples) == sum(len(ep["segments"]) for ep in episodes)
    assert adv.metrics["num_segments"] == len(samples) and adv.metrics["num_episodes"] == 2
    for s in samples:
        seg = episodes[s.episode]["segments"][s.segment]
        assert s.advantage == pytest.approx(0.5 if s.episode == 0 else -0.5)
        assert s.loss_mask == [0] * len(seg["prompt_ids"]) + seg["response_mask"]
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    metrics = learner.step([result], lr=1e-3)
    assert (metrics["skipped"] == 0.0 and metrics["loss"] != 0.0
            and metrics["train_tokens"] == sum(sum(s.loss_mask) for s in samples))
    assert any(not torch.equal(before[n], p) for n, p in learner.model.named_parameters())


def test_run_logs_segments_and_summaries(setup):
    from megatron_composer.checkpoint.dcp import save_checkpoint
    from rl.config import RLConfig
    from rl.launch import run_rl

    cfg, _, model, meta, root, rl_assets, tasks = setup
    init = root / "init"
    save_checkpoint(init, 0, model, None, {"step": 0}, meta)
    run_dir = root / "run_rl"
    run_rl(load_config(RLConfig, None, _overrides(rl_assets, tasks, run_dir, **{"checkpoint.init_from": init})))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["num_episodes"] == 2 and r["num_segments"] >= 3  # at least one chain in every step
        assert r["num_segments"] - 2 <= r["summaries"] <= r["num_segments"]
        assert r["segments_per_episode"] == r["num_segments"] / 2 and r["train_tokens"] > 0


def test_summary_settings_are_checked():
    from rl.rollout.config import RolloutConfig

    with pytest.raises(ConfigError, match="summary_trigger_tokens=4096 must be below rollout.max_seq_len=1024"):
        RolloutConfig(summary_trigger_tokens=4096, max_seq_len=1024).validate()
    with pytest.raises(ConfigError, match="must be >= 0"):
        RolloutConfig(summary_trigger_tokens=-1).validate()
