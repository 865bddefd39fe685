"""Objectives (what to maximise) and reward types (how its change becomes a reward).

An objective maps one tick's PIs, an array of shape (ticks, nodes, PIs), to one number
per tick, p_t. A reward type maps the series p to r_t, the reward of the transition from
tick t to t + 1 (thesis §5.2.2):

* ``diff``:      r_t = p_{t+1} − p_t
* ``diff_avg``:  r_t = avg(p_{t−m+2..t+1}) − avg(p_{t−m+1..t})   (window m)
* ``diff_ewma``: r_t = e_{t+1} − e_t,  e_t = (1 − a)·e_{t−1} + a·p_t  (EWMA weight a)

Both are plug-ins: add one with ``@objective("name")`` or ``@reward_type("name")``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from capes.common.registry import Registry

OBJECTIVES = Registry("objective")
REWARD_TYPES = Registry("reward type")
objective = OBJECTIVES.register
reward_type = REWARD_TYPES.register


@dataclass
class RewardConfig:
    objective: str = "throughput"
    pis: list[str] = field(default_factory=lambda: ["throughput"])
    fairness_alpha: float = 1.0          # α of Eq. 3.1 (objective "throughput_fairness")
    type: Literal["diff", "diff_avg", "diff_ewma"] = "diff"
    avg_window: int = 5                  # m of diff_avg
    ewma_weight: float = 0.2             # a of diff_ewma

    def validate(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: unknown objective {self.objective!r} "
                             f"(known: {', '.join(sorted(OBJECTIVES))})")
        if not self.pis:
            raise ValueError("pis: name at least one PI")
        if self.avg_window < 1:
            raise ValueError(f"avg_window: must be >= 1 (got {self.avg_window})")
        if not 0 < self.ewma_weight <= 1:
            raise ValueError(f"ewma_weight: must lie in (0, 1] (got {self.ewma_weight})")


def pi_columns(cfg: RewardConfig, pi_names) -> list[int]:
    missing = [p for p in cfg.pis if p not in pi_names]
    if missing:
        raise ValueError(f"objective PIs {missing} are not among the recorded PIs "
                         f"{list(pi_names)}")
    return [list(pi_names).index(p) for p in cfg.pis]


@objective("throughput")
def total_throughput(pis: np.ndarray, cols: list[int], cfg: RewardConfig) -> np.ndarray:
    """Sum of the named PIs over all nodes (NaN if any is missing)."""
    return pis[:, :, cols].sum(axis=(1, 2))


@objective("throughput_fairness")
def throughput_minus_stdev(pis: np.ndarray, cols: list[int], cfg: RewardConfig) -> np.ndarray:
    """Eq. 3.1: total throughput − α · standard deviation of the nodes' throughputs."""
    per_node = pis[:, :, cols].sum(axis=2)
    return per_node.sum(axis=1) - cfg.fairness_alpha * per_node.std(axis=1)


def ewma(p: np.ndarray, weight: float, start: float = np.nan) -> np.ndarray:
    """EWMA of ``p``; a NaN input carries the previous value forward."""
    out = np.empty_like(p, dtype=np.float64)
    e = start
    for i, x in enumerate(p):
        if not np.isnan(x):
            e = x if np.isnan(e) else (1.0 - weight) * e + weight * x
        out[i] = e
    return out


@reward_type("diff")
def diff(p: np.ndarray, cfg: RewardConfig) -> np.ndarray:
    r = np.full(len(p), np.nan)
    r[:-1] = p[1:] - p[:-1]
    return r


@reward_type("diff_avg")
def diff_of_moving_average(p: np.ndarray, cfg: RewardConfig) -> np.ndarray:
    m = cfg.avg_window
    r = np.full(len(p), np.nan)
    if len(p) >= m + 1:
        c = np.concatenate([[0.0], np.cumsum(p, dtype=np.float64)])
        avg = (c[m:] - c[:-m]) / m            # avg[j] = mean(p[j..j+m-1])
        # r_t = avg ending at t+1 − avg ending at t  ->  avg[t-m+2] − avg[t-m+1]
        r[m - 1:-1] = avg[1:] - avg[:-1]
    return r


@reward_type("diff_ewma")
def diff_of_ewma(p: np.ndarray, cfg: RewardConfig) -> np.ndarray:
    e = ewma(p, cfg.ewma_weight)
    r = np.full(len(p), np.nan)
    r[:-1] = e[1:] - e[:-1]
    return r
