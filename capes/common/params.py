"""Tunable parameters: the typed knob catalogue shared by engine, daemon and agents.

A ``ParameterSpec`` says what one knob may be: its valid range, the step an action
moves it by, the value it starts at, and forbidden values. The engine turns specs into
its action set; the daemon's action checker and every control agent use the same
``check_value`` so no out-of-range value reaches a target.

**The range is the safe range.** ``min``/``max`` bound everything: the engine's moves
(``clamp``), the daemon's checker and the control agent's own re-check. Put a floor
where a value would hurt the host (e.g. ``read_ahead_kb`` ≥ 128: exploring down to 0
dropped sequential reads from ~1.2 GB/s to 30 MB/s). There is deliberately no second
"safe" range inside the valid one: the engine's action set is built from min/max, so a
narrower range enforced elsewhere would only produce actions that are always refused.
The one value that may lie outside the range is the host's own original, which the
control agent puts back when it restores (it was there before CAPES came).

A valid value is in [min, max], on the step grid ``min + k·step`` (or exactly ``max``,
where the engine clamps), and not forbidden; grid and forbidden checks use a tolerance
of a millionth of a step, never float equality.

**Categorical parameters** (``values = ["none", "mq-deadline", "kyber", "bfq"]``): the
number the engine moves, the daemon checks and the replay DB records is the value's
index (min 0, max len − 1, step 1, set by ``validate``; leave them out); ``default`` and
``forbidden`` may name values or give indexes, and ``validate`` turns them into
indexes. Appliers are handed the name (``label``).

**Minimum dwell time** (``min_dwell_s``, default 0: none): the least time between two
changes of the parameter on a node. The daemon's action checker refuses an action that
would change it sooner after its last change (counted as ``refused_dwell``), and the
control agent re-checks the same locally. For knobs whose every change costs something
(switching a GlusterFS translator on and off leaks FUSE client memory).

**Cost** (``cost``, seed 000 table 9.1): ``dynamic`` (the default) knobs take effect
live and are tuned online; ``remount``, ``reboot`` and ``reformat`` knobs need that
much downtime, so the engines never move them and report the values seen to do best as
recommendations instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

NAN = math.nan
TOLERANCE = 1e-6            # of a step: how close counts as "on the grid" / "forbidden"
MAX_MAGNITUDE = float(2 ** 53)   # |min|, |max|: beyond it floats skip integers
COSTS = ("dynamic", "remount", "reboot", "reformat")   # what a change of the knob needs
MAX_GRID_POINTS = 1e9            # (max − min) / step: finer grids defeat the tolerance


def _given(x) -> bool:
    return not (isinstance(x, float) and math.isnan(x))


@dataclass
class ParameterSpec:
    min: float = NAN                   # NaN: not given (required for numeric parameters)
    max: float = NAN
    step: float = NAN
    default: float | str = NAN         # a number, or (categorical) a value's name or index
    forbidden: list[float | str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)   # nodes it is set on; empty: all
    name: str = ""
    values: list[str] = field(default_factory=list)  # categorical: the names; empty: numeric
    min_dwell_s: float = 0.0           # least time between two changes of it on a node
    cost: str = "dynamic"              # dynamic | remount | reboot | reformat: see above

    @property
    def categorical(self) -> bool:
        return bool(self.values)

    def validate(self) -> None:
        if self.cost not in COSTS:
            raise ValueError(f"cost: must be one of {', '.join(COSTS)} (got {self.cost!r})")
        if self.values:
            self._validate_categorical()
        else:
            for key in ("min", "max", "step", "default"):
                value = getattr(self, key)
                if not _given(value):
                    raise ValueError(f"{key}: required (or give values = [...] for a "
                                     f"categorical parameter)")
                if isinstance(value, str):
                    raise ValueError(f"{key}: expected a number, got {value!r} (names need "
                                     f"values = [...])")
            if any(isinstance(f, str) for f in self.forbidden):
                raise ValueError("forbidden: names need values = [...]; give numbers")
        for key in ("min", "max"):
            value = getattr(self, key)
            if not (math.isfinite(value) and abs(value) <= MAX_MAGNITUDE):
                raise ValueError(f"{key}: must be a finite number within ±2**53 (got {value})")
        if self.min > self.max:
            raise ValueError(f"min: must be <= max ({self.min} > {self.max})")
        if not (self.step > 0 and math.isfinite(self.step)):
            raise ValueError(f"step: must be > 0 (got {self.step})")
        if (self.max - self.min) / self.step > MAX_GRID_POINTS:
            raise ValueError(f"step: {self.step:g} is too fine for [{self.min:g}, "
                             f"{self.max:g}]: at most {MAX_GRID_POINTS:g} steps in the range")
        for i, f in enumerate(self.forbidden):
            if not (isinstance(f, (int, float)) and math.isfinite(f)):
                raise ValueError(f"forbidden[{i}]: must be a finite number (got {f!r})")
        if not (isinstance(self.min_dwell_s, (int, float)) and math.isfinite(self.min_dwell_s)
                and self.min_dwell_s >= 0):
            raise ValueError(f"min_dwell_s: must be a finite number of seconds >= 0 "
                             f"(got {self.min_dwell_s!r})")
        for i, n in enumerate(self.nodes):
            if not n or len(n.encode()) > 255:
                raise ValueError(f"nodes[{i}]: a node name has 1 to 255 bytes (got {n!r})")
        if not (isinstance(self.default, (int, float)) and math.isfinite(self.default)):
            raise ValueError(f"default: must be a finite number (got {self.default!r})")
        if not self.min <= self.default <= self.max:
            raise ValueError(f"default: must lie in [{self.min:g}, {self.max:g}] "
                             f"(got {self.default:g})")
        if not self.on_grid(self.default):
            raise ValueError(f"default: {self.default:g} is not on the step grid "
                             f"{self.min:g} + k × {self.step:g}; the engine moves from it")
        if self.is_forbidden(self.default):
            raise ValueError(f"default: {self.default:g} is listed as forbidden")

    def _validate_categorical(self) -> None:
        vals = self.values
        if not all(isinstance(v, str) and v and v.isprintable() and not any(c.isspace() for c in v)
                   for v in vals):
            raise ValueError("values: each must be a non-empty name without spaces")
        dup = sorted({v for v in vals if vals.count(v) > 1})
        if dup:
            raise ValueError(f"values: {dup[0]!r} is listed twice")
        for key, want in (("min", 0.0), ("max", float(len(vals) - 1)), ("step", 1.0)):
            got = getattr(self, key)
            if _given(got) and got != want:
                raise ValueError(f"{key}: a categorical parameter moves over its values' "
                                 f"indexes ({key} = {want:g}); leave {key} out")
            setattr(self, key, want)
        if not _given(self.default):
            raise ValueError(f"default: required (one of {', '.join(vals)}, or an index)")
        self.default = self._as_index("default", self.default)
        self.forbidden = [self._as_index("forbidden", f) for f in self.forbidden]

    def _as_index(self, key: str, value: float | str) -> float:
        if isinstance(value, str):
            if value not in self.values:
                raise ValueError(f"{key}: {value!r} is not one of {', '.join(self.values)}")
            return float(self.values.index(value))
        if not (float(value).is_integer() and 0 <= value < len(self.values)):
            raise ValueError(f"{key}: {value!r} is neither a value's name nor an index in "
                             f"[0, {len(self.values) - 1}]")
        return float(value)

    # ------------------------------------------------------------------ values

    def clamp(self, value: float) -> float:
        return min(self.max, max(self.min, value))

    def on_grid(self, value: float) -> bool:
        """``value`` is min + k·step (or max, where the engine clamps), within tolerance."""
        k = (value - self.min) / self.step
        if not math.isfinite(k):
            return False
        return (abs(k - round(k)) <= TOLERANCE
                or abs(value - self.max) <= TOLERANCE * self.step)

    def is_forbidden(self, value: float) -> bool:
        tol = TOLERANCE * (self.step if _given(self.step) else 1.0)
        return any(not isinstance(f, str) and abs(value - f) <= tol for f in self.forbidden)

    def next_value(self, value: float, direction: int, forbidden=()) -> float:
        """Where one step up (``direction`` > 0) or down from ``value`` lands: clamped to
        the range, and over any forbidden value (this spec's, or one of ``forbidden``)
        to the next allowed one on the grid, so a forbidden value never blocks one-step
        tuning from crossing it. ``value`` itself when no allowed value lies that way.
        The engine's moves and the daemon's step rule both use this one function."""
        step = self.step if direction > 0 else -self.step
        tol = TOLERANCE * self.step
        extra = [f for f in forbidden if not isinstance(f, str)]
        v = value
        for _ in range(len(self.forbidden) + len(extra) + 1):
            nv = self.clamp(v + step)
            if nv == v:                   # the end of the range: nowhere to go
                return value
            if not (self.is_forbidden(nv) or any(abs(nv - f) <= tol for f in extra)):
                return nv
            v = nv
        return value

    def check_value(self, value: float) -> str | None:
        """Why ``value`` may not be applied, or None when it may."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            return "not a finite number"
        if value < self.min or value > self.max:
            return f"outside [{self.min:g}, {self.max:g}]"
        if not self.on_grid(value):
            return f"off the step grid {self.min:g} + k × {self.step:g}"
        if self.is_forbidden(value):
            return "forbidden value"
        return None

    def label(self, value: float) -> str | float:
        """What an applier is given: the name of a categorical value (``value`` must be a
        valid index), the number itself for a numeric parameter."""
        if not self.values:
            return value
        return self.values[int(round(value))]

    def index_of(self, name: str) -> float | None:
        """The index of a categorical value's name (None: not one of ``values``)."""
        return float(self.values.index(name)) if name in self.values else None

    def describe(self, value: float | str | None) -> str:
        """For logs: ``4096``, ``kyber``, ``kyber (2)``, ``unknown``."""
        if value is None:
            return "unknown"
        if isinstance(value, str):
            return value
        from capes.common.plain_numbers import plain
        if self.values and self.check_value(value) is None:
            return f"{self.label(value)} ({plain(value, 6)})"
        return plain(value, 6)
