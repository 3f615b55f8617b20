"""Inference engine on the shared model: KV-cached continuous batching, exact log-probs, routing capture,
MTP speculative decoding, live weight updates, and an OpenAI-compatible server (inference.server)."""

from .batch_invariant import BatchInvariantMode, attend_row, batch_invariant
from .engine import Engine, EngineError, GenerationResult
from .kv_cache import CacheError, PagedKVCache
from .lockstep import Lockstep, follow
from .sampling import SamplingError, SamplingParams

__all__ = [
    "BatchInvariantMode", "attend_row", "batch_invariant", "Engine", "EngineError", "GenerationResult",
    "CacheError", "PagedKVCache", "Lockstep", "follow", "SamplingError", "SamplingParams",
]
