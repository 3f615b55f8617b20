"""OpenAI-compatible HTTP server over the inference engine (megatron_composer/inference/server.py: the endpoints
and what each choice carries).

    python tools/serve.py --checkpoint DIR [--tokenizer PATH] [--port 8000]
    torchrun --nproc-per-node 4 tools/serve.py --checkpoint DIR --tp 2 --ep 2    # tensor / expert parallel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.inference.server import serve  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory (config.json + safetensors)")
    p.add_argument("--tokenizer", help="tokenizer file or directory (default: the checkpoint directory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="megatron-composer")
    p.add_argument("--chat-format", default="auto",
                   help="auto (the tokenizer directory's chat template, else chatml), chatml, or the template's "
                        "tool-call family: kimi_k2, deepseek_v3, deepseek_v31, hermes")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--cache-memory-gb", type=float, default=4.0)
    p.add_argument("--batch-invariant", action="store_true", help="bitwise batch-invariant numerics (slower)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: the torchrun world size / --ep)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (routed experts split over the ranks)")
    args = p.parse_args(argv)
    try:
        serve(args.checkpoint, args.tokenizer, args.host, args.port, args.model_name, args.chat_format,
              args.max_batch_size, args.cache_memory_gb, args.batch_invariant, args.tp, args.ep)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
