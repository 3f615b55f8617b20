"""`make demo`: the whole continued-pretraining recipe on this machine's CPU, end to end.

1. Trains a sentencepiece BPE tokenizer on the Python standard library's .py files found on this machine.
2. Tokenizes them into a megatron-core indexed dataset (data/tiny/stdlib.bin/.idx).
3. Writes SFT chat transcripts with tool calls built from real stdlib functions (data/tiny/sft.jsonl).
4. Generates the tiered agent task family (tools/task_family.py) in disjoint splits under
   data/tiny/agent_tasks/ (sft, train, heldout), and replays the sft split's reference solutions as tool calls
   through the agent protocol in sandboxes: those episodes (summarised where their context reaches 600 tokens)
   are the tool-use SFT transcripts (data/tiny/agent_sft.jsonl).
5. Runs examples/tiny/{pretrain,long_context,sft}.yaml as one chain with torchrun on 2 CPU ranks, then prints
   each stage's losses and the copy gate (tools/copy_eval.py).

`--chain agent` (`make demo-agent`) is the agentic chain: from the shipped base that copies (models/tiny-agent-base,
made by `make base`, with its own tokenizer), tool-use SFT on the tiered tasks told the compact agent profile
(examples/tiny/agent/sft.yaml, data under data/tiny_agent/), the SFT checkpoint's pass@1 / pass@4 per tier on train
and held-out tasks, then examples/tiny/rl_agent.yaml's RL and its table.
Nothing it writes is committed (data/ and runs/ are git-ignored). Re-running resumes / reuses what exists.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ["examples/tiny/pretrain.yaml", "examples/tiny/long_context.yaml", "examples/tiny/sft.yaml"]
AGENT_SPLITS = {"sft": 480, "train": 320, "heldout": 18}  # instances per split (one seeded stream: disjoint)
AGENT_SUMMARY_TRIGGER = 600  # the full agent profile's episodes of examples/tiny/sft.yaml summarise there

# `--chain agent` (make demo-agent): the shipped base, tool-use SFT on the tiered tasks, then agentic RL.
AGENT_BASE = Path("models/tiny-agent-base")  # tools/make_base.py ships it; it holds its tokenizer
AGENT_STAGES = ["examples/tiny/agent/sft.yaml"]
AGENT_RL = "examples/tiny/rl_agent.yaml"
AGENT_CHAIN_SPLITS = {"sft": 480, "train": 320, "heldout": 96}  # x 8 samples: a 0.05 held-out change is 2+ SE
AGENT_CHAIN_SUMMARY_TRIGGER = 300  # = rollout.summary_trigger_tokens of examples/tiny/rl_agent.yaml
AGENT_COPY_CONVERSATIONS = 1000  # word lists repeated back, beside the tool-use SFT: they keep the base's copy
AGENT_TRAIN_EVAL_TASKS = 48  # the SFT checkpoint's pass@k on this many train tasks (a seeded sample)


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def _run_env(cmd: list[str], env: dict) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


def _functions(stdlib: Path, limit: int, seed: int) -> list[tuple[str, str, str, str]]:
    """(module path, function name, docstring first line, source) of small documented stdlib functions."""
    out = []
    files = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                body = ast.get_source_segment(src, node)
                if body and 80 < len(body) < 500:
                    out.append((str(path.relative_to(stdlib)), node.name, ast.get_docstring(node).split("\n")[0], body))
    random.Random(seed).shuffle(out)
    return out[:limit]


def write_sft(stdlib: Path, path: Path, n: int = 200, seed: int = 0) -> int:
    """Agentic transcripts: the assistant reads a file with a tool call, then answers with the code."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for module, name, doc, body in _functions(stdlib, n, seed):
            messages = [{"role": "system", "content": "You are a coding agent. Use tools to read files."}]
            messages.append({"role": "user", "content": f"Show me `{name}` from {module}."})
            if rng.random() < 0.5:
                call = {"name": "read_file", "arguments": {"path": module, "symbol": name}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "content": body})
                messages.append({"role": "assistant", "content": f"`{name}`: {doc}\n{body}"})
            else:
                messages.append({"role": "assistant", "content": f"{body}\n# {doc}"})
            fh.write(json.dumps({"messages": messages}) + "\n")
    return n


