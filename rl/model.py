"""The RL run's model config as the trainer, rollout workers and evaluation read it, and the models built from
it: by training's one builder (megatron_composer.training.core.build_model: the trainer's shards, `full_model`)
or the inference engine's loader (inference.loading.engine_model: `rollout_model`).

The model section is the pretraining one (megatron_composer.training.config.model_config); its context for
YaRN is data.seq_length, or rollout.max_seq_len when that is 0.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_composer.checkpoint.dcp import CheckpointError
from megatron_composer.training.config import checkpoint_meta, model_config
from megatron_composer.training.core import local_device, starting_checkpoint
from rl.config import RLConfig


def rl_model_config(cfg: RLConfig, tokenizer):
    """The policy's ModelConfig, with the rope scaling of the weights the run resumes (run.dir) or starts from
    (checkpoint.init_from) when that checkpoint is readable here."""
    seq_length = cfg.data.seq_length or cfg.rollout.max_seq_len
    try:
        weights = starting_checkpoint(cfg.run.dir, cfg.checkpoint.init_from)
    except CheckpointError:
        weights = None  # a trainer fails on loading it; a rollout host without it keeps the configured rope
    return model_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_length=seq_length)), tokenizer,
                        weights=weights)


def build_model_meta(cfg: RLConfig, tokenizer):
    """The run's ModelConfig and the checkpoint meta its checkpoints carry."""
    mc = rl_model_config(cfg, tokenizer)
    return mc, checkpoint_meta(mc, tokenizer)


def full_model(cfg: RLConfig, tokenizer, seed: int = 0, checkpoint=None) -> tuple[torch.nn.Module, dict]:
    """The whole model of the run in one process (evaluation, tools, tests) and its checkpoint meta: the weights of
    `checkpoint` (a checkpoint directory) when given, else the seeded initialisation (= torch.manual_seed(seed);
    Transformer(mc))."""
    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.training.core import InitialWeights, build_model
    from megatron_composer.training.layout import Layout

    mc, meta = build_model_meta(cfg, tokenizer)
    init = InitialWeights(checkpoint=checkpoint) if checkpoint is not None else None
    model = build_model(mc, Layout(ParallelConfig(), distributed=False), torch.device("cpu"), FP8Config(), seed=seed,
                        init=init, meta=meta)
    return model, meta


def rollout_model(cfg: RLConfig, tokenizer, groups=None) -> torch.nn.Module:
    """This rank's shard of a rollout engine's model (the whole model without `groups`), built on the meta device,
    laid out and allocated in weight_sync.dtype on this process's device, holding no weights yet: the worker
    loads the first published version per rank (each rank reads only its slices of it,
    RolloutWorker.wait_for_weights)."""
    from megatron_composer.inference.loading import engine_model

    mc, _ = build_model_meta(cfg, tokenizer)
    dtype = getattr(torch, cfg.weight_sync.dtype)
    if cfg.rollout.backend == "vllm":  # vLLM holds the weights; this model only names them (no memory)
        from megatron_composer.model import Transformer

        with torch.device("meta"):
            return Transformer(mc).to(dtype)
    return engine_model(mc, None, groups, dtype=dtype, device=local_device(), seed=cfg.train.seed)


__all__ = ["build_model_meta", "full_model", "rl_model_config", "rollout_model"]
