"""Rollback to the best-known setting when the objective stays below it.

When the objective's ``best_window``-tick level stays below ``rollback_fraction`` of the
best-known level (``drl_engine.best_known``) for ``rollback_ticks`` ticks, the next
action puts every row's dynamic knobs back on the best-known setting at once
(``Decision.rolled_back``) and holds them there for ``settle_ticks`` + ``best_window``
ticks to measure it; still below then, that best is no longer reachable (a change the
detector missed, or a transient): it is dropped and counted (``stale_bests``).
"""
from __future__ import annotations

import logging

log = logging.getLogger("capes.engine")


class Rollback:
    def __init__(self, model, settle_ticks: int):
        self.mcfg, self.settle_ticks = model, settle_ticks
        self.below = 0                          # ticks in a row below the fraction
        self.due = False                        # the next act rolls back
        self.hold_until: int | None = None      # after a rollback: hold until this tick
        self.rollback_ticks: list[int] = []
        self.stale_bests = 0                    # bests dropped: a rollback did not help

    def reset(self) -> None:
        """A new workload (or a best handed over): nothing pending."""
        self.below, self.due, self.hold_until = 0, False, None

    def holding(self, tick: int) -> bool:
        """Measuring the rolled-back setting: no moves, no probes."""
        return self.hold_until is not None and tick < self.hold_until

    def watch(self, tick: int, best) -> None:
        """Count the ticks in a row that ``best``'s level (a
        :class:`~drl_engine.best_known.PeakTracker`) stays below the floor; set ``due``
        after ``rollback_ticks`` of them; after a hold, drop a best still below."""
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

    def start(self, tick: int) -> None:
        """The rollback is applied at ``tick``: hold, and count it."""
        self.due = False
        self.hold_until = tick + self.settle_ticks + self.mcfg.best_window + 1
        self.rollback_ticks.append(tick)


__all__ = ["Rollback"]
