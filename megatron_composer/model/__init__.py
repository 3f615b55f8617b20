"""One model definition for continued pretraining, SFT, RL and inference."""

from .args import ModelConfig, ModelConfigError, RopeScaling
from .model import ModelOutput, MTPModule, Transformer, TransformerBlock
from .presets import PRESETS, count_parameters, get_preset

__all__ = [
    "ModelConfig", "ModelConfigError", "RopeScaling", "ModelOutput", "MTPModule", "Transformer",
    "TransformerBlock", "PRESETS", "count_parameters", "get_preset",
]
