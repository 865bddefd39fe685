"""Small statistics for reporting results honestly: intervals for a median, a success
rate and a mean (the t intervals import scipy, a base dependency, only when called,
so that the agents never load it)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

NAN = float("nan")


def binom_cdf(k: int, n: int, p: float = 0.5) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def median_ci(values, confidence: float = 0.95) -> tuple[float, float, float] | None:
    """Median and a distribution-free confidence interval from order statistics.

    The interval [x_(j), x_(k)] covers the median with probability >= ``confidence``
    (binomial argument); with fewer than 6 values it is the whole range.
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return None
    mid = n // 2
    median = xs[mid] if n % 2 else 0.5 * (xs[mid - 1] + xs[mid])
    alpha = 1 - confidence
    j = 0
    while j + 1 < n and binom_cdf(j, n) <= alpha / 2:   # largest j with P(B <= j-1) <= a/2
        j += 1
    lo_idx = max(0, j - 1)
    hi_idx = min(n - 1, n - 1 - lo_idx)
    return median, float(xs[lo_idx]), float(xs[hi_idx])


def wilson_ci(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a success rate."""
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class MeanCI:
    n: int
    mean: float
    sd: float
    low: float
    high: float

    @property
    def rel_half_width(self) -> float:
        if not (math.isfinite(self.low) and self.mean):
            return NAN
        return (self.high - self.low) / 2 / abs(self.mean)


def mean_ci(x, confidence: float = 0.95) -> MeanCI:
    """The mean and its Student t confidence interval (NaN bounds below 2 samples)."""
    x = np.asarray(x, dtype=float)
    n = x.size
    if n == 0:
        return MeanCI(0, NAN, NAN, NAN, NAN)
    m = float(x.mean())
    if n < 2:
        return MeanCI(1, m, NAN, NAN, NAN)
    sd = float(x.std(ddof=1))
    if sd == 0.0:
        return MeanCI(n, m, 0.0, m, m)
    from scipy import stats
    lo, hi = stats.t.interval(confidence, n - 1, loc=m, scale=sd / math.sqrt(n))
    return MeanCI(n, m, sd, float(lo), float(hi))


def paired_mean_ci(a, b, confidence: float = 0.95) -> tuple[float, float, float] | None:
    """Mean of the paired differences ``b[i] − a[i]`` and its Student t interval (None
    with fewer than two pairs). Pairing (same seed, two tuners) removes the run-to-run
    spread they share, which is most of it in a seeded simulator."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} and {len(b)})")
    if len(a) < 2:
        return None
    ci = mean_ci([y - x for x, y in zip(a, b)], confidence)
    return ci.mean, ci.low, ci.high


def paired_bootstrap_ci(a, b, stat=np.median, confidence: float = 0.95,
                        resamples: int = 2000, seed: int = 0
                        ) -> tuple[float, float, float] | None:
    """``stat`` (default the median) of the paired differences ``b[i] − a[i]`` and a
    percentile bootstrap interval over the pairs (the seeds resampled with
    replacement); None with fewer than two pairs. No normality assumed: times to a
    band are skewed and censored at the time limit."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} and {len(b)})")
    if len(a) < 2:
        return None
    d = np.asarray(b, float) - np.asarray(a, float)
    rng = np.random.default_rng(seed)
    boot = stat(d[rng.integers(0, len(d), (resamples, len(d)))], axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return float(stat(d)), float(lo), float(hi)
