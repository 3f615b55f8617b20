"""An engine rank's model, loaded per rank: built on the meta device, laid out, allocated, and filled with only
the slices this rank holds.

`engine_model(cfg, source, groups)` builds `Transformer(cfg)` on the meta device (nothing allocated), applies the
engine's layout with the library's own `parallelize_model` (tensor parallel: heads, FFN columns, vocabulary;
expert parallel: the routed experts), casts it, allocates this rank's shards (`to_empty`, keeping the
ShardSpecs) and has the source fill them. Which box of each full tensor a rank holds is
parallel/slices.py's one definition (`local_pieces`). Sources:

* `HFWeights(path)`: a Hugging Face directory (sharded safetensors); checkpoint/hf.py's `HFReader` reads each
  box with `safe_open(...).get_slice`, so only this rank's bytes are read (FP8 dequantised on the box).
* `CheckpointWeights(path)`: a training checkpoint (torch.distributed.checkpoint); checkpoint/dcp.py's
  `load_checkpoint` loads into DTensor views of the local shards, so DCP reads, per stored chunk, the part
  that overlaps this rank's shard (a chunk is read whole, then narrowed: one stored chunk at a time).
* `BoxWeights(read)`: any reader of boxes of full tensors, `read(name, box) -> tensor` (a weight-sync version:
  rl.weight_sync's `VersionReader`, which decodes only the compressed chunks a box's elements lie in).

Tensors a source may lack keep the seeded initialisation of the one-process model (HF: MTP depths the hub
export dropped, a routing bias). No rank builds the full model; the HF and box readers return one box at a
time, so a rank holds its shards plus one slice (the weight-sync reader: plus the flat span of one tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from megatron_composer.model import ModelConfig, Transformer
from megatron_composer.model.moe import Router
from megatron_composer.parallel.layers import to_empty
from megatron_composer.parallel.slices import fill_local

BoxReader = Callable[[str, tuple], torch.Tensor]


class WeightSource(Protocol):
    def fill(self, model: torch.nn.Module, groups) -> None:
        """Fill this rank's allocated shards of `model` (laid out over `groups`, None for one rank)."""


@dataclass(frozen=True)
class HFWeights:
    """A Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""
    path: str | Path

    def fill(self, model: torch.nn.Module, groups) -> None:
        from megatron_composer.checkpoint.hf import HFReader, load_hf_shards
        from megatron_composer.training.core import init_reader

        load_hf_shards(model, HFReader(self.path, model.config), progress=False, init=init_reader(model))


@dataclass(frozen=True)
class CheckpointWeights:
    """A training checkpoint directory (or a run directory: its latest checkpoint), saved in any layout;
    `meta`, when given, is the checkpoint meta its architecture is checked against."""
    path: str | Path
    meta: Optional[dict] = None

    def fill(self, model: torch.nn.Module, groups) -> None:
        from megatron_composer.checkpoint.dcp import load_checkpoint, resolve_checkpoint

        load_checkpoint(resolve_checkpoint(self.path), model, None, self.meta, restore_rng=False, groups=groups)


@dataclass(frozen=True)
class BoxWeights:
    """A reader of boxes of the full tensors: read(name, box) returns box (a tuple of slices) of tensor `name`."""
    read: BoxReader

    def fill(self, model: torch.nn.Module, groups) -> None:
        fill_local(model, self.read)


def hf_config(path: str | Path) -> tuple[ModelConfig, torch.dtype]:
    """The model config of a Hugging Face checkpoint directory (its MTP depths: those it holds) and the dtype
    load_hf_checkpoint gives it (the checkpoint's; bfloat16 for FP8 weights)."""
    from megatron_composer.checkpoint.hf import HFReader, checkpoint_dtype

    reader = HFReader(path)
    return reader.config, checkpoint_dtype(reader.hf_config)


def engine_model(cfg: ModelConfig, source: Optional[WeightSource], groups=None, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", float32_router: bool = False, seed: int = 0) -> Transformer:
    """This rank's shard of the model for an engine laid out over `groups` (tp / ep; None: one rank), in `dtype` on
    `device`, filled by `source` reading only this rank's slices. source=None allocates without filling (the
    weights arrive later, e.g. a rollout worker's first weight version through Engine.update_weights).
    float32_router keeps the routers in float32 (as load_hf_checkpoint does). `seed` draws the init seed of
    tensors a source may lack (torch.manual_seed(seed); Transformer(cfg), as training's build_model)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg)
    if groups is not None and (groups.dims.tp > 1 or groups.dims.ep > 1):
        from megatron_composer.parallel.parallelize import parallelize_model

        model = parallelize_model(model, groups)
    model = model.to(dtype)
    if float32_router:
        for module in model.modules():
            if isinstance(module, Router):
                module.float()
    to_empty(model, device)
    if source is not None:
        with torch.no_grad():
            source.fill(model, groups)
    model.reset_buffers()
    return model.eval()


__all__ = ["BoxWeights", "CheckpointWeights", "HFWeights", "WeightSource", "engine_model", "hf_config"]
