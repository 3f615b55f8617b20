"""What a step's or an evaluation's finished groups measure: reward statistics, pass@k. Used by the trainer
(every step, every held-out evaluation) and by `tools/evaluate.py` (the command line)."""

from __future__ import annotations

import math

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n samples of which c passed: 1 - C(n - c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_1_se(per_task: list[dict], samples: int) -> float:
    """The sampling standard error of pass@1 on these tasks: how far another evaluation of the same checkpoint on
    the same tasks would move it (each task's pass rate is a mean of `samples` Bernoulli draws, whose variance
    p(1-p)/(samples-1) estimates without bias). Two evaluations on one task set differ by more than twice
    sqrt(se_a^2 + se_b^2) by chance about 5% of the time. The spread between task sets is not in it. NaN with
    one sample per task."""
    if samples < 2 or not per_task:
        return float("nan")
    var = sum(t["pass@1"] * (1 - t["pass@1"]) / (samples - 1) for t in per_task)
    return math.sqrt(var) / len(per_task)


def summarize_groups(tasks, results: list[dict], samples: int, success_reward: float = 1.0) -> dict:
    """pass@1, pass@K (K = samples) and the reward mean over one finished group of ``samples`` episodes per
    task (``results[i]`` is tasks[i]'s, as `RolloutWorker.run_group` returns it). A sample passes when its
    verifier reward is at least ``success_reward``; the shaping terms of training rewards do not count."""
    per_task = []
    for task, result in zip(tasks, results, strict=True):
        rewards = [float(ep.get("verifier_reward", ep["reward"])) for ep in result["episodes"]]
        if len(rewards) != samples:
            raise ValueError(f"task {task.name}: {len(rewards)} episodes, expected {samples}")
        c = sum(r >= success_reward for r in rewards)
        tier = (getattr(getattr(task, "harbor", None), "metadata", None) or {}).get("tier")
        per_task.append({"task": task.name, "kind": task.kind, "tier": tier, "rewards": rewards,
                         "pass@1": pass_at_k(samples, c, 1), f"pass@{samples}": pass_at_k(samples, c, samples)})
    k = f"pass@{samples}"
    tiers = {}
    for tier in sorted({t["tier"] for t in per_task if t["tier"] is not None}):
        rows = [t for t in per_task if t["tier"] == tier]
        tiers[tier] = {"tasks": len(rows), "pass@1": sum(t["pass@1"] for t in rows) / len(rows),
                       "pass@1_se": pass_at_1_se(rows, samples), k: sum(t[k] for t in rows) / len(rows)}
    return {"tasks": len(tasks), "samples": samples,
            "pass@1": sum(t["pass@1"] for t in per_task) / len(per_task),
            "pass@1_se": pass_at_1_se(per_task, samples),
            k: sum(t[k] for t in per_task) / len(per_task),
            "reward_mean": sum(sum(t["rewards"]) for t in per_task) / (len(per_task) * samples),
            "per_tier": tiers,  # tasks whose metadata names a tier (the generated family's)
            "per_task": per_task}


def group_metrics(results: list[dict]) -> dict:
    """Reward mean / best-of-K / distribution and episode, segment and summary counts of one step's groups, and the
    faults of the infrastructure apart from the episodes' own errors (``infra_faults``, ``policy_errors``).

    ``reward_mean`` is the training reward the advantages use; ``verifier_reward_mean`` the verifier's part and
    ``<term>_mean`` each shaping term's signed part (``length_penalty_mean``, ``malformed_tool_calls_mean``, ...),
    so reward_mean = verifier_reward_mean + the sum of the term means."""
    episodes = [ep for r in results for ep in r["episodes"]]
    rewards = torch.tensor([[float(ep["reward"]) for ep in r["episodes"]] for r in results])
    metas = [ep.get("meta", {}) for ep in episodes]
    q = torch.quantile(rewards.flatten(), torch.tensor([0.1, 0.5, 0.9])).tolist()
    terms = sorted({t for ep in episodes for t in ep.get("reward_terms", {})})
    shaping = {f"{t}_mean": sum(ep.get("reward_terms", {}).get(t, 0.0) for ep in episodes) / len(episodes)
               for t in terms}
    return {
        "reward_mean": rewards.mean().item(),
        "verifier_reward_mean": sum(float(ep.get("verifier_reward", ep["reward"])) for ep in episodes) / len(episodes),
        **shaping,
        "reward_best_of_k": rewards.max(dim=1).values.mean().item(),
        "reward_p10": q[0], "reward_p50": q[1], "reward_p90": q[2],
        "episodes": float(rewards.numel()),
        "turns": float(sum(m.get("turns", 1) for m in metas)),
        "segments_per_episode": sum(m.get("segments", 1) for m in metas) / max(len(metas), 1),
        "summaries": float(sum(m.get("summaries", 0) for m in metas)),
        "generated_tokens": float(sum(m.get("tokens", 0) for m in metas)),
        "no_tool_call_episodes": float(sum(m.get("stop_reason") == "no_tool_call" for m in metas)),
        "verifier_timeouts": float(sum(bool(m.get("verifier_timeout")) for m in metas)),
        # faults of the infrastructure (retried, never scored) apart from episodes scored 0 for an error instead of a
        # verdict (kept: a void verdict, a command that broke the sandbox; also what a task whose verifier cannot
        # run here shows), #57
        "infra_faults": float(sum(r.get("infra_faults", 0) for r in results)),
        "policy_errors": float(sum("error" in m for m in metas)),
    }
