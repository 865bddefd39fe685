"""One context memory over rows, both modes': what a workload context keeps.

A *row* is what has a signature and a setting of its own: the one-row (flat) mode has
one (its signature: the whole target's PIs, ``drl_engine.context``), the per-node mode
a row per node (each node's own PIs, ``drl_engine.row_context``). Both modes tell a
row's workloads apart the same way (:class:`~drl_engine.context.SignatureClusters`;
the per-node mode's :class:`~drl_engine.row_context.RowSignatures` folds every row in at
once, tick for tick the same clustering), over the same signature columns
(:func:`~drl_engine.context.context_columns`), raise ε through the one exploration state
(``drl_engine.exploration``), and keep here, in :class:`ContextMemory`:

* per row and context, the **best-known setting** of the context's last visit (grid
  indices, ``drl_engine.best_known``), stored when the row leaves the context and
  recalled when it comes back (:meth:`ContextMemory.remember`, :meth:`ContextMemory.recalled`);
* per row, the **hold**: once a recalled setting is reached, no probe (nor, per node, a
  greedy move) for ``context_hold_ticks`` ticks (:meth:`ContextMemory.hold`,
  :meth:`ContextMemory.held`).

What stays with each mode, and why: the flat mode's best-known setting is a lower
confidence bound over per-setting statistics, so a context also keeps those statistics,
its change detector and its ε clock (``WorkloadContexts``); it may infer a new
workload's first setting and be seeded from earlier sessions. The per-node mode's is a
moving-average peak over every row at once, so rows that change together store one
snapshot of it, a change counts for the cluster once ``MIN_ROWS`` rows make it, and the
group search and the walks over many rows are its own (``RowContexts``). Two rules
differ with the estimators, so neither class is the other's case of one row (the engine
traces pin both): a row leaving a context stores the flat mode's bound as it stands at
the switch (none known: the stored one is forgotten) but the per-node snapshot only when
there is one (none: the stored one stays; a row leaving mid-sweep stores what its sweep
measured instead, and with nothing measured forgets, ``drl_engine.row_sweep``); and a row entering a context is a *new* one
for the flat mode when its signature makes a new cluster, for the per-node mode when
nothing is stored for it (a known context left without a best explores again).
"""
from __future__ import annotations

import numpy as np


class ContextMemory:
    """Per row: each context's best-known setting, and the tick the row's hold ends."""

    def __init__(self, cfg, columns: list[int], rows: int):
        self.cfg, self.columns = cfg, columns
        self.settings: list[dict[int, np.ndarray]] = []   # per row: context → grid indices
        self.hold_until = np.zeros(0, np.int64)            # per row: no probe before
        self.grow(rows)

    def grow(self, rows: int) -> None:
        """Rows appended (nodes joined): nothing remembered for them yet."""
        self.settings += [{} for _ in range(rows - len(self.settings))]
        self.hold_until = np.concatenate(
            [self.hold_until, np.zeros(rows - len(self.hold_until), np.int64)])

    @property
    def rows(self) -> int:
        return len(self.settings)

    def remember(self, row: int, context: int, best: np.ndarray | None) -> None:
        """``row``'s best-known setting in ``context`` (None: none known)."""
        if best is None:
            self.settings[row].pop(context, None)
        else:
            self.settings[row][context] = best

    def recalled(self, row: int, context: int) -> np.ndarray | None:
        """The setting ``row`` had in ``context`` (None: none remembered)."""
        return self.settings[row].get(context)

    def hold(self, rows, tick: int) -> None:
        """``rows`` reached a recalled setting at ``tick``: held ``context_hold_ticks``."""
        self.hold_until[rows] = tick + self.cfg.context_hold_ticks

    def held(self, tick: int) -> np.ndarray:
        """Per row: whether it holds its setting at ``tick``."""
        return self.hold_until > tick


__all__ = ["ContextMemory"]
