"""Ablate the RL objective: runs that each switch one choice of the recipe, several seeds each, one table with
95% confidence intervals and each arm's difference to the baseline.

    python tools/ablate.py --config examples/tiny/rl.yaml --arms all --seeds 5 --jobs 2 --out runs/ablation \
        eval.tasks=examples/tiny/rl_heldout train.steps=40

Every arm is the config plus the overrides of its choice (``--arms`` names them, comma-separated, or ``all``);
the remaining arguments are overrides applied to every run. Each (arm, seed) is one `rl_composer.py` run in its
own directory ``<out>/<arm>/seed<k>`` (an existing finished run is reused, an interrupted one resumes); ``--jobs``
runs that many at once (one thread each). Per run the table takes the final verifier reward (mean over the last
``--final-steps`` steps) and, when the config evaluates held-out tasks (``eval.tasks``; the tool adds
``eval.at_start=true`` and, unless given, ``eval.interval`` = the run's steps), the held-out pass@1 of the last
evaluation and its gain over step 0. Written to ``<out>``:

* ``ablation.md`` / ``ablation.csv``: per arm, the mean over seeds with a 95% percentile-bootstrap interval over
  seeds (`tools/intervals.py`), the difference to the baseline with its interval (marked where it excludes 0),
  and run means of the mismatch-masked token fraction, the KL to the reference and the generated tokens per
  episode; a line states the baseline's learning gain against its seed spread (an ablation resolves only when
  the gain is several times the spread);
* ``reward_curves.png``: the verifier reward per step of each arm (mean over seeds, band = min..max) and the
  held-out pass@1 at each evaluation (mean, 95% interval).

Arms (each one switch away from the config's recipe):
  baseline       the config as is
  std_norm       advantages divided by the group std (GRPO)          rl.advantage_std_normalize=true
  length_norm    1/|o_i| per sequence (GRPO's seq-mean-token-mean)   rl.loss_aggregation=seq_mean_token_mean
  k3_in_loss     KL as k3 in the loss instead of k1 in the reward     rl.kl_estimator=k3 rl.kl_placement=in_loss
  r2             replay the trainer's own old-policy routing          rl.router_replay=r2
  replay_off     route freely in training                             rl.router_replay=off
  summarisation  self-summarisation chains (agent tasks only: single-turn episodes never reach the trigger, so
                 there the arm is the baseline and ``all`` leaves it out)   rollout.summary_trigger_tokens=...
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.intervals import Interval, difference_interval, mean_interval, paired_difference_interval, sample_std  # noqa: E402

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
AGENT_ONLY_ARMS = ("summarisation",)
METRICS = ("verifier_reward", "heldout_pass1", "heldout_gain")  # the ones compared with the baseline
KEYS = ("reward", "verifier_reward", "verifier_gain", "heldout_start", "heldout_pass1", "heldout_gain", "mismatch",
        "routing_mismatch", "kl", "tokens_per_episode")


def read_rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows: training steps (``reward_mean``) and held-out evaluations (``eval_pass@1``)."""
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
    return [r for r in rows if "reward_mean" in r or "eval_pass@1" in r]


def train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "reward_mean" in r]


def eval_rows(rows: list[dict]) -> list[dict]:
    return sorted((r for r in rows if "eval_pass@1" in r), key=lambda r: r["step"])


