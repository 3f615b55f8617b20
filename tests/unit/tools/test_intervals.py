"""tools/intervals.py: percentile-bootstrap intervals over seeds."""

from __future__ import annotations

import math
import random

import pytest

from tools.intervals import difference_interval, mean_interval, paired_difference_interval, sample_std


def test_mean_interval_brackets_the_mean_and_is_reproducible():
    xs = [0.31, 0.42, 0.38, 0.29, 0.45]
    iv = mean_interval(xs)
    assert iv.mean == pytest.approx(sum(xs) / 5) and iv.n == 5
    assert min(xs) <= iv.low < iv.mean < iv.high <= max(xs)
    assert mean_interval(xs) == iv  # seeded


def test_mean_interval_matches_the_normal_approximation_for_many_values():
    rng = random.Random(3)
    xs = [rng.gauss(1.0, 2.0) for _ in range(400)]
    iv = mean_interval(xs, resamples=4000)
    half = 1.96 * sample_std(xs) / math.sqrt(len(xs))
    assert (iv.high - iv.low) / 2 == pytest.approx(half, rel=0.15)


def test_degenerate_inputs():
    assert mean_interval([]).n == 0 and str(mean_interval([])) == "n/a"
    one = mean_interval([0.5, float("nan"), None])
    assert one.n == 1 and one.low == one.high == 0.5 and not one.excludes_zero()
    assert sample_std([2.0]) == 0.0


def test_difference_interval_separates_distinct_arms_only():
    base = [0.30, 0.34, 0.28, 0.33, 0.31]
    better = [0.45, 0.49, 0.44, 0.50, 0.47]
    d = difference_interval(better, base)
    assert d.mean == pytest.approx(sum(better) / 5 - sum(base) / 5)
    assert d.excludes_zero() and d.low > 0
    same = difference_interval([0.29, 0.35, 0.30, 0.32, 0.33], base)
    assert not same.excludes_zero() and same.low < 0 < same.high
    assert difference_interval(base, better).high < 0


def test_paired_difference_removes_what_seeds_share():
    base = [0.20, 0.35, 0.28, 0.41, 0.25]  # seeds differ a lot (e.g. their prompts' difficulty)
    arm = [b + d for b, d in zip(base, [0.02, 0.03, 0.01, 0.02, 0.03])]  # a small, consistent gain per seed
    assert not difference_interval(arm, base).excludes_zero()
    paired = paired_difference_interval(arm, base)
    assert paired.mean == pytest.approx(0.022) and paired.excludes_zero() and paired.low >= 0.01 - 1e-12
    # a seed missing on either side leaves its pair out
    assert paired_difference_interval([*arm[:4], None], base).n == 4
    with pytest.raises(ValueError, match="one entry per seed"):
        paired_difference_interval(arm[:4], base)
