"""The best-known setting, both modes': one state, two estimators.

What the trust region stays around, the rollback goes back to, a context remembers and
a checkpoint keeps is one thing, :class:`BestKnown`: the grid indices of a setting
(``best_idx``: (K,) for the one row of the flat mode, (N, K) for the per-node mode's
rows) and the tick it was named at (``best_tick``); ``take`` hands one in (a cold
start's, a recalled context's, a group search's, an alarm's anchor), ``drop`` loses it.
Each mode's controller holds one (the guide's ``known``, the row controller's ``best``)
and every reader in that mode goes through it: the guide keeps no second copy or
accessor. Two estimators name it, each fitted to what its mode can afford (one for
both would move one mode's results, which the engine traces pin):

* :class:`LowerBound` (the flat mode, through the guide, ``drl_engine.guide``): per
  setting the kernel-smoothed mean of the objective credited to it less ``lcb_kappa``
  standard errors, recomputed every ``best_refresh_ticks``. One row has few enough
  settings that each is sampled often enough for a bound.
* :class:`PeakTracker` (the per-node mode): every row's knobs when the objective's
  ``best_window``-tick moving average was highest (the settings in effect
  ``settle_ticks`` + half a window earlier), replaced only by a level higher by
  ``best_margin``; the best level decays by ``best_decay`` a tick, so a best the
  workload no longer allows expires even without an alarm. N rows make too many joint
  settings for per-setting statistics. The trust region (``drl_engine.trust_region``)
  and rollback (``drl_engine.rollback``) are around it.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("capes.engine")


class BestKnown:
    """A best-known setting (grid indices) and the tick it was named at."""

    def __init__(self, tick: int | None = None):
        self.best_idx: np.ndarray | None = None     # grid indices: (K,) or (N, K)
        self.best_tick: int | None = tick           # when it was named

    def take(self, best_idx: np.ndarray | None, tick: int | None) -> None:
        """A best handed in from elsewhere (or None: none known)."""
        self.best_idx, self.best_tick = best_idx, tick

    def drop(self) -> None:
        """The best is no longer reachable or no longer the workload's."""
        self.best_idx = self.best_tick = None


class LowerBound(BestKnown):
    """The flat mode's estimator over the guide's per-setting statistics (see the module
    docstring); ``best_tick`` −1: to be recomputed at the next :meth:`setting`.
    ``stats``: the owner of those sums (the guide: ``dense``, ``grid_stats`` or ``sums``,
    ``shape``, ``pooled_variance``), read at each refresh: a context swaps its own in."""

    def __init__(self, cfg, stats):
        super().__init__(tick=-1)
        self.cfg, self.stats = cfg, stats
        self.had_best = False          # a best was known once: best None is a new workload
        self._kernels: list[np.ndarray] | None = None   # per axis, fixed by the grid

    def take(self, best_idx: np.ndarray | None, tick: int | None = -1) -> None:
        """A best handed in (an alarm's anchor, a recalled context's): it stands until
        the statistics name one at the next refresh."""
        super().take(best_idx, tick)

    def stale(self) -> None:
        """Other statistics (a context's, swapped in): recomputed at the next call."""
        self.best_tick = -1

    def setting(self, now: int) -> np.ndarray | None:
        """Grid indices of the best-known setting by its lower confidence bound,
        recomputed every ``best_refresh_ticks`` ticks (None before any setting was
        seen)."""
        cfg, stats = self.cfg, self.stats
        if self.best_idx is not None and 0 <= now - self.best_tick < cfg.best_refresh_ticks:
            return self.best_idx
        if stats.dense:
            if not stats.grid_stats[2].any():
                return self.best_idx
            s, sq, n = self._smooth_dense(stats.grid_stats, stats.shape)
            visited = stats.grid_stats[2] > 0
            keys = np.argwhere(visited)
            s, sq, n = s[visited], sq[visited], n[visited]
        else:
            if not stats.sums:
                return self.best_idx
            keys = np.array(list(stats.sums), np.float64)                  # (V, P)
            cells = np.array(list(stats.sums.values()), np.float64)        # (V, 3)
            d2 = (((keys[:, None, :] - keys[None, :, :]) / cfg.kernel_steps) ** 2).sum(-1)
            w = np.exp(-0.5 * d2)                                         # (V, V)
            s, sq, n = w @ cells[:, 0], w @ cells[:, 1], w @ cells[:, 2]
        mean = s / n
        var = np.maximum(sq / n - mean ** 2, 0.0)
        if cfg.lcb_pooled_noise:
            var = np.maximum(var, stats.pooled_variance())
        lcb = mean - cfg.lcb_kappa * np.sqrt(var / np.maximum(n, 1.0))
        lcb[n < cfg.best_min_samples] = -np.inf
        if not np.isfinite(lcb).any():
            lcb = mean
        self.best_idx = np.asarray(keys[int(np.argmax(lcb))]).astype(np.int64)
        self.best_tick = now
        self.had_best = True
        return self.best_idx

    def _smooth_dense(self, grid_stats: np.ndarray, shape: tuple):
        """The Gaussian-kernel sums of every cell, one axis at a time."""
        if self._kernels is None:                  # fixed by the grid: built once
            self._kernels = []
            for size in shape:
                i = np.arange(size)
                self._kernels.append(
                    np.exp(-0.5 * ((i[:, None] - i[None, :]) / self.cfg.kernel_steps) ** 2))
        out = grid_stats
        for axis, k in enumerate(self._kernels):
            out = np.moveaxis(np.tensordot(out, k, axes=([axis + 1], [0])), -1, axis + 1)
        return out[0], out[1], out[2]


class PeakTracker(BestKnown):
    """The moving-average peak over a :class:`~drl_engine.node_replay.NodeReplay`."""

    def __init__(self, model, settle_ticks: int, grid):
        super().__init__()
        self.mcfg, self.settle_ticks, self.grid = model, settle_ticks, grid
        self.level: float | None = None             # the objective's best_window average
        self.best_level: float | None = None
        self.best_nodes: np.ndarray | None = None   # (N,) the nodes present then
        self.best_from: int | None = None           # best windows start here or later

    def forget(self, tick: int | None) -> None:
        """Forget the best-known setting; track it afresh only over windows that start
        after a change at ``tick`` has settled."""
        self.drop()
        self.best_from = None if tick is None else int(tick) + self.settle_ticks

    def drop(self) -> None:
        """The best is no longer reachable (a rollback to it did not help)."""
        super().drop()
        self.best_level = None

    def take(self, best_idx: np.ndarray, tick: int, present: np.ndarray) -> None:
        """A best handed over (the cold start's shared one), at the level measured now."""
        super().take(best_idx, tick)
        self.best_level = self.level
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


__all__ = ["BestKnown", "LowerBound", "PeakTracker"]
