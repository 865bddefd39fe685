"""The row floor: a row whose own objective collapses away from its best-known setting
goes back, and does not go there again.

The per-node mode's counterpart of the one-row default's probe floor
(``engine.probe_floor``, ``probe_avoid_bad``) and of a sweep's abort
(``cluster_engine.sweep_abort``), which judge the same way: by the row's **own**
objective (its node's PIs among the reward's), not the cluster's. A row's move shows in
the cluster objective diluted by the other rows (a client of four falling from 10 to
1.2 MB/s moved the sum 30 → 22 MB/s, inside the noise of a 10-tick average), so the
cluster-wide rollback (``drl_engine.rollback``) needs most of a minute to see it; the
row's own figure shows it within the settle time.

Per row, its **level** is the median of its own objective over its last ``LEVEL_TICKS``
settled ticks on its knobs of the best-known setting (``best_idx``, the peak tracker's;
none known: no floor). A row off that setting, settled there (``settle_ticks`` since
its knobs last changed), whose own objective lies below ``row_floor`` × its level for
``FALL_TICKS`` ticks in a row **falls**: it walks back to its best-known knobs (its
probe ends, no greedy move until it is there) and the value it fell at bounds its knob
from then on (no move of that row reaches it or goes beyond, on that side of its
best-known value) until the best-known setting is forgotten (a new workload) or moves
outside the bounds. Rows a sweep or a recall moves are not judged (the sweep has its
own abort; a recall walks to a measured setting). ``row_floor = 0`` turns it off (the
ablation).
"""
from __future__ import annotations

import logging
from collections import deque

import numpy as np

log = logging.getLogger("capes.engine")


class RowFloor:
    LEVEL_TICKS = 10   # a row's level: the median of its last this many settled ticks home
    MIN_LEVEL = 3      # ... once it has at least this many
    FALL_TICKS = 2     # settled ticks in a row below the floor
    RECENT_FALLS = 256  # (tick, row) of the latest falls kept (a week-long session's
                        # every fall would grow without bound; ``fall_count`` counts all)

    def __init__(self, rows: int, knobs: int, fraction: float, settle_ticks: int):
        self.fraction, self.settle = float(fraction), int(settle_ticks)
        self.falls: deque[tuple[int, int]] = deque(maxlen=self.RECENT_FALLS)
        self.fall_count = 0                          # falls since the engine started
        self.blocked = 0                             # moves the bounds turned to NULL
        self._alloc(rows, knobs)

    def _alloc(self, rows: int, knobs: int) -> None:
        self.home_own = np.full((rows, self.LEVEL_TICKS), np.nan)   # ring per row
        self.pos = np.zeros(rows, np.int64)
        self.home = np.full((rows, knobs), -1, np.int64)    # best-known knobs judged by
        self.moved = np.full(rows, np.iinfo(np.int64).min // 2, np.int64)
        self.last_idx: np.ndarray | None = None
        self.below = np.zeros(rows, np.int64)
        self.returning = np.zeros(rows, bool)
        self.lo = np.full((rows, knobs), -1, np.int64)      # no move to <= lo ...
        self.hi = np.full((rows, knobs), np.iinfo(np.int64).max, np.int64)  # ... or >= hi

    @property
    def active(self) -> bool:
        return self.fraction > 0

    def grow(self, extra: int) -> None:
        """Rows appended (nodes joined): nothing known of them."""
        rows, knobs = self.home.shape
        old = {a: getattr(self, a) for a in ("home_own", "pos", "home", "moved", "below",
                                             "returning", "lo", "hi")}
        self._alloc(rows + extra, knobs)
        for a, v in old.items():
            getattr(self, a)[:rows] = v

    def reset(self) -> None:
        """The best-known setting forgotten (a new workload): levels and bounds too."""
        rows, knobs = self.home.shape
        self._alloc(rows, knobs)          # the falls and counters stay

    def level(self) -> np.ndarray:
        """Each row's level at home (NaN: fewer than ``MIN_LEVEL`` settled ticks there)."""
        n = np.isfinite(self.home_own).sum(axis=1)
        with np.errstate(all="ignore"):
            lv = np.nanmedian(np.where(n[:, None] > 0, self.home_own, 0.0), axis=1)
        return np.where(n >= self.MIN_LEVEL, lv, np.nan)

    def observe(self, tick: int, idx: np.ndarray, own: np.ndarray,
                best_idx: np.ndarray | None, judged: np.ndarray) -> np.ndarray:
        """One tick: ``idx`` (N, K) the grid indices in effect, ``own`` (N,) each row's
        own objective (NaN: none), ``best_idx`` the best-known setting's, ``judged``
        (N,) the rows the floor may judge (not sweeping, recalling or rolled back).
        Returns the rows that fell this tick."""
        n = len(idx)
        fell = np.zeros(n, bool)
        if not self.active:
            return fell
        if self.last_idx is not None and self.last_idx.shape == idx.shape:
            self.moved[(idx != self.last_idx).any(axis=1)] = tick
        self.last_idx = idx.copy()
        if best_idx is None or np.shape(best_idx) != idx.shape:
            self.below[:] = 0
            self.returning[:] = False
            return fell
        new_home = (best_idx != self.home).any(axis=1)
        if new_home.any():                   # a level belongs to its home; bounds that
            r = np.flatnonzero(new_home)     # leave the new home inside are kept
            self.home[r] = best_idx[r]
            self.home_own[r] = np.nan
            self.below[r] = 0
            out = ((best_idx[r] <= self.lo[r]) | (best_idx[r] >= self.hi[r])).any(axis=1)
            self.lo[r[out]], self.hi[r[out]] = -1, np.iinfo(np.int64).max
        at_home = (idx == best_idx).all(axis=1)
        self.returning &= ~at_home
        settled = tick - self.moved >= self.settle
        ok = np.isfinite(own) & settled
        put = np.flatnonzero(ok & at_home)
        self.home_own[put, self.pos[put] % self.LEVEL_TICKS] = own[put]
        self.pos[put] += 1
        lv = self.level()
        with np.errstate(invalid="ignore"):
            low = (ok & ~at_home & judged & ~self.returning & np.isfinite(lv)
                   & (own < self.fraction * lv))
        self.below = np.where(low, self.below + 1, 0)
        fell = self.below >= self.FALL_TICKS
        for r in np.flatnonzero(fell):
            up, down = idx[r] > best_idx[r], idx[r] < best_idx[r]
            self.hi[r] = np.where(up, np.minimum(self.hi[r], idx[r]), self.hi[r])
            self.lo[r] = np.where(down, np.maximum(self.lo[r], idx[r]), self.lo[r])
            self.falls.append((int(tick), int(r)))
            self.fall_count += 1
            log.info("tick %d: row %d's own objective %.4g stayed below %.0f %% of its "
                     "level %.4g at its best-known knobs: back there, %s bounded", tick, r,
                     own[r], 100 * self.fraction, lv[r], idx[r].tolist())
        self.returning |= fell
        self.below[fell] = 0
        return fell

    def block(self, idx: np.ndarray, after: np.ndarray, acts: np.ndarray) -> np.ndarray:
        """``acts`` with every move whose knobs ``after`` (N, K) reach a row's bound, on
        a knob it changes, turned to NULL (0)."""
        if not self.active:
            return acts
        moved = after != idx
        bad = (moved & ((after <= self.lo) | (after >= self.hi))).any(axis=1) & (acts != 0)
        self.blocked += int(bad.sum())
        return np.where(bad, 0, acts)


__all__ = ["RowFloor"]
