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
    a value for each name (NaN when a value cannot be read this tick).

    What a collector does is declared by where it does it, so that ``capes config
    check`` can build every collector without acting: ``__init__`` only checks its
    options (no program run, nothing changed, at most a read of the host);
    ``check()`` reports, read-only, what is wrong with the source on this host (it may
    query, never change, and never runs a program the config names); ``start()`` does
    what acts (runs the configured program to learn its PI names, turns on a target's
    statistics) and runs at the first ``names()`` or ``collect()``, never in a check;
    ``undo()`` puts back what ``start()`` changed on the target (``monitor-agent
    --test`` leaves the target as it found it). ``effects()`` says in words what
    ``start()`` and ``collect()`` do beyond reading."""

    name: str = ""

    def names(self) -> list[str]:
        raise NotImplementedError

    def collect(self) -> dict[str, float]:
        raise NotImplementedError

    def check(self) -> list[str]:
        """What is wrong with this collector's source on this host, one line each
        ([]: nothing found); read-only."""
        return []

    def start(self) -> None:
        """What acts before the first collection (nothing by default)."""

    def undo(self) -> None:
        """Put back what ``start()`` changed on the target (nothing by default)."""

    def effects(self) -> list[str]:
        """What ``start()`` and ``collect()`` do beyond reading, in words."""
        return []

    def close(self) -> None:
        pass


register = COLLECTORS.register


def read_text(path: str, limit: int = 65536) -> str | None:
    """At most ``limit`` bytes of a small kernel file (``/proc``, ``/sys``) as text; None
    when it cannot be read (gone, not ours): a collector's value is then NaN."""
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("ascii", "replace")
    except OSError:
        return None


def build_collector(name: str, options: dict[str, Any] | None = None) -> Collector:
    return COLLECTORS.build(name, options)
