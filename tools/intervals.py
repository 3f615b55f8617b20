"""Confidence intervals over seeds: percentile bootstrap of a mean and of a difference of two means.

Seeds are few (5-10), so the interval comes from resampling the seeds themselves, not from a normal
approximation. Two arms run with the same seeds share their common random numbers (an RL seed fixes the prompts of
every step and the held-out samples' draws), so their difference is taken per seed and those differences are
resampled (`paired_difference_interval`); `difference_interval` resamples each arm on its own, for arms without
shared seeds. The generator is seeded: the same values give the same interval.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

RESAMPLES = 10_000


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def columns(self, name: str) -> dict[str, float]:
        """Table columns <name>_mean, <name>_low, <name>_high."""
        return {f"{name}_mean": self.mean, f"{name}_low": self.low, f"{name}_high": self.high}

    def excludes_zero(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        if self.n == 0:
            return "n/a"
        if self.n == 1:
            return f"{self.mean:.3f} (1 seed)"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _percentiles(samples: list[float], level: float) -> tuple[float, float]:
    samples = sorted(samples)
    tail = (1.0 - level) / 2.0
    lo = samples[min(len(samples) - 1, max(0, int(math.floor(tail * len(samples)))))]
    hi = samples[min(len(samples) - 1, max(0, int(math.ceil((1.0 - tail) * len(samples))) - 1))]
    return lo, hi


def mean_interval(values, level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """The mean of `values` and its percentile-bootstrap interval (degenerate with fewer than 2 values)."""
    xs = _finite(values)
    if not xs:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return Interval(mean, mean, mean, 1)
    rng = random.Random(seed)
    n = len(xs)
    means = [sum(rng.choice(xs) for _ in range(n)) / n for _ in range(resamples)]
    lo, hi = _percentiles(means, level)
    return Interval(mean, lo, hi, n)


def difference_interval(values, baseline, level: float = 0.95, resamples: int = RESAMPLES,
                        seed: int = 0) -> Interval:
    """mean(values) - mean(baseline) with a bootstrap interval, each group resampled on its own."""
    xs, bs = _finite(values), _finite(baseline)
    if not xs or not bs:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    diff = sum(xs) / len(xs) - sum(bs) / len(bs)
    n = min(len(xs), len(bs))
    if n == 1:
        return Interval(diff, diff, diff, 1)
    rng = random.Random(seed)
    diffs = [sum(rng.choice(xs) for _ in xs) / len(xs) - sum(rng.choice(bs) for _ in bs) / len(bs)
             for _ in range(resamples)]
    lo, hi = _percentiles(diffs, level)
    return Interval(diff, lo, hi, n)


def paired_difference_interval(values, baseline, level: float = 0.95, resamples: int = RESAMPLES,
                               seed: int = 0) -> Interval:
    """mean over seeds of (value - baseline) of the same seed, with the bootstrap interval of that mean; `values`
    and `baseline` are aligned by seed (None where a seed has no run: that pair is left out)."""
    if len(values) != len(baseline):
        raise ValueError(f"paired values need one entry per seed on both sides, got {len(values)} and {len(baseline)}")
    diffs = [a - b for a, b in zip(values, baseline) if _finite([a]) and _finite([b])]
    return mean_interval(diffs, level, resamples, seed)


def sample_std(values) -> float:
    xs = _finite(values)
    if len(xs) < 2:
        return 0.0 if xs else float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
