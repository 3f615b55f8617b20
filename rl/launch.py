"""Roles to processes: what `rl_composer.py` runs on every process of an RL launch.

Ranks 0 .. trainer_ranks-1 are the Trainer role (rl/trainer.py; rank 0 also runs the orchestrator role and
publishes the weights) and form torch.distributed's default process group, cut into the pretraining
layouts; every other rank is a rollout process (rl/rollout/launch.py), which never joins that group. When
the launch leaves no rollout rank (one process, or trainer_ranks = world size) trainer rank 0 runs
``rollout.embedded_workers`` worker threads. Separate launches (clusters) run the same entrypoint with
``role=trainer`` or ``role=rollout``; they meet only through run.dir's rollout queue and the weight store.
Which of these a process is comes from one function, `rl.rollout.launch.worker_mode` (its module has the table
of the ways a rollout worker runs); `run_rl` acts on its answer.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_composer.config import ConfigError
from megatron_composer.parallel.dims import ParallelDims
from rl.config import RLConfig
from rl.model import build_model_meta
from rl.rollout.launch import WorkerMode, run_worker_process, worker_mode
from rl.trainer import Trainer


def check_model_layout(cfg: RLConfig) -> None:
    """The model against the trainer layout (heads, vocabulary, experts divisible), on every rank before any
    work, so a bad layout stops rollout ranks too."""
    from megatron_composer.data.tokenizer import load_tokenizer

    trainer = cfg.role != "rollout" and max(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.ep) > 1
    rollout = cfg.role != "trainer" and cfg.rollout.engine_ranks > 1
    if not (trainer or rollout):
        return
    from megatron_composer.parallel import validate_layout

    mc, _ = build_model_meta(cfg, load_tokenizer(cfg.data.tokenizer))
    if trainer:
        validate_layout(ParallelDims.from_config(cfg.parallel, cfg.trainer_ranks), mc)
    if rollout:
        tp, ep = cfg.rollout.tp, cfg.rollout.ep
        if mc.tie_word_embeddings and tp > 1:
            raise ConfigError(f"rollout.tp={tp}: tensor parallelism does not support tied embeddings "
                              "(model tie_word_embeddings); set rollout.tp=1")
        try:
            validate_layout(ParallelDims(tp * ep, tp=tp, ep=ep), mc, section="rollout")
        except ConfigError as e:
            raise ConfigError(f"rollout.tp={tp} rollout.ep={ep}: {e}") from None


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


def check_chat_format(cfg: RLConfig) -> None:
    """data.chat_format against the tokenizer directory (its template, its end-of-turn token), before any work."""
    from megatron_composer.data.chat_format import load_chat_format
    from megatron_composer.data.chat_template import ChatFormatError
    from megatron_composer.data.tokenizer import load_tokenizer

    if not Path(cfg.data.tokenizer).exists():
        return  # load_tokenizer's own error comes where the tokenizer is first needed
    try:
        load_chat_format(cfg.data.chat_format, load_tokenizer(cfg.data.tokenizer))
    except ChatFormatError as e:
        raise ConfigError(f"data.chat_format: {e}") from None


def run_rl(cfg: RLConfig) -> Path | None:
    cfg.validate()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg.check_runnable(world)
    check_model_layout(cfg)
    check_chat_format(cfg)
    if cfg.rollout.backend == "vllm" and cfg.role != "trainer":
        from megatron_composer.data.tokenizer import load_tokenizer
        from megatron_composer.inference.vllm_engine import VLLMError, cpu_serving_problem, require_vllm

        if (why := cpu_serving_problem(build_model_meta(cfg, load_tokenizer(cfg.data.tokenizer))[0])) is not None:
            raise ConfigError(f"rollout.backend=vllm: {why}")
        try:
            require_vllm()
        except VLLMError as e:
            raise ConfigError(str(e)) from None
    mode = worker_mode(cfg, rank, world)  # the process's part in the rollouts (rl/rollout/launch.py's table)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    if mode.rollout_process:
        run_worker_process(cfg, rank, world)
        return None
    created = init_trainer_group(cfg, rank, world)
    try:
        trainer = Trainer(cfg)
        if mode is WorkerMode.THREADS:
            trainer.start_embedded_workers(cfg.rollout.embedded_workers)
        return trainer.fit()
    finally:
        if created:
            dist.destroy_process_group()
