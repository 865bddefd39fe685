"""The reward's unit, one piece for both engine modes: a minibatch's returns are taken
in it, so that the Q-values stay of order one whatever the objective's units (bytes/s,
IOPS, a game's throughput). Each mode fits it from the objective p_t it keeps:

* :func:`spread` (the one-row mode with ``engine.scale_rewards``; its
  :class:`~drl_engine.normaliser.Normaliser` refits it as the cache grows and keeps it
  with the input statistics, ``objective_std``): the objective's standard deviation;
  the batch's rewards are multiplied by its reciprocal (``Experience.reward_scale``).
* :func:`level` (the per-node mode, ``RowData.p_scale``, fitted once over the first
  ticks and kept in the checkpoint's controller state): 1 % of the objective's mean
  magnitude, so a return of 1 is a 1 % change; the batch's returns are divided by it.

Either is 1 where the data give none (no finite value, no spread, no level)."""
from __future__ import annotations

import warnings

import numpy as np


def spread(p: np.ndarray) -> float:
    """The standard deviation of the objective values ``p`` (NaN: missing)."""
    with np.errstate(all="ignore"), warnings.catch_warnings(action="ignore",
                                                            category=RuntimeWarning):
        std = float(np.nanstd(p)) if np.isfinite(p).any() else 1.0
    return std if std > 1e-6 else 1.0


def level(p: np.ndarray) -> float:
    """1 % of the mean magnitude of the finite objective values ``p`` (an infinite one
    made the unit infinite, every return 0 or NaN, and was saved in checkpoints)."""
    p = np.where(np.isinf(p), np.nan, p)       # (the same sum as before without)
    mean = float(np.nanmean(np.abs(p))) if np.isfinite(p).any() else 0.0
    return mean / 100.0 if 0 < mean < np.inf else 1.0


__all__ = ["level", "spread"]
