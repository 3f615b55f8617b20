"""The held-out pass@1's sampling standard error (rl.metrics.pass_at_1_se): what repeated evaluations of one
checkpoint on one task set scatter by, which a gain must clear to be read as one."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest


def _results(pass_rates: list[float], samples: int, rng: random.Random) -> list[dict]:
    return [{"episodes": [{"reward": float(rng.random() < p)} for _ in range(samples)]} for p in pass_rates]


def test_the_standard_error_matches_the_scatter_of_repeated_evaluations():
    from rl.metrics import summarize_groups

    rng = random.Random(0)
    rates = [rng.choice([0.0, 0.1, 0.3, 0.6, 0.9, 1.0]) for _ in range(32)]
    tasks = [SimpleNamespace(name=f"t{i}", kind="k") for i in range(len(rates))]
    runs = [summarize_groups(tasks, _results(rates, 4, rng), samples=4) for _ in range(2000)]
    values = [r["pass@1"] for r in runs]
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    se = sum(r["pass@1_se"] for r in runs) / len(runs)   # each evaluation's own estimate, averaged
    truth = math.sqrt(sum(p * (1 - p) / 4 for p in rates)) / len(rates)
    assert spread == pytest.approx(truth, rel=0.08)
    assert se == pytest.approx(truth, rel=0.08)


def test_certain_tasks_have_no_sampling_error_and_one_sample_has_no_estimate():
    from rl.metrics import summarize_groups

    tasks = [SimpleNamespace(name=f"t{i}", kind="k") for i in range(3)]
    results = [{"episodes": [{"reward": r}] * 4} for r in (0.0, 1.0, 1.0)]
    assert summarize_groups(tasks, results, samples=4)["pass@1_se"] == 0.0
    one = summarize_groups(tasks, [{"episodes": [{"reward": 1.0}]}] * 3, samples=1)
    assert math.isnan(one["pass@1_se"])
    half = summarize_groups(tasks[:1], [{"episodes": [{"reward": 1.0}, {"reward": 0.0}] * 2}], samples=4)
    assert half["pass@1_se"] == pytest.approx(math.sqrt(0.25 / 3))
