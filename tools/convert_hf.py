"""Convert between Hugging Face checkpoints and this project's model.

    # HF directory -> HF directory in our export's layout (e.g. an FP8 checkpoint to bf16), tensor by tensor;
    # --quantize int4-experts writes the routed experts in Kimi K2.5's INT4 (compressed-tensors pack-quantized)
    python tools/convert_hf.py HF_DIR --out OUT_DIR [--dtype bfloat16] [--shard-gb 4] [--quantize int4-experts]
    # HF directory -> logits parity against transformers on random tokens (float32)
    python tools/convert_hf.py HF_DIR --check
    # one of our training checkpoints (run dir or checkpoint dir) -> HF directory; on several ranks each
    # holds its shards of the model in the given layout and the export gathers one tensor at a time
    [torchrun --nproc-per-node N] python tools/convert_hf.py --checkpoint RUN_DIR --out OUT_DIR \
        [--fsdp] [--tp T] [--ep E]
    # a fresh model of a preset -> HF directory (e.g. to start from random weights)
    python tools/convert_hf.py --preset tiny-deepseek-v3 --out OUT_DIR

HF -> HF never builds the model: memory holds one output shard (--shard-gb) plus one tensor. Export writes
shards of --shard-gb and an index, each file as soon as it is full.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.checkpoint.hf import (  # noqa: E402
    CheckpointError,
    convert_hf_checkpoint,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from megatron_composer.config import ConfigError  # noqa: E402
from megatron_composer.model import ModelConfigError, Transformer, get_preset  # noqa: E402


def check_against_transformers(path: Path, ours: Transformer, tokens: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for module in ref.modules():  # compressed-tensors leaves dequantised INT4 experts in bf16: compute in float32
        for param in module.parameters(recurse=False):
            if param.dtype != torch.float32:
                param.data = param.data.float()
    ids = torch.randint(0, ours.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours.float().eval()(ids) - ref(ids).logits).abs().max().item()


def export_training_checkpoint(path: str, out: Path, max_shard_bytes: int, dtype, overwrite: bool, parallel: dict,
                               quantize: str | None = None) -> int:
    """Our checkpoint -> HF: the model is built in `parallel`'s layout (torchrun: every rank its shards), loads
    the checkpoint, and is written tensor by tensor. Returns the parameter count."""
    import torch.distributed as dist

    from megatron_composer.checkpoint.dcp import resolve_checkpoint
    from megatron_composer.config import load_config
    from megatron_composer.data.tokenizer import load_tokenizer
    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.training.config import architecture, model_config
    from megatron_composer.training.core import InitialWeights, build_model
    from megatron_composer.training.layout import Layout
    from pretrain.trainer import PretrainConfig

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    ckpt = resolve_checkpoint(path)
    cfg = load_config(PretrainConfig, ckpt.parent.parent / "config.yaml")
    mc = model_config(cfg, load_tokenizer(cfg.data.tokenizer), weights=ckpt)
    layout = Layout(ParallelConfig(**parallel))
    model = build_model(mc, layout, torch.device("cpu"), FP8Config(), seed=0, init=InitialWeights(checkpoint=ckpt),
                        meta={"model": architecture(mc)})
    save_hf_checkpoint(model, out, max_shard_bytes=max_shard_bytes, dtype=dtype, overwrite=overwrite,
                       groups=layout.groups if layout.world > 1 else None, progress=layout.rank == 0,
                       quantize=quantize)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", nargs="?", type=Path, help="Hugging Face checkpoint directory to import")
    p.add_argument("--preset", help="build a freshly initialised model of this preset instead of importing")
    p.add_argument("--checkpoint", help="one of our run directories or checkpoint directories to export")
    p.add_argument("--out", type=Path, help="write the model as a Hugging Face checkpoint here")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--check", action="store_true", help="compare logits with transformers (float32)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quantize", choices=["int4-experts"], default=None,
                   help="--out: write the routed experts in INT4 (compressed-tensors pack-quantized, group 32)")
    p.add_argument("--fsdp", action="store_true", help="--checkpoint on several ranks: shard parameters with FSDP")
    p.add_argument("--tp", type=int, default=1, help="--checkpoint on several ranks: tensor-parallel size")
    p.add_argument("--ep", type=int, default=1, help="--checkpoint on several ranks: expert-parallel size")
    args = p.parse_args(argv)
    if sum(x is not None for x in (args.hf_dir, args.preset, args.checkpoint)) != 1:
        p.error("give one of HF_DIR, --preset, --checkpoint")
    if not args.out and not args.check:
        p.error("give --out and/or --check")
    if args.check and args.hf_dir is None:
        p.error("--check needs HF_DIR")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    shard_bytes = int(args.shard_gb * (1 << 30))
    try:
        if args.checkpoint:
            n = export_training_checkpoint(args.checkpoint, args.out, shard_bytes, dtype, args.overwrite,
                                           dict(fsdp=args.fsdp, tp=args.tp, ep=args.ep), args.quantize)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"wrote {args.out} ({n / 1e6:.1f}M parameters on rank 0)")
            return 0
        if args.preset:
            torch.manual_seed(0)
            model = Transformer(get_preset(args.preset))
            if dtype:
                model.to(dtype)
            save_hf_checkpoint(model, args.out, max_shard_bytes=shard_bytes, overwrite=args.overwrite,
                               quantize=args.quantize)
            print(f"wrote {args.out}")
            return 0
        if args.check:
            model = load_hf_checkpoint(args.hf_dir, dtype=torch.float32)
            n = sum(p.numel() for p in model.parameters())
            print(f"model: {n / 1e6:.1f}M parameters, {model.config.num_layers} layers, "
                  f"{model.config.num_experts} experts, {model.config.num_mtp_layers} MTP depth(s)")
            print(f"max |logits - transformers| = {check_against_transformers(args.hf_dir, model):.3e}")
            del model
        if args.out:
            cfg = convert_hf_checkpoint(args.hf_dir, args.out, dtype=dtype, max_shard_bytes=shard_bytes,
                                        overwrite=args.overwrite, quantize=args.quantize)
            print(f"wrote {args.out} ({cfg.num_layers} layers, {cfg.num_experts} experts, "
                  f"{cfg.num_mtp_layers} MTP depth(s))")
    except (CheckpointError, ConfigError, ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
