"""How far the per-node engine may read a live session: up to each node's own newest row.

The replay DB stores each node's rows at the ticks its agent stamped them with, by the
node's own clock. A node whose clock runs ahead (2-3 s after an NTP step: far inside
``daemon.max_clock_skew_s``) has rows at ticks the others have not reached yet. The
engine takes a tick into its ring once and never goes back, so reading up to the newest
row of any node took tick after tick with only the fast node in it: the on-time nodes
were seen in ~10 % of the ticks (issue 38).

:class:`TickFrontier` waits instead for every node that is still sending: a tick is
taken once each such node has a row at it (or after it). Two bounds keep one node from
holding the others back for long:

* **stalled**: a node whose newest row has not moved while the session's newest tick
  moved ``stall_ticks`` ticks has stopped sending (killed, left, lost): it is not waited
  for (measured in the session's ticks, not wall time, so a slow engine tick or a
  daemon's commit batch never makes a live node look stopped);
* **behind**: a node more than ``lag_ticks`` ticks behind the (lower) median of the
  nodes' newest ticks is a clock running *behind*: waiting for it would make every
  decision that late, so it is left out (its rows are in the DB, not in the ring).

A node ahead of the median costs nothing: the others are not behind it in this sense.
"""
from __future__ import annotations

import numpy as np

CHUNK = 1024          # ticks scanned at once (bounds the scan's memory at any size)

class TickFrontier:
    """One session's read frontier (see the module docstring). Ticks, not indices: a
    late row older than the session's first tick shifts the reader's indices."""

    def __init__(self, stall_ticks: int = 5, lag_ticks: int = 10):
        self.stall_ticks, self.lag_ticks = int(stall_ticks), int(lag_ticks)
        self.last = np.zeros(0, np.int64)       # per node: its newest row's tick (-1: none)
        self.moved_at = np.zeros(0, np.int64)   # per node: the newest tick when it last moved

    def reset(self) -> None:
        """A new session."""
        self.last = np.zeros(0, np.int64)
        self.moved_at = np.zeros(0, np.int64)

    def end(self, pis: np.ndarray, first_tick: int, length: int, seen: int) -> int:
        """One past the last index of ``pis`` ((ticks, nodes, PIs), NaN: no row; index
        i is tick ``first_tick + i``) that may be taken now, given that the indices
        before ``seen`` are taken: at least ``seen``, at most ``length``."""
        if length <= seen:
            return seen
        n = pis.shape[1]
        if len(self.last) < n:                               # nodes joined
            grow = n - len(self.last)
            self.last = np.concatenate([self.last, np.full(grow, -1, np.int64)])
            self.moved_at = np.concatenate([self.moved_at, np.zeros(grow, np.int64)])
        newest = first_tick + length - 1
        found = np.full(n, -1, np.int64)
        for lo in range(seen, length, CHUNK):       # in chunks: a restart reads a day
            has = ~np.isnan(pis[lo:min(length, lo + CHUNK)]).all(axis=2)   # (ticks, nodes)
            at = first_tick + lo + len(has) - 1 - np.argmax(has[::-1], axis=0)
            found = np.where(has.any(axis=0), at, found)
        moved = found > self.last
        self.last = np.maximum(self.last, found)
        self.moved_at[moved] = newest
        live = (self.last >= 0) & (newest - self.moved_at <= self.stall_ticks)
        if not live.any():
            return length
        heads = np.sort(self.last[live])
        median = heads[(len(heads) - 1) // 2]                # the lower median
        waited = live & (self.last >= median - self.lag_ticks)
        upto = int(self.last[waited].min()) - first_tick + 1
        return int(min(length, max(seen, upto)))


__all__ = ["TickFrontier"]
