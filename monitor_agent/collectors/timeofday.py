"""Time of day as separate PIs: month, weekday, hour and minute (thesis §5.1.1).

Cyclical workloads (nightly backups, office hours) change with the clock. One
timestamp would be hard for the Q-network to use; separate month (1–12), weekday
(0 = Monday … 6), hour (0–23) and minute (0–59) features let it tie a workload change
to the hour it happens. Local time by default, since that is what workloads follow.
"""
from __future__ import annotations

import time
from typing import Callable

from monitor_agent.collectors.base import Collector, register

NAMES = ("month", "weekday", "hour", "minute")


@register("timeofday")
class TimeOfDayCollector(Collector):
    def __init__(self, utc: bool = False, clock: Callable[[], float] = time.time):
        self._convert = time.gmtime if utc else time.localtime
        self._clock = clock

    def names(self) -> list[str]:
        return list(NAMES)

    def collect(self) -> dict[str, float]:
        t = self._convert(self._clock())
        return {"month": float(t.tm_mon), "weekday": float(t.tm_wday),
                "hour": float(t.tm_hour), "minute": float(t.tm_min)}
