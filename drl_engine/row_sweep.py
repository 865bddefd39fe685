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

Five savings, a correction and an order, each with its switch (``[cluster_engine]``):
- ``sweep_pool``: rows entering new contexts within ``JOIN_TICKS`` of each other whose
  signatures are alike (``context_search.signature_groups``: the clients of one phase
  running one workload) form a cohort: the points are dealt round its members and each
  member's measure is the cohort's, so m alike rows sweep in 1/m of the time, and all go
  to the cohort's best point.
- ``sweep_cut``: a point that scored under that share of the knob's best so far ends the
  sweep on its side (the points beyond it are not visited): a window's throughput is
  taken as unimodal along the ladder, and every point visited costs its row
  ``settle_ticks`` + ``probe_dwell`` ticks there.
- ``sweep_abort``: the cut skips the points beyond a bad one, but the bad one itself was
  held its full ``settle_ticks`` + ``probe_dwell`` (9 s at 1 s ticks), and such a point
  starves its client (an mmap random reader on GlusterFS: 11 MB/s at 4 KiB, 0.08 at 512
  KiB): on the real cluster CAPES's worst 10 s of a session were 0.69-0.71 of the
  original's, at such points, where issue 40 asks >= 0.8. So once a point has settled,
  when the row's own objective lies below that share of the best median its cohort has
  on the knob (none yet: the row's level over its last ticks before the sweep; unknown:
  no abort) for 2 ticks in a row, and the median of its ticks there does too, that
  median is the point's measure at once and the row moves on: ~``settle_ticks`` + 2
  ticks there. The cut and the choice see the point as bad, as they would have after
  the full dwell (the rule, and the re-check's: :meth:`RowSweep._starved`).
- ``sweep_recheck``: a phase's throughput drifts while its sweep runs (on GlusterFS the
  bricks' page cache warms, so the points measured later look better: one sequential
  reader's own figures put 8192 KiB at 3x 4 KiB where every static run puts 4 KiB
  first, and its sweep kept 8192). So once a sweep's points are measured, each of its
  rows measures its first point once more (``settle_ticks`` + ``probe_dwell`` ticks, the
  price of one point), and every median is corrected for the drift those two measures
  show (the rule: ``_Cohort.scores``). A row that cannot (it left, it measured nothing)
  keeps its medians as measured. The cut judges the medians as measured: the drift is
  known only at the end. ``sweep_recheck_floor``: a row whose first point scored under
  that share of the knob's best does not measure it again (:meth:`RowSweep._recheck`).
