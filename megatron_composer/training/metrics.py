"""Metrics sinks: metrics.jsonl (always), a console line every N steps, TensorBoard and W&B when enabled."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class LoggingConfig:
    interval: int = field(default=10, metadata={"help": "console line every N steps (metrics.jsonl gets every step)"})
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "megatron-composer"
    wandb_mode: str = field(
        default="offline", metadata={"help": "offline unless you set online and have a key configured"})


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux
    except ImportError:
        return float("nan")


class MetricsLogger:
    """Rank 0 writes; other ranks hold a disabled logger so callers need no rank checks."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, enabled: bool, run_config: dict | None = None):
        self.cfg = cfg
        self.enabled = enabled
        self.console_keys: list[str] = []  # more numbers for the console line (e.g. evaluation probes)
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                print("logging.tensorboard=true but tensorboard is not installed (pip install tensorboard); "
                      "skipping it")
        if cfg.wandb:
            try:
                import wandb

                os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
                self._wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=run_config, resume="allow")
            except ImportError:
                print("logging.wandb=true but wandb is not installed (pip install wandb); skipping it")

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines for steps after the checkpoint so the file reads as one uninterrupted run."""
        if not self.enabled:
            return
        path = Path(self._file.name)
        self._file.close()
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
        path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict, console: bool = False) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) or torch.is_tensor(v) else v)
                                   for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, float) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if console:
            print(format_console(record, self.console_keys), flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_console(r: dict, extra: list[str] = ()) -> str:
    def f(key, fmt):
        v = r.get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    parts = [f"step {r['step']}"]
    for key, label, fmt in (
        ("loss", "loss", "{:.4f}"), ("val_loss", "val", "{:.4f}"), ("lr", "lr", "{:.2e}"),
        ("grad_norm", "gnorm", "{:.3f}"), ("tokens_per_s", "tok/s", "{:.0f}"), ("mfu", "mfu", "{:.2%}"),
        ("mtp1_top1", "mtp1@1", "{:.3f}"), ("memory_gb", "mem", "{:.2f}GB"),
    ):
        s = f(key, fmt)
        if s is not None:
            parts.append(f"{label} {s}")
    parts += [f"{key} {f(key, '{:.4g}')}" for key in extra if f(key, "{}") is not None]
    if r.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)
