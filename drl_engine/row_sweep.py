"""Per-row coarse sweep: a row in a new workload context measures its ladder knobs'
range before anything else (the per-node mode's ``sweep_points``).

Why: on a real cluster a node's best readahead window can sit anywhere on a 12-rung
ladder and differs by workload by 100x in throughput (an mmap random reader on GlusterFS:
9.7 MB/s at 8 KiB, 0.1 at 512 KiB and above, docs/targets.md). Per-row probes (a few
rungs from where the row is, then back) and the moving-average peak of the cluster
objective (a snapshot of every row's knobs, ``drl_engine.best_known.PeakTracker``) did
not find it within a 45-60 s phase: the probes walked back from 4 KiB, and the peak's
snapshot named a window the row held a few ticks before its best. The one-row mode
sweeps a new workload's ladder knobs for the same reason (``drl_engine.guide``).

So, when a row enters a new context (its first one included, ``drl_engine.
row_context``), it visits ``sweep_points`` settings spread evenly over each dynamic
ladder knob's grid, one knob at a time (the nearer end's side first), walking there as
the daemon's step rule allows (``RowController.walk_to``). At each it waits
``settle_ticks`` (a new window reaches an application only when it reopens its files)
and takes the median of its **own** objective (its PIs among the reward's) over
``probe_dwell`` ticks; then it goes to the best one (back where it was when it moved no
data at any: an idle node tells nothing) and that setting is the row's in
the best-known setting (pinned there over the peak tracker's snapshots while the row
stays in the context: the trust region, rollback and the context memory keep it). A
row's own objective leaves out what its window costs the others on shared servers; the
probes afterwards are judged on the cluster's. Numeric knobs are not swept (a range of
100 steps walks ~50 ticks a point; the one-row mode's measurement, docs/engine.md).
A row that changes context mid-sweep drops it; a sweep under way is not checkpointed.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("capes.engine")


class RowSweep:
    """The sweeps under way (row -> plan) and the settings they found (row -> indices)."""

    def __init__(self, grid, dynamic: np.ndarray, points: int, settle_ticks: int,
                 dwell: int):
        self.grid, self.points = grid, int(points)
        self.knobs = np.flatnonzero(dynamic & grid.ladder & (grid.n_steps > 0))
        self.settle, self.dwell = int(settle_ticks), max(1, int(dwell))
        self.plans: dict[int, dict] = {}     # row -> {"plan", "at", "since", "scores", "got"}
        self.found: dict[int, np.ndarray] = {}
        self.sweeps = 0                      # sweeps finished

    @classmethod
    def build(cls, cfg, model, grid, dynamic: np.ndarray) -> "RowSweep | None":
        """None unless ``sweep_points`` > 0, contexts are on and a dynamic knob is a
        ladder."""
        if cfg.sweep_points <= 0 or not cfg.use_context or not cfg.context_pis:
            return None
        sweep = cls(grid, dynamic, cfg.sweep_points, cfg.settle_ticks, model.probe_dwell)
        return sweep if len(sweep.knobs) else None

    def covers(self, dynamic: np.ndarray) -> bool:
        """Every dynamic knob is swept (the shared cold start is then not needed)."""
        return bool(set(np.flatnonzero(dynamic)) <= set(self.knobs.tolist()))

    @property
    def active(self) -> np.ndarray:
        """Rows sweeping (held from probes and greedy moves; :meth:`step` moves them)."""
        return np.array(sorted(self.plans), np.int64)

    def start(self, rows, idx: np.ndarray, tick: int) -> None:
        """Rows entered new contexts: each sweeps from its grid indices ``idx`` (N, K)."""
        for r in rows:
            if r >= len(idx):
                continue
            self.found.pop(r, None)
            plan = []
            for k in self.knobs:
                n, b = int(self.grid.n_steps[k]), int(idx[r, k])
                pts = np.unique(np.rint(np.linspace(0, n, max(2, self.points)))).astype(int)
                below = [int(v) for v in pts[::-1] if v <= b]     # nearest first
                above = [int(v) for v in pts if v > b]
                for v in (below + above if b <= n - b else above + below):
                    t = idx[r].copy()
                    t[k] = v
                    plan.append(t)
            self.plans[r] = {"plan": plan, "at": 0, "since": None, "got": [],
                             "scores": [], "tick": int(tick), "origin": idx[r].copy()}

    def drop(self, rows) -> None:
        """Rows left their context: their sweep and what it found belonged to it."""
        for r in rows:
            self.plans.pop(r, None)
            self.found.pop(r, None)

    def observe(self, tick: int, idx: np.ndarray, own: np.ndarray) -> None:
        """One tick: ``idx`` (N, K) the grid indices in effect, ``own`` (N,) each row's
        own objective (NaN: none this tick)."""
        for r in list(self.plans):
            p = self.plans[r]
            if r >= len(idx):
                continue
            if p["at"] >= len(p["plan"]):                 # walking to what it found
                if (idx[r] == self.found[r]).all():
                    del self.plans[r]
                continue
            if not (idx[r] == p["plan"][p["at"]]).all():
                p["since"] = None                        # not there (yet, or moved off)
                continue
            if p["since"] is None:
                p["since"] = int(tick)
            if tick - p["since"] < self.settle or not np.isfinite(own[r]):
                continue
            p["got"].append(float(own[r]))
            if len(p["got"]) >= self.dwell:
                p["scores"].append(float(np.median(p["got"])))
                p["got"], p["since"] = [], None
                p["at"] += 1
                if p["at"] == len(p["plan"]):
                    # a row that moved no data at any point (idle) keeps its setting
                    best = p["plan"][int(np.argmax(p["scores"]))] \
                        if max(p["scores"]) > 0 else p["origin"]
                    self.found[r] = best.copy()
                    self.sweeps += 1
                    log.info("tick %d: row %d's sweep (since tick %d) found %s (own "
                             "objective %s at %s)", tick, r, p["tick"],
                             self.grid.values(best[None])[0].tolist(),
                             [f"{s:.3g}" for s in p["scores"]],
                             [self.grid.values(t[None])[0].tolist() for t in p["plan"]])

    def targets(self) -> dict[int, np.ndarray]:
        """Where each sweeping row heads now (row -> grid indices)."""
        return {r: (p["plan"][p["at"]] if p["at"] < len(p["plan"]) else self.found[r])
                for r, p in self.plans.items()}

    def pin(self, best) -> None:
        """The settings found are the rows' in the best-known setting (when one is)."""
        if best.best_idx is None or not self.found:
            return
        for r, t in self.found.items():
            if r < len(best.best_idx):
                best.best_idx[r] = t


__all__ = ["RowSweep"]
