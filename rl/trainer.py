"""RL run: config schema, the trainer role, and how roles are placed on processes.

`run_rl(cfg)` is what `rl_composer.py` calls on every process. Roles by rank: rank 0 is the trainer (which also
owns the orchestrator, see rl/orchestrator.py); every other rank is a rollout worker (rl/rollout/worker.py).
A run with one process (no torchrun, or --nproc-per-node 1) runs ``rollout.embedded_workers`` worker threads
inside the trainer process. Separate launches (clusters) run the same entrypoint with ``role=trainer`` or
``role=rollout``; they meet only through ``run.dir``'s rollout queue and the weight-sync store.

Trainer step v (the trainer holds weight version v, the number of optimizer steps taken):
1. wait for ``train.groups_per_step`` complete groups from the orchestrator (each at most
   ``rollout.max_staleness`` versions old);
2. group advantages over episode rewards, samples per segment (rl.algorithm.episodes_to_samples);
3. forward with router replay of the inference engine's experts, token log-probs, `PolicyGradientLoss`
   (importance ratio against the engine's log-probs, mismatch masking, KL to the initial policy);
4. optimizer step, then publish version v + 1 to the weight-sync store (XOR delta against v);
5. log metrics, and checkpoint (model, optimizer, orchestrator state) every ``checkpoint.interval`` steps.
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch

from megatron_composer.checkpoint.dcp import find_latest, load_checkpoint, resolve_checkpoint, save_checkpoint
from megatron_composer.config import ConfigError, save_config, to_dict
from megatron_composer.parallel.dims import ParallelConfig
from megatron_composer.training.metrics import LoggingConfig, MetricsLogger
from megatron_composer.training.optim import OptimizerConfig, build_optimizer, lr_at, set_lr
from pretrain.trainer import CheckpointConfig, ModelSection, RunConfig, architecture, model_config
from rl.algorithm import (
    Episode,
    PolicyGradientLoss,
    RLObjectiveConfig,
    Segment,
    collate_samples,
    episodes_to_samples,
    replay_routing,
    routing_mismatch,
    token_logprobs,
)
from rl.orchestrator import Orchestrator, QueueError, WorkQueue
from rl.rollout.worker import RolloutConfig, RolloutWorker
from rl.weight_sync import ObjectStore, ObjectStoreError, WeightSyncConfig


@dataclass
class RLDataConfig:
    tasks: str = field(default="examples/tiny/rl_tasks", metadata={"help": "task directory: tasks.jsonl and/or Harbor task folders"})
    tokenizer: str = field(default="data/tiny/tokenizer", metadata={"help": "tokenizer file or directory"})
    seq_length: int = field(default=0, metadata={"help": "context of the stage the weights come from (YaRN factor = this / "
                                                        "model.yarn_original_length, as in that stage); 0 = rollout.max_seq_len"})


@dataclass
class RLTrainConfig:
    steps: int = field(default=100, metadata={"help": "optimizer steps (fewer if the single epoch of prompts ends first)"})
    seed: int = 1234
    groups_per_step: int = field(default=2, metadata={"help": "prompts (groups of rollout.group_size episodes) per step"})
    micro_batch_size: int = field(default=8, metadata={"help": "sequences per forward pass"})
    max_skipped_steps: int = 20


@dataclass
class HeldOutEvalConfig:
    tasks: str = field(default="", metadata={"help": "held-out task directory evaluated during the run; empty = off"})
    interval: int = field(default=0, metadata={"help": "evaluate every N steps (0 = off)"})
    samples: int = field(default=4, metadata={"help": "samples per task (K of pass@K)"})
    success_reward: float = field(default=1.0, metadata={"help": "a sample passes when its reward is at least this"})


@dataclass
class RLConfig:
    run: RunConfig = field(default_factory=RunConfig)
    role: Literal["auto", "trainer", "rollout"] = field(default="auto", metadata={"help": "auto: rank 0 trains, other ranks roll out; separate launches pick one"})
    model: ModelSection = field(default_factory=ModelSection)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    rl: RLObjectiveConfig = field(default_factory=RLObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: HeldOutEvalConfig = field(default_factory=HeldOutEvalConfig)

    def validate(self) -> "RLConfig":
        self.optim.validate()
        self.rl.validate()
        self.rollout.validate()
        self.parallel.validate()
        if self.train.steps < 1 or self.train.groups_per_step < 1 or self.train.micro_batch_size < 1:
            raise ConfigError("train.steps, train.groups_per_step and train.micro_batch_size must be >= 1")
        if self.checkpoint.interval < 1:
            raise ConfigError(f"checkpoint.interval={self.checkpoint.interval} must be >= 1")
        if self.eval.interval < 0 or self.eval.samples < 1 or (self.eval.interval > 0 and not self.eval.tasks):
            raise ConfigError("eval.interval must be >= 0 and eval.samples >= 1; eval.interval > 0 needs eval.tasks")
        return self

    def check_runnable(self, world: int) -> None:
        """What this version of the trainer can run; the real-size configs state their target layout."""
        if max(self.parallel.tp, self.parallel.cp, self.parallel.ep) > 1:
            raise ConfigError(f"parallel.tp/cp/ep = {self.parallel.tp}/{self.parallel.cp}/{self.parallel.ep}: the RL "
                              "trainer runs a single trainer rank in this version; set them to 1 "
                              "(multi-rank trainer layouts run in pretrain_composer.py only)")


def weights_url(cfg: RLConfig) -> str:
    return cfg.weight_sync.url or str(Path(cfg.run.dir) / "weights")


def weight_store(cfg: RLConfig) -> ObjectStore:
    return cfg.weight_sync.open_store(weights_url(cfg))


def build_model(cfg: RLConfig, tokenizer):
    from megatron_composer.model import Transformer

    seq_length = cfg.data.seq_length or cfg.rollout.max_seq_len
    mc = model_config(SimpleNamespace(model=cfg.model, data=SimpleNamespace(seq_length=seq_length)), tokenizer)
    return Transformer(mc), {"model": architecture(mc), "tokenizer": tokenizer.describe()}


def sync_state_dict(model: torch.nn.Module, dtype: str) -> dict[str, torch.Tensor]:
    dt = getattr(torch, dtype)
    return {k: (v.detach().to(dt) if v.is_floating_point() else v.detach()).cpu() for k, v in model.state_dict().items()}


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def make_worker(cfg: RLConfig, name: str, tokenizer, tasks, seed: int) -> RolloutWorker:
    model, _ = build_model(cfg, tokenizer)
    model = model.to(local_device(), getattr(torch, cfg.weight_sync.dtype))
    queue = WorkQueue(Path(cfg.run.dir) / "rollouts")
    return RolloutWorker(name, cfg.rollout, model, tokenizer, tasks, queue, cfg.weight_sync.subscriber(weight_store(cfg)),
                         seed=seed, poll_seconds=cfg.weight_sync.poll_seconds)


def _episodes(result: dict) -> list[Episode]:
    out = []
    for ep in result["episodes"]:
        segs = [Segment(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], response_logprobs=s["response_logprobs"],
                        response_mask=s["response_mask"], routed_experts=s["routed_experts"]) for s in ep["segments"]]
        out.append(Episode(segments=segs, reward=float(ep["reward"]), metadata=ep.get("meta", {})))
    return out


def group_metrics(results: list[dict]) -> dict:
    """Reward mean / best-of-K / distribution and episode counts of one step's groups."""
    rewards = torch.tensor([[float(ep["reward"]) for ep in r["episodes"]] for r in results])
    metas = [ep.get("meta", {}) for r in results for ep in r["episodes"]]
    q = torch.quantile(rewards.flatten(), torch.tensor([0.1, 0.5, 0.9])).tolist()
    return {
        "reward_mean": rewards.mean().item(),
        "reward_best_of_k": rewards.max(dim=1).values.mean().item(),
        "reward_p10": q[0], "reward_p50": q[1], "reward_p90": q[2],
        "episodes": float(rewards.numel()),
        "turns": float(sum(m.get("turns", 1) for m in metas)),
        "generated_tokens": float(sum(m.get("tokens", 0) for m in metas)),
        "no_tool_call_episodes": float(sum(m.get("stop_reason") == "no_tool_call" for m in metas)),
        "verifier_timeouts": float(sum(bool(m.get("verifier_timeout")) for m in metas)),
        "sandbox_failures": float(sum(r.get("sandbox_failures", 0) for r in results)),
    }