def write_agent_sft(tasks_root: Path, path: Path, tokenizer_dir: Path, workers: int, seed: int = 0, *,
                    splits: dict[str, int] = AGENT_SPLITS, profile: str = "full",
                    summary_trigger: int = AGENT_SUMMARY_TRIGGER) -> int:
    """Generate the agent task splits and write the sft split's reference episodes as SFT conversations, told
    the agent `profile` and summarised where their context reaches `summary_trigger` (as the RL run's are)."""
    import shutil

    from megatron_composer.data.tokenizer import load_tokenizer
    from tools.task_family import generate_splits, solution_transcripts

    if tasks_root.exists():
        shutil.rmtree(tasks_root)
    written = generate_splits(tasks_root, splits, seed=seed)
    tok = load_tokenizer(str(tokenizer_dir))
    convs = solution_transcripts(written["sft"], lambda text: len(tok.encode(text)),
                                 summary_trigger_tokens=summary_trigger, workers=workers, profile=profile)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(record) + "\n" for record in convs)
    tmp.rename(path)  # only a complete file counts as done on a re-run
    return len(convs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"],
                    help="directory of .py files used as the corpus")
    ap.add_argument("--run-dir", default=None, help="default: runs/tiny (cpt), runs/tiny_agent (agent)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--chain", choices=("cpt", "agent"), default="cpt",
                    help="cpt: pretraining, long context, SFT (make demo); agent: pretraining, "
                         "tool-use SFT on the tiered agent tasks, then agentic RL (make demo-agent)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides passed to every stage, e.g. train.steps=20")
    args = ap.parse_args(argv)
    from rl.sandbox.leftovers import release_on_signals

    release_on_signals()  # the sandboxes that replay the tasks' solutions go with a stop signal
    args.run_dir = args.run_dir or ("runs/tiny_agent" if args.chain == "agent" else "runs/tiny")
    t0 = time.time()
    py = sys.executable
    data = Path("data/tiny")  # where examples/tiny/*.yaml read their data
    if args.chain == "agent":
        return agent_chain(args, py, t0)
    stdlib = Path(args.stdlib)
    if not any(stdlib.glob("*.py")):
        print(f"error: {stdlib} has no .py files; pass --stdlib DIR with a directory of Python sources",
              file=sys.stderr)
        return 1
    code_corpus(py, stdlib, data, args.vocab_size, args.nproc)
    if not (data / "sft.jsonl").exists():
        print(f"wrote {write_sft(stdlib, data / 'sft.jsonl')} SFT conversations to {data / 'sft.jsonl'}")
    if not (data / "agent_sft.jsonl").exists():
        n = write_agent_sft(data / "agent_tasks", data / "agent_sft.jsonl", data / "tokenizer", args.nproc)
        print(f"wrote {n} tool-use SFT conversations (reference solutions replayed in sandboxes) "
              f"to {data / 'agent_sft.jsonl'}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # One command runs the chain; each stage continues from the previous one (checkpoint.init_from: previous).
    _run_env([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
              "pretrain_composer.py", "--config", *STAGES, f"run.dir={args.run_dir}", *args.overrides], env)
    _summarise(Path(args.run_dir), STAGES, time.time() - t0)
    return 0


def code_corpus(py: str, stdlib: Path, data: Path, vocab_size: int, nproc: int) -> None:
    """The tokenizer and the code corpus trained on `stdlib`'s .py files (data/tokenizer, data/stdlib), made once."""
    if not (data / "tokenizer" / "tokenizer.model").exists():
        _run([py, "tools/train_tokenizer.py", "--input", str(stdlib), "--output", str(data / "tokenizer"),
              "--vocab-size", str(vocab_size), "--max-lines", "300000"])
    if not (data / "stdlib.idx").exists():
        _run([py, "tools/preprocess_data.py", "--input", str(stdlib), "--tokenizer", str(data / "tokenizer"),
              "--output-prefix", str(data / "stdlib"), "--workers", str(nproc)])


def agent_chain(args, py: str, t0: float) -> int:
    """Tool-use SFT of the shipped base, the copy gate on both, the SFT checkpoint's pass@1/pass@4 per tier on
    train and held-out tasks, then examples/tiny/rl_agent.yaml's RL and its table."""
    if not (ROOT / AGENT_BASE / "config.json").is_file():
        print(f"error: the tiny agent base {AGENT_BASE} is missing; restore it (git checkout {AGENT_BASE}) or "
              "rebuild it with `make base`", file=sys.stderr)
        return 1
    agent = Path("data/tiny_agent")  # where examples/tiny/agent/sft.yaml and rl_agent.yaml read their data
    run_root = Path(args.run_dir)
    agent.mkdir(parents=True, exist_ok=True)
    if not (agent / "agent_sft.jsonl").exists():
        n = write_agent_sft(agent / "agent_tasks", agent / "agent_sft.jsonl", AGENT_BASE, args.nproc,
                            splits=AGENT_CHAIN_SPLITS, profile="compact", summary_trigger=AGENT_CHAIN_SUMMARY_TRIGGER)
        print(f"wrote {n} tool-use SFT conversations (compact agent profile) to {agent / 'agent_sft.jsonl'}")
    if not (agent / "copy_sft.jsonl").exists():  # keeps the base's copy through the SFT (tools/make_base.py)
        from megatron_composer.data.tokenizer import load_tokenizer
        from tools.make_base import copy_conversations

        rows = copy_conversations(load_tokenizer(str(AGENT_BASE)), AGENT_COPY_CONVERSATIONS, 4, 15, seed=0)
        tmp = agent / "copy_sft.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(agent / "copy_sft.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sft = run_root / "sft"  # one stage: its run.dir (a chain of stages would place each in run.dir/<stem>)
    _run_env([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
              "pretrain_composer.py", "--config", *AGENT_STAGES, f"run.dir={sft}", *args.overrides], env)
    import yaml

    rl_cfg = yaml.safe_load((ROOT / AGENT_RL).read_text())
    samples = int(rl_cfg["eval"]["samples"])
    train_tiers = _tier_eval(py, agent / "agent_tasks" / "train", sft, AGENT_TRAIN_EVAL_TASKS, samples,
                             rl_cfg["rollout"])
    _run_env([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", "rl_composer.py",
              "--config", AGENT_RL, f"run.dir={run_root / 'rl'}", f"checkpoint.init_from={sft}"], env)
    _summarise(run_root, AGENT_STAGES, time.time() - t0, base=AGENT_BASE)
    # the RL run's step-0 evaluation is the SFT checkpoint's, on the held-out split with the same settings
    tiers = {"train": train_tiers, "heldout": _step0_eval(run_root / "rl", samples)}
    print(f"\nSFT checkpoint, {samples} samples per task (held-out: the RL run's step-0 evaluation):")
    for split, summary in tiers.items():
        for tier, t in summary["per_tier"].items():
            print(f"  {split:8s} tier {tier}: {t['tasks']:3d} tasks  pass@1 {t['pass@1']:.3f} ± "
                  f"{t['pass@1_se']:.3f}  pass@{samples} {t[f'pass@{samples}']:.3f}")
        print(f"  {split:8s} all   : {summary['tasks']:3d} tasks  pass@1 {summary['pass@1']:.3f} ± "
              f"{summary['pass@1_se']:.3f}  pass@{samples} {summary[f'pass@{samples}']:.3f}")
    print("  (± one sampling standard error: the scatter of another evaluation of the same checkpoint)")
    _rl_table(run_root / "rl")
    return 0


def _copy_gates(run_root: Path, stages: list[str], base: Path | None = None) -> None:
    """tools/copy_eval.py on the base the chain starts from (a Hugging Face directory) and on each stage's last
    checkpoint: a list of words repeated after itself, the task family's and words it never uses."""
    print("copy gate (second copy of a repeated list of 8 words; a model that copies pays well under 1 nat/word):")
    sources = ([("base", ["--hf", str(base)])] if base else []) + [
        (Path(stage).stem, ["--checkpoint", str(run_root / Path(stage).stem)]) for stage in stages]
    for name, source in sources:
        out = subprocess.run([sys.executable, str(ROOT / "tools" / "copy_eval.py"), *source, "--json"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        g = json.loads(out.strip().splitlines()[-1])
        for what, r in (("task-family words", g), ("other words", g["open"])):
            print(f"  {name:13s} {what:17s} first copy {r['first_copy_nats_per_word']:.2f}  second copy "
                  f"{r['second_copy_nats_per_word']:.2f} nats/word  (gate < {r['gate']:g}: "
                  f"{'pass' if r['passes'] else 'FAIL'})")


def _step0_eval(rl_dir: Path, samples: int) -> dict:
    """The RL run's step-0 held-out evaluation (eval.at_start) in tools/evaluate.py's summary shape."""
    rows = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    row = next(r for r in rows if r.get("step") == 0 and "eval_pass@1" in r)
    k = f"pass@{samples}"
    tiers = sorted({int(key[len("eval_tier"):].split("_")[0]) for key in row if key.startswith("eval_tier")})
    return {"tasks": int(row["eval_tasks"]), "pass@1": row["eval_pass@1"], "pass@1_se": row["eval_pass@1_se"],
            k: row[f"eval_{k}"], "per_tier": {t: {"tasks": int(row[f"eval_tier{t}_tasks"]),
                                                  **{m: row[f"eval_tier{t}_{m}"] for m in ("pass@1", "pass@1_se", k)}}
                                              for t in tiers}}


def _tier_eval(py: str, tasks: Path, checkpoint: Path, sample_tasks: int, samples: int, rollout: dict) -> dict:
    """tools/evaluate.py on the SFT checkpoint with the RL run's episode settings (`rollout`, its config's section:
    the compact agent profile, turns, tokens, temperature, summary trigger), which an SFT run's own config does
    not hold."""
    out = ROOT / checkpoint / f"eval_{tasks.name}.json"
    cmd = [py, str(ROOT / "tools" / "evaluate.py"), "--tasks", str(tasks), "--checkpoint", str(checkpoint),
           "--samples", str(samples), "--summary", str(out)] + (["--sample-tasks", str(sample_tasks)] if sample_tasks
                                                                  else [])
    cmd += [f"rollout.{k}={v}" for k, v in rollout.items()]
    _run(cmd)
    return json.loads(out.read_text())


def _rl_table(rl_dir: Path) -> None:
    rows = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "verifier_reward_mean" in r]
    evals = [r for r in rows if "eval_pass@1" in r]
    fifth = max(1, len(steps) // 5)
    first, last = steps[:fifth], steps[-fifth:]
    mean = lambda rs, k: sum(r.get(k, 0.0) for r in rs) / max(len(rs), 1)  # noqa: E731
    print(f"\nRL ({rl_dir}, {len(steps)} steps):")
    print(f"  verifier reward, first fifth {mean(first, 'verifier_reward_mean'):.3f} -> last fifth "
          f"{mean(last, 'verifier_reward_mean'):.3f}")
    print("  held-out pass@1 by step: " + ", ".join(
        f"{r['step']}: {r['eval_pass@1']:.3f}" + (f" ± {r['eval_pass@1_se']:.3f}" if "eval_pass@1_se" in r else "")
        for r in evals))
    if len(evals) > 1 and "eval_pass@1_se" in evals[0] and "eval_pass@1_se" in evals[-1]:
        gain = evals[-1]["eval_pass@1"] - evals[0]["eval_pass@1"]
        se = (evals[0]["eval_pass@1_se"] ** 2 + evals[-1]["eval_pass@1_se"] ** 2) ** 0.5
        print(f"  held-out gain, step {evals[0]['step']} -> {evals[-1]['step']}: {gain:+.3f} "
              f"({gain / se:+.1f} standard errors)" if se > 0 else f"  held-out gain: {gain:+.3f}")
    print(f"  tool calls per episode (evaluations) {mean(evals, 'eval_tool_calls_per_episode'):.2f}; chains summarised "
          f"{sum(r.get('summaries', 0) for r in steps):.0f}; all-equal groups dropped and refilled "
          f"{sum(r.get('equal_reward_groups_replaced', 0) for r in steps):.0f}")
    png = rl_dir / "rl.png"
    try:
        subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(rl_dir), "--output", str(png)],
                       check=True, capture_output=True)
        print(f"  curves: {png}")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"  (no plot: {e})")


