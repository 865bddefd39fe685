"""The collector interface and registry (after Telegraf / node_exporter).

A collector turns one source of a node's state into named float PIs. Collectors are
registered by name with ``@register("name")`` and built from their config table with
``build_collector(name, options)``. Cumulative counters must be turned into rates by
the collector itself (the thesis, §5.1.1: totals are not useful, rates are).
"""
from __future__ import annotations

from typing import Any

from capes.common.registry import Registry

COLLECTORS = Registry("collector", "monitor_agent.collectors")


class Collector:
    """One source of PIs. ``names()`` is fixed after construction; ``collect()`` returns
    a value for each name (NaN when a value cannot be read this tick)."""

    name: str = ""

    def names(self) -> list[str]:
        raise NotImplementedError

    def collect(self) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


register = COLLECTORS.register


def build_collector(name: str, options: dict[str, Any] | None = None) -> Collector:
    return COLLECTORS.build(name, options)
