"""Small statistics for reporting results honestly (the t interval needs scipy, the
optional extra ``stats``; the rest is dependency-free)."""
from __future__ import annotations

import math
from statistics import NormalDist


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


def paired_mean_ci(a, b, confidence: float = 0.95) -> tuple[float, float, float] | None:
    """Mean of the paired differences ``b[i] − a[i]`` and its Student t interval (None
    with fewer than two pairs). Pairing (same seed, two tuners) removes the run-to-run
    spread they share, which is most of it in a seeded simulator."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length ({len(a)} and {len(b)})")
    n = len(a)
    if n < 2:
        return None
    from scipy import stats
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half
