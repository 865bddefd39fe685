"""Input normalisation: per-(node, PI) mean and standard deviation of the PIs, and the
spread of the objective (the one-row mode's reward unit, ``drl_engine.reward_scale``). PIs differ by orders of magnitude (bytes/s
next to a window of 50); a network sees them better as z-scores.

The statistics follow the data: ``maybe_update`` recomputes them when the cache has
grown by 5 % since the last time. Statistics loaded from a checkpoint are kept until
this DB has ``PRIOR_TICKS`` ticks of its own, so a pretrained model first sees inputs
scaled as in its training.
"""
from __future__ import annotations

import warnings

import numpy as np

from drl_engine import reward_scale


class Normaliser:
    PRIOR_TICKS = 1000

    def __init__(self):
        self.mean: np.ndarray | None = None     # (nodes, PIs)
        self.std: np.ndarray | None = None
        self.objective_std = 1.0
        self._at_ticks = 0
        self._prior_until = 0

    def maybe_update(self, pis: list[np.ndarray], objective: list[np.ndarray]) -> None:
        """Recompute from every cached tick (``pis``: per-session (ticks, nodes, PIs)
        arrays; ``objective``: per-session p_t) when the cache grew by 5 %."""
        total = sum(len(p) for p in pis)
        if total < self._prior_until or total - self._at_ticks < max(1, total // 20):
            return
        self._at_ticks = total
        chunks = [p for p in pis if len(p)]
        if not chunks:
            return
        allp = np.concatenate(chunks)
        with np.errstate(all="ignore"), warnings.catch_warnings(action="ignore",
                                                                category=RuntimeWarning):
            mean = np.nanmean(allp, axis=0)
            std = np.nanstd(allp, axis=0)
        self.mean = np.nan_to_num(mean).astype(np.float32)
        self.std = np.where(np.isfinite(std) & (std > 1e-6), std, 1.0).astype(np.float32)
        self.objective_std = reward_scale.spread(np.concatenate(objective) if objective
                                                 else np.zeros(0))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """z-scores of ``x`` (..., nodes, PIs); unchanged until statistics exist."""
        return x if self.mean is None else (x - self.mean) / self.std

    def state(self) -> dict | None:
        """The statistics, for a checkpoint (None before any exist)."""
        if self.mean is None:
            return None
        return {"mean": self.mean.tolist(), "std": self.std.tolist(),
                "objective_std": self.objective_std}

    def load(self, state: dict) -> None:
        mean = np.asarray(state["mean"], np.float32)
        if self.mean is not None and mean.shape != self.mean.shape:
            raise ValueError("checkpoint statistics do not fit this layout")
        self.mean, self.std = mean, np.asarray(state["std"], np.float32)
        self.objective_std = float(state["objective_std"])
        self._prior_until = self.PRIOR_TICKS
