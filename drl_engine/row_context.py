"""Workload contexts per row: the per-node mode's recall (issue 25, the cluster variant).

The one-row mode tells workloads apart by the signature PIs of the whole target
(``drl_engine.context``). With a row of knobs per node, each node runs its own share of
the work (a checkpoint writer, an analysis reader, idle), so here every row has its own
context, derived from that node's own signature PIs by the same online clustering
(:class:`~drl_engine.context.SignatureClusters`, one per row), and every row keeps, per
context, the setting it had in the best-known setting (``drl_engine.best_known``) of
the last visit: the grid indices of its knobs at the objective's moving-average peak
(the context memory both modes share, ``drl_engine.context_memory``; the one-row mode's
is its case of one row).

On a tick where rows change context (the per-row running median confirms a new
signature):

* the best-known setting is stored with the contexts the rows leave (a snapshot taken
  on the first such tick, so rows that confirm a tick or two later store the same
  visit's best), then forgotten (levels of another mix of workloads do not compare),
  and the change detector starts afresh (the change is known; its alarm would forget
  what is recalled next);
* a row that **returns** to a context with a stored setting walks to it (one knob a
  tick, by at most ``actions.MAX_STEPS`` steps: the interface daemon's per-node step
  rule, as the rollback's walk, ``RowController.walk_to``) and, once there, holds it
  ``context_hold_ticks`` without probes or greedy moves: the recalled setting is used
  before it is questioned. ``cluster_engine.rollback_walk = false`` (the ablation) sets
  it at once, every knob in one tick, the hold counted from the change: a live daemon
  refuses that action whenever a row must move two knobs (or one by more than
  ``MAX_STEPS``), and the row would hold the setting it meant to leave. A walk that has
  not arrived ``rollback_ticks`` ticks after its length (a node that refuses the
  values) is given up (``recall_unreached``);
* a row that enters a **new** context explores as after an alarm (ε raised for the
  cluster); rows that did not change, and returning rows, hold meanwhile, so only what
  is new is explored. When no row is new, ε is not raised (``cluster_engine.
  return_epsilon = true`` raises it, so that the recalled setting is searched around
  after the hold: no gain measured, ``docs/journal.md``, cluster variant).

A row entering a new context (its first one included) sweeps its ladder knobs first
where the engine has a sweep (``engine.sweep_points``, ``drl_engine.row_sweep``); a
row leaving one drops its sweep and what it found.

The group search's settings (``cluster_engine.context_search``) are walked to the same
way, the trial's measure starting once the rows are there.

Signature PIs must be named (``engine.context_pis``): a node's own latency or queue
depth moves with its knobs, so the one-row default (every PI that is neither the
objective's nor a knob's) would cluster the tuner's own moves. Without them, or with
``engine.use_context = false``, nothing here is built and the engine plays as before
(a test compares the traces). Hooks in ``drl_engine/row_engine.py`` are marked
``[row context hook]``.
"""
from __future__ import annotations

import logging

import numpy as np

from drl_engine import checkpoint
from drl_engine.context import (SETTINGS, SignatureClusters, context_columns, log_offset,
                                running_add)
from drl_engine.context_memory import ContextMemory
from drl_engine.context_search import GroupSearch, signature_groups

log = logging.getLogger("capes.engine")


