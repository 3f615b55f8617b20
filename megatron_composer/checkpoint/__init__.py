"""Checkpoints: distributed save/load with resharding (dcp) and HF safetensors import/export (hf)."""

from megatron_composer.checkpoint.dcp import (
    CheckpointError,
    find_latest,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)

__all__ = ["CheckpointError", "find_latest", "load_checkpoint", "resolve_checkpoint", "save_checkpoint"]
