"""Config sections every training run shares (pretraining, SFT and RL), and the model they describe.

A run's schema (pretrain.trainer.PretrainConfig, rl.config.RLConfig) is built from these sections plus its
own data and train sections: `run`, `model`, `checkpoint` here, `parallel` (megatron_composer.parallel.dims),
`optim` (training.optim), `logging` (training.metrics), `fp8` (megatron_composer.fp8) and `qat`
(training.qat). `model_config`
turns the model section into the ModelConfig the trainers, rollout engines and evaluation build; a
checkpoint's `architecture` is what must match for weights to load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_composer.checkpoint.dcp import saved_architecture
from megatron_composer.config import ConfigError, to_dict
from megatron_composer.fp8.config import FP8Config
from megatron_composer.parallel.dims import ParallelConfig
from megatron_composer.training.metrics import LoggingConfig
from megatron_composer.training.optim import OptimizerConfig
from megatron_composer.training.qat import QATConfig


@dataclass
class RunConfig:
    dir: str = field(
        default="runs/default",
        metadata={"help": "outputs; running again with the same dir resumes from its latest checkpoint"})


@dataclass
class ModelSection:
    preset: str = field(default="tiny-deepseek-v3", metadata={"help": "megatron_composer.model preset name"})
    vocab_size: int = field(
        default=0, metadata={"help": "0: the tokenizer's vocab size rounded up to a multiple of 64"})
    yarn_original_length: int = field(
        default=0,
        metadata={"help": ">0 turns on YaRN with factor data.seq_length / this (the previous stage's context)"})
    overrides: dict = field(default_factory=dict, metadata={"help": "any ModelConfig field, e.g. {num_layers: 2}"})


@dataclass
class CheckpointConfig:
    interval: int = field(default=100, metadata={"help": "save every N steps (and at the end)"})
    keep_last: int = field(default=3, metadata={"help": "checkpoints kept (0 keeps all)"})
    init_from: str = field(
        default="", metadata={"help": "fresh runs load model weights from this run dir or checkpoint; "
                                      "'previous' = the previous stage of a chain"})
    async_save: bool = field(
        default=False, metadata={"help": "write checkpoints in the background (DCP async save after a host copy); "
                                         "each becomes `latest` at the next save or at the end of the run"})


# Fields that do not change parameter shapes: a stage may change them and still load the previous weights.
# rope_scaling is architecture: what the weights learned (checked on load, inherited by later stages).
_NON_ARCH_FIELDS = {"max_position_embeddings", "init_std", "aux_loss_coef", "rope_theta", "routed_scaling_factor"}


def model_config(cfg, tokenizer, weights=None):
    """The ModelConfig of a run config `cfg` (its `model` section; `data.seq_length` is the context YaRN
    stretches to), with the vocabulary sized for `tokenizer`. ``weights`` (a checkpoint directory the run
    resumes or starts from) gives the rope scaling it inherits (megatron_composer.model.args.stage_rope_scaling)."""
    from megatron_composer.model import ModelConfig, RopeScaling, get_preset

    mc = get_preset(cfg.model.preset)
    overrides = dict(cfg.model.overrides)
    if isinstance(overrides.get("rope_scaling"), dict):
        overrides["rope_scaling"] = RopeScaling(**overrides["rope_scaling"])
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"model.overrides has unknown ModelConfig field(s) {sorted(unknown)}")
    vocab = cfg.model.vocab_size or -(-tokenizer.vocab_size // 64) * 64
    mc = dataclasses.replace(mc, vocab_size=vocab, **overrides)
    if cfg.model.yarn_original_length:
        old = cfg.model.yarn_original_length
        base = mc.rope_scaling or RopeScaling()
        mc = dataclasses.replace(
            mc,
            rope_scaling=dataclasses.replace(base, factor=cfg.data.seq_length / old,
                                             original_max_position_embeddings=old),
            max_position_embeddings=max(mc.max_position_embeddings, cfg.data.seq_length),
        )
    saved = saved_architecture(weights) if weights is not None else None
    if saved is not None and "rope_scaling" in saved:
        from megatron_composer.model.args import stage_rope_scaling

        rope = RopeScaling(**saved["rope_scaling"]) if saved["rope_scaling"] else None
        mc = dataclasses.replace(mc, rope_scaling=stage_rope_scaling(mc.rope_scaling, cfg.data.seq_length, rope))
    tokenizer.check_fits_model(mc.vocab_size)
    return mc.validate()


def architecture(mc) -> dict:
    return {k: v for k, v in to_dict(mc).items() if k not in _NON_ARCH_FIELDS}


def checkpoint_meta(mc, tokenizer) -> dict:
    """What a checkpoint records and checks on load: the architecture and the tokenizer."""
    return {"model": architecture(mc), "tokenizer": tokenizer.describe()}


__all__ = ["CheckpointConfig", "FP8Config", "LoggingConfig", "ModelSection", "OptimizerConfig", "ParallelConfig",
           "QATConfig", "RunConfig", "architecture", "checkpoint_meta", "model_config"]
