"""Decode throughput of the inference engine versus transformers' `generate` with the same weights, and
speculative (MTP-drafted) versus plain decoding.

Both contenders run in this process on the same weights in the same dtype (--dtype, float32 by default):
our model is exported with save_hf_checkpoint and loaded by transformers (DeepseekV3ForCausalLM); each
measures greedy generation of --new-tokens tokens after --prompt-len prompt tokens at batch 1 and 16
(tokens/s counts generated tokens; prefill included on both sides; end-of-sequence disabled on both), and
the output says whether both produce the same tokens. transformers is run with each of its expert
implementations and the fastest is the baseline. Rounds interleave the contenders (each round runs every
contender once): tokens/s is each one's median round, and a ratio the median over rounds of the ratio of the
two contenders' times in that round. With one torch thread on the CPU (the default) the clock is
the process's CPU time, not the wall clock: on a shared machine the time the OS gives other jobs then does not
count against whichever contender happened to be running (what made wall-clock ratios move by 1.5x between
runs); what remains (caches, memory bandwidth and clock frequency shared with other jobs) the per-round ratios
and their median absorb.

Speculative decoding needs MTP heads trained to agree with the main head. With --pretrain-run pointing at a
run of pretrain_composer.py (e.g. examples/tiny/pretrain.yaml, whose MTP depth is trained by
self-distillation; `make demo` writes runs/tiny/pretrain, used by default when present), that model and
its tokenizer's text are used; otherwise a random tiny-deepseek-v3 is used and its (untrained) MTP head
gives near-zero acceptance, which the output says.

    python benchmarks/generate_throughput.py [--pretrain-run runs/tiny/pretrain] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_composer.checkpoint.hf import save_hf_checkpoint  # noqa: E402
from megatron_composer.inference import Engine  # noqa: E402
from megatron_composer.model import Transformer, get_preset  # noqa: E402


def load_pretrain_run(run_dir: str):
    """Model (with MTP heads) and tokenizer of a pretrain_composer.py run's latest checkpoint."""
    from megatron_composer.checkpoint.dcp import load_checkpoint, resolve_checkpoint
    from megatron_composer.config import load_config
    from megatron_composer.data.tokenizer import load_tokenizer
    from megatron_composer.training.config import model_config
    from pretrain.trainer import PretrainConfig

    cfg = load_config(PretrainConfig, Path(run_dir) / "config.yaml")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = Transformer(model_config(cfg, tokenizer))
    ckpt = resolve_checkpoint(run_dir)
    load_checkpoint(ckpt, model, None, restore_rng=False)
    return model.eval(), tokenizer, ckpt


def text_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """Prompts cut from Python standard-library sources (the tiny pretraining corpus)."""
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::7]:
        ids += tokenizer.encode(path.read_text(errors="ignore")[:4000])
        if len(ids) > n * length * 2:
            break
    return [ids[i * 2 * length:(i * 2 + 1) * length] for i in range(n)]


def timed(contenders: dict, rounds: int, clock) -> dict[str, tuple[list[float], object]]:
    """name -> (its time in each of `rounds` interleaved rounds, output); a first call of each warms up. Round r
    runs every contender once, in turn, so each round's contenders see the same machine load; `clock` is
    time.process_time (this process's CPU time: with one torch thread each and no device, the time other jobs
    take on a shared machine is not counted) or time.perf_counter (wall clock, the device synchronised before
    each read). Python's cyclic collector is run before each call, outside the clock, so a collection that
    one contender's garbage would trigger is not charged to the next."""
    outs = {name: fn() for name, fn in contenders.items()}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            gc.collect()  # each call starts from a collected heap: no collection of another's garbage in its time
            _sync()
            t0 = clock()
            fn()
            _sync()
            times[name].append(clock() - t0)
    return {name: (times[name], outs[name]) for name in contenders}


