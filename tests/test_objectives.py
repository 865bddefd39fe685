"""Objectives: what the engine maximises from one tick's PIs (drl_engine/rewards.py)."""
from __future__ import annotations

import numpy as np
import pytest

from drl_engine.config import RewardConfig
from drl_engine.rewards import OBJECTIVES


def build(name, **options):
    return OBJECTIVES.build(name, options, "objective_options", "<test>")


def test_sum_of_logs_sees_a_small_clients_collapse_that_the_sum_hides():
    """Two clients: a writer at ~10 MB/s ± 3, an mmap reader that a large window takes
    from 14 MB/s to 0.05. The sum's change from the reader is within the writer's swing;
    the sum of logs' is far beyond it."""
    writer = np.array([10e6, 13e6, 7e6])
    good = np.stack([writer, np.full(3, 14e6)], axis=1)[:, :, None]     # (ticks, nodes, 1)
    bad = np.stack([writer[::-1], np.full(3, 0.05e6)], axis=1)[:, :, None]
    total, logs = build("throughput"), build("log_throughput", floor=1e5)
    swing_total = np.ptp(total(good[:, :1]))
    swing_logs = np.ptp(logs(good[:, :1]))
    assert total(good).mean() - total(bad).mean() == pytest.approx(13.95e6)
    assert logs(good).min() - logs(bad).max() > 5 * swing_logs
    assert swing_total > 0.4 * (total(good).mean() - total(bad).mean())
    # per node, the named PIs are summed first; below the floor counts as the floor
    two = np.array([[[1e6, 1e6], [0.0, 0.0]]])
    assert logs(two)[0] == pytest.approx(np.log(2e6) + np.log(1e5))
    assert np.isnan(logs(np.array([[[np.nan], [1e6]]])))[0]   # a missing PI: no value


def test_its_floor_is_checked_on_load():
    with pytest.raises(ValueError, match="floor"):
        build("log_throughput", floor=0)
    with pytest.raises(ValueError, match="floor"):
        RewardConfig(objective="log_throughput", objective_options={"floor": -1.0}).validate()


def test_the_smoothed_rewards_are_the_next_minus_the_current_smoothed_objective():
    """diff_avg: r_t = mean of the m values ending at t+1 − that ending at t; NaN where
    either is not there yet (the first m − 1 ticks, and the last, which has no next)."""
    from drl_engine.rewards import REWARD_TYPES
    p = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    r = REWARD_TYPES.build("diff_avg", {"window": 2}, "options", "<test>")(p)
    np.testing.assert_array_equal(r, [np.nan, 1.5, 3.0, 6.0, np.nan])   # 1.5, 3, 6, 12
    short = REWARD_TYPES.build("diff_avg", {"window": 5}, "options", "<test>")(p)
    assert np.isnan(short).all()                     # one average: nothing to subtract
    e = REWARD_TYPES.build("diff_ewma", {"weight": 0.5}, "options", "<test>")(p)
    np.testing.assert_array_equal(e, [0.5, 1.25, 2.625, 5.3125, np.nan])
