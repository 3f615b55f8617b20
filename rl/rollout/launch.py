"""How rollout workers run, and the one function that chooses it: `worker_mode`.

A rollout worker (rl/rollout/worker.py) claims groups from the run's queue and runs them on an engine whose
weights come from the weight store. Every process of an RL launch of w processes (`rl_composer.py`, then
rl/launch.py `run_rl`) asks ``worker_mode(cfg, rank, w)`` for its part in the rollouts; n is
``rollout.engine_ranks``, the processes of one engine (rollout.tp x rollout.ep; 1 with rollout.backend=vllm,
which starts its own workers):

  way                     launch        processes                       n    mode      what runs
  ----------------------  ------------  ------------------------------  ---  --------  ------------------------------
  1 threads in trainer 0  role=auto     rank 0, if trainer_ranks = w    1    THREADS   trainer rank 0 and
                                                                                       rollout.embedded_workers worker
                                                                                       threads, one engine each
    (no worker)           role=auto     the other trainer ranks         -    NONE      a trainer rank
                          role=trainer  all                             -    NONE      a trainer rank
  2 rollout ranks         role=auto     rank >= trainer_ranks           1    PROCESS   one worker, its own engine
  3 engines of n ranks    role=auto     rank >= trainer_ranks,          > 1  LEADER    the worker; its engine's calls
                                        (rank - trainer_ranks) % n = 0                 reach the other ranks through
                                                                                       Lockstep
                                        the engine's other ranks        > 1  FOLLOWER  `run_follower`: replays them
  4 separate launches     role=rollout  all (rank % n places a rank     any  as in 2 and 3: PROCESS, LEADER or
                                        in its engine)                       FOLLOWER

Rollout processes next to trainer ranks (ways 2 and 3) ignore stop markers older than their start (a previous
launch's); those of a separate launch (way 4) meet the trainer launch only through run.dir's queue and the weight
store. The ranks of engines of n > 1 form their own process group (`init_rollout_group`), never the trainer's.
`run_rl` starts the trainer (way 1: with `start_worker_threads`) or `run_worker_process` (ways 2 to 4) by the
mode; `RLConfig.check_runnable` has refused, before any work, the launches that cannot run.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.config import ConfigError
from megatron_composer.parallel.dims import ParallelDims
from rl.config import RLConfig, weight_store
from rl.model import rollout_model
from rl.orchestrator import WorkQueue
from rl.rollout.engines import run_follower
from rl.rollout.worker import RolloutWorker


class WorkerMode(enum.Enum):
    """A process's part in the rollouts (the table above)."""

    NONE = "none"          # a trainer rank that runs no worker
    THREADS = "threads"    # trainer rank 0 with rollout.embedded_workers worker threads
    PROCESS = "process"    # a rollout process: one worker on a one-process engine
    LEADER = "leader"      # the first rank of an engine of n > 1 ranks: the worker
    FOLLOWER = "follower"  # another rank of that engine: replays the leader's engine calls

    @property
    def rollout_process(self) -> bool:
        """Whether the process is a rollout process (it never trains)."""
        return self in (WorkerMode.PROCESS, WorkerMode.LEADER, WorkerMode.FOLLOWER)


def worker_mode(cfg: RLConfig, rank: int, world: int) -> WorkerMode:
    """Process `rank` of a launch of `world` processes: its part in the rollouts, as in the module's table."""
    if cfg.role == "trainer" or (cfg.role == "auto" and rank < cfg.trainer_ranks):
        embedded = cfg.role == "auto" and cfg.trainer_ranks == world and rank == 0
        return WorkerMode.THREADS if embedded else WorkerMode.NONE
    size = cfg.rollout.engine_ranks
    if size == 1 or cfg.rollout.backend == "vllm":  # a vLLM data-parallel rank is a worker of its own
        return WorkerMode.PROCESS
    first = cfg.trainer_ranks if cfg.role == "auto" else 0
    return WorkerMode.LEADER if (rank - first) % size == 0 else WorkerMode.FOLLOWER


def make_worker(cfg: RLConfig, name: str, tokenizer, tasks, seed: int, stops_since: float | None = None,
                model: torch.nn.Module | None = None, engine_group=None, dp_rank: tuple | None = None
                ) -> RolloutWorker:
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
                         chat_format=load_chat_format(cfg.data.chat_format, tokenizer), dp_rank=dp_rank)


def start_worker_threads(cfg: RLConfig, tokenizer, tasks, n: int) -> list[tuple[RolloutWorker, threading.Thread]]:
    """Way 1: `n` workers, each running in a daemon thread of this (trainer) process."""
    started = []
    for i in range(n):
        w = make_worker(cfg, f"embedded{i}", tokenizer, tasks, cfg.train.seed + 1000 + i)
        t = threading.Thread(target=w.run, name=f"rollout-{i}", daemon=True)
        t.start()
        started.append((w, t))
    return started


def run_worker_process(cfg: RLConfig, rank: int, world: int = 1) -> None:
    """Ways 2 to 4: this rollout process's worker, or its part of an engine of several ranks, until the run
    stops."""
    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.rollout.tasks import load_rl_tasks

    mode = worker_mode(cfg, rank, world)
    if not mode.rollout_process:
        raise ValueError(f"process {rank} of {world} is a trainer rank ({mode.value}), not a rollout process")
    # Launched together with the trainer (role=auto): a STOP left by a previous launch of this run.dir is not for
    # this worker (the resuming trainer removes it at start, possibly after this worker looked).
    started = time.time() if cfg.role == "auto" else None
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    tasks = load_rl_tasks(cfg.data.tasks)
    name = os.environ.get("RL_WORKER_NAME")
    name = f"rank{rank}" if name is None else (f"{name}x{rank}" if world > 1 else name)
    seed = cfg.train.seed + 1000 + rank
    if mode is WorkerMode.PROCESS:
        dp_rank = None
        if cfg.rollout.vllm_layout == "dp_attention":  # (rank in its engine, the engine's index on the node)
            # an engine's ranks are consecutive processes of one node: next to the trainer (one node) or a
            # separate launch's processes on each node
            local = rank - cfg.trainer_ranks if cfg.role == "auto" else int(os.environ.get("LOCAL_RANK", rank))
            dp_rank = (local % cfg.rollout.ep, local // cfg.rollout.ep)
        make_worker(cfg, name, tokenizer, tasks, seed, stops_since=started, dp_rank=dp_rank).run()
        return
    groups, engine_group, engine_rank = init_rollout_group(cfg, rank, world)
    try:
        model = rollout_model(cfg, tokenizer, groups)
        if mode is WorkerMode.LEADER:
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
                              "joins the rollout ranks); use torchrun, or launch the rollouts separately with "
                              "role=rollout")
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
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
