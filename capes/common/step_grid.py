"""The knobs' step grids, vectorised: value ↔ grid index, clamped to the range.

Engines and tuners search over grid indices and apply values. Index k of knob j is
``lo[j] + k·step[j]`` for k = 0 … ``n_steps[j]``; when ``max`` is off the grid (min 0,
max 10, step 3) its last index is ``max`` itself, as :meth:`ParameterSpec.on_grid
<capes.common.params.ParameterSpec.on_grid>` allows. Forbidden values are the
caller's business (``ParameterSpec.next_value`` steps over them; the search baselines
skip them). Works on a row of knobs (K,) or on rows of them (N, K).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capes.common.params import TOLERANCE, ParameterSpec


@dataclass(frozen=True, eq=False)
class StepGrid:
    lo: np.ndarray           # (K,) each knob's min
    step: np.ndarray         # (K,) its step
    n_steps: np.ndarray      # (K,) int64: its last index
    hi: np.ndarray | None = None   # (K,) its max (None: on the grid, lo + n_steps·step)

    def __post_init__(self):
        if self.hi is None:
            object.__setattr__(self, "hi", self.lo + self.n_steps * self.step)

    @classmethod
    def of(cls, specs: list[ParameterSpec]) -> StepGrid:
        lo = np.array([s.min for s in specs], np.float64)
        hi = np.array([s.max for s in specs], np.float64)
        step = np.array([s.step for s in specs], np.float64)
        n = np.floor((hi - lo) / step + TOLERANCE).astype(np.int64)
        n += lo + n * step < hi - TOLERANCE * step          # max itself is the last point
        return cls(lo, step, n, hi)

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


__all__ = ["StepGrid"]
