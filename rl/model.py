"""The RL run's model as the trainer, rollout workers and evaluation build it.

The model section is the pretraining one (megatron_composer.training.config.model_config); its context for
YaRN is data.seq_length, or rollout.max_seq_len when that is 0.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_composer.training.config import checkpoint_meta, model_config
from megatron_composer.training.core import local_device
from rl.config import RLConfig


def rl_model_config(cfg: RLConfig, tokenizer):
    seq_length = cfg.data.seq_length or cfg.rollout.max_seq_len
    return model_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_length=seq_length)), tokenizer)


def build_model_meta(cfg: RLConfig, tokenizer):
    """The run's ModelConfig and the checkpoint meta its checkpoints carry."""
    mc = rl_model_config(cfg, tokenizer)
    return mc, checkpoint_meta(mc, tokenizer)


def build_model(cfg: RLConfig, tokenizer):
    """The full (unsharded) model of the run, as rollout workers and evaluation hold it, and its meta."""
    from megatron_composer.model import Transformer

    mc, meta = build_model_meta(cfg, tokenizer)
    return Transformer(mc), meta


def rollout_model(cfg: RLConfig, tokenizer, groups) -> torch.nn.Module:
    """This rank's shard of a tensor-parallel rollout engine's model (weights arrive from the store)."""
    from megatron_composer.parallel.parallelize import parallelize_model

    model, _ = build_model(cfg, tokenizer)
    model = parallelize_model(model.to(getattr(torch, cfg.weight_sync.dtype)), groups)  # shard on the host first
    return model.to(local_device()).eval()


__all__ = ["build_model", "build_model_meta", "rl_model_config", "rollout_model"]
