"""Paged KV cache: preallocated blocks of `block_size` token slots per attention layer, shared by all requests.

For MLA the cache holds what DeepSeek caches: the normed compressed latent c_kv [kv_lora_rank] and the
rotated rope key [qk_rope_head_dim] per token, side by side in one row [kv_lora_rank + qk_rope_head_dim]
(the latent attention scores both with one matmul), instead of 2 x heads x head_dim.
For GQA it holds k and v [num_kv_heads, head_dim].

Tensor parallelism: GQA caches this rank's kv heads (num_kv_heads / tp). MLA's latent and rope key belong
to every head, so each rank caches the whole row for its heads to attend to: sharding the latent's
channels instead would need a collective inside every attention (partial scores, then partial outputs),
for a cache that is already heads-times smaller than GQA's. Replication is what DeepSeek-style TP
serving does; data-parallel attention is the way to cut it.

Block 0 is a scratch block: padded rows of a batch write there and it is never read unmasked. A request
reserves the blocks for its whole budget (prompt + max_new_tokens + speculative slack) when it is admitted,
so a running request can never run out of cache and nothing needs preempting.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_composer.model import ModelConfig


class CacheError(ValueError):
    """The cache cannot hold what was asked of it; the message says what to raise or lower."""


def cache_entries_per_token(cfg: ModelConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """Shapes of the per-token tensors one attention layer caches (on one of tp tensor-parallel ranks)."""
    if cfg.attention == "mla":
        return [(cfg.kv_lora_rank + cfg.qk_rope_head_dim,)]
    kv = cfg.num_kv_heads or cfg.num_heads
    if kv % tp:
        raise CacheError(f"{kv} kv heads do not split over tp={tp}; change parallel.tp")
    return [(kv // tp, cfg.gqa_head_dim), (kv // tp, cfg.gqa_head_dim)]


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_layers: int, block_size: int, memory_bytes: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, tp: int = 1):
        if block_size < 1:
            raise CacheError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        shapes = cache_entries_per_token(cfg, tp)
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = num_layers * sum(math.prod(s) for s in shapes) * elem
        bytes_per_block = self.bytes_per_token * block_size
        budget_blocks = memory_bytes // bytes_per_block
        wanted_blocks = -(-max_tokens // block_size)
        num_blocks = min(budget_blocks, wanted_blocks) + 1  # + scratch block
        if num_blocks < 2:
            raise CacheError(f"cache_memory_bytes={memory_bytes} holds no block of {block_size} tokens "
                             f"({bytes_per_block} bytes); raise cache_memory_bytes")
        self.num_blocks = num_blocks
        slots = num_blocks * block_size
        # zeros, not empty: masked slots are multiplied by zero probabilities and must not hold NaN
        self.layers = [[torch.zeros(slots, *s, dtype=dtype, device=device) for s in shapes]
                       for _ in range(num_layers)]
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_tokens: int) -> Optional[list[int]]:
        """Blocks for num_tokens, or None when not enough are free right now."""
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def write(self, layer: int, slots_T: torch.Tensor, *values_T: torch.Tensor) -> None:
        for buf, val in zip(self.layers[layer], values_T):
            buf.index_copy_(0, slots_T, val if val.dtype == buf.dtype else val.to(buf.dtype))

    def read(self, layer: int, slots_BL: torch.Tensor, slots_flat: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Cached rows [B, L, ...] at slots_BL (slots_flat: the same, flattened, when the caller has it)."""
        # index_select on the flattened slots: a row copy per slot, several times faster than buf[slots_BL]
        flat = slots_BL.reshape(-1) if slots_flat is None else slots_flat
        return [buf.index_select(0, flat).view(*slots_BL.shape, *buf.shape[1:]) for buf in self.layers[layer]]
