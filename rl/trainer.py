"""RL run: config schema, the trainer role, and how roles are placed on processes.

`run_rl(cfg)` is what `rl_composer.py` calls on every process. Roles by rank: ranks 0 .. trainer_ranks-1 train
(rank 0 also owns the orchestrator, see rl/orchestrator.py, and publishes the weights); every other rank is a
rollout worker (rl/rollout/worker.py). The trainer ranks, and only they, form torch.distributed's default
process group, cut into the pretraining layouts (parallel.tp/cp/ep, dp inferred, ZeRO-1; see rl/learner.py);
rollout ranks never join it (with ``rollout.tp`` > 1 they form their own group, cut into tensor-parallel
engines of that size; see `init_rollout_group`). When the launch leaves no rollout rank (one process, or
trainer_ranks = world size) trainer rank 0 runs ``rollout.embedded_workers`` worker threads. Separate launches (clusters) run the
same entrypoint with ``role=trainer`` (every process trains; trainer_ranks = their number) or
``role=rollout``; they meet only through ``run.dir``'s rollout queue and the weight-sync store.

Trainer step v (the trainer holds weight version v, the number of optimizer steps taken):
1. trainer rank 0 waits for ``train.groups_per_step`` complete groups from the orchestrator (each at most
   ``rollout.max_staleness`` versions old) and broadcasts them to the other trainer ranks;
2. group advantages over episode rewards, samples per segment (rl.algorithm.episodes_to_samples); each
   data-parallel rank takes its share;
3. (when needed) an old-policy pass over the step's samples, then forward with router replay (the engine's
   experts, or under R2 the old pass's), token log-probs at the rollout temperature, `PolicyGradientLoss`
   (importance ratio against the engine's log-probs, the step's mismatch threshold, KL to the initial policy);
4. optimizer step, then the full weights are gathered to trainer rank 0, which publishes version v + 1 to the
   weight-sync store (XOR delta against v);
5. log metrics, and checkpoint (model, optimizer, orchestrator state) every ``checkpoint.interval`` steps.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist

from megatron_composer.checkpoint.dcp import find_latest
from megatron_composer.config import ConfigError, save_config, to_dict
from megatron_composer.fp8 import FP8Config
from megatron_composer.parallel.dims import ParallelConfig, ParallelDims
from megatron_composer.training.metrics import LoggingConfig, MetricsLogger
from megatron_composer.training.optim import OptimizerConfig, lr_at
from pretrain.layout import Layout
from pretrain.trainer import CheckpointConfig, ModelSection, RunConfig, architecture
from rl.algorithm import RLObjectiveConfig
from rl.learner import PolicyLearner, rl_model_config
from rl.orchestrator import Orchestrator, QueueError, WorkQueue
from rl.rollout.worker import RolloutConfig, RolloutWorker, run_follower
from rl.weight_sync import ObjectStore, ObjectStoreError, WeightSyncConfig


@dataclass
class RLDataConfig:
    tasks: str = field(default="examples/tiny/rl_tasks", metadata={"help": "task directory: tasks.jsonl and/or Harbor task folders"})
    tokenizer: str = field(default="data/tiny/tokenizer", metadata={"help": "tokenizer file or directory"})
    seq_length: int = field(default=0, metadata={"help": "context of the stage the weights come from; the rope scaling is the "
                                                        "weights' own (inherited from the checkpoint), else YaRN factor = this / "
                                                        "model.yarn_original_length; 0 = rollout.max_seq_len"})


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
    role: Literal["auto", "trainer", "rollout"] = field(default="auto", metadata={"help": "auto: ranks below trainer_ranks train, the others roll out; separate launches pick one"})
    trainer_ranks: int = field(default=1, metadata={"help": "processes that train (ranks 0..N-1, laid out by parallel.*); role=trainer: all of the launch's"})
    model: ModelSection = field(default_factory=ModelSection)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    rl: RLObjectiveConfig = field(default_factory=RLObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: HeldOutEvalConfig = field(default_factory=HeldOutEvalConfig)

    def validate(self) -> "RLConfig":
        self.optim.validate()
        self.rl.validate()
        self.rollout.validate()
        self.parallel.validate()
        self.fp8.validate()
        if self.trainer_ranks < 1:
            raise ConfigError(f"trainer_ranks={self.trainer_ranks} must be >= 1")
        if self.train.steps < 1 or self.train.groups_per_step < 1 or self.train.micro_batch_size < 1:
            raise ConfigError("train.steps, train.groups_per_step and train.micro_batch_size must be >= 1")
        if self.checkpoint.interval < 1:
            raise ConfigError(f"checkpoint.interval={self.checkpoint.interval} must be >= 1")
        if self.eval.interval < 0 or self.eval.samples < 1 or (self.eval.interval > 0 and not self.eval.tasks):
            raise ConfigError("eval.interval must be >= 0 and eval.samples >= 1; eval.interval > 0 needs eval.tasks")
        return self

    def check_runnable(self, world: int) -> None:
        """Raise a one-line ConfigError, before any work, if this launch of `world` processes cannot run the
        configured roles and trainer layout."""
        n = self.trainer_ranks
        tp = self.rollout.tp
        if self.role == "rollout":
            if world % tp:
                raise ConfigError(f"rollout.tp={tp} does not divide this launch's {world} rollout process(es); launch a "
                                  f"multiple of {tp} (torchrun --nproc-per-node) or change rollout.tp")
            return
        if self.role == "trainer" and n != world:
            raise ConfigError(f"role=trainer: all {world} process(es) of this launch train; set trainer_ranks={world} "
                              f"(got {n})")
        if n > world:
            raise ConfigError(f"trainer_ranks={n} but this launch has {world} process(es); launch at least {n} "
                              f"(torchrun --nproc-per-node) or lower trainer_ranks")
        if self.role == "auto" and n == world and self.rollout.embedded_workers < 1:
            raise ConfigError(f"trainer_ranks={n} leaves no rollout rank of the {world} and rollout.embedded_workers=0: "
                              "nothing would generate; launch more processes, lower trainer_ranks, or use role=trainer "
                              "with separately launched role=rollout workers")
        if self.role == "auto" and tp > 1:
            if n == world:
                raise ConfigError(f"rollout.tp={tp} needs rollout processes, but trainer_ranks={n} leaves none of the {world} "
                                  "(embedded worker threads run one-rank engines); launch more processes or set rollout.tp=1")
            if (world - n) % tp:
                raise ConfigError(f"rollout.tp={tp} does not divide the {world - n} rollout rank(s) (world {world} - "
                                  f"trainer_ranks {n}); launch trainer_ranks + a multiple of {tp} processes or change rollout.tp")
        p = self.parallel
        try:
            ParallelDims.from_config(p, n)
        except ConfigError as e:
            who = "a single trainer rank (trainer_ranks=1)" if n == 1 else f"trainer_ranks={n}"
            raise ConfigError(f"{who} does not hold the layout parallel.tp/cp/ep/dp = {p.tp}/{p.cp}/{p.ep}/{p.dp}: "
                              f"{e}") from None


def weights_url(cfg: RLConfig) -> str:
    return cfg.weight_sync.url or str(Path(cfg.run.dir) / "weights")


def weight_store(cfg: RLConfig) -> ObjectStore:
    return cfg.weight_sync.open_store(weights_url(cfg))


def build_model(cfg: RLConfig, tokenizer):
    """The full (unsharded) model of the run, as rollout workers and evaluation hold it, and its meta."""
    from megatron_composer.model import Transformer

    mc, meta = build_model_meta(cfg, tokenizer)
    return Transformer(mc), meta


def build_model_meta(cfg: RLConfig, tokenizer):
    mc = rl_model_config(cfg, tokenizer)
    return mc, {"model": architecture(mc), "tokenizer": tokenizer.describe()}


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def make_worker(cfg: RLConfig, name: str, tokenizer, tasks, seed: int, stops_since: float | None = None,
                model: torch.nn.Module | None = None) -> RolloutWorker:
    """A rollout worker on `model` (default: a new full model; a tensor-parallel shard from `rollout_model`)."""
    if model is None:
        model, _ = build_model(cfg, tokenizer)
        model = model.to(local_device(), getattr(torch, cfg.weight_sync.dtype))
    queue = WorkQueue(Path(cfg.run.dir) / "rollouts")
    return RolloutWorker(name, cfg.rollout, model, tokenizer, tasks, queue, cfg.weight_sync.subscriber(weight_store(cfg)),
                         seed=seed, poll_seconds=cfg.weight_sync.poll_seconds, stops_since=stops_since, objective=cfg.rl)


def group_metrics(results: list[dict]) -> dict:
    """Reward mean / best-of-K / distribution and episode, segment and summary counts of one step's groups.

    ``reward_mean`` is the training reward the advantages use; ``verifier_reward_mean`` the verifier's part and
    ``<term>_mean`` each shaping term's signed part (``length_penalty_mean``, ``malformed_tool_calls_mean``, ...),
    so reward_mean = verifier_reward_mean + the sum of the term means."""
    episodes = [ep for r in results for ep in r["episodes"]]
    rewards = torch.tensor([[float(ep["reward"]) for ep in r["episodes"]] for r in results])
    metas = [ep.get("meta", {}) for ep in episodes]
    q = torch.quantile(rewards.flatten(), torch.tensor([0.1, 0.5, 0.9])).tolist()
    terms = sorted({t for ep in episodes for t in ep.get("reward_terms", {})})
    shaping = {f"{t}_mean": sum(ep.get("reward_terms", {}).get(t, 0.0) for ep in episodes) / len(episodes) for t in terms}
    return {
        "reward_mean": rewards.mean().item(),
        "verifier_reward_mean": sum(float(ep.get("verifier_reward", ep["reward"])) for ep in episodes) / len(episodes),
        **shaping,
        "reward_best_of_k": rewards.max(dim=1).values.mean().item(),
        "reward_p10": q[0], "reward_p50": q[1], "reward_p90": q[2],
        "episodes": float(rewards.numel()),
        "turns": float(sum(m.get("turns", 1) for m in metas)),
        "segments_per_episode": sum(m.get("segments", 1) for m in metas) / max(len(metas), 1),
        "summaries": float(sum(m.get("summaries", 0) for m in metas)),
        "generated_tokens": float(sum(m.get("tokens", 0) for m in metas)),
        "no_tool_call_episodes": float(sum(m.get("stop_reason") == "no_tool_call" for m in metas)),
        "verifier_timeouts": float(sum(bool(m.get("verifier_timeout")) for m in metas)),
        "sandbox_failures": float(sum(r.get("sandbox_failures", 0) for r in results)),
    }


class Trainer:
    """One trainer rank. Every trainer rank builds one (collectively); rank 0 also owns the orchestrator, the
    metrics log and the weight publisher, and hands each step's groups to the others."""

    def __init__(self, cfg: RLConfig):
        from megatron_composer.data.tokenizer import load_tokenizer
        from rl.rollout.tasks import load_rl_tasks

        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.layout = Layout(cfg.parallel)
        self.is_main = self.layout.rank == 0
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.tasks = load_rl_tasks(cfg.data.tasks)
        self.device = local_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(cfg.train.seed)
        self.latest = find_latest(self.run_dir)
        if self.latest is not None:
            from megatron_composer.checkpoint.dcp import check_meta

            _, meta = build_model_meta(cfg, self.tokenizer)
            check_meta(self.latest, meta)  # before anything in run.dir is touched
        self._barrier()
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        init = cfg.checkpoint.init_from
        self.learner = PolicyLearner(cfg, self.tokenizer, self.layout, self.device, init_from=init,
                                     resuming=self.latest is not None,
                                     agent_tasks=any(t.kind != "single_turn" for t in self.tasks))
        self.model, self.meta = self.learner.model, self.learner.meta
        if self.latest is None and init and self.is_main:
            from megatron_composer.checkpoint.dcp import resolve_checkpoint

            print(f"initialised weights from {resolve_checkpoint(init)}", flush=True)
        self.step = 0
        self.version = 0
        self.queue = self.orch = self.logger = self.publisher = None
        state = self.learner.load(self.latest) if self.latest is not None else None
        if state is not None:
            self.step = state["step"]
        if self.is_main:
            self.queue = WorkQueue(self.run_dir / "rollouts")
            self.queue.clear_stop()
            self.orch = Orchestrator(self.queue, len(self.tasks), cfg.rollout.group_size, cfg.train.seed,
                                     cfg.rollout.max_inflight_groups, cfg.rollout.max_staleness, cfg.rollout.lease_s)
            self.logger = MetricsLogger(self.run_dir, cfg.logging, True, to_dict(cfg))
            if state is not None:
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
        error = None if "weight_sync_bytes" in first or not self.is_main else (
            f"cannot publish the initial weights to {weights_url(cfg)}; check weight_sync.url")
        error = self._from_main(error)
        if error:
            raise RuntimeError(error)
        self.workers: list[tuple[RolloutWorker, threading.Thread]] = []
        self._eval_tasks = None
        self._eval_model = None

    # -- trainer ranks ----------------------------------------------------------------------------------
    def _from_main(self, obj):
        """Trainer rank 0's `obj` on every trainer rank."""
        if self.layout.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _barrier(self) -> None:
        if self.layout.world > 1:
            dist.barrier()

    def _publish(self, out: Optional[dict] = None) -> dict:
        """Collective: gather the full weights to trainer rank 0, which publishes them as self.version (and
        puts them in `out` when given)."""
        state_dict = self.learner.full_state_dict(self.cfg.weight_sync.dtype)
        if out is not None and state_dict is not None:  # None on trainer ranks other than 0
            out.update(state_dict)
        if not self.is_main:
            return {}
        try:
            stats = self.publisher.publish(state_dict, self.version)
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
        """One optimizer step on these groups (collective over the trainer ranks, which all pass the same)."""
        metrics = self.learner.step(results, lr_at(self.step, self.cfg.train.steps, self.cfg.optim))
        metrics.update(group_metrics(results))
        return metrics

    def _next_groups(self) -> list[dict]:
        """Trainer rank 0 collects the step's groups from the orchestrator; every trainer rank gets them."""
        results, error = None, None
        if self.is_main:
            try:
                results = self.orch.next_groups(self.cfg.train.groups_per_step, self.version,
                                                timeout_s=self.cfg.rollout.group_timeout_s, alive=self._workers_alive)
            except QueueError as e:
                error = str(e)
        if self.layout.world > 1:
            results, error = self._from_main((results, error))
        if error:
            raise RuntimeError(error)
        return results

    def fit(self) -> Path:
        cfg = self.cfg
        total = min(cfg.train.steps, -(-len(self.tasks) // cfg.train.groups_per_step))
        if self.is_main:
            print(f"RL trainer: {len(self.tasks)} prompts x group {cfg.rollout.group_size}, {cfg.train.groups_per_step} "
                  f"groups/step, steps {self.step}->{total} on {self.layout.world} trainer rank(s) "
                  f"(tp {self.layout.dims.tp}, cp {self.layout.dims.cp}, ep {self.layout.dims.ep}, "
                  f"dp {self.layout.dims.dp}); weights at {weights_url(cfg)} (v{self.version})", flush=True)
        skipped = 0
        try:
            while self.step < total:
                t0 = time.perf_counter()
                results = self._next_groups()
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
                published = {}
                metrics.update(self._publish(published))
                if self.is_main:
                    self._log(metrics, results, versions, wait_s, t0, total, published)
                del published  # the full weights live only until the held-out evaluation has used them
                if self.step % cfg.checkpoint.interval == 0 or self.step == total:
                    self.save()
        finally:
            if self.is_main:
                self.queue.stop_all()
                for _, t in self.workers:
                    t.join(timeout=30)
                self.logger.close()
        return self.run_dir

    def _log(self, metrics: dict, results: list[dict], versions: list[int], wait_s: float, t0: float, total: int,
             published: dict):
        cfg = self.cfg
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
            metrics.update(self.held_out_eval(published))
        console = self.step % cfg.logging.interval == 0 or self.step == total
        self.logger.log(self.step, metrics, console=console)

    def held_out_eval(self, state_dict: dict) -> dict:
        """pass@1 / pass@K of the current (just published) weights on eval.tasks, on trainer rank 0 (the other
        trainer ranks wait for the next step; rollout workers go on)."""
        from rl.evaluate import evaluate_model
        from rl.rollout.tasks import load_rl_tasks

        cfg = self.cfg
        if self._eval_tasks is None:
            self._eval_tasks = load_rl_tasks(cfg.eval.tasks)
        if self._eval_model is None:
            self._eval_model, _ = build_model(cfg, self.tokenizer)
        model = self._eval_model
        model.load_state_dict(state_dict)
        model.to(self.device, getattr(torch, cfg.weight_sync.dtype))
        summary, _ = evaluate_model(model, self.tokenizer, cfg.rollout, self._eval_tasks, cfg.eval.samples,
                                    cfg.eval.success_reward, seed=cfg.train.seed + self.step, progress=False)
        model.to("cpu")  # kept between evaluations off the accelerator the trainer uses
        k = cfg.eval.samples
        return {"eval_pass@1": summary["pass@1"], f"eval_pass@{k}": summary[f"pass@{k}"],
                "eval_reward_mean": summary["reward_mean"]}

    def save(self) -> Path:
        """Collective: model and optimizer shards of every trainer rank; step and orchestrator from rank 0."""
        state = {"step": self.step, "weight_version": self.version}
        if self.is_main:
            state["orchestrator"] = self.orch.state_dict()
        return self.learner.save(self.run_dir, self.step, state, self.cfg.checkpoint.keep_last)



def run_worker_process(cfg: RLConfig, rank: int, world: int = 1) -> None:
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.rollout.tasks import load_rl_tasks

    # Launched together with the trainer (role=auto): a STOP left by a previous launch of this run.dir is not for
    # this worker (the resuming trainer removes it at start, possibly after this worker looked).
    started = time.time() if cfg.role == "auto" else None
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    tasks = load_rl_tasks(cfg.data.tasks)
    name = os.environ.get("RL_WORKER_NAME")
    name = f"rank{rank}" if name is None else (f"{name}x{rank}" if world > 1 else name)
    seed = cfg.train.seed + 1000 + rank
    if cfg.rollout.tp == 1:
        make_worker(cfg, name, tokenizer, tasks, seed, stops_since=started).run()
        return
    groups = init_rollout_group(cfg, rank, world)
    try:
        model = rollout_model(cfg, tokenizer, groups)
        if groups.tp_rank == 0:
            make_worker(cfg, name, tokenizer, tasks, seed, stops_since=started, model=model).run()
        else:
            run_follower(f"{name} (rollout tp rank {groups.tp_rank})", cfg.rollout, model, cfg.weight_sync.subscriber(weight_store(cfg)), cfg.weight_sync.poll_seconds)
    finally:
        dist.destroy_process_group()


def init_rollout_group(cfg: RLConfig, rank: int, world: int):
    """rollout.tp > 1: the rollout ranks of the launch become their own torch.distributed default group (never
    the trainer's), cut into consecutive tensor-parallel groups of rollout.tp. In a launch with trainer ranks the
    group meets through torchrun's store, under its own key prefix. Returns this rank's ParallelGroups."""
    import datetime

    first = cfg.trainer_ranks if cfg.role == "auto" else 0
    n = world - first
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    # Short: the leader beats every 30 s while idle, so a silent group means a dead rank; fail instead of
    # holding the group's lease for half an hour.
    timeout = datetime.timedelta(seconds=300)
    if first == 0:
        dist.init_process_group(backend, rank=rank, world_size=n, timeout=timeout)
    else:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise ConfigError(f"rollout.tp={cfg.rollout.tp} next to trainer ranks needs a torchrun launch (its store "
                              "joins the rollout ranks); use torchrun, or launch the rollouts separately with role=rollout")
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("rl_rollout/", base), rank=rank - first, world_size=n,
                                timeout=timeout)
    return ParallelDims(n, tp=cfg.rollout.tp).build()


def rollout_model(cfg: RLConfig, tokenizer, groups) -> torch.nn.Module:
    """This rank's shard of the rollout engine's model (weights arrive from the store)."""
    from megatron_composer.parallel.parallelize import parallelize_model

    model, _ = build_model(cfg, tokenizer)
    model = parallelize_model(model.to(getattr(torch, cfg.weight_sync.dtype)), groups)  # shard on the host first
    return model.to(local_device()).eval()


def check_model_layout(cfg: RLConfig) -> None:
    """The model against the trainer layout (heads, vocabulary, experts divisible), on every rank before any
    work, so a bad layout stops rollout ranks too."""
    from megatron_composer.data.tokenizer import load_tokenizer

    trainer = cfg.role != "rollout" and max(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.ep) > 1
    rollout = cfg.role != "trainer" and cfg.rollout.tp > 1
    if not (trainer or rollout):
        return
    from megatron_composer.parallel import validate_layout

    mc, _ = build_model_meta(cfg, load_tokenizer(cfg.data.tokenizer))
    if trainer:
        validate_layout(ParallelDims.from_config(cfg.parallel, cfg.trainer_ranks), mc)
    if rollout:
        if mc.tie_word_embeddings:
            raise ConfigError(f"rollout.tp={cfg.rollout.tp}: tensor parallelism does not support tied embeddings "
                              "(model tie_word_embeddings); set rollout.tp=1")
        try:
            validate_layout(ParallelDims(cfg.rollout.tp, tp=cfg.rollout.tp), mc)
        except ConfigError as e:
            raise ConfigError(f"rollout.tp={cfg.rollout.tp}: {e}".replace("parallel.tp", "rollout.tp")) from None


def init_trainer_group(cfg: RLConfig, rank: int, world: int) -> bool:
    """Trainer ranks 0..trainer_ranks-1 of a multi-process launch become torch.distributed's default group;
    rollout ranks never join it (they meet the trainer only through the queue and the weight store).
    Returns whether it created the group."""
    n = cfg.trainer_ranks if cfg.role == "auto" else world
    if n == 1 or dist.is_initialized():
        return False
    import datetime

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=1800))
    return True


def run_rl(cfg: RLConfig) -> Path | None:
    cfg.validate()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg.check_runnable(world)
    check_model_layout(cfg)
    if cfg.role == "auto":
        role = "trainer" if rank < cfg.trainer_ranks else "rollout"
    else:
        role = cfg.role
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    if role == "rollout":
        run_worker_process(cfg, rank, world)
        return None
    created = init_trainer_group(cfg, rank, world)
    try:
        trainer = Trainer(cfg)
        if cfg.role == "auto" and cfg.trainer_ranks == world and trainer.is_main:
            trainer.start_embedded_workers(cfg.rollout.embedded_workers)
        return trainer.fit()
    finally:
        if created:
            dist.destroy_process_group()
