"""The RL run's config schema and its checks (before any work), and where the run's weights are published.

The sections every training run shares (run, model, checkpoint, parallel, optim, logging, fp8) come from
megatron_composer.training.config; the RL ones from their rooms: rl (rl.algorithm), rollout
(rl.rollout.config), weight_sync (rl.weight_sync); data, train and eval are defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_composer.config import ConfigError
from megatron_composer.parallel.dims import ParallelDims
from megatron_composer.training.config import (
    CheckpointConfig,
    FP8Config,
    LoggingConfig,
    ModelSection,
    OptimizerConfig,
    ParallelConfig,
    QATConfig,
    RunConfig,
)
from rl.algorithm import RLObjectiveConfig
from rl.rollout.config import RolloutConfig
from rl.weight_sync import ObjectStore, WeightSyncConfig


@dataclass
class RLDataConfig:
    tasks: str = field(default="examples/tiny/rl_tasks", metadata={
        "help": "task directory: tasks.jsonl and/or Harbor task folders"})
    tokenizer: str = field(default="data/tiny/tokenizer", metadata={"help": "tokenizer file or directory"})
    chat_format: str = field(default="auto", metadata={
        "help": "how prompts render and turns parse: auto (the tokenizer directory's "
                "chat template, else chatml), chatml, or the template's tool-call "
                "family: kimi_k2, deepseek_v3, deepseek_v31, hermes"})
    seq_length: int = field(default=0, metadata={
        "help": "context of the stage the weights come from; the rope scaling is the "
                "weights' own (inherited from the checkpoint), else YaRN factor = this / "
                "model.yarn_original_length; 0 = rollout.max_seq_len"})


@dataclass
class RLTrainConfig:
    steps: int = field(default=100, metadata={
        "help": "optimizer steps (fewer if the single epoch of prompts ends first)"})
    seed: int = 1234
    groups_per_step: int = field(default=2, metadata={
        "help": "prompts (groups of rollout.group_size episodes) per step"})
    micro_batch_size: int = field(default=8, metadata={"help": "sequences per forward pass"})
    max_skipped_steps: int = 20


@dataclass
class HeldOutEvalConfig:
    tasks: str = field(default="", metadata={
        "help": "held-out task directory evaluated during the run by the rollout workers "
                "(each loads it); empty = off"})
    interval: int = field(default=0, metadata={"help": "evaluate every N steps (0 = off)"})
    samples: int = field(default=4, metadata={"help": "samples per task (K of pass@K)"})
    at_start: bool = field(default=False, metadata={
        "help": "also evaluate the starting weights, logged as step 0 (the curve's origin)"})
    success_reward: float = field(default=1.0, metadata={"help": "a sample passes when its reward is at least this"})


@dataclass
class RLConfig:
    run: RunConfig = field(default_factory=RunConfig)
    role: Literal["auto", "trainer", "rollout"] = field(default="auto", metadata={
        "help": "auto: ranks below trainer_ranks train, the others roll out; separate launches pick one"})
    trainer_ranks: int = field(default=1, metadata={
        "help": "processes that train (ranks 0..N-1, laid out by parallel.*); role=trainer: all of the launch's"})
    model: ModelSection = field(default_factory=ModelSection)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    rl: RLObjectiveConfig = field(default_factory=RLObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    qat: QATConfig = field(default_factory=QATConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: HeldOutEvalConfig = field(default_factory=HeldOutEvalConfig)

    def validate(self) -> "RLConfig":
        self.optim.validate()
        self.rl.validate()
        self.rollout.validate()
        self.parallel.validate()
        self.fp8.validate()
        self.qat.validate()
        from megatron_composer.data.chat_format import CHAT_FORMATS

        if self.data.chat_format not in CHAT_FORMATS:
            raise ConfigError(f"data.chat_format={self.data.chat_format!r} is not known; use one of "
                              f"{list(CHAT_FORMATS)}")
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
        tp, ep = self.rollout.tp, self.rollout.ep
        size = self.rollout.engine_ranks  # processes we launch per engine (one for vLLM, which starts its workers)
        what = f"rollout.tp x rollout.ep = {tp} x {ep}"
        if self.role == "rollout":
            if world % size:
                raise ConfigError(f"{what} = {size} processes per engine does not divide this launch's {world} "
                                  f"rollout process(es); launch a multiple of {size} (torchrun --nproc-per-node) or "
                                  "change them")
            return
        if self.role == "trainer" and n != world:
            raise ConfigError(f"role=trainer: all {world} process(es) of this launch train; set trainer_ranks={world} "
                              f"(got {n})")
        if n > world:
            raise ConfigError(f"trainer_ranks={n} but this launch has {world} process(es); launch at least {n} "
                              f"(torchrun --nproc-per-node) or lower trainer_ranks")
        if self.role == "auto" and n == world and self.rollout.embedded_workers < 1:
            raise ConfigError(f"trainer_ranks={n} leaves no rollout rank of the {world} and "
                              "rollout.embedded_workers=0: nothing would generate; launch more processes, lower "
                              "trainer_ranks, or use role=trainer with separately launched role=rollout workers")
        if self.role == "auto" and size > 1:
            if n == world:
                raise ConfigError(f"{what} needs rollout processes, but trainer_ranks={n} leaves none of the {world} "
                                  "(embedded worker threads run one-rank engines); launch more processes or set "
                                  "rollout.tp=1 rollout.ep=1")
            if (world - n) % size:
                raise ConfigError(f"{what} = {size} processes per engine does not divide the {world - n} rollout "
                                  f"rank(s) (world {world} - trainer_ranks {n}); launch trainer_ranks + a multiple of "
                                  f"{size} processes or change them")
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
