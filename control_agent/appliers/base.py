"""The applier interface and registry.

An applier sets one kind of knob on the local node. It is built from its config table
with ``build_applier(name, options)``; ``apply(param, value)`` sets the knob and
``read(param)`` returns its current value (None when it cannot be read). Range checks
are the control agent's job and happen before ``apply`` is ever called.
"""
from __future__ import annotations

from typing import Any, Callable

APPLIERS: dict[str, Callable[..., "Applier"]] = {}


class ApplyError(RuntimeError):
    """A value could not be applied (the knob is unchanged)."""


def format_value(value: float) -> str:
    """How every applier writes a number: ``32`` rather than ``32.0`` when the value is
    integral (sysfs and procfs knobs reject a decimal point), else the shortest repr."""
    value = float(value)
    if value.is_integer():
        return str(int(value))
    return repr(value)


class Applier:
    name: str = ""

    def apply(self, param: str, value: float) -> None:
        raise NotImplementedError

    def read(self, param: str) -> float | None:
        return None

    def close(self) -> None:
        pass


def register(name: str):
    def deco(cls):
        cls.name = name
        APPLIERS[name] = cls
        return cls
    return deco


def build_applier(name: str, options: dict[str, Any] | None = None) -> Applier:
    if name not in APPLIERS:
        _load_builtin()
    if name not in APPLIERS:
        raise ValueError(f"unknown applier {name!r} (known: {', '.join(sorted(APPLIERS))})")
    return APPLIERS[name](**(options or {}))


def _load_builtin() -> None:
    import importlib
    import pkgutil

    import control_agent.appliers as pkg
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"{pkg.__name__}.{mod.name}")
