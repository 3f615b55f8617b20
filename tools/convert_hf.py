"""Convert between Hugging Face checkpoints and this project's model.

    # HF directory -> check it loads, optionally re-export it (e.g. an FP8 checkpoint to bf16)
    python tools/convert_hf.py HF_DIR --out OUT_DIR [--dtype bfloat16] [--shard-gb 4]
    # HF directory -> logits parity against transformers on random tokens (float32)
    python tools/convert_hf.py HF_DIR --check
    # a fresh model of a preset -> HF directory (e.g. to start from random weights)
    python tools/convert_hf.py --preset tiny-deepseek-v3 --out OUT_DIR

Loading streams one tensor at a time; export writes shards of --shard-gb and an index.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.checkpoint.hf import CheckpointError, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from megatron_composer.model import ModelConfigError, Transformer, get_preset  # noqa: E402


def check_against_transformers(path: Path, ours: Transformer, tokens: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours.float().eval()(ids) - ref(ids).logits).abs().max().item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", nargs="?", type=Path, help="Hugging Face checkpoint directory to import")
    p.add_argument("--preset", help="build a freshly initialised model of this preset instead of importing")
    p.add_argument("--out", type=Path, help="write the model as a Hugging Face checkpoint here")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--check", action="store_true", help="compare logits with transformers (float32)")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if (args.hf_dir is None) == (args.preset is None):
        p.error("give either HF_DIR or --preset")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        if args.preset:
            torch.manual_seed(0)
            model = Transformer(get_preset(args.preset))
            if dtype:
                model.to(dtype)
        else:
            model = load_hf_checkpoint(args.hf_dir, dtype=dtype)
        n = sum(p.numel() for p in model.parameters())
        print(f"model: {n / 1e6:.1f}M parameters, {model.config.num_layers} layers, "
              f"{model.config.num_experts} experts, {model.config.num_mtp_layers} MTP depth(s)")
        if args.check:
            if args.hf_dir is None:
                p.error("--check needs HF_DIR")
            print(f"max |logits - transformers| = {check_against_transformers(args.hf_dir, model):.3e}")
        if args.out:
            save_hf_checkpoint(model, args.out, max_shard_bytes=int(args.shard_gb * (1 << 30)), overwrite=args.overwrite)
            print(f"wrote {args.out}")
    except (CheckpointError, ModelConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
