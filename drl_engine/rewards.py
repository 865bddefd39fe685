"""Objectives (what to maximise) and reward types (how its change becomes a reward).

An objective maps one tick's PIs, an array of shape (ticks, nodes, PIs) restricted to
the PIs named in ``[reward] pis``, to one number per tick, p_t. A reward type maps the
series p to r_t, the reward of the transition from tick t to t + 1 (thesis §5.2.2):

* ``diff``:      r_t = p_{t+1} − p_t
* ``diff_avg``:  r_t = avg(p_{t−m+2..t+1}) − avg(p_{t−m+1..t})   (window m)
* ``diff_ewma``: r_t = e_{t+1} − e_t,  e_t = (1 − a)·e_{t−1} + a·p_t  (EWMA weight a)

Both are registry plug-ins. A plug-in is a class with an ``Options`` dataclass (its
``[reward] options`` / ``objective_options`` table, checked on load) and a
``__call__``; a reward type also says how many earlier objective values a reward at t
can depend on (``lookback``), so the engine recomputes only what new ticks change.
Register your own with ``@reward_type("name")`` or ``@objective("name")`` in a module
imported before the config is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from capes.common.registry import Registry

OBJECTIVES = Registry("objective")
REWARD_TYPES = Registry("reward type")
objective = OBJECTIVES.register
reward_type = REWARD_TYPES.register


@dataclass
class NoOptions:
    pass


def check_range(name: str, value, lo, hi) -> None:
    """ValueError unless ``lo <= value <= hi`` (an option's bounds, checked on load)."""
    if not lo <= value <= hi:
        raise ValueError(f"{name}: must lie in [{lo}, {hi}] (got {value})")


# -- objectives ---------------------------------------------------------------------------

@objective("throughput")
class TotalThroughput:
    """Sum of the named PIs over all nodes (NaN if any is missing)."""
    Options = NoOptions

    def __init__(self, options: NoOptions):
        self.options = options

    def __call__(self, pis: np.ndarray) -> np.ndarray:
        return pis.sum(axis=(1, 2))


@dataclass
class FairnessOptions:
    alpha: float = 1.0                   # α of Eq. 3.1

    def validate(self) -> None:
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha: must be a finite number >= 0 (got {self.alpha})")


@objective("throughput_fairness")
class ThroughputMinusStdev:
    """Eq. 3.1: total throughput − α · standard deviation of the nodes' throughputs."""
    Options = FairnessOptions

    def __init__(self, options: FairnessOptions):
        self.alpha = options.alpha

    def __call__(self, pis: np.ndarray) -> np.ndarray:
        per_node = pis.sum(axis=2)
        return per_node.sum(axis=1) - self.alpha * per_node.std(axis=1)


@dataclass
class LogOptions:
    floor: float = 1.0                   # a node's figure below this counts as this

    def validate(self) -> None:
        if not (math.isfinite(self.floor) and self.floor > 0):
            raise ValueError(f"floor: must be a finite number > 0 (got {self.floor})")


@objective("log_throughput")
class SumOfLogs:
    """Σ over the nodes of log(each node's figure): the proportional-fair objective
    (Kelly). Each node's own change counts by its ratio, so a client whose window cuts it
    from 14 MB/s to 0.05 is seen through another's ±5 MB/s of noise, which the sum
    hides (measured on the GlusterFS cluster: docs/targets.md). An idle node counts as
    ``floor`` whatever its knobs."""
    Options = LogOptions

    def __init__(self, options: LogOptions):
        self.floor = options.floor

    def __call__(self, pis: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(pis.sum(axis=2), self.floor)).sum(axis=1)


# -- reward types -------------------------------------------------------------------------

def ewma(p: np.ndarray, weight: float, start: float = np.nan) -> np.ndarray:
    """EWMA of ``p``; a NaN input carries the previous value forward."""
    out = np.empty_like(p, dtype=np.float64)
    e = start
    for i, x in enumerate(p):
        if not np.isnan(x):
            e = x if np.isnan(e) else (1.0 - weight) * e + weight * x
        out[i] = e
    return out


def moving_average(p: np.ndarray, m: int) -> np.ndarray:
    """Mean of the ``m`` values ending at each tick; NaN before the ``m``-th."""
    out = np.full(len(p), np.nan)
    if len(p) >= m:
        c = np.concatenate([[0.0], np.cumsum(p, dtype=np.float64)])
        out[m - 1:] = (c[m:] - c[:-m]) / m
    return out


def next_minus_now(x: np.ndarray) -> np.ndarray:
    """r_t = x_{t+1} − x_t; NaN at the last tick, which has no next value yet."""
    r = np.full(len(x), np.nan)
    r[:-1] = x[1:] - x[:-1]
    return r


@reward_type("diff")
class Diff:
    Options = NoOptions
    lookback = 1

    def __init__(self, options: NoOptions):
        self.options = options

    def __call__(self, p: np.ndarray) -> np.ndarray:
        return next_minus_now(p)


@dataclass
class MovingAverageOptions:
    window: int = 5                      # m

    def validate(self) -> None:
        check_range("window", self.window, 1, 100_000)


@reward_type("diff_avg")
class DiffOfMovingAverage:
    Options = MovingAverageOptions

    def __init__(self, options: MovingAverageOptions):
        self.m = options.window
        self.lookback = self.m + 1

    def __call__(self, p: np.ndarray) -> np.ndarray:
        return next_minus_now(moving_average(p, self.m))


@dataclass
class EWMAOptions:
    weight: float = 0.2                  # a: weight of the newest value

    def validate(self) -> None:
        # below 0.001 the EWMA's exact lookback passes 20,000 ticks (and at 1e-17,
        # 1 − weight == 1 and the lookback is infinite)
        check_range("weight", self.weight, 0.001, 1)


@reward_type("diff_ewma")
class DiffOfEWMA:
    Options = EWMAOptions

    def __init__(self, options: EWMAOptions):
        self.weight = options.weight
        # long enough that the truncated EWMA is exact to 1e-9
        self.lookback = 1 + math.ceil(math.log(1e-9) / math.log(1.0 - min(self.weight,
                                                                          0.999999)))

    def __call__(self, p: np.ndarray) -> np.ndarray:
        return next_minus_now(ewma(p, self.weight))


def pi_columns(pis: list[str], pi_names) -> list[int]:
    """Columns of the objective's PIs among the recorded ones."""
    missing = [p for p in pis if p not in pi_names]
    if missing:
        raise ValueError(f"objective PIs {missing} are not among the recorded PIs "
                         f"{list(pi_names)}")
    return [list(pi_names).index(p) for p in pis]