class Trainer:
    def __init__(self, cfg: RLConfig):
        from megatron_composer.data.tokenizer import load_tokenizer
        from rl.rollout.tasks import load_rl_tasks

        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.tasks = load_rl_tasks(cfg.data.tasks)
        torch.manual_seed(cfg.train.seed)
        self.model, self.meta = build_model(cfg, self.tokenizer)
        self.latest = find_latest(self.run_dir)
        if self.latest is not None:
            from megatron_composer.checkpoint.dcp import check_meta

            check_meta(self.latest, self.meta)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        self.device = local_device()
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.loss_fn = PolicyGradientLoss(cfg.rl)
        self.queue = WorkQueue(self.run_dir / "rollouts")
        self.queue.clear_stop()
        self.orch = Orchestrator(self.queue, len(self.tasks), cfg.rollout.group_size, cfg.train.seed,
                                 cfg.rollout.max_inflight_groups, cfg.rollout.max_staleness, cfg.rollout.lease_s)
        self.logger = MetricsLogger(self.run_dir, cfg.logging, True, to_dict(cfg))
        self.step = 0
        self.version = 0
        self.ref_model = None
        init = cfg.checkpoint.init_from
        if self.latest is None and init:
            load_checkpoint(resolve_checkpoint(init), self.model, None, self.meta, restore_rng=False)
            print(f"initialised weights from {resolve_checkpoint(init)}", flush=True)
        if cfg.rl.kl_coef > 0:  # reference policy: the initial weights (same seed and init checkpoint on resume)
            if self.latest is None:
                self.ref_model = copy.deepcopy(self.model)
            else:
                torch.manual_seed(cfg.train.seed)
                self.ref_model, _ = build_model(cfg, self.tokenizer)
                if init:
                    load_checkpoint(resolve_checkpoint(init), self.ref_model, None, self.meta, restore_rng=False)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        if self.latest is not None:
            state = load_checkpoint(self.latest, self.model, self.optimizer, self.meta)
            self.step = state["step"]
            self.orch.load_state_dict(state["orchestrator"])
            self.logger.truncate_after(self.step)
            print(f"resumed from {self.latest} at step {self.step}; {len(self.orch.inflight)} unconsumed groups "
                  f"re-issued, sampler at prompt {self.orch.sampler.position}/{len(self.tasks)}", flush=True)
        self.publisher = cfg.weight_sync.publisher(weight_store(cfg))
        # Versions only grow, also across resumes: a resumed trainer publishes after whatever is in the store.
        stored = cfg.weight_sync.subscriber(weight_store(cfg)).latest_version()
        self.version = 0 if stored is None else stored + 1
        self.publish_failures = 0
        first = self._publish()
        if "weight_sync_bytes" not in first:
            raise RuntimeError(f"cannot publish the initial weights to {weights_url(cfg)}; check weight_sync.url")
        self.workers: list[tuple[RolloutWorker, threading.Thread]] = []
        self._eval_tasks = None

    def _publish(self) -> dict:
        try:
            stats = self.publisher.publish(sync_state_dict(self.model, self.cfg.weight_sync.dtype), self.version)
        except ObjectStoreError as e:
            # Training goes on: workers keep the last version they have, the staleness bound redoes groups that
            # fall too far behind, and the next step publishes again (a delta against the last stored version).
            self.publish_failures += 1
            print(f"weight sync: publishing v{self.version} failed ({e}); continuing, will publish the next version",
                  flush=True)
            return {"weight_sync_failures": float(self.publish_failures)}
        out = {"weight_sync_bytes": float(stats.bytes_written), "weight_sync_seconds": float(stats.seconds),
               "weight_sync_failures": float(self.publish_failures),
               "weight_sync_snapshot": float(stats.is_snapshot), "weight_sync_retries": float(stats.retries)}
        if stats.delta_ratio is not None:
            out["weight_sync_delta_ratio"] = stats.delta_ratio
        if stats.identical_fraction is not None:
            out["weight_sync_identical_fraction"] = stats.identical_fraction
        return out

    def start_embedded_workers(self, n: int) -> None:
        for i in range(n):
            w = make_worker(self.cfg, f"embedded{i}", self.tokenizer, self.tasks, self.cfg.train.seed + 1000 + i)
            t = threading.Thread(target=w.run, name=f"rollout-{i}", daemon=True)
            t.start()
            self.workers.append((w, t))

    def _workers_alive(self) -> bool:
        return not self.workers or any(t.is_alive() for _, t in self.workers)

    def train_step(self, results: list[dict]) -> dict:
        cfg = self.cfg
        groups = [_episodes(r) for r in results]
        samples, adv = episodes_to_samples(groups, cfg.rl)
        metrics = dict(adv.metrics)
        metrics.update(group_metrics(results))
        a = adv.advantages
        metrics.update(advantage_mean=a.mean().item(), advantage_std=a.std(unbiased=False).item(),
                       advantage_abs_mean=a.abs().mean().item())
        lr = lr_at(self.step, cfg.train.steps, cfg.optim)
        set_lr(self.optimizer, lr)
        self.model.train()
        num_episodes = sum(len(g) for g in groups)
        weighted: dict[str, float] = {}  # token-weighted means over micro-batches
        loss_sum, mismatch_max, tokens = 0.0, 0.0, 0.0
        pad = self.tokenizer.pad if self.tokenizer.pad is not None and self.tokenizer.pad >= 0 else 0
        mbs = cfg.train.micro_batch_size
        for start in range(0, len(samples), mbs):
            batch = {k: v.to(self.device) for k, v in collate_samples(samples[start:start + mbs], pad_id=pad).items()}
            ids, mask = batch["input_ids"], batch["loss_mask"]
            routed = batch.get("routed_experts")
            replay = replay_routing(cfg.rl.router_replay, routed) if cfg.rl.router_replay != "r2" else None
            out = self.model(ids, routed_experts=replay, return_routing=True)
            n = float(mask.sum())
            tokens += n
            stats: dict[str, float] = {}
            if routed is not None:  # how often the trainer would route differently from the engine
                if replay is None:
                    free = out.routed_experts
                else:
                    with torch.no_grad():
                        free = self.model(ids, return_routing=True).routed_experts
                stats.update(routing_mismatch(free, routed, mask > 0))
            logp = token_logprobs(out.logits, ids)
            ref_logp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(self.ref_model(ids, routed_experts=replay, return_routing=True).logits, ids)
            loss, m = self.loss_fn(logp, mask, batch["advantages"], batch["behaviour_logp"],
                                   ref_logp=ref_logp, num_sequences=num_episodes)
            loss.backward()
            loss_sum += m["loss"]
            mismatch_max = max(mismatch_max, m.get("mismatch_max", 0.0))
            for k in ("kl", "mismatch_masked_fraction", "ratio_mean", "tis_truncated_fraction"):
                if k in m and math.isfinite(m[k]):
                    stats[k] = m[k]
            for k, v in stats.items():
                weighted[k] = weighted.get(k, 0.0) + v * n
        metrics.update({k: v / max(tokens, 1.0) for k, v in weighted.items()})
        metrics.update(loss=loss_sum, mismatch_max=mismatch_max)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf"))
        finite = math.isfinite(metrics["loss"]) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(lr=lr, grad_norm=float(grad_norm), skipped=0.0 if finite else 1.0, train_tokens=tokens)
        return metrics

    def fit(self) -> Path:
        cfg = self.cfg
        total = min(cfg.train.steps, -(-len(self.tasks) // cfg.train.groups_per_step))
        print(f"RL trainer: {len(self.tasks)} prompts x group {cfg.rollout.group_size}, {cfg.train.groups_per_step} "
              f"groups/step, steps {self.step}->{total}; weights at {weights_url(cfg)} (v{self.version})", flush=True)
        skipped = 0
        try:
            while self.step < total:
                t0 = time.perf_counter()
                try:
                    results = self.orch.next_groups(cfg.train.groups_per_step, self.version,
                                                    timeout_s=cfg.rollout.group_timeout_s, alive=self._workers_alive)
                except QueueError as e:
                    raise RuntimeError(str(e)) from None
                if not results:
                    break  # epoch done
                wait_s = time.perf_counter() - t0
                versions = sorted({int(v) for r in results for v in r["version_counts"]})
                metrics = self.train_step(results)
                skipped = skipped + 1 if metrics["skipped"] else 0
                if skipped > cfg.train.max_skipped_steps:
                    raise RuntimeError(f"{skipped} consecutive non-finite steps; lower optim.lr")
                self.step += 1
                self.version += 1
                metrics.update(self._publish())
                hist = self.orch.take_staleness()
                metrics.update(
                    weight_version=float(self.version), rollout_wait_s=wait_s, step_time=time.perf_counter() - t0,
                    staleness_hist={str(k): v for k, v in hist.items()},
                    staleness_mean=(sum(k * v for k, v in hist.items()) / max(sum(hist.values()), 1)),
                    staleness_max=float(max(hist, default=0)),
                    requeued_crashed=float(self.orch.stats.requeued_crashed),
                    requeued_stale=float(self.orch.stats.requeued_stale),
                    prompts=[int(r["prompt_index"]) for r in results], token_versions=versions)
                if versions and versions[0] < self.version - 1:
                    print(f"step {self.step}: trained on tokens of versions {versions} while the trainer was at "
                          f"v{self.version - 1} (off-policy by up to {self.version - 1 - versions[0]})", flush=True)
                if cfg.eval.interval and (self.step % cfg.eval.interval == 0 or self.step == total):
                    metrics.update(self.held_out_eval())
                console = self.step % cfg.logging.interval == 0 or self.step == total
                self.logger.log(self.step, metrics, console=console)
                if self.step % cfg.checkpoint.interval == 0 or self.step == total:
                    self.save()
        finally:
            self.queue.stop_all()
            for _, t in self.workers:
                t.join(timeout=30)
            self.logger.close()
        return self.run_dir

    def held_out_eval(self) -> dict:
        """pass@1 / pass@K of the current weights on eval.tasks (the trainer pauses; rollout workers go on)."""
        from rl.evaluate import evaluate_model
        from rl.rollout.tasks import load_rl_tasks

        cfg = self.cfg
        if self._eval_tasks is None:
            self._eval_tasks = load_rl_tasks(cfg.eval.tasks)
        model = copy.deepcopy(self.model).to(getattr(torch, cfg.weight_sync.dtype))
        summary, _ = evaluate_model(model, self.tokenizer, cfg.rollout, self._eval_tasks, cfg.eval.samples,
                                    cfg.eval.success_reward, seed=cfg.train.seed + self.step, progress=False)
        k = cfg.eval.samples
        return {"eval_pass@1": summary["pass@1"], f"eval_pass@{k}": summary[f"pass@{k}"],
                "eval_reward_mean": summary["reward_mean"]}

    def save(self) -> Path:
        state = {"step": self.step, "weight_version": self.version, "orchestrator": self.orch.state_dict()}
        ckpt = save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, state, self.meta,
                               self.cfg.checkpoint.keep_last)
        return ckpt


def run_worker_process(cfg: RLConfig, rank: int) -> None:
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.rollout.tasks import load_rl_tasks

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    tasks = load_rl_tasks(cfg.data.tasks)
    name = os.environ.get("RL_WORKER_NAME", f"rank{rank}")
    worker = make_worker(cfg, name, tokenizer, tasks, cfg.train.seed + 1000 + rank)
    worker.run()


def run_rl(cfg: RLConfig) -> Path | None:
    cfg.validate()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg.check_runnable(world)
    role = cfg.role if cfg.role != "auto" else ("trainer" if rank == 0 else "rollout")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    if role == "rollout":
        run_worker_process(cfg, rank)
        return None
    trainer = Trainer(cfg)
    if world == 1 and cfg.role == "auto":
        trainer.start_embedded_workers(cfg.rollout.embedded_workers)
    return trainer.fit()