def round_ratio(times_a: list[float], times_b: list[float]) -> float:
    """Median over rounds of time_b / time_a: how many times faster a is than b, each round's pair measured back
    to back (so a load change between rounds moves both sides of a ratio, not one side of a median)."""
    return statistics.median(b / a for a, b in zip(times_a, times_b))


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def experts_implementations(ref) -> tuple[list[str], dict[str, str]]:
    """transformers' expert implementations this build has (name list) and, for those it lacks, why; ["default"]
    where the build has no switch (set_experts_implementation)."""
    impls, missing = [], {}
    if not hasattr(ref, "set_experts_implementation"):
        why = f"transformers {transformers_version()} has no set_experts_implementation"
        return ["default"], {"eager/grouped_mm/batched_mm": why}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            ref.set_experts_implementation(impl)
            impls.append(impl)
        except Exception as e:  # an implementation this transformers build lacks
            missing[impl] = f"{type(e).__name__}: {e}"
    return impls, missing


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def compare_decode(engine, ref, impls: list[str], prompts_all: list[list[int]], batches, new_tokens: int,
                   rounds: int, clock) -> list[dict]:
    """Greedy decode tokens/s of the engine and of transformers' generate (each implementation) per batch size.
    Rows: {batch, contender, tokens_per_s, same_tokens (prompts whose tokens equal the engine's), time_s}."""
    device = next(ref.parameters()).device

    def hf_generate(ids, impl):
        if impl != "default":
            ref.set_experts_implementation(impl)
        with torch.no_grad():
            return ref.generate(ids, max_new_tokens=new_tokens, do_sample=False)

    rows = []
    for B in batches:
        prompts = prompts_all[:B]
        ids = torch.tensor(prompts, device=device)
        contenders = {"ours (Engine)": lambda prompts=prompts: engine.generate(prompts, max_new_tokens=new_tokens)}
        for impl in impls:
            contenders[f"transformers[{impl}]"] = lambda ids=ids, impl=impl: hf_generate(ids, impl)
        timing = timed(contenders, rounds, clock)
        ours_out = timing["ours (Engine)"][1]
        prompt_len = ids.shape[1]
        ours_times = timing["ours (Engine)"][0]
        for name, (ts, out) in timing.items():
            same = B if name == "ours (Engine)" else sum(
                r.token_ids == out[b, prompt_len:].tolist() for b, r in enumerate(ours_out))
            t = statistics.median(ts)
            rows.append({"batch": B, "contender": name, "tokens_per_s": B * new_tokens / t, "time_s": t,
                         "ours_over_this": round_ratio(ours_times, ts), "same_tokens": same})
    return rows