- ``sweep_adopt``: alike rows that switch a few ticks apart do not pool (a cohort takes
  joiners for ``JOIN_TICKS`` and only until a member has measured): on GlusterFS a
  reader whose signature flickered entered its context 7 ticks after its cohort formed
  and swept 8192, 512 and 64 KiB alone. So a row entering a new context alike a cohort
  it is too late to join, one still sweeping or one finished within ``adopt_ticks``,
  sweeps nothing: it takes the cohort's point when the cohort finishes (at once when it
  has). Meanwhile it waits at the cohort's best point so far, where it is while none is
  measured: a measured point of an alike row beats the window it brought from its last
  context (the flickering reader's 8192 KiB), and the point found is mostly that one
  or near it, so the row has less to walk at the end. ``adopt_ticks`` is one sweep's
  length (``sweep_points`` × knobs × (``settle_ticks`` + ``probe_dwell``)): a cohort
  finished that lately measured no longer ago than a sweep of the row's own would end,
  and alike rows switching further apart are more likely in another phase than late.
  Adopting is left to rows too late to pool, so ``sweep_pool`` off still sweeps rows
  that start together alone.
- ``sweep_from = "original"``: a row's later sweeps visit their points in the order seen
  from the setting it had when its first sweep began (the original, or what a
  restarted engine found), not from the window it brings from its last context. On
  GlusterFS two readers carried the 8192 KiB their sequential phase had found into an
  mmap random phase, so their sweep began at 8192 and 512 KiB (0.05 MB/s each, against
  11.8 at 4 KiB) and the phase's first visit held 0.73 of its best (seed 2). A
  window fitted to another workload is no better a first guess than the original, and
  is the one more likely to sit at an end of the ladder; from the original the nearer
  end's side comes first as before (``capes.common.step_grid.sweep_order``).
"""
from __future__ import annotations

import logging
from collections import deque

import numpy as np

from capes.common.step_grid import sweep_order
from drl_engine.context_search import signature_groups

log = logging.getLogger("capes.engine")


class _Cohort:
    """Rows that entered new contexts together with alike signatures: one set of points,
    split among them, and what every member measured (row, point, tick, median)."""

    def __init__(self, row: int, points: list[tuple[int, int]], tick: int,
                 sig: np.ndarray | None = None):
        self.rows, self.points, self.tick = [row], points, int(tick)
        self.sig = sig                   # its first row's signature when it formed
        self.measures: list[tuple[int, tuple[int, int], int, float]] = []
        self.measured = False            # a member has started measuring: closed to joins
        self.rechecked = False           # its members' first points were put back
        self.aborted: list[tuple[int, tuple[int, int], int]] = []   # (row, point, tick)
        self.end: int | None = None      # the tick it finished, and the point it found
        self.found: tuple[int, int] | None = None

    def first(self, row: int) -> tuple[tuple[int, int], int, float] | None:
        """Row ``row``'s first measure (point, tick, median): its reference point."""
        return next(((p, t, v) for q, p, t, v in self.measures if q == row), None)

    def scores(self, corrected: bool = True) -> dict[tuple[int, int], list[float]]:
        """point -> its medians; ``corrected``: each scaled for its row's drift.

        A row that measured its first point twice (``sweep_recheck``: at t0 and again at
        t1 after its other points) has its level's drift; a median taken at tick t is
        multiplied by v0 / ref(t), ref the line through (t0, v0) and (t1, v1). Why this
        rule: a warming cache (or a neighbour's load fading) scales every setting's
        throughput alike, so the drift is a factor on the level, read off the one setting
        measured twice; two measures fix a line and nothing more, and every point lies
        between them, so the line is interpolated, never extrapolated; scaling to the
        level at t0 (not to 1) keeps the rows' medians in their units, comparable across
        a cohort's members as they were uncorrected. A row without that second measure
        (it left, or it measured nothing, or no re-check) keeps its medians as they are."""
        drift = {}
        if corrected:
            for row in {q for q, _, _, _ in self.measures}:
                p0, t0, v0 = self.first(row)
                again = [(t, v) for q, p, t, v in self.measures
                         if q == row and p == p0 and t > t0]
                if again and v0 > 0 and again[-1][1] > 0:
                    drift[row] = (t0, v0, *again[-1])
        out: dict[tuple[int, int], list[float]] = {}
        for q, p, t, v in self.measures:
            if q in drift:
                t0, v0, t1, v1 = drift[q]
                v *= v0 / (v0 + (v1 - v0) * (t - t0) / (t1 - t0))
            out.setdefault(p, []).append(v)
        return out

    def means(self) -> dict[tuple[int, int], float]:
        """point -> the mean of its medians as measured, uncorrected (what the cut and
        the abort judge by: the drift is known only at the end)."""
        return {p: float(np.mean(s)) for p, s in self.scores(corrected=False).items()}

    def top(self, knob: int) -> float | None:
        """The highest mean of a point's medians on ``knob``, as measured (what the abort
        and the re-check floor judge by); None: none measured there yet."""
        return max((m for p, m in self.means().items() if p[0] == knob), default=None)

    def best(self) -> tuple[int, int] | None:
        """The point with the highest mean score, drift-corrected (the first on a tie);
        None when nothing moved data (an idle row tells nothing)."""
        means = [(float(np.mean(s)), p) for p, s in self.scores().items()]
        top = max(means, key=lambda m: m[0], default=(0.0, None))
        return top[1] if top[0] > 0 else None


class RowSweep:
    """The sweeps under way (row -> plan) and the settings they found (row -> indices)."""

    JOIN_TICKS = 3     # a row entering a new context this soon after a cohort formed ...
    LEVEL_TICKS = 3    # ticks of a row's own objective before its sweep: its level
    ABORT_TICKS = 2    # settled ticks in a row below sweep_abort x the reference

    def __init__(self, grid, dynamic: np.ndarray, points: int, settle_ticks: int,
                 dwell: int, pool: bool = True, cut: float = 0.0, recheck: bool = False,
                 adopt: bool = False, abort: float = 0.0, recheck_floor: float = 0.0,
                 from_original: bool = False):
        self.grid, self.points, self.pool, self.cut = grid, int(points), bool(pool), cut
        self.abort, self.recheck_floor = float(abort), float(recheck_floor)
        # row -> its grid indices when its first sweep began (the original, where the
        # engine started with it); with ``from_original`` every later sweep's order
        # starts from there
        self.home: dict[int, np.ndarray] = {}
        self.from_original = bool(from_original)
        self.recent: deque[np.ndarray] = deque(maxlen=self.LEVEL_TICKS)   # own, per tick
        self.recheck, self.adopt = bool(recheck), bool(adopt)
        self.knobs = np.flatnonzero(dynamic & grid.ladder & (grid.n_steps > 0))
        self.settle, self.dwell = int(settle_ticks), max(1, int(dwell))
        # a finished cohort is adopted this long after (a sweep's length, the module
        # docstring says why), and the ones finished that recently
        self.adopt_ticks = self.points * len(self.knobs) * (self.settle + self.dwell)
        self.finished: list[_Cohort] = []
        # row -> {"cohort", "points" (its share, in order), "at", "since", "got",
        #         "origin", "tick"}
        self.plans: dict[int, dict] = {}
        self.found: dict[int, np.ndarray] = {}
        self.sweeps = 0                      # sweeps finished (a cohort's counts once)
        self.arrived: list[int] = []         # rows that reached what they found this tick
        self.pooled = 0                      # rows that joined another row's sweep
        self.adopted = 0                     # rows that took a later cohort's result
        self.aborted = 0                     # points left early (sweep_abort)

    @classmethod
    def build(cls, cfg, model, grid, dynamic: np.ndarray) -> "RowSweep | None":
        """None unless ``sweep_points`` > 0, contexts are on and a dynamic knob is a
        ladder."""
        if cfg.sweep_points <= 0 or not cfg.use_context or not cfg.context_pis:
            return None
        sweep = cls(grid, dynamic, cfg.sweep_points, cfg.settle_ticks, model.probe_dwell,
                    model.sweep_pool, model.sweep_cut, model.sweep_recheck,
                    model.sweep_adopt, model.sweep_abort, model.sweep_recheck_floor,
                    model.sweep_from == "original")
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
        sweep in 1/m of the time. With adoption, a row alike a cohort it is too late to
        join (running, or finished within ``adopt_ticks``) sweeps nothing: it waits for
        that cohort's point, or takes the one it found."""
        self.finished = [c for c in self.finished if tick - c.end <= self.adopt_ticks]
        for r in rows:
            if r >= len(idx):
                continue
            self.drop([r])
            origin = idx[r].copy()
            home = self.home.setdefault(r, origin.copy())
            cohort = self._joinable(r, tick, sig)
            late = None if cohort is not None else self._adoptable(r, tick, sig)
            if late is not None:
                cohort = late
                self.adopted += 1
            elif cohort is None:
                cohort = _Cohort(r, self._order(home if self.from_original else origin),
                                 tick,
                                 None if sig is None or r >= len(sig) else sig[r].copy())
            else:
                self.pooled += 1
            if r not in cohort.rows:
                cohort.rows.append(r)
            self.plans[r] = {"cohort": cohort, "points": [], "at": 0, "since": None,
                             "got": [], "origin": origin, "tick": int(tick),
                             "level": self._level(r)}
            if late is None:                           # the points dealt round the members
                m = len(cohort.rows)
                for i, q in enumerate(cohort.rows):
                    self.plans[q]["points"] = cohort.points[i::m]
            elif late.end is not None:                 # finished: its point, at once
                self.found[r] = self._at(origin, late.found)

    def _level(self, r: int) -> float | None:
        """Row ``r``'s own objective over the last ``LEVEL_TICKS`` ticks observed (its
        level before the sweep, what ``sweep_abort`` judges the first points by); None
        when none was finite."""
        seen = [float(o[r]) for o in self.recent if r < len(o) and np.isfinite(o[r])]
        return float(np.mean(seen)) if seen else None

    def _cohorts(self) -> list[_Cohort]:
        """The cohorts under way (each once), then those finished lately, newest first."""
        mine = {id(p["cohort"]): p["cohort"] for p in self.plans.values()}
        return [c for c in mine.values() if c.end is None] + \
            [c for c in self.finished[::-1]]

    def _joinable(self, r: int, tick: int, sig: np.ndarray | None) -> "_Cohort | None":
        if not self.pool:
            return None
        return next((c for c in self._cohorts() if c.end is None and not c.measured
                     and tick - c.tick <= self.JOIN_TICKS and self._alike(c, r, sig)), None)

    def _adoptable(self, r: int, tick: int, sig: np.ndarray | None) -> "_Cohort | None":
        """An alike cohort too late to join (what pooling would have joined it is left
        to the pool, so ``sweep_pool`` off still sweeps rows that start together alone)."""
        if not self.adopt:
            return None
        return next((c for c in self._cohorts() if (
            c.end is not None or c.measured or tick - c.tick > self.JOIN_TICKS)
            and self._alike(c, r, sig)), None)

    def _alike(self, c: _Cohort, r: int, sig: np.ndarray | None) -> bool:
        """Row ``r``'s signature is alike cohort ``c``'s (``signature_groups``' rule),
        read off its first row now, or as it was when the cohort formed when that row
        is gone or has none."""
        if sig is None or r >= len(sig) or not np.isfinite(sig[r]).all():
            return False
        head = c.rows[0] if c.rows else len(sig)
        ref = sig[head] if head < len(sig) and np.isfinite(sig[head]).all() else c.sig
        return ref is not None and np.isfinite(ref).all() and len(
            signature_groups(np.stack([ref, sig[r]]), np.arange(2))) == 1

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
            short = len(p["got"]) < self.dwell
            if short and not self._starved(p, point):
                continue
            if short:
                self.aborted += 1
                p["cohort"].aborted.append((r, point, int(tick)))
            p["cohort"].measures.append((r, point, int(tick), float(np.median(p["got"]))))
            p["got"], p["since"] = [], None
            p["at"] += 1
            self._cut(p["cohort"])
        self.recent.append(np.asarray(own, float).copy())
        for c in {id(p["cohort"]): p["cohort"] for p in self.plans.values()}.values():
            if c.rows and all(self.plans[q]["at"] >= len(self.plans[q]["points"])
                              for q in c.rows) and not all(q in self.found for q in c.rows) \
                    and not self._recheck(c):
                self._finish(c, tick)

    def _starved(self, p: dict, point: tuple[int, int]) -> bool:
        """``sweep_abort``: the row's last ``ABORT_TICKS`` settled ticks at ``point`` and
        the median of all it got there lie below ``abort`` x the reference: the highest
        mean of a point's medians the cohort has on that knob (as measured: the cut's
        reading), or with none yet the row's level before its sweep (unknown: no abort).
        The median's test makes the measure recorded (that median) one the cut and the
        choice see as bad: two low ticks after good ones (a neighbour's burst) leave a
        median still good, and the point keeps its dwell.

        A re-check (``sweep_recheck``: the row's first point again) is aborted by the same
        rule, and its drift is then read off that short median. Why not exempt it: the
        first point is the one nearest the row's origin, and where it lies below half the
        knob's best it starves the client as any point does (an mmap reader's 64 KiB: 0.8
        MB/s against 11 at 4 KiB), so holding it a full dwell brings back the worst 10 s
        this switch removes; the drift is a ratio of two measures of one setting, and a
        median of >= ``ABORT_TICKS`` ticks there reads the same level with more noise, not
        a bias; and dropping the correction instead would bring back the warming cache's
        bias the re-check exists for."""
        got = p["got"]
        if self.abort <= 0 or len(got) < self.ABORT_TICKS:
            return False
        top = p["cohort"].top(point[0])
        ref = top if top is not None else p["level"]
        if ref is None or not ref > 0:
            return False
        bar = self.abort * ref
        return all(v < bar for v in got[-self.ABORT_TICKS:]) and float(np.median(got)) < bar

    def _recheck(self, c: _Cohort) -> bool:
        """With ``recheck``, once a cohort's points are measured each member measures its
        first point once more (its drift, :meth:`_Cohort.scores`); True while they do. A
        member with nothing measured, or whose first median is 0, has no drift to read
        and measures nothing more; nor does one whose first median lies under
        ``recheck_floor`` x the best mean on that knob (as measured): the drift that would
        lift it to the top (4x at the default floor) is far beyond what a warming cache
        shows, and its second measure would starve its client again (an mmap reader
        carrying 8192 KiB into its phase: 0.05 MB/s there against 11.8 at 4 KiB)."""
        if not self.recheck or c.rechecked:
            return False
        c.rechecked = True
        again = False
        for q in c.rows:
            first = c.first(q)
            if first is None or not first[2] > 0:
                continue
            if first[2] < self.recheck_floor * c.top(first[0][0]):
                continue
            self.plans[q]["points"].append(first[0])
            again = True
        return again

    def _cut(self, c: _Cohort) -> None:
        """Points not yet measured that lie beyond a measured one scoring under ``cut`` ×
        the knob's best, seen from that best, are dropped from every member's share: a
        window's throughput is taken as unimodal along the ladder, so past a point this
        much worse it only falls (an mmap reader: 11 MB/s at 4 KiB, 0.8 at 64, 0.08 at
        512, 0.006 at 8192), and each point visited costs the row ~``settle`` +
        ``dwell`` ticks there."""
        if self.cut <= 0:
            return
        means = c.means()
        dropped = set()
        for k in {p[0] for p in means}:
            mine = {p[1]: m for p, m in means.items() if p[0] == k}
            top = max(mine, key=mine.get)
            if mine[top] <= 0:
                continue
            for v, m in mine.items():
                if m < self.cut * mine[top]:
                    side = np.sign(v - top)
                    dropped |= {q for q in c.points if q[0] == k and q not in means
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
        c.end, c.found = int(tick), best
        self.finished.append(c)
        first = self.plans[c.rows[0]]
        log.info("tick %d: row(s) %s's sweep (since tick %d) found %s (own objective%s %s "
                 "at %s; %d point(s) left early)", tick, c.rows, first["tick"],
                 self.grid.values(self.found[c.rows[0]][None])[0].tolist(),
                 ", drift-corrected," if c.rechecked else "",
                 {f"{self.grid.values(self._at(first['origin'], p)[None])[0][p[0]]:g}":
                  [f"{v:.3g}" for v in s] for p, s in c.scores().items()}, c.points,
                 len(c.aborted))

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
