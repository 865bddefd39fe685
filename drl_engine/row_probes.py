"""Per-row probes: exploration as excursions, one row (node) at a time, vectorised.

ε is the share of rows exploring at a time: a row not already probing starts a probe
(``explore="probe"``) with the probability that keeps that share: a target for one knob
drawn around its current value (``probe_steps`` steps, inside the trust region around
the row's best-known setting), walked to one step per tick, held ``probe_dwell`` ticks
(the delayed effect is measured) and walked back to where it started (``probe_return``;
``"best"``: to the row's knob in the best-known setting, so a probe during which the
objective peaked stays where it went, the others go back)
— an excursion, so exploration never displaces a row for good and knobs the objective
does not depend on do not random-walk away. ``explore="random"``: one uniform random
action. The target is drawn by the rule both modes share
(``capes.common.step_grid.local_draw``); the one-row (flat) mode's guide draws several
around its best and lets its Gaussian process choose (``drl_engine.guide``).
"""
from __future__ import annotations

import numpy as np

from capes.common.step_grid import local_draw

# checkpoint names of the probe state (kept from the cluster engine's checkpoints)
STATE = {"probe_knob": "knob", "probe_target": "target", "probe_dwell": "dwell",
         "probe_origin": "origin", "probe_back": "back"}


class RowProbes:
    """Each row's probe: knob (−1: none), target grid index, dwell left, origin, and
    whether it is on its way back."""

    def __init__(self, rows: int, model, n_steps: np.ndarray, dynamic: np.ndarray,
                 allowed: np.ndarray):
        self.mcfg, self.n_steps = model, n_steps
        self.dynamic, self.allowed = dynamic, allowed
        self.knob = np.full(rows, -1, np.int64)
        self.target = np.zeros(rows, np.int64)
        self.dwell = np.zeros(rows, np.int64)
        self.origin = np.zeros(rows, np.int64)
        self.back = np.zeros(rows, bool)

    def grow(self, extra: int) -> None:
        """Rows appended (nodes joined), none probing."""
        for name in STATE.values():
            a = getattr(self, name)
            fill = -1 if name == "knob" else 0
            setattr(self, name, np.concatenate([a, np.full(extra, fill, a.dtype)]))

    def start_probability(self, eps: float) -> float:
        """Per tick, the chance that a row not probing starts a probe, such that a share
        ε of the rows is probing at any time (a probe lasts ~L ticks: out, hold, back)."""
        if eps >= 1.0:
            return 1.0
        m = self.mcfg
        length = (2.0 if m.probe_return else 1.0) * 0.8 * m.probe_steps + m.probe_dwell + 1
        return min(1.0, eps / max(1e-9, length * (1.0 - eps)))

    def explore(self, idx: np.ndarray, eps: float, rng: np.random.Generator,
                best_idx: np.ndarray | None, guard_steps: int
                ) -> tuple[np.ndarray, np.ndarray]:
        """Which rows explore this tick and their actions (0 for the others), from the
        rows' grid indices ``idx`` (N, K)."""
        n = len(self.knob)
        actions = np.zeros(n, np.int64)
        tunable = np.flatnonzero(self.dynamic)
        if self.mcfg.explore == "random":
            explore = rng.random(n) < eps
            choices = np.flatnonzero(self.allowed)
            actions[explore] = choices[rng.integers(0, len(choices), int(explore.sum()))]
            return explore, actions
        start = (self.knob < 0) & (rng.random(n) < self.start_probability(eps))
        if len(tunable) == 0:
            start[:] = False
        if start.any():
            who = np.flatnonzero(start)
            k = tunable[rng.integers(0, len(tunable), len(who))]
            band = best_idx is not None and guard_steps > 0
            target = local_draw(rng, idx[who, k], self.mcfg.probe_steps, self.n_steps[k],
                                best=best_idx[who, k] if band else None,
                                guard=guard_steps, nonzero=True)
            self.knob[who] = k
            self.origin[who] = idx[who, k]
            self.target[who] = target
            self.dwell[who] = self.mcfg.probe_dwell
            self.back[who] = False
        probing = self.knob >= 0
        if not probing.any():
            return probing, actions
        who = np.flatnonzero(probing)
        k = self.knob[who]
        at = idx[who, k]
        there = self.target[who] == at
        holding = there & ~self.back[who]
        self.dwell[who[holding]] -= 1
        turn = holding & (self.dwell[who] < 0)
        if self.mcfg.probe_return and turn.any():      # dwell over: head back
            t = who[turn]
            self.back[t] = True
            self.target[t] = self.origin[t]
            if self.mcfg.probe_return == "best" and best_idx is not None:
                self.target[t] = best_idx[t, k[turn]]
        else:
            self.back[who[turn]] = True          # no return leg: done now
            self.target[who[turn]] = at[turn]
        diff = self.target[who] - at
        done = self.back[who] & (diff == 0)
        a = np.where(diff > 0, 1 + 2 * k, np.where(diff < 0, 2 + 2 * k, 0))
        actions[who] = np.where(done, 0, a)
        self.knob[who[done]] = -1
        explore = probing.copy()
        explore[who[done]] = False        # the probe is over: greedy this tick
        return explore, actions


__all__ = ["RowProbes", "STATE"]
