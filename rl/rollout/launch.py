"""Rollout roles on processes: a rollout worker (engine + weight subscriber on the run's queue), a rollout
process of a launch (one worker, or an engine of rollout.tp x rollout.ep processes whose rank 0 runs the
worker and whose other ranks follow it), and the rollout ranks' own process group.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.config import ConfigError
from megatron_composer.parallel.dims import ParallelDims
from rl.config import RLConfig, weight_store
from rl.model import rollout_model
from rl.orchestrator import WorkQueue
from rl.rollout.worker import RolloutWorker, run_follower


def make_worker(cfg: RLConfig, name: str, tokenizer, tasks, seed: int, stops_since: float | None = None,
                model: torch.nn.Module | None = None, engine_group=None) -> RolloutWorker:
    """A rollout worker on `model` (default: `rollout_model`'s whole model; a tp / ep shard from it), subscribed
    to the boxes of the weights that shard holds; with eval.interval it also runs the held-out evaluation items
    of eval.tasks."""
    from megatron_composer.data.chat_format import load_chat_format
    from rl.rollout.tasks import load_rl_tasks

    if model is None:
        model = rollout_model(cfg, tokenizer)
    queue = WorkQueue(Path(cfg.run.dir) / "rollouts")
    eval_tasks = load_rl_tasks(cfg.eval.tasks) if cfg.eval.interval and cfg.eval.tasks else None
    return RolloutWorker(name, cfg.rollout, model, tokenizer, tasks, queue,
                         cfg.weight_sync.subscriber(weight_store(cfg), model), seed=seed,
                         poll_seconds=cfg.weight_sync.poll_seconds, stops_since=stops_since, objective=cfg.rl,
                         engine_group=engine_group, eval_tasks=eval_tasks,
                         chat_format=load_chat_format(cfg.data.chat_format, tokenizer))


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
    if cfg.rollout.engine_ranks == 1:
        make_worker(cfg, name, tokenizer, tasks, seed, stops_since=started).run()
        return
    groups, engine_group, engine_rank = init_rollout_group(cfg, rank, world)
    try:
        model = rollout_model(cfg, tokenizer, groups)
        if engine_rank == 0:
            make_worker(cfg, name, tokenizer, tasks, seed, stops_since=started, model=model,
                        engine_group=engine_group).run()
        else:
            run_follower(f"{name} (rollout engine rank {engine_rank})", cfg.rollout, model,
                         cfg.weight_sync.subscriber(weight_store(cfg), model), cfg.weight_sync.poll_seconds,
                         engine_group=engine_group)
    finally:
        dist.destroy_process_group()


def init_rollout_group(cfg: RLConfig, rank: int, world: int):
    """rollout.tp x rollout.ep > 1: the rollout ranks of the launch become their own torch.distributed default
    group (never the trainer's), laid out by ParallelDims(tp, ep) (tp and ep groups are consecutive ranks) and cut
    into consecutive engines of tp x ep ranks, which hold each of their tp and ep groups. In a launch with trainer
    ranks the group meets through torchrun's store, under its own key prefix. Returns this rank's ParallelGroups,
    its engine's process group (every rank of it makes the engine's calls) and its rank in the engine."""
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
    groups = ParallelDims(n, tp=cfg.rollout.tp, ep=cfg.rollout.ep).build()
    size = cfg.rollout.engine_ranks
    me = dist.get_rank()
    engine_group = None
    for start in range(0, n, size):   # every rank creates every group, in the same order
        g = dist.group.WORLD if size == n else dist.new_group(list(range(start, start + size)))
        if start <= me < start + size:
            engine_group = g
    return groups, engine_group, me % size
