"""The collector interface and registry (after Telegraf / node_exporter).

A collector turns one source of a node's state into named float PIs. Collectors are
registered by name with ``@register("name")`` and built from their config table with
``build_collector(name, options)``. Cumulative counters must be turned into rates by
the collector itself (the thesis, §5.1.1: totals are not useful, rates are).
"""
from __future__ import annotations

from typing import Any, Callable

COLLECTORS: dict[str, Callable[..., "Collector"]] = {}


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


def register(name: str):
    def deco(cls):
        cls.name = name
        COLLECTORS[name] = cls
        return cls
    return deco


def build_collector(name: str, options: dict[str, Any] | None = None) -> Collector:
    if name not in COLLECTORS:
        _load_builtin()
    if name not in COLLECTORS:
        raise ValueError(f"unknown collector {name!r} (known: {', '.join(sorted(COLLECTORS))})")
    return COLLECTORS[name](**(options or {}))


def _load_builtin() -> None:
    """Import the built-in collector modules so they register themselves."""
    import importlib
    import pkgutil

    import monitor_agent.collectors as pkg
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
