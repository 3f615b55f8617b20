"""Resident memory of an inference engine: the model's parameters once, plus the KV cache, plus the process.

A rollout process is run as a fresh subprocess: it imports the library, builds the C++ kernels and builds the
model once on the meta device (which imports torch's meta machinery, ~150 MiB): the baseline RSS. It then builds
a ~120M-parameter DeepSeek-V3-style model (float32) the way rollout workers do (rl/model.py rollout_model:
inference.loading.engine_model on the meta device, allocated, no weights), wraps it in an Engine, loads its
first weights through Engine.update_weights from a reader of boxes (what a weight-sync version is; here the
model's own seeded initialisation, model/init.py, drawn one box at a time, so the source holds no copy of the
weights), and generates for a batch of prompts (prefill and decode, every kernel path), then a speculative
request. Its peak RSS is compared with baseline + parameter bytes + KV-cache bytes: the engine keeps no second
copy of any weight, so the ratio should be ~1 (within 10%; activations of a step and one box being loaded are
small next to the weights).

`--build full` instead builds the model as one process does (`Transformer(cfg)` on the CPU): its initialisation
draws each tensor into a temporary and copies it, so the peak also holds the largest tensor twice (the
embedding, 62.5 MiB here) -- construction, not the engine.

    python benchmarks/engine_memory.py [--hidden 512 --layers 6 --experts 16] [--build rollout|full]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class InitBoxes:
    """A reader of boxes of the model's full tensors (names, shape(name), read(name, box)) as the one-process
    model initialises them under the model's init seed: model/init.py draws only the row blocks a box touches."""

    def __init__(self, model):
        from megatron_composer.model.init import init_box
        from megatron_composer.parallel.slices import full_shape

        self.init_box, self.model = init_box, model
        self.shapes = {name: list(full_shape(t)) for name, t in model.state_dict(keep_vars=True).items()}
        self.names = list(self.shapes)

    def shape(self, name: str) -> list[int]:
        return self.shapes[name]

    def read(self, name: str, box: tuple[slice, ...]):
        return self.init_box(self.model.init_rule(name), self.shapes[name], self.model.init_seed, name, box)


def child(args) -> dict:
    import torch

    from megatron_composer.inference import Engine
    from megatron_composer.inference.loading import engine_model
    from megatron_composer.kernels.cpu import cpp
    from megatron_composer.model import Transformer, get_preset

    torch.set_num_threads(1)
    for name in ("decode", "rms_norm", "rope", "grouped_mm", "causal_attention"):
        cpp.load(name)
    cfg = get_preset("tiny-deepseek-v3").replace(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=4 * args.hidden,
        num_experts=args.experts, moe_intermediate_size=args.hidden, n_group=4, topk_group=2, num_mtp_layers=1)
    with torch.device("meta"):  # torch's meta-device machinery imports ~900 modules (~150 MiB) on first use
        Transformer(cfg)
    baseline = rss_bytes()  # the library, its kernels and torch's machinery; no weight yet
    if args.build == "full":
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
    else:
        model = engine_model(cfg, None, seed=0)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    param_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    engine = Engine(model, max_batch_size=args.batch, max_seq_len=args.prompt_len + args.new_tokens + 8,
                    cache_memory_bytes=args.cache_mb << 20)
    if args.build == "rollout":
        engine.update_weights(InitBoxes(model), version=1)
    cache_bytes = sum(t.numel() * t.element_size() for layer in engine.cache.layers for t in layer)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    results = engine.generate(prompts, max_new_tokens=args.new_tokens)
    engine.generate(prompts[:1], max_new_tokens=4, speculative=True)
    assert all(len(r.token_ids) == args.new_tokens for r in results)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"params": sum(p.numel() for p in model.parameters()), "param_bytes": param_bytes,
            "cache_bytes": cache_bytes, "baseline": baseline, "peak": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cache-mb", type=int, default=64)
    p.add_argument("--build", choices=["rollout", "full"], default="rollout",
                   help="rollout: meta-device build + update_weights (a rollout worker); full: Transformer(cfg)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    expected = r["baseline"] + r["param_bytes"] + r["cache_bytes"]
    print(f"model: {r['params'] / 1e6:.1f}M parameters, {r['param_bytes'] / mib:.1f} MiB; KV cache "
          f"{r['cache_bytes'] / mib:.1f} MiB; process baseline {r['baseline'] / mib:.1f} MiB")
    print(f"peak RSS {r['peak'] / mib:.1f} MiB vs baseline + parameters + cache {expected / mib:.1f} MiB: "
          f"{r['peak'] / expected:.3f}x "
          f"(weights beyond one copy would show as +{r['param_bytes'] / expected:.0%} per copy)")


if __name__ == "__main__":
    main()