def _summarise(run_root: Path, stages: list[str], seconds: float, base: Path | None = None) -> None:
    print(f"\n=== demo finished in {seconds / 60:.1f} min ===")
    for stage in stages:
        name = Path(stage).stem
        rows = [json.loads(line) for line in (run_root / name / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        vals = [r for r in rows if "val_loss" in r]
        top1 = [r["mtp1_top1"] for r in rows if "mtp1_top1" in r]
        msg = (f"{name:13s} val_loss {vals[0]['val_loss']:.3f} (step {vals[0]['step']}) -> "
               f"{vals[-1]['val_loss']:.3f} (step {vals[-1]['step']})")
        if top1:
            k = max(1, len(top1) // 10)
            msg += f" | MTP top-1 agreement {sum(top1[:k]) / k:.3f} -> {sum(top1[-k:]) / k:.3f}"
        print(msg)
        print(f"{'':13s} metrics {run_root / name / 'metrics.jsonl'}  checkpoints {run_root / name / 'checkpoints'}")
    _copy_gates(run_root, stages, base)
    png = run_root / "loss.png"
    try:
        subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"),
                        *(str(run_root / Path(s).stem) for s in stages), "--output", str(png)],
                       check=True, capture_output=True)
        print(f"curves: {png}")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"(no plot: {e})")


if __name__ == "__main__":
    sys.exit(main())
