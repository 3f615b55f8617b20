"""Codebase perplexity: per-token loss and perplexity of a checkpoint on held-out code.

    python tools/eval_perplexity.py --checkpoint runs/tiny/pretrain --input some/repo/ --seq-length 256
    python tools/eval_perplexity.py --hf /path/to/hf_model --input held_out.jsonl

--checkpoint takes one of our run directories (its latest checkpoint and config.yaml) or a checkpoint
directory inside one; --hf a Hugging Face directory (config.json + safetensors + tokenizer). Documents are
scored independently in windows of --seq-length tokens; reports nats/token, perplexity and bits per byte
(tokenizer-independent, so base models with different tokenizers can be compared).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_composer.checkpoint.dcp import CheckpointError, resolve_checkpoint  # noqa: E402
from megatron_composer.config import ConfigError, load_config  # noqa: E402
from megatron_composer.data.corpus import CorpusError, iter_documents, list_inputs  # noqa: E402
from megatron_composer.data.tokenizer import TokenizerError, load_tokenizer  # noqa: E402


def _one_process_model(mc, init):
    """The model as the training core builds it (meta device, then filled from `init`), in one process."""
    from megatron_composer.fp8 import FP8Config
    from megatron_composer.parallel.dims import ParallelConfig
    from megatron_composer.training.config import architecture
    from megatron_composer.training.core import build_model
    from megatron_composer.training.layout import Layout

    return build_model(mc, Layout(ParallelConfig(), distributed=False), torch.device("cpu"), FP8Config(), seed=0,
                       init=init, meta={"model": architecture(mc)})


def load_ours(path: str):
    from megatron_composer.training.config import model_config
    from megatron_composer.training.core import InitialWeights
    from pretrain.trainer import PretrainConfig

    ckpt = resolve_checkpoint(path)
    cfg = load_config(PretrainConfig, ckpt.parent.parent / "config.yaml")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    mc = model_config(cfg, tokenizer, weights=ckpt)  # the rope the checkpoint was trained with
    return _one_process_model(mc, InitialWeights(checkpoint=ckpt)), tokenizer, str(ckpt)


def load_hf(path: str):
    from megatron_composer.checkpoint.hf import HFReader
    from megatron_composer.training.core import InitialWeights

    tokenizer = load_tokenizer(path)
    mc = HFReader(path).config  # headers only; the weights are read into the built model slice by slice
    tokenizer.check_fits_model(mc.vocab_size)
    return _one_process_model(mc, InitialWeights(hf=path)), tokenizer, path


@torch.no_grad()
def score(model, tokenizer, docs, seq_length: int, max_tokens: int) -> dict:
    model.eval()
    nll, tokens, nbytes = 0.0, 0, 0
    bar = tqdm(desc="scoring", unit="tok", total=max_tokens or None)
    for text in docs:
        ids = tokenizer.encode(text) + [tokenizer.eod]
        nbytes += len(text.encode("utf-8"))
        for start in range(0, len(ids) - 1, seq_length):
            window = torch.tensor(ids[start: start + seq_length + 1])[None]
            if window.shape[1] < 2:
                break
            logits = model(window[:, :-1])
            nll += float(F.cross_entropy(logits[0].float(), window[0, 1:], reduction="sum"))
            tokens += window.shape[1] - 1
            bar.update(window.shape[1] - 1)
            if max_tokens and tokens >= max_tokens:
                break
        if max_tokens and tokens >= max_tokens:
            break
    bar.close()
    loss = nll / max(tokens, 1)
    return {"tokens": tokens, "loss": loss, "perplexity": math.exp(loss),
            "bits_per_byte": nll / math.log(2) / max(nbytes, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="our run directory or checkpoint directory")
    src.add_argument("--hf", help="Hugging Face checkpoint directory")
    ap.add_argument("--input", nargs="+", required=True, help="held-out JSONL files or source directories")
    ap.add_argument("--extensions", default=".py")
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=100_000, help="stop after this many scored tokens (0: all)")
    args = ap.parse_args(argv)
    try:
        model, tokenizer, name = load_ours(args.checkpoint) if args.checkpoint else load_hf(args.hf)
        docs = iter_documents(list_inputs(args.input, tuple(args.extensions.split(",")), ["site-packages"]))
        result = score(model, tokenizer, docs, args.seq_length, args.max_tokens)
    except (CheckpointError, ConfigError, TokenizerError, CorpusError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{name}: {result['tokens']} tokens, loss {result['loss']:.4f} nats/token, "
          f"perplexity {result['perplexity']:.2f}, {result['bits_per_byte']:.4f} bits/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
