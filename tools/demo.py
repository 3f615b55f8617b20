"""`make demo`: the whole continued-pretraining recipe on this machine's CPU, end to end.

1. Trains a sentencepiece BPE tokenizer on the Python standard library's .py files found on this machine.
2. Tokenizes them into a megatron-core indexed dataset (data/tiny/stdlib.bin/.idx).
3. Writes SFT chat transcripts with tool calls built from real stdlib functions (data/tiny/sft.jsonl).
4. Generates the easy agent task family (rl/envs/task_family.py) in disjoint splits under
   data/tiny/agent_tasks/ (sft, train: examples/tiny/rl_agent.yaml's RL prompts, heldout: its evaluation), and
   replays the sft split's reference solutions as tool calls through the agent protocol in sandboxes: those
   episodes (summarised where their context reaches the RL run's summary trigger) are the tool-use SFT
   transcripts (data/tiny/agent_sft.jsonl).
5. Runs examples/tiny/{pretrain,long_context,sft}.yaml as one chain with torchrun on 2 CPU ranks.
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
AGENT_SUMMARY_TRIGGER = 600  # = rollout.summary_trigger_tokens of examples/tiny/rl_agent.yaml


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
                messages.append({"role": "assistant", "content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": module, "symbol": name}}]})
                messages.append({"role": "tool", "content": body})
                messages.append({"role": "assistant", "content": f"`{name}`: {doc}\n{body}"})
            else:
                messages.append({"role": "assistant", "content": f"{body}\n# {doc}"})
            fh.write(json.dumps({"messages": messages}) + "\n")
    return n


def write_repeat_corpus(tokenizer_dir: Path, prefix: Path, seq_length: int, n_tokens: int = 2_000_000,
                        seed: int = 0, alphabet: int = 0) -> dict:
    """Rows of random tokens written twice ("x1 .. xk x1 .. xk", 2k = seq_length): the second half is
    predictable only by copying, the cleanest signal for the copy (induction) circuit, which the code corpus
    alone does not form at the demo's few hundred thousand tokens. Documents are exactly one training row long
    and carry no end-of-document token, so every row (cut every seq_length tokens) is one whole document that
    starts at position 0: measured on the tiny MLA preset, rows that start mid-document (packed, position ids
    reset) did not form the circuit in 300 steps where aligned rows formed it in about 200."""
    import numpy as np

    from megatron_composer.data.tokenizer import load_tokenizer
    from tools.preprocess_data import write_indexed_dataset

    if seq_length % 2:
        raise ValueError(f"seq_length {seq_length} must be even (a row is a list written twice)")
    tok = load_tokenizer(str(tokenizer_dir))
    controls = set(tok.special_tokens.values()) | {tok.pad}
    ordinary = np.array([i for i in range(tok.vocab_size) if i not in controls])
    if alphabet:  # the first ids of a BPE vocabulary: its earliest, most frequent merges
        ordinary = ordinary[:alphabet]
    rng = np.random.default_rng(seed)

    def documents():
        for _ in range(n_tokens // seq_length):
            half = rng.choice(ordinary, seq_length // 2).tolist()
            yield half + half, 0

    return write_indexed_dataset(prefix, tok, documents(), ["random tokens, each row written twice"])

def write_agent_sft(tasks_root: Path, path: Path, tokenizer_dir: Path, workers: int, seed: int = 0) -> int:
    """Generate the agent task splits and write the sft split's reference episodes as SFT conversations."""
    import shutil

    from megatron_composer.data.tokenizer import load_tokenizer
    from rl.envs.task_family import generate_splits, solution_transcripts

    if tasks_root.exists():
        shutil.rmtree(tasks_root)
    splits = generate_splits(tasks_root, AGENT_SPLITS, seed=seed)
    tok = load_tokenizer(str(tokenizer_dir))
    convs = solution_transcripts(splits["sft"], lambda text: len(tok.encode(text)),
                                 summary_trigger_tokens=AGENT_SUMMARY_TRIGGER, workers=workers)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(record) + "\n" for record in convs)
    tmp.rename(path)  # only a complete file counts as done on a re-run
    return len(convs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="directory of .py files used as the corpus")
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("overrides", nargs="*", help="key=value overrides passed to every stage, e.g. train.steps=20")
    args = ap.parse_args(argv)
    t0 = time.time()
    py = sys.executable
    data = Path("data/tiny")  # where examples/tiny/*.yaml read their data
    stdlib = Path(args.stdlib)
    if not any(stdlib.glob("*.py")):
        print(f"error: {stdlib} has no .py files; pass --stdlib DIR with a directory of Python sources", file=sys.stderr)
        return 1
    if not (data / "tokenizer" / "tokenizer.model").exists():
        _run([py, "tools/train_tokenizer.py", "--input", str(stdlib), "--output", str(data / "tokenizer"), "--vocab-size", str(args.vocab_size), "--max-lines", "300000"])
    if not (data / "stdlib.idx").exists():
        _run([py, "tools/preprocess_data.py", "--input", str(stdlib), "--tokenizer", str(data / "tokenizer"), "--output-prefix", str(data / "stdlib"), "--workers", str(args.nproc)])
    if not (data / "sft.jsonl").exists():
        print(f"wrote {write_sft(stdlib, data / 'sft.jsonl')} SFT conversations to {data / 'sft.jsonl'}")
    if not (data / "agent_sft.jsonl").exists():
        n = write_agent_sft(data / "agent_tasks", data / "agent_sft.jsonl", data / "tokenizer", args.nproc)
        print(f"wrote {n} tool-use SFT conversations (reference solutions replayed in sandboxes) to {data / 'agent_sft.jsonl'}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # One command runs the chain; each stage continues from the previous one (checkpoint.init_from: previous).
    _run_env([py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", "pretrain_composer.py",
              "--config", *STAGES, f"run.dir={args.run_dir}", *args.overrides], env)
    _summarise(Path(args.run_dir), time.time() - t0)
    return 0


def _summarise(run_root: Path, seconds: float) -> None:
    print(f"\n=== demo finished in {seconds / 60:.1f} min ===")
    for stage in STAGES:
        name = Path(stage).stem
        rows = [json.loads(line) for line in (run_root / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
        vals = [r for r in rows if "val_loss" in r]
        top1 = [r["mtp1_top1"] for r in rows if "mtp1_top1" in r]
        msg = f"{name:13s} val_loss {vals[0]['val_loss']:.3f} (step {vals[0]['step']}) -> {vals[-1]['val_loss']:.3f} (step {vals[-1]['step']})"
        if top1:
            k = max(1, len(top1) // 10)
            msg += f" | MTP top-1 agreement {sum(top1[:k]) / k:.3f} -> {sum(top1[-k:]) / k:.3f}"
        print(msg)
        print(f"{'':13s} metrics {run_root / name / 'metrics.jsonl'}  checkpoints {run_root / name / 'checkpoints'}")
    png = run_root / "loss.png"
    try:
        subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), *(str(run_root / Path(s).stem) for s in STAGES), "--output", str(png)], check=True, capture_output=True)
        print(f"curves: {png}")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        print(f"(no plot: {e})")


if __name__ == "__main__":
    sys.exit(main())
