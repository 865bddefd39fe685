"""Rollback to the best-known setting when the objective stays below it.

When the objective's ``best_window``-tick level stays below ``rollback_fraction`` of the
best-known level (``drl_engine.best_known``) for ``rollback_ticks`` ticks, the engine
puts every row's dynamic knobs back on the best-known setting (``Decision.rolled_back``)
and holds them there to measure it; still below then, that best is no longer reachable
(a change the detector missed, or a transient): it is dropped and counted
(``stale_bests``).

How the setting goes back (``rollback_walk``): by default a walk, each row moving one
knob by at most ``actions.MAX_STEPS`` steps a tick, the interface daemon's per-node step
rule (``interface_daemon.action_checker``); the jump of every knob at once (the ablation,
``rollback_walk = false``) is refused by a live daemon whenever a row must move two
knobs, and the hold then measured the bad setting it was meant to leave: the good best
was dropped, a new one set at the bad level, and the cascade of rollbacks and ever lower
bests lost a CI demo.

When the measure starts: once every present row's knob PIs (the values the nodes report)
are on the setting, on the knobs' step grid; the hold then lasts ``settle_ticks`` +
``best_window`` ticks from there. In simulated time a jump shows up on the next tick: the
fixed hold it always was. On a live cluster an action reaches the nodes late (the control
plane and the agents wait for CPU under load) or never (refused): a setting not in effect
``rollback_ticks`` ticks after its last move (the walk's length allowed for) ends the
hold with no verdict (``unconfirmed``), the best kept, for it was never measured.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("capes.engine")


class Rollback:
    def __init__(self, model, settle_ticks: int):
        self.mcfg, self.settle_ticks = model, settle_ticks
        self.below = 0                          # ticks in a row below the fraction
        self.due = False                        # the next act rolls back
        self.hold_until: int | None = None      # measured: hold until this tick
        self.target: np.ndarray | None = None   # (N, K) grid indices rolled back to ...
        self.cells: np.ndarray | None = None    # ... on these (row, knob) cells
        self.since: int | None = None           # the tick of the rollback awaiting them
        self.deadline: int | None = None        # ... given up at this tick
        self.rollback_ticks: list[int] = []
        self.stale_bests = 0                    # bests dropped: a rollback did not help
        self.unconfirmed = 0                    # rollbacks whose setting never showed up

    def reset(self) -> None:
        """A new workload (or a best handed over): nothing pending."""
        self.below, self.due, self.hold_until = 0, False, None
        self.target = self.cells = self.since = self.deadline = None

    @property
    def waiting(self) -> bool:
        """Rolled back, the setting not seen in effect yet."""
        return self.since is not None

    def holding(self, tick: int) -> bool:
        """Waiting for the rolled-back setting or measuring it: no moves, no probes."""
        return self.waiting or (self.hold_until is not None and tick < self.hold_until)

    def watch(self, tick: int, best, knobs=None, present=None, grid=None) -> None:
        """Count the ticks in a row that ``best``'s level (a
        :class:`~drl_engine.best_known.PeakTracker`) stays below the floor; set ``due``
        after ``rollback_ticks`` of them; after a rollback, wait until the nodes'
        ``knobs`` (N, K) PIs at ``tick`` are on its setting, hold, and drop a best still
        below."""
        if self.waiting:
            self._await(tick, knobs, present, grid)
            return
        f = self.mcfg.rollback_fraction
        if not f or best.best_level is None or best.level is None or best.best_idx is None:
            self.below = 0
            return
        floor = best.best_level - (1.0 - f) * abs(best.best_level)
        if self.hold_until is not None:
            if tick < self.hold_until:
                return
            self.hold_until = None
            self.below = 0
            if best.level < floor:
                log.info("tick %d: back at the best-known setting the level is %.4g, "
                         "below %.4g: that best is dropped", tick, best.level, floor)
                self.stale_bests += 1
                best.drop()
            return
        self.below = self.below + 1 if best.level < floor else 0
        if self.below < self.mcfg.rollback_ticks or self.due:
            return
        self.below = 0
        self.due = True

    def _await(self, tick: int, knobs, present, grid) -> None:
        """The hold's measure starts once the rolled-back setting is in effect."""
        if knobs is None or self.target is None or self.target.shape != np.shape(knobs):
            seen = True                     # nothing to read back: the fixed hold
        else:
            cells = self.cells & np.asarray(present, bool)[:, None]
            v = np.asarray(knobs, np.float64)
            ok = np.isfinite(v)
            on = ok & (grid.index(np.where(ok, v, grid.lo)) == self.target)
            seen = bool(on[cells].all())
        if seen:
            self.reset()
            self.hold_until = tick + self.settle_ticks + self.mcfg.best_window
            return
        if tick >= self.deadline:
            log.info("tick %d: the setting rolled back to at tick %d is not in effect "
                     "yet: no verdict, the best is kept", tick, self.since)
            self.reset()
            self.unconfirmed += 1

    def start(self, tick: int, target: np.ndarray | None = None,
              cells: np.ndarray | None = None, walk_ticks: int = 0) -> None:
        """The rollback to the grid indices ``target`` (N, K) on ``cells`` (N, K) starts
        at ``tick`` (a walk of ``walk_ticks`` ticks): wait for it, hold, and count it."""
        self.due = False
        self.hold_until = None
        self.since = tick
        self.deadline = tick + walk_ticks + self.mcfg.rollback_ticks
        self.target = None if target is None else np.asarray(target, np.int64).copy()
        self.cells = None if cells is None else np.asarray(cells, bool).copy()
        self.rollback_ticks.append(tick)


__all__ = ["Rollback"]
