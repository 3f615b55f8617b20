"""Ablate the RL objective: runs that each switch one choice of the recipe, several seeds each, one table.

    python tools/ablate.py --config examples/tiny/rl.yaml --arms all --seeds 3 --out runs/ablation \
        checkpoint.init_from=runs/tiny/sft train.steps=20

Every arm is the config plus the overrides of its choice (``--arms`` names them, comma-separated, or ``all``);
the remaining arguments are overrides applied to every run (e.g. a shorter ``train.steps``). Each (arm, seed)
is one `rl_composer.py` run in its own directory ``<out>/<arm>/seed<k>`` (an existing finished run is reused,
an interrupted one resumes). Written to ``<out>``:

* ``ablation.md`` / ``ablation.csv``: per arm, over seeds, the mean and spread (sample std) of the final
  training reward and verifier reward (means over the last ``--final-steps`` steps), and run means of the
  mismatch-masked token fraction, the KL to the reference and the generated tokens per episode;
* ``reward_curves.png``: the verifier reward per step of each arm (mean over seeds, band = min..max).

Arms (each one switch away from the config's recipe):
  baseline       the config as is
  std_norm       advantages divided by the group std (GRPO)          rl.advantage_std_normalize=true
  length_norm    1/|o_i| per sequence (GRPO's seq-mean-token-mean)   rl.loss_aggregation=seq_mean_token_mean
  k3_in_loss     KL as k3 in the loss instead of k1 in the reward     rl.kl_estimator=k3 rl.kl_placement=in_loss
  r2             replay the trainer's own old-policy routing          rl.router_replay=r2
  replay_off     route freely in training                             rl.router_replay=off
  summarisation  self-summarisation chains (agent tasks only)         rollout.summary_trigger_tokens=...
  shaping        length penalty and malformed-tool-call penalty on    rl.length_penalty_weight=...
                                                                      rl.behaviour_rewards=...
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ARMS: dict[str, list[str]] = {
    "baseline": [],
    "std_norm": ["rl.advantage_std_normalize=true"],
    "length_norm": ["rl.loss_aggregation=seq_mean_token_mean"],
    "k3_in_loss": ["rl.kl_estimator=k3", "rl.kl_placement=in_loss"],
    "r2": ["rl.router_replay=r2"],
    "replay_off": ["rl.router_replay='off'"],
    # a trigger below the agent episodes' context; single-turn tasks never reach it (the arm equals baseline)
    "summarisation": ["rollout.summary_trigger_tokens=768"],
    "shaping": ["rl.length_penalty_weight=0.5", "rl.length_penalty_q=0.0", "rl.length_budget=16",
                "rl.behaviour_rewards={rl.algorithm.rewards:malformed_tool_calls: -0.1}"],
}


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
    return [r for r in rows if "reward_mean" in r]


def run_one(config: str, overrides: list[str], run_dir: Path, log: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p]))
    cmd = [sys.executable, str(ROOT / "rl_composer.py"), "--config", config, *overrides, f"run.dir={run_dir}"]
    with open(log, "w") as fh:
        return subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def run_mean(rows: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if key in r and isinstance(r[key], (int, float))]
    return sum(vals) / len(vals) if vals else None


def summarise(arm: str, runs: list[list[dict]], final_steps: int) -> dict:
    """One table row: per seed the final (last `final_steps` steps) and run-mean numbers, then mean/std."""
    per_seed = {"reward": [], "verifier_reward": [], "mismatch": [], "kl": [], "tokens_per_episode": []}
    for rows in runs:
        if not rows:
            continue
        tail = rows[-final_steps:]
        per_seed["reward"].append(run_mean(tail, "reward_mean"))
        per_seed["verifier_reward"].append(run_mean(tail, "verifier_reward_mean"))
        per_seed["mismatch"].append(run_mean(rows, "mismatch_masked_fraction"))
        per_seed["kl"].append(run_mean(rows, "kl"))
        per_seed["tokens_per_episode"].append(
            sum(r["generated_tokens"] for r in rows) / max(sum(r["episodes"] for r in rows), 1))
    out = {"arm": arm, "seeds": len([r for r in runs if r]), "steps": max((len(r) for r in runs), default=0)}
    for key, vals in per_seed.items():
        out[f"{key}_mean"], out[f"{key}_std"] = _mean_std(vals)
    return out


def write_table(rows: list[dict], out: Path) -> None:
    cols = ["reward", "verifier_reward", "mismatch", "kl", "tokens_per_episode"]
    with open(out / "ablation.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    head = ("| arm | seeds | steps | final reward | final verifier reward | mismatch-masked fraction | KL | "
            "tokens / episode |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        cells = [f"{r[f'{c}_mean']:.4g} ± {r[f'{c}_std']:.2g}" for c in cols]
        lines.append(f"| {r['arm']} | {r['seeds']} | {r['steps']} | " + " | ".join(cells) + " |")
    (out / "ablation.md").write_text("\n".join(lines) + "\n\nmean ± sample std over seeds; final = mean of the last "
                                     "steps; mismatch, KL, tokens: run means; KL is the arm's own estimator "
                                     "(k3 for k3_in_loss, k1 otherwise)\n")


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for arm, runs in curves.items():
        runs = [r for r in runs if r]
        if not runs:
            continue
        n = min(len(r) for r in runs)
        steps = [runs[0][i]["step"] for i in range(n)]
        key = "verifier_reward_mean" if all("verifier_reward_mean" in r[0] for r in runs) else "reward_mean"
        per_step = [[r[i][key] for r in runs] for i in range(n)]
        ax.plot(steps, [sum(v) / len(v) for v in per_step], label=f"{arm} ({len(runs)} seeds)")
        ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("verifier reward (mean over the step's episodes)")
    ax.set_title("RL ablation: reward per arm (line = mean over seeds, band = min..max)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="RL config YAML (e.g. examples/tiny/rl.yaml)")
    ap.add_argument("--arms", default="all", help=f"comma-separated arms or 'all': {', '.join(ARMS)}")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm (train.seed = 1 .. N)")
    ap.add_argument("--out", default="runs/ablation", help="directory of the runs, the table and the plot")
    ap.add_argument("--final-steps", type=int, default=5, help="final reward = mean over this many last steps")
    ap.add_argument("--report-only", action="store_true", help="tabulate the finished runs under --out; start none")
    ap.add_argument("overrides", nargs="*", help="overrides for every run, e.g. train.steps=20")
    args = ap.parse_args(argv)
    arms = list(ARMS) if args.arms == "all" else [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.seeds < 1:
        ap.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}" if unknown else "--seeds must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[list[dict]]] = {}
    for arm in arms:
        curves[arm] = []
        for seed in range(1, args.seeds + 1):
            run_dir = out / arm / f"seed{seed}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            if not (run_dir / "done").is_file() and args.report_only:
                curves[arm].append([])
                continue
            if not (run_dir / "done").is_file():
                rc = run_one(args.config, [*args.overrides, *ARMS[arm], f"train.seed={seed}"], run_dir,
                             out / arm / f"seed{seed}.log")
                if rc != 0:
                    print(f"{arm} seed {seed}: run failed (rc {rc}); see {out / arm / f'seed{seed}.log'}", flush=True)
                    curves[arm].append([])
                    continue
                (run_dir / "done").write_text("ok\n")
            rows = read_rows(run_dir)
            curves[arm].append(rows)
            last = rows[-1] if rows else {}
            print(f"{arm} seed {seed}: {len(rows)} steps, last verifier reward "
                  f"{last.get('verifier_reward_mean', float('nan')):.3f}", flush=True)
    table = [summarise(arm, runs, args.final_steps) for arm, runs in curves.items()]
    write_table(table, out)
    plot(curves, out / "reward_curves.png")
    print((out / "ablation.md").read_text())
    print(f"table: {out / 'ablation.md'} (csv: {out / 'ablation.csv'}); curves: {out / 'reward_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