class RowSignatures:
    """One :class:`SignatureClusters` per row, folded in for every row at once.

    Per tick and row the clustering is the one-row mode's, but a Python call per row
    costs ~0.2 ms (53 s of CPU for an hour of 64 nodes). Here the running median, the
    log scale and the distance to each row's current context are computed for all rows
    at once, and a row whose point fits its current context (nearly every row, nearly
    every tick) updates that context's running mean and spread in arrays; only the rest
    (a misfit, a pending switch, a row's first point) go through
    :meth:`SignatureClusters.fold`, with the current context's statistics written back
    first and read again after. The result is the per-row clustering's, tick for tick (a
    test compares them; ``leaving``, which only the one-row mode's lead reads, is not
    kept for rows that fit)."""

    def __init__(self, cfg, width: int):
        self.cfg, self.width = cfg, width
        self.rows: list[SignatureClusters] = []
        w = cfg.context_window
        self.recent = np.full((0, w, width), np.nan)
        self.seen = np.zeros(0, np.int64)              # points folded in, per row
        self.offset = np.full((0, width), np.nan)      # c of log(x + c), per row and PI
        self.mean = np.zeros((0, width))               # each row's current context ...
        self.m2 = np.zeros((0, width))
        self.n = np.zeros(0, np.int64)
        self.fast = np.zeros(0, bool)                  # ... held here (no pending switch)

    def grow(self, rows: int) -> None:
        cfg, extra = self.cfg, rows - len(self.rows)
        for _ in range(extra):
            self.rows.append(SignatureClusters(cfg.context_window, cfg.context_threshold,
                                               cfg.context_floor, cfg.context_confirm,
                                               cfg.context_floor_strict))
        pad = lambda a, fill: np.concatenate([a, np.full((extra,) + a.shape[1:], fill,  # noqa: E731
                                                          a.dtype)])
        self.recent, self.offset = pad(self.recent, np.nan), pad(self.offset, np.nan)
        self.seen, self.n, self.fast = pad(self.seen, 0), pad(self.n, 0), pad(self.fast, False)
        self.mean, self.m2 = pad(self.mean, 0.0), pad(self.m2, 0.0)

    def update(self, x: np.ndarray) -> list[tuple[int, int | None, int, bool]]:
        """Fold in one tick's signatures (N, P; a row without any finite value is
        skipped); (row, context left, context entered, new) for each row that switched."""
        x = np.asarray(x, np.float64)
        on = np.isfinite(x).any(axis=1)
        w = self.recent.shape[1]
        rows = np.flatnonzero(on)
        self.recent[rows, self.seen[rows] % w] = x[rows]
        self.seen[rows] += 1
        with np.errstate(all="ignore"):
            med = np.nanmedian(self.recent[rows], axis=1)
        ok = np.isfinite(med).all(axis=1)
        rows, med = rows[ok], med[ok]
        first = np.isnan(self.offset[rows, 0])
        self.offset[rows[first]] = log_offset(med[first])
        off = self.offset[rows]
        with np.errstate(all="ignore"):
            u = np.log(np.maximum(med, 0.0) + off)
            newest = np.log(np.maximum(x[rows], 0.0) + off)
        c = self.rows[0] if self.rows else None
        fits = np.zeros(len(rows), bool)
        if c is not None:
            var = c.variance(self.m2[rows], self.n[rows])
            with np.errstate(all="ignore"):
                dist = np.max(np.abs(u - self.mean[rows]) / np.sqrt(var), axis=1)
            fits = self.fast[rows] & (dist <= c.threshold)
            self._add(rows[fits], u[fits])
        changed = []
        for j in np.flatnonzero(~fits):
            r = int(rows[j])
            cl = self.clusters(r)
            before = cl.current
            cl.offset = self.offset[r]
            ch = cl.fold(u[j], newest[j])
            k = cl.current
            self.mean[r], self.m2[r], self.n[r] = cl.mean[k], cl.m2[k], cl.n[k]
            self.fast[r] = cl._pending is None
            if ch is not None:
                changed.append((r, before, *ch))
        return changed

    def clusters(self, r: int) -> SignatureClusters:
        """Row ``r``'s :class:`SignatureClusters`, its current context's statistics
        written back from the arrays (which hold them while the row fits)."""
        cl = self.rows[r]
        if cl.current is not None:
            cl.mean[cl.current], cl.m2[cl.current] = self.mean[r].copy(), self.m2[r].copy()
            cl.n[cl.current] = int(self.n[r])
        return cl

    def _add(self, rows: np.ndarray, u: np.ndarray) -> None:
        """:meth:`SignatureClusters._add` for many rows at once."""
        if len(rows):
            self.mean[rows], self.m2[rows], self.n[rows] = running_add(
                self.mean[rows], self.m2[rows], self.n[rows], u,
                SignatureClusters.MOST_SAMPLES)

    ARRAYS = ("recent", "seen", "offset", "mean", "m2", "n", "fast")

    def state(self) -> dict:
        """Every row's clustering: the arrays and each row's :class:`SignatureClusters`
        (the arrays hold a fitting row's current context; a misfit reads them first)."""
        return {"arrays": {k: checkpoint.encode(getattr(self, k)) for k in self.ARRAYS},
                "rows": [checkpoint.state_of(c, skip=SETTINGS) for c in self.rows]}

    def load_state(self, state: dict) -> None:
        for k in self.ARRAYS:
            setattr(self, k, checkpoint.decode(state["arrays"][k]))
        for c, s in zip(self.rows, state["rows"]):
            checkpoint.restore_into(c, s)

    def current(self) -> np.ndarray:
        return np.array([-1 if c.current is None else c.current for c in self.rows])

    def counts(self) -> np.ndarray:
        return np.array([c.count for c in self.rows])


