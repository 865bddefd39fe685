"""The applier interface and registry.

An applier sets one kind of knob on the local node. It is built from its config table
with ``build_applier(name, options)``; ``apply(param, value)`` sets the knob and
``read(param)`` returns its current value (None when it cannot be read). Range checks
are the control agent's job and happen before ``apply`` is ever called.
"""
from __future__ import annotations

from typing import Any

from capes.common.registry import Registry

APPLIERS = Registry("applier", "control_agent.appliers")
register = APPLIERS.register


class ApplyError(RuntimeError):
    """A value could not be applied (the knob is unchanged)."""


def format_value(value: float | str) -> str:
    """How every applier writes a number: ``32`` rather than ``32.0`` when the value is
    integral (sysfs and procfs knobs reject a decimal point), else the shortest repr.
    A categorical parameter's value arrives as its name and is written as it is."""
    if isinstance(value, str):
        return value
    value = float(value)
    if value.is_integer():
        return str(int(value))
    return repr(value)


NUMERIC, CATEGORICAL = "numeric", "categorical"


class Applier:
    """Override ``kinds`` with the parameter kinds the applier can set: the control
    agent refuses a config that gives it another kind (a ConfigError naming the key)
    rather than failing at the first action or restore."""
    name: str = ""
    kinds: tuple[str, ...] = (NUMERIC,)

    def supports(self, param: str, categorical: bool) -> str | None:
        """Why this applier cannot set ``param`` of that kind (None: it can)."""
        kind = CATEGORICAL if categorical else NUMERIC
        if kind not in self.kinds:
            return (f"the {self.name} applier sets only {' and '.join(self.kinds)} "
                    f"parameters, not {kind} ones")
        return None

    def check(self, param: str) -> str | None:
        """What is wrong with ``param``'s knob on this host (None: nothing found):
        read-only, for ``capes config check``; runs no program the config names and
        changes nothing. Building an applier never acts either."""
        return None

    def apply(self, param: str, value: float) -> None:
        raise NotImplementedError

    def read(self, param: str) -> float | None:
        return None

    def read_text(self, param: str) -> str | None:
        """A categorical knob's current value by name (None: cannot be read). ``apply``
        is given the name (a str) for a categorical parameter."""
        return None

    def close(self) -> None:
        pass


def build_applier(name: str, options: dict[str, Any] | None = None) -> Applier:
    return APPLIERS.build(name, options)