def compare_speculative(engine, prompts_all: list[list[int]], batches, new_tokens: int, draft_tokens,
                        rounds: int, clock) -> list[dict]:
    """Speculative (MTP-drafted) vs plain greedy decoding per batch size and draft length. Rows: {batch,
    draft_tokens (0 = plain), tokens_per_s, speedup, acceptance, same_tokens (prompts equal to plain)}."""
    rows = []
    for B in batches:
        prompts = prompts_all[:B]
        contenders = {0: lambda prompts=prompts: engine.generate(prompts, max_new_tokens=new_tokens)}
        for D in draft_tokens:
            contenders[D] = lambda prompts=prompts, D=D: engine.generate(
                prompts, max_new_tokens=new_tokens, speculative=True, num_draft_tokens=D)
        timing = timed(contenders, rounds, clock)
        plain_times, plain = timing.pop(0)
        base = B * new_tokens / statistics.median(plain_times)
        rows.append({"batch": B, "draft_tokens": 0, "tokens_per_s": base, "speedup": 1.0, "acceptance": None,
                     "same_tokens": B})
        for D, (spec_times, spec) in timing.items():
            drafted = sum(r.num_draft_tokens for r in spec)
            accepted = sum(r.num_accepted_tokens for r in spec)
            rate = B * new_tokens / statistics.median(spec_times)
            rows.append({"batch": B, "draft_tokens": D, "tokens_per_s": rate,
                         "speedup": round_ratio(spec_times, plain_times),
                         "acceptance": accepted / max(drafted, 1),
                         "same_tokens": sum(a.token_ids == b.token_ids for a, b in zip(spec, plain))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_run = "runs/tiny/pretrain" if Path("runs/tiny/pretrain/latest").is_file() else None
    p.add_argument("--pretrain-run", default=default_run,
                   help="run dir of pretrain_composer.py (MTP heads trained by self-distillation); default "
                        "runs/tiny/pretrain when `make demo` has made it")
    p.add_argument("--preset", default="tiny-deepseek-v3", help="model when no --pretrain-run is given")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--draft-tokens", default="1,2,3")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds; each contender's median counts")
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                   help="cpu: process CPU time (auto's choice with --threads 1 on the CPU: robust to other jobs on a "
                        "shared machine); wall: wall clock (auto's choice with several threads or a GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both contenders")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and activations, both sides")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    if args.pretrain_run:
        model, tokenizer, ckpt = load_pretrain_run(args.pretrain_run)
        source = f"pretrained run checkpoint {ckpt}"
        prompts_all = text_prompts(tokenizer, max(int(b) for b in args.batches.split(",")), args.prompt_len)
    else:
        torch.manual_seed(0)
        model = Transformer(get_preset(args.preset)).eval()
        source = f"random {args.preset} (MTP head untrained)"
        g = torch.Generator().manual_seed(0)
        n = max(int(b) for b in args.batches.split(","))
        prompts_all = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
                       for _ in range(n)]
    cfg = model.config
    dtype = getattr(torch, args.dtype)
    print(f"model: {source}; layers={cfg.num_layers} hidden={cfg.hidden_size} experts={cfg.num_experts} "
          f"top{cfg.num_experts_per_tok} vocab={cfg.vocab_size} mtp={len(model.mtp)}; threads={args.threads}; "
          f"prompt {args.prompt_len} + {args.new_tokens} new tokens, greedy, {args.dtype}")

    model = model.to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(model, tmp, progress=False)
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
    ref.generation_config.eos_token_id = None  # always generate exactly new_tokens, like the engine
    ref.generation_config.pad_token_id = 0
    engine = Engine(model, max_batch_size=64, cache_memory_bytes=256 << 20)
    on_cpu = engine.device.type == "cpu" and next(ref.parameters()).device.type == "cpu"
    use_cpu_clock = args.clock == "cpu" or (args.clock == "auto" and args.threads == 1 and on_cpu)
    clock = time.process_time if use_cpu_clock else time.perf_counter
    print(f"clock: {'process CPU time' if use_cpu_clock else 'wall'}; median of {args.rounds} interleaved rounds")

    print(f"\n{'batch':>5} {'contender':32} {'tokens/s':>10}   ours / this (median of the rounds' ratios)")
    impls, missing = experts_implementations(ref)
    for impl, why in missing.items():
        print(f"      transformers[{impl}] unavailable: {why}")
    batches = [int(b) for b in args.batches.split(",")]
    rows = compare_decode(engine, ref, impls, prompts_all, batches, args.new_tokens, args.rounds, clock)
    for B in batches:
        rates = {r["contender"]: r["tokens_per_s"] for r in rows if r["batch"] == B}
        ratios = {r["contender"]: r["ours_over_this"] for r in rows if r["batch"] == B}
        for r in rows:
            if r["batch"] == B and r["same_tokens"] != B:
                print(f"      note: {r['contender']} tokens equal ours for {r['same_tokens']}/{B} prompts")
        best_hf = max((k for k in rates if k.startswith("transformers")), key=rates.get)
        for name, rate in rates.items():
            print(f"{B:5d} {name:32} {rate:10.1f}   {ratios[name]:5.2f}x")
        print(f"{B:5d} ours vs fastest transformers ({best_hf}): {ratios[best_hf]:.2f}x")

    if not len(model.mtp):
        print("\nspeculative decoding skipped: the model has no MTP heads")
        return
    print(f"\n{'batch':>5} {'decoding':32} {'tokens/s':>10} {'accept':>7}   speedup vs plain")
    rows = compare_speculative(engine, prompts_all, batches, args.new_tokens,
                               [int(d) for d in args.draft_tokens.split(",")], args.rounds, clock)
    for r in rows:
        B = r["batch"]
        if r["draft_tokens"] == 0:
            print(f"{B:5d} {'plain':32} {r['tokens_per_s']:10.1f} {'':>7}   1.00x")
            continue
        # float32 verification matches plain decoding token for token; bfloat16 rounds differently per shape
        assert r["same_tokens"] == B or dtype != torch.float32, "speculative greedy differs from plain"
        if r["same_tokens"] != B:
            print(f"      note: {args.dtype} speculative tokens equal plain for {r['same_tokens']}/{B} prompts")
        label = f"speculative, {r['draft_tokens']} draft token(s)"
        print(f"{B:5d} {label:32} {r['tokens_per_s']:10.1f} {r['acceptance']:7.1%}   {r['speedup']:.2f}x")


if __name__ == "__main__":
    main()