class RowContexts(ContextMemory):
    """Every row's contexts and what each keeps (see the module docstring): the context
    memory over the rows (``drl_engine.context_memory``), with the snapshot of the
    best-known setting, the cluster's changes, the group search and the walks beside it."""

    SNAPSHOT_TICKS = 6     # rows confirming a change this many ticks after the first one
                           # store the same best-known setting (median of 3 + NEW_CONFIRM)
    MIN_ROWS = 2           # rows whose change makes it the cluster's (forget, detector,
                           # hold, ε): one row's context split by noise does not

    def __init__(self, cfg, columns: list[int], rows: int):
        self.signatures = RowSignatures(cfg, len(columns))
        self.target: dict[int, np.ndarray] = {}         # rows to set at the next action
        self._snapshot: np.ndarray | None = None
        self._snapshot_until = -1
        self._event_rows = 0                            # rows changed in this event
        self._event_new: set[int] = set()               # ... to a new context
        self._last_best: np.ndarray | None = None       # the newest best-known setting
        self.switch_ticks: list[int] = []               # ticks with a confirmed change
        self.returns = 0                                # row switches to a known context
        self.news = 0                                   # row switches to a new one
        self.search: GroupSearch | None = None          # cluster_engine.context_search
        self._search_at: int | None = None              # ... starts at this tick
        self._search_rows: set[int] = set()             # ... over the groups of these
        self.searches = 0
        self._final: np.ndarray | None = None           # a search's last setting to apply
        # rows walking to a setting (rollback_walk): row -> (grid indices, tick the walk
        # started, tick it is given up, "recall" or "search")
        self.walking: dict[int, tuple[np.ndarray, int, int, str]] = {}
        self.unreached = 0                              # walks given up
        self.promises = None          # earlier sessions' (drl_engine/row_experience.py)
        super().__init__(cfg, columns, rows)            # (grows the signatures too)

    @classmethod
    def build(cls, cfg, pi_names, reward_pis, params, rows: int) -> "RowContexts | None":
        """None without named signature PIs or with ``use_context = false``."""
        if not cfg.use_context or not cfg.context_pis:
            return None
        cols = context_columns(cfg, pi_names, reward_pis, [s.name for s in params])
        return cls(cfg, cols, rows)

    def grow(self, rows: int) -> None:
        """Rows appended (nodes joined): contexts of their own, from scratch."""
        super().grow(rows)
        self.signatures.grow(rows)

    def seed(self, workloads: list, offset: np.ndarray) -> None:
        """Workloads of earlier sessions (``drl_engine.row_experience``): (log mean, log
        m2, samples, best-known setting or None) on the log scale of ``offset``, made
        known contexts of every row before its first tick, so that a row entering one
        recalls its setting as a return does."""
        sig = self.signatures
        sig.offset[:] = offset
        for r, cl in enumerate(sig.rows):
            cl.seed(sig.offset[r], [(m, m2, n) for m, m2, n, _ in workloads])
            for k, (_, _, _, best) in enumerate(workloads):
                self.remember(r, k, None if best is None else best.copy())

    def explore(self, engine, rows: list[int], tick: int) -> None:
        """``rows`` explore from here as rows new to their context do: their hold ends,
        ε is raised, the group search (``context_search``) is scheduled over them."""
        self.hold_until[rows] = 0
        engine.exploration.bump(engine.action_ticks)
        if engine.mcfg.context_search and self.search is None:
            self._search_at, self._search_rows = tick, set(rows)

    # -- per tick ------------------------------------------------------------------------
    def follow(self, engine, tick: int, pis: np.ndarray) -> None:
        """Fold one tick's signatures in (``pis``: (N, P)); on a change of some rows'
        contexts, store, forget and recall as the module docstring says."""
        control = engine.control
        self._advance_search(engine, tick)
        if control.best.best_idx is not None:   # kept through an alarm that forgot it a
            self._last_best = control.best.best_idx   # tick or two before the rows confirm
        updates = self.signatures.update(np.asarray(pis)[:, self.columns])
        changed = [c for c in updates if c[1] is not None]   # a row's first context: no
        sweep = control.sweep                                # change, but a sweep
        swept = {}                                           # rows leaving mid-sweep
        if sweep is not None and (control.cold is None or not control.cold.active):
            swept = {c[0]: sweep.so_far(c[0]) for c in changed if c[0] in sweep.plans}
            sweep.drop([c[0] for c in changed])
            fresh = [c[0] for c in updates if c[1] is None or self.recalled(c[0], c[2])
                     is None]
            if fresh:
                rep = engine.data.replay
                sig = np.exp(self.signatures.mean) - self.signatures.offset
                sweep.start(fresh, control.indices(rep.knobs[rep.slot(tick)]), tick, sig)
        if not changed:
            return
        if self.search is not None and len(changed) >= min(self.MIN_ROWS, self.rows):
            self._end_search(engine, tick, undo=False)   # another change: what it found
                                                         # is what the rows leaving store
        if tick > self._snapshot_until:
            best = self._last_best
            self._snapshot = None if best is None else best.copy()
            self._snapshot_until = tick + self.SNAPSHOT_TICKS
            self._event_rows = 0
            self._event_new: set[int] = set()
        self._event_rows += len(changed)
        new_rows = []
        for r, left, ctx, new in changed:
            if r in swept:                  # what its sweep measured (None: nothing), not
                self.remember(r, left, swept[r])   # the point it was on (a flicker would
                                                   # recall that)
            elif self._snapshot is not None and r < len(self._snapshot):
                self.remember(r, left, self._snapshot[r].copy())
            self.target.pop(r, None)
            self.walking.pop(r, None)
            known = self.recalled(r, ctx)
            if known is None:
                new_rows.append(r)
                self._event_new.add(r)
                self.news += 1
            else:
                self.target[r] = known
                self.returns += 1
        self.switch_ticks.append(int(tick))
        if control.cold is not None and control.cold.active:
            self.target, self.walking = {}, {}
            return                                     # the cold start owns the setting
        if self._event_rows < min(self.MIN_ROWS, self.rows):
            return                                     # one row: its recall alone
        self._final = None
        self.walking = {r: w for r, w in self.walking.items() if w[3] != "search"}
        control.forget(tick)
        control.new_detector()
        self._last_best = None                         # the next visit's own from here
        hold = tick + self.cfg.context_hold_ticks
        self.hold_until[:] = np.maximum(self.hold_until, hold)
        if self._event_new:                            # only the new rows explore (also
            self.hold_until[list(self._event_new)] = 0  # those new a tick or two before)
        if new_rows or engine.mcfg.return_epsilon:
            engine.exploration.bump(engine.action_ticks)
        if self._event_new and engine.mcfg.context_search:
            self._search_at = self._snapshot_until     # once the rows have confirmed
            self._search_rows = set(self._event_new)
        log.info("tick %d: %d row(s) changed context (%d new, %d recalled)", tick,
                 len(changed), len(new_rows), len(changed) - len(new_rows))

    # -- group search (cluster_engine.context_search; drl_engine/context_search.py) ------
    def _advance_search(self, engine, tick: int) -> None:
        """Start the scheduled search, or advance the running one by this tick."""
        rep, control = engine.data.replay, engine.control
        if self.search is not None:
            if self._search_walk():
                return                               # its setting not reached yet
            self.search.observe(rep, tick)
            if self.search.done:
                self._end_search(engine, tick, undo=True)
            return
        if self._search_at is None or tick < self._search_at or self.walking:
            return                                   # (returning rows walk there first)
        self._search_at = None
        s = rep.slot(tick)
        present = rep.present[s]
        moving = present & (np.nan_to_num(rep.lp[s][:, rep.obj_cols]) > 0).any(axis=1)
        sig = np.exp(self.signatures.mean) - self.signatures.offset
        groups = [g for g in signature_groups(sig, np.flatnonzero(moving))
                  if self._search_rows & set(g.tolist())]
        if not groups or not np.isfinite(rep.knobs[s][present]).all():
            return
        m = engine.mcfg
        idx = control.grid.index(np.where(np.isfinite(rep.knobs[s]), rep.knobs[s],
                                          control.lo).astype(np.float64))
        self.search = GroupSearch(groups, idx, control.n_steps, control.dynamic,
                                  m.context_search_step, m.context_search_ticks,
                                  engine.cfg.settle_ticks, tick,
                                  tick + m.context_search_max_ticks)
        self.searches += 1
        log.info("tick %d: group search over %d group(s) of %s rows", tick, len(groups),
                 [len(g) for g in groups])

    def _end_search(self, engine, tick: int, undo: bool) -> None:
        """The search's setting becomes the best-known one (trust region, rollback, what
        the contexts store next); ``undo``: a trial cut short goes back to it (not on a
        change of contexts: the rows are recalled or explore from there)."""
        search, self.search = self.search, None
        search.finish(tick, "stopped")
        control, rep = engine.control, engine.data.replay
        control.best.take(search.best.copy(), int(tick), rep.present[rep.slot(tick)])
        control.rollback.reset()
        self._last_best = search.best.copy()
        self._final = search.take() if undo else None

    def _search_values(self, cur: np.ndarray, present: np.ndarray, grid, dynamic
                       ) -> np.ndarray | None:
        pending = self._final if self.search is None else self.search.take()
        self._final = None
        if pending is None:
            return cur if self.search is not None else None   # held while searching
        idx = grid.index(cur)
        rows = present[:, None] & dynamic[None, :]
        return np.where(rows, grid.values(np.where(rows, pending, idx)), cur)

    def recall(self, cur: np.ndarray, present: np.ndarray, control, tick: int,
               walk: bool = True) -> np.ndarray | None:
        """The values for this tick when the contexts decide them (None: the engine's
        usual action, the walking rows held and moved by :meth:`walk`). ``walk``
        (``rollback_walk``): returning rows and the group search's settings are walked
        to; else every returning row is set at once to its recalled setting, or the
        group search's setting is. Knobs that are not dynamic keep their values."""
        grid, dynamic = control.grid, control.dynamic
        if walk:
            self._start_walks(self.target, cur, present, control, tick, "recall")
            self.target = {}
            pending = self._final if self.search is None else self.search.take()
            self._final = None
            if pending is not None:
                self._start_walks(dict(enumerate(pending)), cur, present, control, tick,
                                  "search")
            return None if self.search is None else self.walk(cur, cur, present, control,
                                                               tick)
        if not self.target:
            return self._search_values(cur, present, grid, dynamic)
        target, self.target = self.target, {}
        rows = np.array([r for r in target if r < len(cur) and present[r]], np.int64)
        if len(rows) == 0:
            return None
        idx = grid.index(cur)
        idx[rows] = np.where(dynamic[None, :], np.stack([target[r] for r in rows]),
                             idx[rows])
        out = cur.copy()
        out[rows] = grid.values(idx)[rows]
        return out

    def _search_walk(self) -> bool:
        """Rows still walking to the group search's setting."""
        return any(w[3] == "search" for w in self.walking.values())

    def _measure_from(self, tick: int) -> None:
        """The search's setting is in effect from ``tick`` (its last step sent on the
        tick before): its measure counts from there, as if set at once then."""
        self.search.t0 = max(self.search.t0, tick - 1)

    def _start_walks(self, targets: dict, cur, present, control, tick: int, kind: str):
        """Rows in ``targets`` (row -> grid indices) start walking there; given up after
        the walk's length plus ``rollback_ticks``."""
        rows = [r for r in targets if r < len(cur) and present[r]]
        if not rows:
            return
        target, cells = self._walk_arrays(cur, control, {r: targets[r] for r in rows})
        until = tick + control.walk_ticks(cur, target, cells) + control.mcfg.rollback_ticks
        for r in rows:
            self.walking[r] = (np.asarray(targets[r], np.int64).copy(), int(tick), until,
                               kind)

    def _walk_arrays(self, cur, control, targets: dict) -> tuple[np.ndarray, np.ndarray]:
        """(N, K) grid indices and cells of ``targets`` (row -> indices), the dynamic
        knobs of those rows."""
        idx = control.grid.index(cur)
        cells = np.zeros(idx.shape, bool)
        for r, t in targets.items():
            idx[r] = np.where(control.dynamic, t, idx[r])
            cells[r] = control.dynamic
        return idx, cells

    def walk(self, values: np.ndarray, cur: np.ndarray, present: np.ndarray, control,
             tick: int) -> np.ndarray:
        """``values`` with each walking row (held: ``values`` has it at ``cur``) one
        tick further on its walk (``RowController.walk_to``). A row whose knobs ``cur``
        show the setting has arrived: a returning row's hold starts there (when its
        change made one); a walk past its deadline is given up."""
        if not self.walking:
            return values
        here = {r: w[0] for r, w in self.walking.items() if r < len(cur) and present[r]}
        target, cells = self._walk_arrays(cur, control, here)
        on = (control.grid.index(cur) == target) | ~cells
        for r in list(self.walking):
            t, since, until, kind = self.walking[r]
            if r in here and on[r].all():
                del self.walking[r]
                if kind == "recall" and self.hold_until[r] > since:
                    self.hold(r, tick)
                elif kind == "search" and self.search is not None:
                    self._measure_from(tick)
            elif tick >= until:
                del self.walking[r]
                self.unreached += 1
                if kind == "search" and self.search is not None:
                    self._measure_from(tick)
                log.info("tick %d: row %d's walk to its %s setting (since tick %d) "
                         "has not arrived: given up", tick, r, kind, since)
        if not self.walking:
            return values
        stepped = control.walk_to(cur, target, cells)
        rows = [r for r in self.walking if r in here]
        out = values.copy()
        out[rows] = stepped[rows]
        return out

    def holding(self, tick: int) -> np.ndarray:
        """Rows that hold their setting this tick (no probe, no greedy move), the
        walking ones too (:meth:`walk` moves them)."""
        if self.search is not None:
            return np.ones(len(self.hold_until), bool)
        held = self.held(tick)
        held[[r for r in self.walking if r < len(held)]] = True
        return held

    # -- checkpoints ----------------------------------------------------------------------
    KEPT = ("settings", "hold_until", "switch_ticks", "returns", "news", "searches",
            "_last_best")                 # a search under way is not kept: it starts over
    NAMES = {"settings": "memory"}        # a checkpoint's name, where it is another
    SINCE = ("walking", "unreached")      # kept since the walk (older checkpoints lack them)

    def state(self) -> dict:
        """Every row's contexts and what each keeps (``drl_engine.checkpoint``: loadable
        with ``weights_only``): a restarted engine recalls the workloads its nodes have
        seen."""
        return {"columns": list(self.columns), "signatures": self.signatures.state(),
                **{self.NAMES.get(k, k): checkpoint.encode(getattr(self, k))
                   for k in self.KEPT + self.SINCE}}

    def load_state(self, state: dict) -> None:
        """Resume from :meth:`state` (the same rows); ValueError for other signature PIs."""
        if list(state["columns"]) != list(self.columns):
            raise ValueError(f"the row contexts were kept for signature columns "
                             f"{list(state['columns'])}, this engine has {self.columns}")
        self.signatures.load_state(state["signatures"])
        for k in self.KEPT + tuple(k for k in self.SINCE if k in state):
            setattr(self, k, checkpoint.decode(state[self.NAMES.get(k, k)]))
        self.walking = {r: w for r, w in self.walking.items() if w[3] == "recall"}

    def counters(self) -> dict:
        return {"context_switch_ticks": len(self.switch_ticks),
                "context_returns": self.returns, "context_news": self.news,
                "context_searches": self.searches, "recall_unreached": self.unreached,
                "contexts_per_row": float(np.mean(self.signatures.counts()))}


__all__ = ["RowContexts"]
