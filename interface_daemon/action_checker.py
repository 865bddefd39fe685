"""The action checker: no value outside a parameter's valid range, and no forbidden
value, ever leaves the daemon (database tuners crashed their targets with extreme
cold-start values; this is the guard against that).

Forbidden values come from each ``[parameters.NAME] forbidden = [...]`` and from
``[daemon.forbidden] NAME = [...]``. The control agents re-check with the same
``ParameterSpec.check_value``; this is the first of the two fences.

:meth:`ActionChecker.check_step` also holds the engine to its own action set
(``capes.common.actions``): an action moves one parameter by the few steps it names (NULL
moves none), so the label recorded for training always matches the change, and no action
jumps across the range.

:meth:`ActionChecker.check_dwell` holds each parameter to its ``min_dwell_s``: an action
that would change it sooner after its last change (:meth:`ActionChecker.changed`, called
when an action is broadcast) is refused with the key ``dwell``. Every node a parameter
targets changes with the same action, so its last change is the same on each of them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from capes.common import actions
from capes.common.params import TOLERANCE, ParameterSpec


@dataclass
class Verdict:
    """The checker's answer: ``values`` is every parameter's value after the action
    (the current ones where it is refused); ``reason`` is None when accepted."""
    values: dict[str, float]
    reason: str | None = None
    key: str = ""             # counter key: range, forbidden, unknown, action, not_finite, step
    proposed: dict[str, float] | None = None   # dry_run: what the engine asked for

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
        self.dwell = {n: float(s.min_dwell_s) for n, s in self.specs.items() if s.min_dwell_s > 0}
        self.changed_at: dict[str, float] = {}    # parameter -> monotonic time of its last change

    def check(self, action: int, values: dict[str, float], current: dict[str, float]) -> Verdict:
        """Check an engine action: ``values`` are absolute new values (parameters left
        out keep their ``current`` value). All or nothing: one bad value refuses it."""
        now = {n: float(current[n]) for n in self.order}
        if not actions.valid(action, len(self.order)):
            most = actions.count(len(self.order), actions.MAX_STEPS) - 1
            return Verdict(now, f"action {action} outside [0, {most}]", "action")
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
        tol = TOLERANCE * spec.step              # never float equality (as ParameterSpec)
        if why is None and any(abs(value - f) <= tol for f in self.forbidden[name]):
            why = "forbidden value"
        return why

    def check_step(self, action: int, verdict: Verdict, current: dict[str, float]) -> Verdict:
        """Check that an accepted ``verdict`` is the change ``action`` stands for: action
        1 + 2k raises parameter k by its step, 2 + 2k lowers it, the actions above 2P
        do the same by 2, 3 … steps (``capes.common.actions``; each step clamped to the
        range and over forbidden values to the next allowed one, as the engine's
        ``ParameterSpec.next_value``), 0 changes nothing, and no other parameter
        moves. The returned values are snapped to the exact step (the engine's may have
        passed through float32)."""
        if not verdict.ok:
            return verdict
        if action == actions.ROWS:
            return self.check_rows(verdict, current)
        now = {n: float(current[n]) for n in self.order}
        target = action_target(action, self.order)
        expect = dict(now)
        if target is not None:               # its steps, each over forbidden values
            name, steps = target
            expect[name] = actions.moved(self.specs[name], now[name], steps,
                                         self.forbidden[name])
        for name in self.order:
            got, want = verdict.values[name], expect[name]
            if not _close(got, want, self.specs[name].step):
                label = "NULL" if target is None else actions.name(action, self.order)
                return Verdict(now, f"action {action} ({label}) sets {name} to {want:g}, "
                                    f"not {got:g}", "step")
        if target is not None:                   # the snapped value must pass too
            why = self.check_value(target[0], expect[target[0]])
            if why is not None:
                return Verdict(now, f"{target[0]}={expect[target[0]]}: {why}",
                               "forbidden" if why == "forbidden value" else "range")
        return Verdict(expect)


    def check_rows(self, verdict: Verdict, current: dict[str, float]) -> Verdict:
        """The step rule of per-node knobs (``actions.ROWS``): each row (the parameters
        ``<node>/<knob>`` of one node) moves at most one of its knobs, by at most
        ``MAX_STEPS`` steps; values are snapped to those steps."""
        now = {n: float(current[n]) for n in self.order}
        out, moved_in = dict(now), {}
        for name in self.order:
            got, spec = verdict.values[name], self.specs[name]
            if _close(got, now[name], spec.step):
                continue
            row = actions.row_of(name)
            landed = self._steps_to(name, now[name], got)
            if row is None or landed is None or row in moved_in:
                why = (f"{name} is not a per-node parameter <node>/<knob>" if row is None
                       else f"{name} moves with {moved_in[row]} in one row" if row in moved_in
                       else f"{name} to {got:g} is not a move of at most "
                            f"{actions.MAX_STEPS} steps from {now[name]:g}")
                return Verdict(now, f"per-node action: {why}", "step")
            moved_in[row] = name
            out[name] = actions.moved(spec, now[name], landed, self.forbidden[name])
        return Verdict(out)

    def _steps_to(self, name: str, now: float, got: float) -> int | None:
        """The signed step count (1 to ``MAX_STEPS``) whose moves take ``name`` from
        ``now`` to ``got`` (None: none does). The count the distance gives is tried
        first, then every count: moves that land on ``got`` give the same value, and
        scanning all 16 of them for every knob of every node was most of a check."""
        spec, most = self.specs[name], actions.MAX_STEPS
        guess = round((got - now) / spec.step) if spec.step else 0
        counts = ([guess] if 0 < abs(guess) <= most else []) + \
            [s for s in range(-most, most + 1) if s]
        return next((s for s in counts if _close(
            got, actions.moved(spec, now, s, self.forbidden[name]), spec.step)), None)

    def check_dwell(self, verdict: Verdict, current: dict[str, float],
                    now: float | None = None) -> Verdict:
        """Refuse an accepted ``verdict`` that changes a parameter less than its
        ``min_dwell_s`` after that parameter's last change."""
        if not verdict.ok or not self.dwell:
            return verdict
        now = time.monotonic() if now is None else now
        for name, dwell in self.dwell.items():
            last = self.changed_at.get(name)
            if last is None or _close(verdict.values[name], current[name],
                                      self.specs[name].step):
                continue
            if now - last < dwell:
                return Verdict({n: float(current[n]) for n in self.order},
                               f"{name} changed {now - last:.1f} s ago: min_dwell_s is "
                               f"{dwell:g} s", "dwell")
        return verdict

    def hold(self, name: str, left_s: float, now: float | None = None) -> None:
        """A node says ``name`` may not change for ``left_s`` more seconds (its agent's
        dwell, which outlives a daemon restart): refuse changes until then too."""
        dwell = self.dwell.get(name)
        if dwell is None or not math.isfinite(left_s) or left_s <= 0:
            return
        now = time.monotonic() if now is None else now
        last = now - dwell + min(left_s, dwell)
        self.changed_at[name] = max(self.changed_at.get(name, last), last)

    def changed(self, before: dict[str, float], after: dict[str, float],
                now: float | None = None) -> None:
        """Note the parameters an action broadcast now changes (for the dwell rule)."""
        now = time.monotonic() if now is None else now
        for name in self.dwell:
            if not _close(after[name], before[name], self.specs[name].step):
                self.changed_at[name] = now


def action_target(action: int, order: list[str]) -> tuple[str, int] | None:
    """(parameter, signed steps) that ``action`` moves; None for the NULL action."""
    move = actions.decode(action, len(order))
    return None if move is None else (order[move[0]], move[1])


def _close(got: float, want: float, step: float) -> bool:
    """Equal up to float32 rounding, and always closer than a quarter step."""
    tol = min(1e-6 * max(abs(got), abs(want), step), step / 4)
    return abs(got - want) <= tol
