"""The trust region around the best-known setting, one function over rows of knobs.

A greedy (or probing) move may take a row's knobs at most ``limit`` steps from that
row's best-known setting; a move that would go farther, and not closer to it, is
replaced by one step back towards it. The flat engine's guide calls it with its one row
(``engine.greedy_guard_steps``), the cluster engine with every node's row
(``engine.guard_steps`` for a probing row, ``engine.greedy_guard_steps`` for a greedy
one); a noisy Q-network otherwise wanders off a good setting.
"""
from __future__ import annotations

import numpy as np

from capes.common import actions
from capes.common.step_grid import walk


def outside(idx: np.ndarray, knob: np.ndarray, steps: np.ndarray, best: np.ndarray,
            n_steps: np.ndarray, limit,
            movable: np.ndarray | None = None,
            after: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row, whether moving ``knob`` by ``steps`` (0: NULL) from grid indices
    ``idx`` (N, K) leaves the region of ``limit`` steps around ``best`` (N, K) (a
    number, or one per row and knob: anything that broadcasts to (N, K)) and is not
    closer to it (the largest excess over the limit does not shrink), and the
    one-step action back towards ``best`` (``capes.common.actions``: 1 + 2k up, 2 + 2k
    down, 0 when there): the knob farthest from it relative to its range. Knobs not
    ``movable`` (K,) (a remount/reboot cost) are left out of both. ``after``: where the
    moves land, when not ``idx`` plus ``steps`` (a move over a forbidden value)."""
    rows = np.arange(len(knob))
    movable = np.ones(idx.shape[1], bool) if movable is None else movable
    if after is None:
        after = idx.copy()
        after[rows, knob] += steps
    limit = np.asarray(limit)
    over_after = (np.where(movable, np.abs(after - best), 0) - limit).max(axis=1)
    over_now = (np.where(movable, np.abs(idx - best), 0) - limit).max(axis=1)
    out = (steps != 0) & (over_after > 0) & (over_after >= over_now)
    k, step = walk(idx, best, n_steps, 1, movable)          # the one walk, one step
    back = actions.encode_rows(k, step, idx.shape[1])
    return out, back


__all__ = ["outside"]
