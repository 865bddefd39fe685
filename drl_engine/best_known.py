"""The best-known setting of rows of knobs, by the objective's moving-average peak.

Every row's knobs when the objective's ``best_window``-tick moving average was highest
(the settings in effect ``settle_ticks`` + half a window earlier), replaced only by a
level higher by ``best_margin``; the best level decays by ``best_decay`` a tick, so a
best the workload no longer allows expires even without an alarm. The trust region
(``drl_engine.trust_region``) and rollback (``drl_engine.rollback``) are around it. The
per-node mode uses it; the one-row (flat) mode's best-known setting is the guide's
lower confidence bound per setting (``drl_engine.guide``), a different estimator kept as
it is (the paper game's single row has the few settings an LCB needs).
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("capes.engine")


class PeakTracker:
    """The moving-average peak over a :class:`~drl_engine.node_replay.NodeReplay`."""

    def __init__(self, model, settle_ticks: int, grid):
        self.mcfg, self.settle_ticks, self.grid = model, settle_ticks, grid
        self.level: float | None = None             # the objective's best_window average
        self.best_level: float | None = None
        self.best_idx: np.ndarray | None = None     # (N, K) grid indices
        self.best_tick: int | None = None           # when it was set
        self.best_nodes: np.ndarray | None = None   # (N,) the nodes present then
        self.best_from: int | None = None           # best windows start here or later

    def forget(self, tick: int | None) -> None:
        """Forget the best-known setting; track it afresh only over windows that start
        after a change at ``tick`` has settled."""
        self.best_level = self.best_idx = self.best_tick = None
        self.best_from = None if tick is None else int(tick) + self.settle_ticks

    def drop(self) -> None:
        """The best is no longer reachable (a rollback to it did not help)."""
        self.best_level = self.best_idx = self.best_tick = None

    def take(self, best_idx: np.ndarray, tick: int, present: np.ndarray) -> None:
        """A best handed over (the cold start's shared one), at the level measured now."""
        self.best_idx = best_idx
        self.best_level, self.best_tick = self.level, tick
        self.best_nodes = present.copy()
        self.best_from = None

    def track(self, rep, tick: int) -> bool:
        """Update the level and the best at ``tick``; True when other nodes are present
        than at the best-known setting's tick (one left or came back: levels over other
        nodes do not compare): the caller forgets it, as on an alarm."""
        W = self.mcfg.best_window
        ticks = np.arange(tick - W + 1, tick + 1)
        if ticks[0] < rep.oldest or (self.best_from is not None and
                                     ticks[0] < self.best_from):
            self.level = None
            return False
        p = rep.comparable(ticks, tick)
        if not np.isfinite(p).all():
            self.level = None
            return False
        level = float(p.mean())
        self.level = level
        now = rep.present[rep.slot(tick)]
        if self.best_idx is not None and (self.best_nodes != now).any():
            log.info("tick %d: other nodes present than at the best-known setting's "
                     "tick %d: it is forgotten", tick, self.best_tick)
            return True
        if self.best_level is not None:
            self.best_level -= self.mcfg.best_decay * abs(self.best_level)
        if self.best_level is None or level > self.best_level + \
                self.mcfg.best_margin * abs(self.best_level):
            at = max(rep.oldest, tick - self.settle_ticks - W // 2)
            knobs = rep.knobs[at % rep.capacity].astype(np.float64)
            if not np.isfinite(knobs[now]).all():
                return False
            # a node absent now is never moved or guarded: a placeholder until it is back
            knobs[~now] = np.median(knobs[now], axis=0)
            self.best_level, self.best_tick, self.best_nodes = level, int(tick), now.copy()
            self.best_idx = self.grid.index(knobs)
        return False


__all__ = ["PeakTracker"]
