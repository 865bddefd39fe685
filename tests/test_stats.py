"""The statistics every reported comparison rests on (capes/common/stats.py)."""
import math

import pytest

from capes.common.stats import median_ci, paired_mean_ci, wilson_ci
from capes.experiments.converge_test import paired_difference

pytest.importorskip("scipy")


def test_paired_interval_is_the_t_interval_of_the_differences():
    a = [0.90, 0.95, 0.85, 0.99, 0.92]
    b = [0.93, 0.96, 0.90, 0.99, 0.97]
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    half = 2.7764451 * sd / math.sqrt(5)            # t(0.975, 4 degrees of freedom)
    m, lo, hi = paired_mean_ci(a, b)
    assert m == pytest.approx(mean)
    assert (lo, hi) == pytest.approx((mean - half, mean + half), rel=1e-6)


def test_pairing_removes_the_shared_spread():
    # the runs differ a lot from seed to seed, B is ahead by 0.01 on each: paired, that
    # is resolved; an unpaired view would call it a tie
    a = [0.5, 0.9, 0.7, 0.6, 0.8]
    m, lo, hi = paired_mean_ci(a, [x + 0.01 for x in a])
    assert m == pytest.approx(0.01) and lo == pytest.approx(0.01) and hi == pytest.approx(0.01)


def test_paired_input_errors_are_clear():
    with pytest.raises(ValueError, match="differ in length"):
        paired_mean_ci([1.0, 2.0], [1.0])
    assert paired_mean_ci([1.0], [2.0]) is None


def test_runs_are_paired_by_seed_and_runs_without_the_metric_skipped():
    a = [{"seed": 0, "tp": 0.90}, {"seed": 1, "tp": 0.80}, {"seed": 2, "tp": None},
         {"seed": 3, "tp": 0.70}]
    b = [{"seed": 3, "tp": 0.75}, {"seed": 1, "tp": 0.82}, {"seed": 2, "tp": 0.99},
         {"seed": 9, "tp": 0.10}, {"seed": 0, "tp": 0.91}]
    d = paired_difference(a, b, "tp")
    assert d["n"] == 3                                 # seeds 0, 1, 3
    assert d["mean"] == pytest.approx((0.01 + 0.02 + 0.05) / 3)
    assert d["ci"][0] < d["mean"] < d["ci"][1]
    assert paired_difference(a[:1], b, "tp") is None   # one pair: no interval


def test_median_and_success_intervals_cover_their_estimate():
    med, lo, hi = median_ci(list(range(1, 31)))
    assert lo <= med <= hi and med == 15.5
    lo, hi = wilson_ci(30, 30)
    assert hi == 1.0 and 0.88 < lo < 0.9                 # 30/30 still admits ~89 %
