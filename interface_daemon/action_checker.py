"""The action checker: no value outside a parameter's valid range, and no forbidden
value, ever leaves the daemon (database tuners crashed their targets with extreme
cold-start values; this is the guard against that).

Forbidden values come from each ``[parameters.NAME] forbidden = [...]`` and from
``[daemon.forbidden] NAME = [...]``. The control agents re-check with the same
``ParameterSpec.check_value``; this is the first of the two fences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from capes.common.params import ParameterSpec


@dataclass
class Verdict:
    """The checker's answer: ``values`` is every parameter's value after the action
    (the current ones where it is refused); ``reason`` is None when accepted."""
    values: dict[str, float]
    reason: str | None = None
    key: str = ""             # short counter key: range, forbidden, unknown, action, not_finite

    @property
    def ok(self) -> bool:
        return self.reason is None


class ActionChecker:
    def __init__(self, specs: list[ParameterSpec], forbidden: dict[str, list[float]] | None = None):
        self.specs = {s.name: s for s in specs}
        if len(self.specs) != len(specs) or "" in self.specs:
            raise ValueError("every parameter needs a unique name")
        self.order = [s.name for s in specs]
        extra = forbidden or {}
        unknown = sorted(set(extra) - set(self.specs))
        if unknown:
            raise ValueError(f"forbidden: unknown parameter {unknown[0]!r}")
        self.forbidden = {n: set(s.forbidden) | set(extra.get(n, ())) for n, s in self.specs.items()}

    def check(self, action: int, values: dict[str, float], current: dict[str, float]) -> Verdict:
        """Check an engine action: ``values`` are absolute new values (parameters left
        out keep their ``current`` value). All or nothing: one bad value refuses it."""
        now = {n: float(current[n]) for n in self.order}
        if not isinstance(action, int) or not 0 <= action <= 2 * len(self.order):
            return Verdict(now, f"action {action} outside [0, {2 * len(self.order)}]", "action")
        new = dict(now)
        for name, value in values.items():
            spec = self.specs.get(name)
            if spec is None:
                return Verdict(now, f"unknown parameter {name!r}", "unknown")
            why = self.check_value(name, value)
            if why is not None:
                key = ("not_finite" if why == "not a finite number" else
                       "forbidden" if why == "forbidden value" else "range")
                return Verdict(now, f"{name}={value}: {why}", key)
            new[name] = float(value)
        return Verdict(new)

    def check_value(self, name: str, value: float) -> str | None:
        """Why ``value`` may not be given to parameter ``name`` (None: it may)."""
        spec = self.specs[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return "not a finite number"
        why = spec.check_value(value)
        if why is None and value in self.forbidden[name]:
            why = "forbidden value"
        return why
