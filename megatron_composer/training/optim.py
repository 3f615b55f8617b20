"""AdamW (torch, or data-parallel with ZeRO-1) and learning-rate schedules (linear warmup, then cosine or
warmup-stable-decay)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_composer.config import ConfigError


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = field(default=3e-5, metadata={"help": "floor reached at the end of the decay"})
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = field(default=1.0, metadata={"help": "max global grad norm (0 disables clipping)"})
    schedule: Literal["cosine", "wsd", "constant"] = field(
        default="cosine", metadata={"help": "after warmup: cosine decay, warmup-stable-decay, or constant"})
    warmup_steps: int = 100
    decay_fraction: float = field(
        default=0.2, metadata={"help": "wsd: fraction of steps spent in the final linear decay"})
    fused: bool = field(default=True, metadata={"help": "use torch's fused AdamW when the device supports it"})

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.lr={self.lr} / optim.min_lr={self.min_lr}: need lr > 0 and 0 <= min_lr <= lr")
        if not 0 <= self.decay_fraction <= 1:
            raise ConfigError(f"optim.decay_fraction={self.decay_fraction} must be in [0, 1]")


def _no_decay(name: str, p: torch.nn.Parameter) -> bool:
    # norms, biases and router biases are not decayed
    return p.ndim < 2 or "norm" in name or name.endswith(".bias")


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, groups=None, *, zero1: bool = False,
                    bucket_mb: float = 25.0):
    """torch AdamW for one process. Given the ParallelGroups of a multi-rank layout, a DistributedAdamW
    instead: it reduces the gradients itself (finish_grad_sync, in buckets of bucket_mb), clips them by the
    global norm, and with zero1 shards the AdamW moments over the data-parallel replicas."""
    if groups is not None:
        from megatron_composer.parallel.data_parallel import DistributedAdamW

        return DistributedAdamW(model.named_parameters(), groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, zero1=zero1, bucket_mb=bucket_mb,
                                decay_filter=lambda name, p: not _no_decay(name, p))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device = next(model.parameters()).device
    fused = cfg.fused and device.type in ("cuda", "cpu") and all(p.dtype == torch.float32 for p in decay + no_decay)
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    # wsd: hold lr, then decay linearly to min_lr over the last decay_fraction of training
    decay_steps = int(round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return cfg.lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
