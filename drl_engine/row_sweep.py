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
A row that changes context mid-sweep drops it, and the context it leaves keeps what the
sweep had measured (its best point so far; nothing when nothing was measured), not the
point it was on: a signature that flickers would otherwise recall a sweep point as the
row's best. A sweep under way is not checkpointed.

Two savings, each with its switch (``[cluster_engine]``):
- ``sweep_pool``: rows entering new contexts within ``JOIN_TICKS`` of each other whose
  signatures are alike (``context_search.signature_groups``: the clients of one phase
  running one workload) form a cohort: the points are dealt round its members and each
  member's measure is the cohort's, so m alike rows sweep in 1/m of the time, and all go
  to the cohort's best point.
- ``sweep_cut``: a point that scored under that share of the knob's best so far ends the
  sweep on its side (the points beyond it are not visited): a window's throughput is
  taken as unimodal along the ladder, and every point visited costs its row
  ``settle_ticks`` + ``probe_dwell`` ticks there.
"""
from __future__ import annotations

import logging

import numpy as np

from drl_engine.context_search import signature_groups

log = logging.getLogger("capes.engine")


class _Cohort:
    """Rows that entered new contexts together with alike signatures: one set of points,
    split among them, and the scores every member measured (point -> medians)."""

    def __init__(self, row: int, points: list[tuple[int, int]], tick: int):
        self.rows, self.points, self.tick = [row], points, int(tick)
        self.scores: dict[tuple[int, int], list[float]] = {}
        self.measured = False            # a member has started measuring: closed to joins

    def best(self) -> tuple[int, int] | None:
        """The point with the highest mean score (the first on a tie); None when nothing
        moved data (an idle row tells nothing)."""
        means = [(float(np.mean(s)), p) for p, s in self.scores.items()]
        top = max(means, key=lambda m: m[0], default=(0.0, None))
        return top[1] if top[0] > 0 else None


class RowSweep:
    """The sweeps under way (row -> plan) and the settings they found (row -> indices)."""

    JOIN_TICKS = 3     # a row entering a new context this soon after a cohort formed ...

    def __init__(self, grid, dynamic: np.ndarray, points: int, settle_ticks: int,
                 dwell: int, pool: bool = True, cut: float = 0.0):
        self.grid, self.points, self.pool, self.cut = grid, int(points), bool(pool), cut
        self.knobs = np.flatnonzero(dynamic & grid.ladder & (grid.n_steps > 0))
        self.settle, self.dwell = int(settle_ticks), max(1, int(dwell))
        # row -> {"cohort", "points" (its share, in order), "at", "since", "got",
        #         "origin", "tick"}
        self.plans: dict[int, dict] = {}
        self.found: dict[int, np.ndarray] = {}
        self.sweeps = 0                      # sweeps finished (a cohort's counts once)
        self.arrived: list[int] = []         # rows that reached what they found this tick
        self.pooled = 0                      # rows that joined another row's sweep

    @classmethod
    def build(cls, cfg, model, grid, dynamic: np.ndarray) -> "RowSweep | None":
        """None unless ``sweep_points`` > 0, contexts are on and a dynamic knob is a
        ladder."""
        if cfg.sweep_points <= 0 or not cfg.use_context or not cfg.context_pis:
            return None
        sweep = cls(grid, dynamic, cfg.sweep_points, cfg.settle_ticks, model.probe_dwell,
                    model.sweep_pool, model.sweep_cut)
        return sweep if len(sweep.knobs) else None

    def covers(self, dynamic: np.ndarray) -> bool:
        """Every dynamic knob is swept (the shared cold start is then not needed)."""
        return bool(set(np.flatnonzero(dynamic)) <= set(self.knobs.tolist()))

    @property
    def active(self) -> np.ndarray:
        """Rows sweeping (held from probes and greedy moves; :meth:`step` moves them)."""
        return np.array(sorted(self.plans), np.int64)

    def _order(self, b: np.ndarray) -> list[tuple[int, int]]:
        """The points (knob, grid index) a row at indices ``b`` visits, in order: per
        knob, the nearer end's side first, nearest first."""
        from capes.common.step_grid import sweep_order
        return [(int(k), v) for k in self.knobs
                for v in sweep_order(int(self.grid.n_steps[k]), int(b[k]), self.points,
                                     with_at=True)]

    @staticmethod
    def _at(origin: np.ndarray, point: tuple[int, int] | None) -> np.ndarray:
        t = origin.copy()
        if point is not None:
            t[point[0]] = point[1]
        return t

    def start(self, rows, idx: np.ndarray, tick: int, sig: np.ndarray | None = None) -> None:
        """Rows entered new contexts: each sweeps from its grid indices ``idx`` (N, K).
        With pooling, a row whose signature (``sig``, N × P, raw scale) is alike that of
        a cohort formed within ``JOIN_TICKS`` ticks, none of whose members has measured
        yet, joins it: the cohort's points are split among its members, so m alike rows
        sweep in 1/m of the time."""
        for r in rows:
            if r >= len(idx):
                continue
            self.drop([r])
            origin = idx[r].copy()
            cohort = self._joinable(r, tick, sig)
            if cohort is None:
                cohort = _Cohort(r, self._order(origin), tick)
            else:
                cohort.rows.append(r)
                self.pooled += 1
            self.plans[r] = {"cohort": cohort, "points": [], "at": 0, "since": None,
                             "got": [], "origin": origin, "tick": int(tick)}
            m = len(cohort.rows)                       # the points dealt round the members
            for i, q in enumerate(cohort.rows):
                self.plans[q]["points"] = cohort.points[i::m]

    def _joinable(self, r: int, tick: int, sig: np.ndarray | None) -> "_Cohort | None":
        if not self.pool or sig is None or not np.isfinite(sig[r]).all():
            return None
        seen = set()
        for p in self.plans.values():
            c = p["cohort"]
            if id(c) in seen or c.measured or tick - c.tick > self.JOIN_TICKS:
                continue
            seen.add(id(c))
            head = c.rows[0]
            if head < len(sig) and np.isfinite(sig[head]).all() and len(
                    signature_groups(sig, np.array([head, r], np.int64))) == 1:
                return c
        return None

    def drop(self, rows) -> None:
        """Rows left their context: their sweep and what it found belonged to it (the
        rest of a cohort goes on without them)."""
        for r in rows:
            p = self.plans.pop(r, None)
            self.found.pop(r, None)
            if p is not None and r in p["cohort"].rows:
                p["cohort"].rows.remove(r)

    def so_far(self, r: int) -> np.ndarray | None:
        """Row ``r``'s setting by what its sweep has measured so far: what it found, or
        its cohort's best point (None: nothing measured yet, or not sweeping). What a row
        leaving its context mid-sweep stores for it, rather than the sweep point it
        happened to be on; with nothing measured it stores nothing, and a return sweeps
        afresh from wherever the row then is."""
        p = self.plans.get(r)
        if p is None:
            return None
        if r in self.found:
            return self.found[r]
        best = p["cohort"].best()
        return None if best is None else self._at(p["origin"], best)

    def observe(self, tick: int, idx: np.ndarray, own: np.ndarray) -> None:
        """One tick: ``idx`` (N, K) the grid indices in effect, ``own`` (N,) each row's
        own objective (NaN: none this tick)."""
        self.arrived = []
        for r in list(self.plans):
            p = self.plans[r]
            if r >= len(idx):
                continue
            if r in self.found:                         # walking to what it found
                if (idx[r] == self.found[r]).all():
                    del self.plans[r]                   # there: its sweep (and its place
                    p["cohort"].rows.remove(r)          # in the cohort) ends
                    self.arrived.append(r)
                continue
            if p["at"] >= len(p["points"]):             # its share done: the others'
                continue
            point = p["points"][p["at"]]
            if not (idx[r] == self._at(p["origin"], point)).all():
                p["since"] = None                        # not there (yet, or moved off)
                continue
            if p["since"] is None:
                p["since"] = int(tick)
            if tick - p["since"] < self.settle or not np.isfinite(own[r]):
                continue
            p["cohort"].measured = True
            p["got"].append(float(own[r]))
            if len(p["got"]) >= self.dwell:
                p["cohort"].scores.setdefault(point, []).append(float(np.median(p["got"])))
                p["got"], p["since"] = [], None
                p["at"] += 1
                self._cut(p["cohort"])
        for c in {id(p["cohort"]): p["cohort"] for p in self.plans.values()}.values():
            if c.rows and all(self.plans[q]["at"] >= len(self.plans[q]["points"])
                              for q in c.rows) and not all(q in self.found for q in c.rows):
                self._finish(c, tick)

    def _cut(self, c: _Cohort) -> None:
        """Points not yet measured that lie beyond a measured one scoring under ``cut`` ×
        the knob's best, seen from that best, are dropped from every member's share: a
        window's throughput is taken as unimodal along the ladder, so past a point this
        much worse it only falls (an mmap reader: 11 MB/s at 4 KiB, 0.8 at 64, 0.08 at
        512, 0.006 at 8192), and each point visited costs the row ~``settle`` +
        ``dwell`` ticks there."""
        if self.cut <= 0:
            return
        means = {p: float(np.mean(s)) for p, s in c.scores.items()}
        dropped = set()
        for k in {p[0] for p in means}:
            mine = {p[1]: m for p, m in means.items() if p[0] == k}
            top = max(mine, key=mine.get)
            if mine[top] <= 0:
                continue
            for v, m in mine.items():
                if m < self.cut * mine[top]:
                    side = np.sign(v - top)
                    dropped |= {q for q in c.points if q[0] == k and q not in c.scores
                                and np.sign(q[1] - top) == side
                                and abs(q[1] - top) > abs(v - top)}
        if not dropped:
            return
        c.points = [q for q in c.points if q not in dropped]
        for q in c.rows:
            p = self.plans[q]
            ahead = p["points"][p["at"]:]
            keep = [x for x in ahead if x not in dropped]
            if keep[:1] != ahead[:1]:
                p["got"], p["since"] = [], None         # its current point was dropped
            p["points"] = p["points"][:p["at"]] + keep

    def _finish(self, c: _Cohort, tick: int) -> None:
        best = c.best()                # none moved data: each keeps its setting
        for q in c.rows:
            self.found[q] = self._at(self.plans[q]["origin"], best)
        self.sweeps += 1
        first = self.plans[c.rows[0]]
        log.info("tick %d: row(s) %s's sweep (since tick %d) found %s (own objective %s "
                 "at %s)", tick, c.rows, first["tick"],
                 self.grid.values(self.found[c.rows[0]][None])[0].tolist(),
                 {f"{self.grid.values(self._at(first['origin'], p)[None])[0][p[0]]:g}":
                  [f"{v:.3g}" for v in s] for p, s in c.scores.items()}, c.points)

    def targets(self) -> dict[int, np.ndarray]:
        """Where each sweeping row heads now (row -> grid indices): its next point; once
        its share is measured, its cohort's best point so far; then what was found."""
        out = {}
        for r, p in self.plans.items():
            if r in self.found:
                out[r] = self.found[r]
            elif p["at"] < len(p["points"]):
                out[r] = self._at(p["origin"], p["points"][p["at"]])
            else:
                out[r] = self._at(p["origin"], p["cohort"].best())
        return out

    def pin(self, best) -> None:
        """The settings found are the rows' in the best-known setting (when one is)."""
        if best.best_idx is None or not self.found:
            return
        for r, t in self.found.items():
            if r < len(best.best_idx):
                best.best_idx[r] = t


__all__ = ["RowSweep"]
