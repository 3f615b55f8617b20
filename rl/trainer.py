"""The Trainer role of an RL run: the RL loss over the training core on the trainer ranks.

Every trainer rank builds a `Trainer` (collectively). Trainer step v (the trainer holds weight version v,
the number of optimizer steps taken):
1. trainer rank 0 asks the orchestrator role (rl.orchestrator.OrchestratorRole) for ``train.groups_per_step``
   complete groups (each at most ``rollout.max_staleness`` versions old) and broadcasts them to the other
   trainer ranks;
2. group advantages over episode rewards, samples per segment (rl.algorithm.episodes_to_samples); each
   data-parallel rank takes its share;
3. (when needed) an old-policy pass over the step's samples, then forward with router replay (the engine's
   experts, or under R2 the old pass's), token log-probs at the rollout temperature, `PolicyGradientLoss`
   (importance ratio against the engine's log-probs, the step's mismatch threshold, KL to the initial
   policy) -- the loss of rl.learner.PolicyLearner, stepped by the training core;
4. every trainer rank publishes the boxes of the weights it owns as version v + 1 (XOR delta against its own
   boxes of v, rl/weight_sync/publisher.py), in a background thread while the next step trains (at most
   ``weight_sync.async_versions`` versions in flight); trainer rank 0 writes the manifest once every owner has
   confirmed, so no rank ever holds more than its shard (its shard of v, and of the versions in flight);
5. log metrics (held-out pass@K every ``eval.interval`` steps, of the version just published, run by the
   rollout workers on their engines while trainer rank 0 waits; with ``eval.at_start`` also of the initial
   weights, as step 0), and checkpoint (model, optimizer, orchestrator state) every ``checkpoint.interval`` steps.
How roles are placed on processes: rl/launch.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.config import save_config, to_dict
from megatron_composer.training.core import local_device, resume_point
from megatron_composer.training.layout import Layout
from megatron_composer.training.metrics import MetricsLogger
from megatron_composer.training.optim import lr_at
from rl.algorithm import zero_variance_groups
from rl.config import RLConfig, weight_store, weights_url
from rl.learner import PolicyLearner
from rl.metrics import group_metrics
from rl.model import build_model_meta
from rl.orchestrator import OrchestratorRole, QueueError
from rl.rollout.records import read_group_index
from rl.weight_sync import ObjectStoreError, WeightSyncError


class Trainer:
    """One trainer rank. Every trainer rank builds one (collectively); rank 0 also runs the orchestrator role,
    the metrics log and the weight manifest, and hands each step's groups to the others."""

    def __init__(self, cfg: RLConfig):
        from megatron_composer.data.tokenizer import load_tokenizer
        from rl.rollout.tasks import load_rl_tasks

        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self._refill: dict[str, float] = {}  # the last step's dynamic-sampling counts (rank 0)
        self.layout = Layout(cfg.parallel)
        self.is_main = self.layout.rank == 0
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.tasks = load_rl_tasks(cfg.data.tasks)
        self.device = local_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(cfg.train.seed)
        self.latest = resume_point(self.run_dir, build_model_meta(cfg, self.tokenizer)[1])  # before run.dir is touched
        self._barrier()
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
        self.learner = PolicyLearner(cfg, self.tokenizer, self.layout, self.device, init_from=cfg.checkpoint.init_from,
                                     resuming=self.latest is not None,
                                     agent_tasks=any(t.kind != "single_turn" for t in self.tasks))
        self.model, self.meta = self.learner.model, self.learner.meta
        self.step = 0
        self.version = 0
        self.orchestrator = self.logger = self.publisher = None
        state = self.learner.load(self.latest) if self.latest is not None else None
        if state is not None:
            self.step = state["step"]
        if self.is_main:
            self.orchestrator = OrchestratorRole(self.run_dir, len(self.tasks), cfg.rollout, cfg.train.seed,
                                                 state["orchestrator"] if state is not None else None)
            self.logger = MetricsLogger(self.run_dir, cfg.logging, True, to_dict(cfg))
            # the console line: the reward, and the infrastructure's faults (retried) apart from the episodes'
            # own errors (scored 0), rl.metrics.group_metrics
            self.logger.console_keys = ["reward_mean", "infra_faults", "policy_errors"]
            if state is not None:
                self.logger.truncate_after(self.step)
                print(f"resumed from {self.latest} at step {self.step}; {self.orchestrator.describe()}", flush=True)
            # Versions only grow, also across resumes: a resumed trainer publishes after whatever is in the store.
            stored = cfg.weight_sync.subscriber(weight_store(cfg)).latest_version()
            self.version = 0 if stored is None else stored + 1
        self.version = self._from_main(self.version)
        # every trainer rank publishes the boxes of the weights it owns (rl/weight_sync/publisher.py), over a gloo
        # group of its own: the publisher's collectives carry Python objects, also when training runs on NCCL
        self._sync_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # the routed experts in the form the rollout engines serve them (INT4 for Kimi K2.5), so engines apply
        # deltas of the bytes they hold and no rollout worker quantises
        served = None if cfg.rollout.quantize_experts == "none" else cfg.rollout.quantize_experts
        self.publisher = cfg.weight_sync.publisher(weight_store(cfg), group=self._sync_group, experts=served)
        self.publish_failures, self._last_publish = 0, {}
        self._publish(background=False)
        if self.publish_failures:   # every trainer rank knows (the publish is collective)
            raise RuntimeError(f"cannot publish the initial weights to {weights_url(cfg)}; check weight_sync.url")
        self.workers: list[tuple[object, threading.Thread]] = []  # in-process rollout workers
        self._eval_tasks = self._eval_subscriber = None

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

    def _publish(self, background: bool = True) -> dict:
        """Collective: every trainer rank writes the boxes it owns of self.version; the version is visible once
        all have (rank 0 writes the manifest last). With weight_sync.async_versions > 0 (and background) the
        writes run in each rank's background thread while training goes on, at most that many versions
        behind. Metrics (of the publishes finished by now) on trainer rank 0."""
        bound = self.cfg.weight_sync.async_versions
        if background and bound > 0:
            return self._publish_outcomes(self.publisher.publish_async(self.model, self.version, bound))
        try:
            outcome = self.publisher.publish(self.model, self.version)
        except (ObjectStoreError, WeightSyncError) as e:
            outcome = e
        return self._publish_outcomes([(self.version, outcome)])

    def _publish_outcomes(self, outcomes: list) -> dict:
        """Metrics of the newest finished publish (weight_sync_version says which) and the failures so far."""
        out = self._last_publish
        for version, stats in outcomes:
            if isinstance(stats, Exception):
                # Training goes on: workers keep the last version they have, the staleness bound redoes groups
                # that fall too far behind, and the next publish is a delta against the last visible version.
                self.publish_failures += 1
                if self.is_main:
                    print(f"weight sync: publishing v{version} failed ({stats}); continuing, will publish the next "
                          f"version", flush=True)
                continue
            out = {"weight_sync_bytes": float(stats.bytes_written), "weight_sync_seconds": float(stats.seconds),
                   "weight_sync_version": float(version), "weight_sync_snapshot": float(stats.is_snapshot),
                   "weight_sync_retries": float(stats.retries)}
            if stats.delta_ratio is not None:
                out["weight_sync_delta_ratio"] = stats.delta_ratio
            if stats.identical_fraction is not None:
                out["weight_sync_identical_fraction"] = stats.identical_fraction
        self._last_publish = out
        return {**out, "weight_sync_failures": float(self.publish_failures)} if self.is_main else {}

    def start_embedded_workers(self, n: int) -> None:
        """Run `n` rollout workers in threads of this process (rl/rollout/launch.py: way 1)."""
        from rl.rollout.launch import start_worker_threads

        self.workers += start_worker_threads(self.cfg, self.tokenizer, self.tasks, n)

    def _workers_alive(self) -> bool:
        return not self.workers or any(t.is_alive() for _, t in self.workers)

    def train_step(self, results: list[dict]) -> dict:
        """One optimizer step on these groups (collective over the trainer ranks, which all pass the same)."""
        metrics = self.learner.step(results, lr_at(self.step, self.cfg.train.steps, self.cfg.optim))
        metrics.update(group_metrics(results))
        return metrics

    def _next_groups(self) -> list[dict]:
        """Trainer rank 0 collects the step's groups from the orchestrator (their record headers); the other
        trainer ranks get only the paths of their record files and read the headers themselves -- every rank
        later reads just the samples it trains on (rl/rollout/records.py)."""
        results, error = None, None
        if self.is_main:
            try:
                results = self._draw_groups()
            except QueueError as e:
                error = str(e)
        if self.layout.world > 1:
            paths, error = self._from_main(([r["path"] for r in results] if results is not None else None, error))
            if not self.is_main and paths is not None:
                results = [read_group_index(p) for p in paths]
        if error:
            raise RuntimeError(error)
        return results

    def _draw_groups(self) -> list[dict]:
        """The step's groups (trainer rank 0). With rl.refill_groups (dynamic sampling), groups whose rewards are
        all equal are replaced by newly drawn ones, at most refill_groups more per step; the replaced groups are
        released untrained and counted (`refilled_groups`, `equal_reward_groups_replaced`)."""
        n, budget = self.cfg.train.groups_per_step, self.cfg.rl.refill_groups
        results = self.orchestrator.next_groups(n, self.version, alive=self._workers_alive)
        replaced: list[dict] = []
        drawn = 0
        while budget > drawn and results:
            flat = [r for r in results if _equal_rewards(r)]
            if not flat:
                break
            more = self.orchestrator.next_groups(min(len(flat), budget - drawn), self.version,
                                                 alive=self._workers_alive)
            if not more:
                break  # end of the epoch: train on what there is
            drawn += len(more)
            out = flat[:len(more)]
            replaced += out
            results = [r for r in results if not any(r is o for o in out)] + more
        if replaced:
            self.orchestrator.step_trained(replaced)  # their files are released; nobody reads their samples
        self._refill = {"refilled_groups": float(drawn), "equal_reward_groups_replaced": float(len(replaced))}
        return results

    def fit(self) -> Path:
        cfg = self.cfg
        total = min(cfg.train.steps, -(-len(self.tasks) // cfg.train.groups_per_step))
        if self.is_main:
            print(f"RL trainer: {len(self.tasks)} prompts x group {cfg.rollout.group_size}, "
                  f"{cfg.train.groups_per_step} groups/step, steps {self.step}->{total} on {self.layout.world} "
                  f"trainer rank(s) (tp {self.layout.dims.tp}, cp {self.layout.dims.cp}, ep {self.layout.dims.ep}, "
                  f"dp {self.layout.dims.dp}); weights at {weights_url(cfg)} (v{self.version})", flush=True)
        try:
            if cfg.eval.interval and cfg.eval.at_start and self.step == 0:
                # the starting point of the held-out curve: the initial weights, logged as step 0
                if self.is_main:
                    self.logger.log(0, self.held_out_eval(), console=True)
            while self.step < total:
                t0 = time.perf_counter()
                results = self._next_groups()
                if not results:
                    break  # epoch done
                wait_s = time.perf_counter() - t0
                versions = sorted({int(v) for r in results for v in r["version_counts"]})
                metrics = self.train_step(results)  # the core stops the run after too many non-finite steps
                if self.is_main:
                    self.orchestrator.step_trained(results)  # every rank has read its samples by now
                self.step += 1
                self.version += 1
                metrics.update(self._publish())
                if self.is_main:
                    self._log(metrics, results, versions, wait_s, t0, total)
                if self.step % cfg.checkpoint.interval == 0 or self.step == total:
                    self.save()
            self._publish_outcomes(self.publisher.flush())   # the last versions become visible
            self.learner.finish_save()
        finally:
            if self.is_main:
                self.orchestrator.stop()
                for _, t in self.workers:
                    t.join(timeout=30)
                self.logger.close()
        return self.run_dir

    def _log(self, metrics: dict, results: list[dict], versions: list[int], wait_s: float, t0: float, total: int):
        cfg = self.cfg
        metrics.update(weight_version=float(self.version), rollout_wait_s=wait_s, step_time=time.perf_counter() - t0)
        metrics.update(self._refill)
        metrics.update(self.orchestrator.step_metrics())
        metrics.update(prompts=[int(r["prompt_index"]) for r in results], token_versions=versions)
        if versions and versions[0] < self.version - 1:
            print(f"step {self.step}: trained on tokens of versions {versions} while the trainer was at "
                  f"v{self.version - 1} (off-policy by up to {self.version - 1 - versions[0]})", flush=True)
        if cfg.eval.interval and (self.step % cfg.eval.interval == 0 or self.step == total):
            metrics.update(self._publish_outcomes(self.publisher.flush()))   # evaluate the version just trained
            metrics.update(self.held_out_eval())
        console = self.step % cfg.logging.interval == 0 or self.step == total
        self.logger.log(self.step, metrics, console=console)

    def held_out_eval(self) -> dict:
        """pass@1 / pass@K / reward mean on eval.tasks of the newest version in the weight store (the one just
        published, unless that publish failed), measured by the rollout workers on their own (sharded) engines:
        trainer rank 0 asks the orchestrator role for it and waits until every held-out task's group is back
        (the other trainer ranks wait for the next step; rollout workers not evaluating go on generating
        training groups, which the bounded queue keeps). No trainer rank builds a model for it."""
        from rl.metrics import summarize_groups
        from rl.rollout.tasks import load_rl_tasks

        cfg = self.cfg
        if self._eval_tasks is None:
            self._eval_tasks = load_rl_tasks(cfg.eval.tasks)
            self._eval_subscriber = cfg.weight_sync.subscriber(weight_store(cfg))
        version = self._eval_subscriber.latest_version()   # reads the manifest only
        t0 = time.perf_counter()
        results = self.orchestrator.evaluate(version, len(self._eval_tasks), cfg.eval.samples,
                                             alive=self._workers_alive)
        summary = summarize_groups(self._eval_tasks, results, cfg.eval.samples, cfg.eval.success_reward)
        k = cfg.eval.samples
        episodes = [ep for r in results for ep in r["episodes"]]
        tiers = {f"eval_tier{t}_{m}": v[m] for t, v in summary["per_tier"].items()
                 for m in ("tasks", "pass@1", "pass@1_se", f"pass@{k}")}
        return {"eval_tasks": summary["tasks"], "eval_pass@1": summary["pass@1"],
                "eval_pass@1_se": summary["pass@1_se"], f"eval_pass@{k}": summary[f"pass@{k}"], **tiers,
                "eval_tool_calls_per_episode": sum(ep.get("meta", {}).get("tool_calls", 0) for ep in episodes)
                / max(len(episodes), 1),
                "eval_reward_mean": summary["reward_mean"], "eval_weight_version": float(version),
                "eval_token_versions": sorted({int(v) for r in results for v in r["version_counts"]}),
                "eval_workers": sorted({r["worker"] for r in results}), "eval_seconds": time.perf_counter() - t0}

    def save(self) -> Path:
        """Collective: model and optimizer shards of every trainer rank; step and orchestrator from rank 0."""
        state = {"step": self.step, "weight_version": self.version}
        if self.is_main:
            state["orchestrator"] = self.orchestrator.state_dict()
        return self.learner.save(self.run_dir, self.step, state, self.cfg.checkpoint.keep_last)


def _equal_rewards(group: dict) -> bool:
    """A group whose episodes all have the same training reward: zero advantages, no signal (the same test
    rl.filter_zero_variance_groups applies in the loss)."""
    return bool(zero_variance_groups(torch.tensor([[float(ep["reward"]) for ep in group["episodes"]]]))[0])