def run_one(config: str, overrides: list[str], run_dir: Path, log: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p]))
    cmd = [sys.executable, str(ROOT / "rl_composer.py"), "--config", config, *overrides, f"run.dir={run_dir}"]
    with open(log, "w") as fh:
        # from the repository root: the example configs name their data relative to it
        return subprocess.run(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode


def run_mean(rows: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if key in r and isinstance(r[key], (int, float))]
    return sum(vals) / len(vals) if vals else None


def seed_values(rows: list[dict], final_steps: int) -> dict:
    """One run's numbers: final verifier reward, last held-out pass@1 and its gain over step 0, run means."""
    steps, evals = train_rows(rows), eval_rows(rows)
    tail = steps[-final_steps:]
    start = next((r["eval_pass@1"] for r in evals if r["step"] == 0), None)
    last = evals[-1]["eval_pass@1"] if evals and evals[-1]["step"] > 0 else None
    return {
        "reward": run_mean(tail, "reward_mean"),
        "verifier_reward": run_mean(tail, "verifier_reward_mean"),
        "verifier_gain": (run_mean(tail, "verifier_reward_mean") - run_mean(steps[:final_steps],
                                                                            "verifier_reward_mean")
                          if steps and "verifier_reward_mean" in steps[0] else None),
        "heldout_start": start,
        "heldout_pass1": last,
        "heldout_gain": last - start if last is not None and start is not None else None,
        "mismatch": run_mean(steps, "mismatch_masked_fraction"),
        "routing_mismatch": run_mean(steps, "routing_mismatch_token_fraction"),
        "kl": run_mean(steps, "kl"),
        "tokens_per_episode": (sum(r.get("generated_tokens", 0) for r in steps)
                               / max(sum(r.get("episodes", 0) for r in steps), 1)) if steps else None,
    }


def summarise(arm: str, runs: list[list[dict]], final_steps: int, baseline: dict | None = None) -> dict:
    """One table row: per metric the mean over seeds with its 95% interval; against `baseline` the difference,
    paired by seed (the same seeds' prompts and draws), with its interval. `runs` holds one entry per seed (empty
    for a seed without a finished run)."""
    per_seed: dict[str, list] = {key: [] for key in KEYS}
    for rows in runs:
        values = seed_values(rows, final_steps) if train_rows(rows) else {}
        for key in KEYS:
            per_seed[key].append(values.get(key))
    out: dict = {"arm": arm, "seeds": sum(1 for r in runs if train_rows(r)),
                 "steps": max((len(train_rows(r)) for r in runs), default=0), "per_seed": per_seed}
    for key in KEYS:
        values = per_seed[key]
        out[key] = mean_interval(values)
        out[f"{key}_std"] = sample_std(values)
        if baseline is not None and key in METRICS:
            base = baseline["per_seed"][key]
            n = max(len(values), len(base))
            pad = [None] * n
            out[f"{key}_diff"] = paired_difference_interval((values + pad)[:n], (base + pad)[:n])
            out[f"{key}_diff_unpaired"] = difference_interval(values, base)
    return out


def _cell(iv: Interval | None, mark: bool = False) -> str:
    if iv is None:
        return "-"  # the baseline's own difference
    if iv.n == 0:
        return "n/a"
    return f"{iv}{' *' if mark and iv.excludes_zero() else ''}"


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows of dicts as CSV, the columns in first-seen order."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def write_table(rows: list[dict], out: Path) -> None:
    flat = []
    for r in rows:
        d = {"arm": r["arm"], "seeds": r["seeds"], "steps": r["steps"]}
        for key in KEYS:
            d.update({**r[key].columns(key), f"{key}_std": r[f"{key}_std"]})
            for kind in ("diff", "diff_unpaired"):
                if f"{key}_{kind}" in r:
                    d.update(r[f"{key}_{kind}"].columns(f"{key}_{kind}"))
        d["per_seed"] = json.dumps(r["per_seed"])
        flat.append(d)
    write_csv(out / "ablation.csv", flat)
    lines = ["| arm | seeds | steps | final verifier reward | Δ vs baseline | held-out pass@1 | Δ vs baseline | "
             "held-out gain over step 0 | mismatch-masked fraction | routing mismatch | KL | tokens / episode |",
             "|" + "---|" * 12]
    for r in rows:
        lines.append(" | ".join([
            f"| {r['arm']}", str(r["seeds"]), str(r["steps"]), _cell(r["verifier_reward"]),
            _cell(r.get("verifier_reward_diff"), True), _cell(r["heldout_pass1"]),
            _cell(r.get("heldout_pass1_diff"), True), _cell(r["heldout_gain"]),
            f"{r['mismatch'].mean:.3g}", f"{r['routing_mismatch'].mean:.3g}", f"{r['kl'].mean:.3g}",
            f"{r['tokens_per_episode'].mean:.3g} |"]))
    lines += ["", "mean over seeds [95% percentile-bootstrap interval over seeds]; Δ = arm - baseline of the same "
              "seed (a seed fixes every step's prompts and the evaluations' draws), its mean over seeds and the "
              "bootstrap interval of that mean (ablation.csv also has the unpaired interval, each arm's seeds "
              "resampled on their own); * = the interval excludes 0. Final verifier reward = mean of the last "
              "steps; held-out pass@1 = the last evaluation; run means: mismatch (tokens masked for train/rollout "
              "log-prob mismatch), routing mismatch (tokens the trainer routes to other experts than the rollout "
              "did), KL (the arm's own estimator: k3 for k3_in_loss, k1 otherwise), tokens per episode."]
    base = next((r for r in rows if r["arm"] == "baseline"), None)
    if base is not None and base["seeds"] > 1:
        lines.append("")
        lines.append(resolution_line(base))
    (out / "ablation.md").write_text("\n".join(lines) + "\n")


def resolution_line(base: dict) -> str:
    """Whether the ablation can resolve anything: the baseline's learning gain against its seed spread."""
    if base["heldout_gain"].n > 1:
        gain, spread, what = base["heldout_gain"].mean, base["heldout_pass1_std"], "held-out pass@1"
    else:  # no held-out set: the verifier reward's rise from the first to the last steps
        gain, spread, what = base["verifier_gain"].mean, base["verifier_reward_std"], "verifier reward"
    ratio = gain / spread if spread and math.isfinite(gain) else float("nan")
    return (f"baseline: {what} gain over the run {gain:.3f}, seed spread (sample std of the final value) "
            f"{spread:.3f}: gain / spread = {ratio:.1f}")


def plot(curves: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_eval = any(eval_rows(r) for runs in curves.values() for r in runs)
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(14 if has_eval else 9, 5), squeeze=False)
    ax = axes[0][0]
    for arm, runs in curves.items():
        runs = [train_rows(r) for r in runs if train_rows(r)]
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
    ax.set_title("reward per arm (line = mean over seeds, band = min..max)")
    ax.legend(fontsize=8)
    if has_eval:
        ax = axes[0][1]
        for i, (arm, runs) in enumerate(curves.items()):
            by_step: dict[int, list[float]] = {}
            for r in runs:
                for e in eval_rows(r):
                    by_step.setdefault(e["step"], []).append(e["eval_pass@1"])
            if not by_step:
                continue
            xs = sorted(by_step)
            ivs = [mean_interval(by_step[x]) for x in xs]
            offset = (i - len(curves) / 2) * 0.25  # arms side by side at each evaluation
            ax.errorbar([x + offset for x in xs], [iv.mean for iv in ivs],
                        yerr=[[iv.mean - iv.low for iv in ivs], [iv.high - iv.mean for iv in ivs]],
                        marker="o", capsize=3, label=arm)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out pass@1")
        ax.set_title("held-out pass@1 (mean over seeds, 95% bootstrap interval)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_overrides(config: str, overrides: list[str]) -> list[str]:
    """Overrides every run gets: with held-out tasks, an evaluation at step 0 and one at the last step."""
    from megatron_composer.config import load_config
    from rl.config import RLConfig

    cfg = load_config(RLConfig, config, overrides)
    extra = []
    if cfg.eval.tasks:
        extra.append("eval.at_start=true")
        if not cfg.eval.interval or cfg.train.steps % cfg.eval.interval:
            extra.append(f"eval.interval={cfg.train.steps}")
    return [*overrides, *extra]


def default_arms(config: str, overrides: list[str]) -> list[str]:
    """`all`: every arm that changes something on the config's tasks (no summarisation on single-turn tasks)."""
    from megatron_composer.config import load_config
    from rl.config import RLConfig
    from rl.rollout.tasks import load_rl_tasks

    cfg = load_config(RLConfig, config, overrides)
    agentic = any(t.kind == "agent" for t in load_rl_tasks(cfg.data.tasks))
    return [a for a in ARMS if agentic or a not in AGENT_ONLY_ARMS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="RL config YAML (e.g. examples/tiny/rl.yaml)")
    ap.add_argument("--arms", default="all", help=f"comma-separated arms or 'all': {', '.join(ARMS)}")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per arm (train.seed = 1 .. N)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each one process, one thread)")
    ap.add_argument("--out", default="runs/ablation", help="directory of the runs, the table and the plot")
    ap.add_argument("--final-steps", type=int, default=10, help="final reward = mean over this many last steps")
    ap.add_argument("--report-only", action="store_true", help="tabulate the finished runs under --out; start none")
    ap.add_argument("overrides", nargs="*", help="overrides for every run, e.g. train.steps=20")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1:
        ap.error("--seeds and --jobs must be >= 1")
    args.config = str(Path(args.config).resolve())
    if args.arms == "all":  # report-only: the arms that have runs under --out
        arms = ([a for a in ARMS if (Path(args.out) / a).is_dir()] if args.report_only
                else default_arms(args.config, args.overrides))
    else:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    if "baseline" not in arms:
        arms.insert(0, "baseline")  # every difference is taken against it
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = args.overrides if args.report_only else run_overrides(args.config, args.overrides)
    todo = [(arm, seed) for arm in arms for seed in range(1, args.seeds + 1)
            if not (out / arm / f"seed{seed}" / "done").is_file()]
    if todo and not args.report_only:
        print(f"{len(todo)} runs to go, {args.jobs} at a time", flush=True)

        def one(job):
            arm, seed = job
            run_dir = out / arm / f"seed{seed}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = out / arm / f"seed{seed}.log"
            rc = run_one(args.config, [*overrides, *ARMS[arm], f"train.seed={seed}"], run_dir, log)
            if rc != 0:
                print(f"{arm} seed {seed}: run failed (rc {rc}); see {log}", flush=True)
                return
            (run_dir / "done").write_text("ok\n")
            rows = read_rows(run_dir)
            last = (train_rows(rows) or [{}])[-1]
            ev = eval_rows(rows)
            print(f"{arm} seed {seed}: {len(train_rows(rows))} steps, last verifier reward "
                  f"{last.get('verifier_reward_mean', float('nan')):.3f}"
                  + (f", held-out pass@1 {ev[0]['eval_pass@1']:.3f} -> {ev[-1]['eval_pass@1']:.3f}" if ev else ""),
                  flush=True)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, todo))
    curves = {arm: [read_rows(out / arm / f"seed{s}") if (out / arm / f"seed{s}" / "done").is_file() else []
                    for s in range(1, args.seeds + 1)] for arm in arms}
    base = summarise("baseline", curves["baseline"], args.final_steps)
    table = [base] + [summarise(arm, runs, args.final_steps, base) for arm, runs in curves.items()
                      if arm != "baseline"]
    write_table(table, out)
    plot(curves, out / "reward_curves.png")
    print((out / "ablation.md").read_text())
    print(f"table: {out / 'ablation.md'} (csv: {out / 'ablation.csv'}); curves: {out / 'reward_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
