"""tools/intervals.py: percentile-bootstrap intervals over seeds."""

from __future__ import annotations

import math
import random

import pytest

from tools.intervals import difference_interval, mean_interval, sample_std


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
