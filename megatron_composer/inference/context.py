"""The inference context the engine passes to the model's own modules (as Megatron's `inference_context`):
where the new tokens sit (positions, cache slots to write and read), the paged KV cache, and the mode.

A forward pass over new tokens is `model(ids_BN, ctx.pos_BN, inference_context=ctx, ...)`: every attention
module writes its keys/values (MLA: the latent row) for the valid rows and attends over the sequence's cached
positions through this object; everything else (norms, projections, the router, the MoE dispatch hook,
MTP) is the training forward's code. The attention math over the cache lives in kernels/paged_attention.py
(MLA in the latent space, GQA without repeated kv heads); in batch-invariant mode attention instead expands
the cache as training does and attends one query row at a time (`attend_row`), so engine and trainer
log-probabilities agree bit for bit.

Rows past a sequence's new tokens are padding: they attend (to keep shapes rectangular) but are never
written to the cache and their outputs are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_composer.kernels.paged_attention import (
    absorbed_attention,
    absorbed_kernel,
    causal_bias,
    expand_bias,
    grouped_attention,
    latent_attention,
)

from .batch_invariant import attend_row
from .kv_cache import PagedKVCache


@dataclass
class InferenceContext:
    """New tokens [B, N] at positions pos_BN of B sequences, their cache and the attention mode."""
    cache: PagedKVCache
    ids_BN: torch.Tensor                 # 0 in padding rows
    pos_BN: torch.Tensor
    read_slots_BL: torch.Tensor          # cache slot of every position 0..L-1 of each sequence
    lengths: list[int]
    starts: list[int]
    write_slots_T: torch.Tensor          # slots of the valid rows only
    rows_T: Optional[torch.Tensor]       # flat indices of the valid rows (None: every row is valid)
    last_T: Optional[torch.Tensor]       # flat index of each sequence's last valid row (None: the last column)
    batch_invariant: bool = False
    _bias: Optional[torch.Tensor] = None
    _read_flat: Optional[torch.Tensor] = None

    @property
    def absorbed(self) -> bool:
        """MLA attends in the latent space (not in batch-invariant mode, which expands as training does)."""
        return not self.batch_invariant

    # ---- layout -----------------------------------------------------------------------------------------
    def last_rows(self, x_BN_: torch.Tensor) -> torch.Tensor:
        """Each sequence's last valid row [B, ...]."""
        if self.last_T is None:
            return x_BN_[:, -1]
        return x_BN_.reshape(-1, *x_BN_.shape[2:]).index_select(0, self.last_T)

    def valid_rows(self, x_BN_: torch.Tensor) -> torch.Tensor:
        flat = x_BN_.reshape(-1, *x_BN_.shape[2:])
        return flat if self.rows_T is None else flat.index_select(0, self.rows_T)

    def bias_BNL(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias (0 or -inf), made once per forward and shared by its layers."""
        if self._bias is None or self._bias.dtype != dtype:
            self._bias = causal_bias(self.pos_BN, self.read_slots_BL.shape[1], dtype)
        return self._bias

    def read_slots_flat(self) -> torch.Tensor:
        if self._read_flat is None:
            self._read_flat = self.read_slots_BL.reshape(-1)
        return self._read_flat

    # ---- cache --------------------------------------------------------------------------------------------
    def write(self, layer: int, *values_BN_: torch.Tensor) -> None:
        """Store the valid rows' cache entries of attention layer `layer`."""
        self.cache.write(layer, self.write_slots_T, *(self.valid_rows(v) for v in values_BN_))

    def gather(self, layer: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The cached entries [B, L, ...] of every position each sequence may attend to."""
        return [t.to(dtype) for t in self.cache.read(layer, self.read_slots_BL, self.read_slots_flat())]

    # ---- attention ----------------------------------------------------------------------------------------
    def attend(self, q_BNHD: torch.Tensor, k_BLKD: torch.Tensor, v_BLKD: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the new queries over gathered keys/values (k/v may have fewer heads); [B, N, H, Dv]."""
        if not self.batch_invariant:
            return grouped_attention(q_BNHD, k_BLKD, v_BLKD, self.bias_BNL(q_BNHD.dtype), scale)
        B, N, H, _ = q_BNHD.shape
        if k_BLKD.shape[2] != H:
            rep = H // k_BLKD.shape[2]
            k_BLKD, v_BLKD = k_BLKD.repeat_interleave(rep, dim=2), v_BLKD.repeat_interleave(rep, dim=2)
        q_BHND, k_BHLD, v_BHLD = q_BNHD.transpose(1, 2), k_BLKD.transpose(1, 2), v_BLKD.transpose(1, 2)
        o_BHND = q_BHND.new_zeros(B, H, N, v_BHLD.shape[-1])
        for b in range(B):  # one query row at a time over exactly its keys, as the training forward in this mode
            for r in range(self.lengths[b]):
                stop = self.starts[b] + r + 1
                o_BHND[b, :, r:r + 1] = attend_row(q_BHND[b, :, r:r + 1], k_BHLD[b, :, :stop], v_BHLD[b, :, :stop],
                                                   scale)
        return o_BHND.transpose(1, 2)

    def attend_absorbed(self, layer: int, q_BNHD: torch.Tensor, kv_new_BNX: torch.Tensor, w_kv_HDC: torch.Tensor,
                        nope_dim: int, scale: float) -> torch.Tensor:
        """MLA in its absorbed form (kernels/paged_attention.py absorbed_attention): writes the new latent rows
        kv_new [B, N, C + R] of layer `layer`, attends q [B, N, H, Dn + R] over the cache; returns [B, N, H * Dv]."""
        cache = self.cache.layers[layer][0]
        kernel = absorbed_kernel(q_BNHD, cache)
        if kernel is not None:
            return kernel.absorbed_attention(q_BNHD, kv_new_BNX, w_kv_HDC, cache, self.write_slots_T, self.rows_T,
                                             self.read_slots_BL, self.pos_BN, scale)
        self.write(layer, kv_new_BNX)
        return absorbed_attention(q_BNHD, w_kv_HDC, nope_dim,
                                  lambda q_BMX: self.attend_latent(layer, q_BMX, scale, w_kv_HDC.shape[2]))

    def attend_latent(self, layer: int, q_BMX: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
        """MLA in the latent space over layer `layer`'s cache rows: [B, N * H, C + R] query rows -> [B, N * H, C]."""
        H = q_BMX.shape[1] // self.pos_BN.shape[1]
        bias = None
        if q_BMX.device.type != "cpu" or q_BMX.dtype != torch.float32 or self.pos_BN.shape[1] > 4:
            bias = expand_bias(self.bias_BNL(q_BMX.dtype), H)
        return latent_attention(q_BMX, self.cache.layers[layer][0], self.read_slots_BL, self.pos_BN, scale,
                                latent_dim, bias)


__all__ = ["InferenceContext"]
