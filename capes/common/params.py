"""Tunable parameters: the typed knob catalogue shared by engine, daemon and agents.

A ``ParameterSpec`` says what one knob may be: its valid range, the step an action
moves it by, the value it starts at (and is restored to), and forbidden values. The
engine turns specs into its action set; the daemon's action checker and every control
agent use the same ``check_value`` so no out-of-range value reaches a target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ParameterSpec:
    min: float
    max: float
    step: float
    default: float
    forbidden: list[float] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)   # nodes it is set on; empty: all
    name: str = ""

    def validate(self) -> None:
        if not (math.isfinite(self.min) and math.isfinite(self.max)):
            raise ValueError("min: min and max must be finite")
        if self.min > self.max:
            raise ValueError(f"min: must be <= max ({self.min} > {self.max})")
        if not self.step > 0:
            raise ValueError(f"step: must be > 0 (got {self.step})")
        if not self.min <= self.default <= self.max:
            raise ValueError(f"default: must lie in [{self.min}, {self.max}] (got {self.default})")
        if self.default in self.forbidden:
            raise ValueError(f"default: {self.default} is listed as forbidden")

    def clamp(self, value: float) -> float:
        return min(self.max, max(self.min, value))

    def check_value(self, value: float) -> str | None:
        """Why ``value`` may not be applied, or None when it may."""
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return "not a finite number"
        if value < self.min or value > self.max:
            return f"outside [{self.min}, {self.max}]"
        if value in self.forbidden:
            return "forbidden value"
        return None

