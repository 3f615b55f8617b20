"""Evaluate a checkpoint on a task set: K samples per task, pass@1 and pass@K, transcripts.

The command line is tools/evaluate.py. The model, tokenizer and rollout settings come from the checkpoint's run
(run.dir/config.yaml, written by rl_composer.py or pretrain_composer.py); key=value overrides apply on top.
Episodes run exactly as in RL (the same rollout worker: the inference engine, sandboxes, agent protocol); the
measures are rl/metrics.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from rl.metrics import summarize_groups


def _run_config(ckpt: Path, overrides: list[str]):
    import yaml

    from megatron_composer.config import ConfigError, from_dict, parse_overrides, set_dotted
    from rl.config import RLConfig

    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"'{path}' does not exist; point --checkpoint at a run directory or one of its checkpoints")
    data = yaml.safe_load(path.read_text()) or {}
    # a pretraining run's config has the same model section; keep only what the RL schema knows
    keep = {k: data[k] for k in ("model",) if k in data}
    if "data" in data:
        keep["data"] = {k: data["data"][k] for k in ("tokenizer", "chat_format", "seq_length") if k in data["data"]}
    for k in ("rollout", "weight_sync"):
        if k in data:
            keep[k] = data[k]
    for key, value in parse_overrides(overrides):
        set_dotted(keep, key, value)
    return from_dict(RLConfig, keep)


def evaluate_model(model, tokenizer, rollout_cfg, tasks, samples: int, success_reward: float = 1.0,
                   seed: int = 0, progress: bool = True, chat_format=None) -> tuple[dict, list[dict]]:
    """Run ``samples`` episodes per task with the rollout worker's runners on the model's fixed weights;
    (summary, transcript rows)."""
    from rl.orchestrator import WorkItem
    from rl.rollout.engines import EngineLeader
    from rl.rollout.episodes import EpisodeRunner

    engine = EngineLeader("eval", rollout_cfg, model, subscriber=None, seed=seed)
    runner = EpisodeRunner("eval", rollout_cfg, tokenizer, tasks, engine, seed=seed, chat_format=chat_format)
    results, rows = [], []
    try:
        for i, task in enumerate(tqdm(tasks, desc="tasks", unit="task", disable=not progress)):
            result = runner.run_group(WorkItem(gid=i, prompt_index=i, samples=samples))
            results.append(result)
            for j, ep in enumerate(result["episodes"]):
                meta_ep = ep.get("meta", {})
                rows.append({"task": task.name, "sample": j, "reward": ep["reward"],
                             "stop_reason": meta_ep.get("stop_reason"),
                             "turns": meta_ep.get("turns"), "verdict": meta_ep.get("verdict"),
                             "transcript": meta_ep.get("transcript")})
    finally:
        runner.close()
    return summarize_groups(tasks, results, samples, success_reward), rows


def evaluate(tasks_dir: str, checkpoint: str, samples: int, output: str | None = None,
             overrides: list[str] = (), success_reward: float = 1.0, seed: int = 0, sample_tasks: int = 0) -> dict:
    from megatron_composer.checkpoint.dcp import resolve_checkpoint
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.model import full_model
    from rl.rollout.tasks import load_rl_tasks

    ckpt = resolve_checkpoint(checkpoint)
    cfg = _run_config(ckpt, list(overrides))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    tasks = load_rl_tasks(tasks_dir)
    if 0 < sample_tasks < len(tasks):  # a seeded subset, not the first by name (names sort by kind)
        import random

        tasks = random.Random(seed).sample(tasks, sample_tasks)
    model, _ = full_model(cfg, tokenizer, seed=cfg.train.seed, checkpoint=ckpt)
    from megatron_composer.data.chat_format import load_chat_format

    summary, rows = evaluate_model(model, tokenizer, cfg.rollout, tasks, samples, success_reward, seed,
                                   chat_format=load_chat_format(cfg.data.chat_format, tokenizer))
    out = Path(output) if output else ckpt / f"eval_{Path(tasks_dir).name}.jsonl"
    with open(out, "w") as fh:
        fh.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    summary.update(checkpoint=str(ckpt), transcripts=str(out))
    return summary
