"""One action tick's choice: the one type every engine, tuner and baseline returns.

Knobs come in *rows*, a row being the knobs set together: one row for global knobs (the
paper's game, a deployment of cluster-wide parameters), one row per node for per-node
knobs (``<node>/<knob>``, the cluster engine). The tick loop (``drl_engine.loop``) hands
a decision to its source, which records and applies it.

- One row: ``action`` is the move (``capes.common.actions``: 0 NULL, 1 + 2k / 2 + 2k
  one step up / down of knob k, above 2P the same by several steps) and ``values`` the
  row's knob values after it, a list.
- Several rows: ``action`` is ``actions.ROWS``; ``values`` is what the engine's consumer
  needs (the cluster engine's (N, K) array, or the per-node daemon's flat
  ``<node>/<knob>`` list); ``row_actions`` and ``row_explored`` say what each row did.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Decision:
    tick: int
    action: int              # one row: its move (capes.common.actions); rows: actions.ROWS
    values: list[float] | np.ndarray   # every knob's value after the action
    epsilon: float
    explored: bool           # the action came from exploration (rows: any row's did)
    q_max: float | None      # the network's value estimate (rows: mean over greedy rows;
                             # None when none was greedy)
    rolled_back: bool = False            # values are the best-known setting (a jump; every
                                         # row's action NULL)
    row_actions: np.ndarray | None = None    # rows: (N,) each row's move (None: one row)
    row_explored: np.ndarray | None = None   # rows: (N,) bool, each row's from exploration

    @property
    def rows(self) -> bool:
        """The decision moves several rows (``row_actions`` says how)."""
        return self.row_actions is not None


__all__ = ["Decision"]
