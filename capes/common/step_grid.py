"""The knobs' step grids, vectorised: value ↔ grid index, clamped to the range.

Engines and tuners search over grid indices and apply values. Index k of knob j is
``lo[j] + k·step[j]`` for k = 0 … ``n_steps[j]``; when ``max`` is off the grid (min 0,
max 10, step 3) its last index is ``max`` itself, as :meth:`ParameterSpec.on_grid
<capes.common.params.ParameterSpec.on_grid>` allows. Works on a row of knobs (K,) or on
rows of them (N, K).

Moves cross forbidden values: :meth:`StepGrid.apply` (an action on values, every
engine's) and :meth:`StepGrid.move` (steps on grid indices: walks, the cold start's
shared setting) land where repeated ``ParameterSpec.next_value`` lands, the daemon's step
rule; numpy does the rows whose knob forbids nothing, ``next_value`` itself the others.
The search baselines skip forbidden settings on their own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capes.common import actions
from capes.common.params import TOLERANCE, ParameterSpec


@dataclass(frozen=True, eq=False)
class StepGrid:
    lo: np.ndarray           # (K,) each knob's min
    step: np.ndarray         # (K,) its step
    n_steps: np.ndarray      # (K,) int64: its last index
    hi: np.ndarray | None = None   # (K,) its max (None: on the grid, lo + n_steps·step)
    specs: tuple = ()        # the knobs' specs, where one has forbidden values (else ())
    ladder: np.ndarray | None = None   # (K,) bool: a knob given as a ladder of named values
                                       # (``values = [...]``, e.g. powers of two), not a range

    def __post_init__(self):
        if self.hi is None:
            object.__setattr__(self, "hi", self.lo + self.n_steps * self.step)
        forbids = np.array([bool(s.forbidden) for s in self.specs], bool) if self.specs \
            else np.zeros(len(self.lo), bool)
        object.__setattr__(self, "forbids", forbids)      # (K,) a knob with forbidden values
        if self.ladder is None:
            object.__setattr__(self, "ladder", np.zeros(len(self.lo), bool))

    @classmethod
    def of(cls, specs: list[ParameterSpec]) -> StepGrid:
        lo = np.array([s.min for s in specs], np.float64)
        hi = np.array([s.max for s in specs], np.float64)
        step = np.array([s.step for s in specs], np.float64)
        n = np.floor((hi - lo) / step + TOLERANCE).astype(np.int64)
        n += lo + n * step < hi - TOLERANCE * step          # max itself is the last point
        return cls(lo, step, n, hi, tuple(specs) if any(getattr(s, "forbidden", ()) for s in specs)
                   else (), np.array([bool(getattr(s, "values", ())) for s in specs], bool))

    def knob_values(self, k: int) -> np.ndarray:
        """Every setting of knob ``k``, in index order."""
        return np.minimum(self.lo[k] + np.arange(self.n_steps[k] + 1) * self.step[k],
                          self.hi[k])

    @property
    def sizes(self) -> np.ndarray:
        """Settings per knob (``n_steps`` + 1)."""
        return self.n_steps + 1

    def clip(self, idx) -> np.ndarray:
        """Indices kept on the grid (int64)."""
        return np.clip(np.rint(idx), 0, self.n_steps).astype(np.int64)

    def index(self, values) -> np.ndarray:
        """The nearest grid index of each value (out-of-range values clamp to an end)."""
        v = np.asarray(values, np.float64)
        idx = self.clip((v - self.lo) / self.step)
        off = self.lo + self.n_steps * self.step > self.hi + TOLERANCE * self.step
        if off.any():            # an off-grid max: nearer to it than to the setting before
            below = self.lo + (self.n_steps - 1) * self.step
            idx = np.where(off & (v >= (below + self.hi) / 2), self.n_steps, idx)
        return idx

    def values(self, idx) -> np.ndarray:
        """The value at each grid index (float64; the last index of an off-grid range is
        its max)."""
        return np.minimum(self.lo + np.asarray(idx) * self.step, self.hi)

    # -- moves, over forbidden values -------------------------------------------------
    def apply(self, values, acts) -> np.ndarray:
        """Every row's values (N, K) after its action (N,) (``capes.common.actions``:
        NULL, or one knob moved by its steps): each step clamped to the range and over
        forbidden values, as ``ParameterSpec.next_value``; the other knobs (and values
        off the grid) as they are. A row of knobs (K,) with one action works too."""
        values = np.asarray(values, np.float64)
        one = values.ndim == 1
        out = values[None].copy() if one else values.copy()
        acts = np.atleast_1d(np.asarray(acts, np.int64))
        knob, steps = actions.decode_rows(acts, out.shape[1])
        rows = np.arange(len(acts))
        sign = np.sign(steps).astype(np.float64)
        for s in range(int(np.abs(steps).max(initial=0))):
            go = np.abs(steps) > s
            v = out[rows, knob]
            out[rows, knob] = np.where(go, np.clip(v + sign * self.step[knob],
                                                   self.lo[knob], self.hi[knob]), v)
        if self.forbids.any():                    # those knobs: next_value itself
            for r in np.flatnonzero(self.forbids[knob] & (steps != 0)):
                k = knob[r]
                out[r, k] = actions.moved(self.specs[k], float(values.reshape(out.shape)[r, k]),
                                          int(steps[r]))
        return out[0] if one else out

    def move(self, idx, knob, steps) -> np.ndarray:
        """Grid indices (N, K) with each row's ``knob`` (N,) moved by ``steps`` (N,,
        signed; 0: none), clamped to the grid and over forbidden values (as
        :meth:`apply`); a row (K,) with scalars works too."""
        idx = np.asarray(idx, np.int64)
        one = idx.ndim == 1
        out = idx[None].copy() if one else idx.copy()
        knob = np.atleast_1d(np.asarray(knob, np.int64))
        steps = np.atleast_1d(np.asarray(steps, np.int64))
        rows = np.arange(len(knob))
        out[rows, knob] = np.clip(out[rows, knob] + steps, 0, self.n_steps[knob])
        if self.forbids.any():
            for r in np.flatnonzero(self.forbids[knob] & (steps != 0)):
                k = knob[r]
                v = actions.moved(self.specs[k], float(self.values(idx.reshape(out.shape)[r])[k]),
                                  int(steps[r]))
                out[r, k] = self.index(np.full(len(self.lo), v))[k]
        return out[0] if one else out

    def walk(self, idx, target, most: int = 1, cells=None, straight: bool = False):
        """One tick of a walk to ``target`` (grid indices): :func:`walk` on this grid."""
        return walk(idx, target, self.n_steps, most, cells, straight)


def walk(idx, target, n_steps, most: int = 1, cells=None, straight: bool = False
         ) -> tuple[np.ndarray, np.ndarray]:
    """One tick of a walk from grid indices ``idx`` to ``target`` (rows (N, K) or a row
    (K,)): per row, the knob farthest from it relative to its range (the first of equals)
    and its signed steps towards it, at most ``most`` (0 when the row is there). Only
    ``cells`` (a mask like ``idx``, or (K,)) count. ``straight``: fewer steps while
    another knob would become the farthest, so that the walk keeps a straight path (the
    guide's probes); else as many as allowed, the fewest ticks there (a recall, a
    rollback). Every walk of both modes, and the trust region's step back, is this one;
    :meth:`StepGrid.move` or an action (``walk_action``) makes it."""
    diff = np.asarray(target) - np.asarray(idx)
    one = diff.ndim == 1
    diff = diff[None] if one else diff
    if cells is not None:
        diff = np.where(cells, diff, 0)
    scale = np.maximum(n_steps, 1)
    rows = np.arange(len(diff))
    knob = np.argmax(np.abs(diff) / scale, axis=1)
    d = diff[rows, knob]
    sign = np.sign(d)
    if straight:
        steps = (d != 0).astype(np.int64)
        alive = d != 0
        diff = diff.copy()
        for _ in range(1, most):
            diff[rows, knob] -= sign * alive
            alive = alive & (diff[rows, knob] != 0) & \
                (np.argmax(np.abs(diff) / scale, axis=1) == knob)
            if not alive.any():
                break
            steps += alive
    else:
        steps = np.minimum(np.abs(d), most)
    steps = sign * steps
    return (knob[0], steps[0]) if one else (knob, steps)


def walk_action(idx, target, n_steps, most: int = 1, straight: bool = False) -> int:
    """:func:`walk` of one row as an action (``capes.common.actions``; 0: NULL, there)."""
    knob, steps = walk(idx, target, n_steps, most, straight=straight)
    return actions.encode(int(knob), int(steps), len(idx)) if steps else 0


def sweep_order(n: int, at: int, points: int, with_at: bool) -> list[int]:
    """The grid indices a coarse sweep of one ladder knob visits, in order: ``points``
    spread evenly over 0 … ``n`` (at least both ends), the side of the end nearer to
    ``at`` first (below on a tie), then the other side, nearest first: one pass each way.
    Both modes sweep with this. ``with_at``: the point at ``at`` itself is visited (in
    the lower side). The per-node sweep keeps it (``drl_engine.row_sweep``): a row
    entering a new context has not measured its own setting there, and the sweep picks
    the best of the points it measured, so its origin must be one of them. The one-row
    sweep leaves it out (``drl_engine.guide``): ``at`` is its best-known setting, the
    one it holds and measures between probes and compares each probe against, so a
    probe there measures nothing new."""
    pts = np.unique(np.rint(np.linspace(0, n, max(2, points)))).astype(int)
    below = [int(v) for v in pts[::-1] if v < at or (with_at and v == at)]
    above = [int(v) for v in pts if v > at]
    return below + above if at <= n - at else above + below


def local_draw(rng: np.random.Generator, center: np.ndarray, spread, n_steps,
               best: np.ndarray | None = None, guard=None, nonzero: bool = False
               ) -> np.ndarray:
    """A local probe's targets, both modes' rule: from ``center`` a Gaussian jump of
    ``spread`` steps (sd, rounded; ``nonzero``: a jump of 0 becomes ±1 at random, so the
    probe moves), inside 0 … ``n_steps`` and, with ``best`` and ``guard``, within
    ``guard`` steps of ``best`` (the best-known setting: the trust region). One draw per
    element of ``center``, grid indices of any shape. The one-row guide draws several
    around its best and lets its model choose (``drl_engine.guide``); a row's probe is
    one draw around where the row is (``drl_engine.row_probes``)."""
    center = np.asarray(center)
    jump = np.rint(rng.normal(0.0, spread, size=center.shape))
    if nonzero:
        jump = np.where(jump == 0, np.where(rng.random(center.shape) < 0.5, 1, -1), jump)
    target = np.clip(center + jump, 0, n_steps)
    if best is not None and guard is not None:
        target = np.clip(target, best - guard, best + guard)
    return target.astype(np.int64)


__all__ = ["StepGrid", "local_draw", "sweep_order", "walk", "walk_action"]
