"""Experience from earlier sessions for the per-node mode: the memory part (issue 37).

The one-row mode's ``--experience`` (``drl_engine/prior_experience.py``) makes every
recorded workload a context of the new engine. Here the same for the per-node mode's
rows (``drl_engine/row_context.py``): each recorded session is clustered as the live
engine clusters it (:class:`~drl_engine.row_context.RowSignatures`, every row's own
signature PIs), and every workload found becomes a known context of **every** row of
the new engine, with its best-known setting. A row whose signature enters one of them
is a *return*: it walks to that setting and holds it, as for a workload seen earlier in
the same session, instead of exploring.

**Matched by signature, not by node name.** The recorded workloads of all nodes are
pooled (a row's context joins a pooled workload whose signature it fits, else makes
one), and each pooled workload is known to every row. Which node runs which workload is
the job scheduler's choice, not the node's: a checkpoint writer on c0003 today may be
on c0017 tomorrow, nodes are replaced and renamed, a cluster grows; and on one target
the setting a workload wants is the workload's (the nodes share servers and hardware),
not the host's. By node name a row would recall only what that host happened to run,
and nothing at all after a rename. (Nodes of different hardware in one target would
want per-node settings for the same signature; they are not modelled here.)

**The best-known setting of a recorded workload** is the per-node mode's own
(``drl_engine.best_known.PeakTracker``), replayed: the session is cut where the
cluster's mix changes (``MIN_ROWS`` rows change context on one tick), and in each such
visit the knobs of each row ``settle_ticks`` + half a window before the objective's
``best_window``-tick moving-average peak are its setting there. A workload keeps the
setting of its latest visit (sessions in the order they started), the per-knob median
over the rows that ran it: as within a session, where a row recalls its last visit's.

Every row's signature scale (the c of log(x + c)) is set to one common offset, 5 % of
the recorded signatures' median (at least 0.05 of its unit: ``context.log_offset``),
so that the recorded signatures and the live ones compare. A row that joins later
starts without the recorded workloads. The search's start for a workload never seen
(the one-row mode's ``--experience-start``) is not carried over: an unknown workload
explores as in a fresh engine.

**A promise check** (:class:`Promises`), as the one-row mode's: a recorded setting
comes with the level its nodes reached there; held here, a level below ``1 −
PROMISE_MARGIN`` of it (a DB from another target) forgets that workload's recorded
setting and its rows explore as new ones. Measured in
``benchmarks/bench_experience_cluster.py`` (docs/engine.md, "Experience from earlier
sessions").
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from capes.common.step_grid import StepGrid
from drl_engine.context import SignatureClusters, log_offset
from drl_engine.rewards import OBJECTIVES, pi_columns
from drl_engine.prior_experience import (PROMISE_MARGIN, ExperienceError, PriorExperience,
                                         brought, open_replay)
from drl_engine.row_context import RowContexts, RowSignatures

log = logging.getLogger("capes.engine")


@dataclass
class RowWorkload:
    """One pooled workload of the recorded sessions (a signature on the common scale)."""
    log_mean: np.ndarray
    log_m2: np.ndarray
    n: int
    ticks: int = 0                         # recorded (node, tick) points that ran it
    best: np.ndarray | None = None         # grid indices of its best-known setting
    best_at: tuple = (-1.0, -1)            # (session start, tick) of that visit
    level: float = math.nan                # a node's own objective there (its promise)


@dataclass
class RowExperience:
    """The recorded workloads, loaded once and seeded into a per-node engine's rows."""
    paths: list[str]
    pi_names: list[str]
    param_names: list[str]
    offset: np.ndarray
    workloads: list[RowWorkload]
    sessions: int
    ticks: int
    newest_started_at: float
    margin: float = PROMISE_MARGIN  # a recalled setting below 1 − margin of its promise
    refused: str | None = None      #   is forgotten (0: never checked, the ablation)

    check_layout = PriorExperience.check_layout   # the same refusal, the same words

    @classmethod
    def load(cls, paths, cfg, reward, model, params) -> "RowExperience":
        """Read ``paths`` (replay DBs of per-node sessions); ExperienceError, naming the
        DB, when one is missing, unreadable, empty or of another layout, or when the
        engine names no signature PIs (``engine.context_pis``)."""
        paths = [str(p) for p in paths]
        if not paths:
            raise ExperienceError("--experience: name at least one replay DB")
        recorded, layout = [], None
        for path in paths:
            reader = open_replay(path, grow_nodes=True)
            try:
                for data in reader.sessions.values():
                    info = data.info
                    names = (list(info.pi_names), [p.name for p in info.params])
                    if layout is None:
                        layout = names
                    elif names != layout:
                        raise ExperienceError(
                            f"--experience {path}: recorded with PIs {names[0]} and "
                            f"parameters {names[1]}, the first DB with {layout[0]} and "
                            f"{layout[1]}")
                    pis = np.asarray(data.pis[:data.length], np.float64)
                    if pis.ndim == 3 and np.isfinite(pis).any():
                        recorded.append((float(info.started_at), pis))
            finally:
                reader.close()
        if not recorded:
            raise ExperienceError(f"--experience {', '.join(paths)}: no recorded ticks")
        pi_names, param_names = layout
        if param_names != [p.name for p in params]:
            raise ExperienceError(f"--experience: recorded with parameters {param_names}; "
                                  f"this session has {[p.name for p in params]}")
        try:
            contexts = RowContexts.build(cfg, pi_names, reward.pis, params, 1)
        except ValueError as exc:          # signature PIs the recorded sessions lack
            raise ExperienceError(f"--experience: {exc}") from None
        if contexts is None:
            raise ExperienceError("--experience: the per-node engine needs signature PIs "
                                  "(engine.context_pis) to tell recorded workloads apart")
        missing = [n for n in param_names if n not in pi_names]
        if missing:
            raise ExperienceError(f"--experience: the knobs {missing} are not among the "
                                  f"recorded PIs (their values per node are needed)")
        cols = contexts.columns
        recorded.sort(key=lambda r: r[0])
        sig = np.concatenate([p[:, :, cols].reshape(-1, len(cols)) for _, p in recorded])
        offset = log_offset(np.nanmedian(sig, axis=0))
        pool = SignatureClusters(cfg.context_window, cfg.context_threshold,
                                 cfg.context_floor, cfg.context_confirm,
                                 cfg.context_floor_strict)
        out = cls(paths, pi_names, param_names, offset, [], len(recorded),
                  sum(len(p) for _, p in recorded), recorded[-1][0])
        replay = _Replayed(cfg, reward, model, pi_names, params, cols)
        for started, pis in recorded:
            labels = replay.cluster(pis, offset, pool, out.workloads)
            replay.bests(started, pis, labels, out.workloads)
        return out

    def summary(self, now: float | None = None) -> str:
        """The one log line: what the experience brought along."""
        return (f"experience (per node, matched by signature): {brought(self, now)}; "
                f"a new workload explores ({', '.join(self.paths)})")

    def seed(self, engine) -> bool:
        """Make the recorded workloads known contexts of every row of ``engine`` (before
        its first tick); False, with ``refused`` saying why, for an engine of another
        layout or without row contexts: it then starts without experience."""
        try:
            self.check_layout(engine.pi_names, [p.name for p in engine.params])
            if engine.row_context is None:
                raise ExperienceError("--experience: this engine keeps no per-node "
                                      "contexts (engine.use_context, engine.context_pis)")
        except ExperienceError as exc:
            self.refused = str(exc)
            return False
        engine.row_context.seed([(w.log_mean, w.log_m2, w.n, w.best)
                                 for w in self.workloads], self.offset)
        if self.margin > 0:
            engine.row_context.promises = Promises(self, engine)
        return True


class Promises:
    """The promise check: a recorded workload's setting comes with the level its nodes
    reached there (their own objective PIs, the mean over the nodes). The first time
    every row of this session that recalled it holds that setting (arrived,
    ``settle_ticks`` + ``best_window`` ticks on), their mean level over the last
    ``best_window`` ticks is compared with it (the mean: nodes on a busier server
    reach less, so no one row's level is the workload's): below ``1 − margin`` of it (a DB from another target, where the
    setting does not do what it did there), the workload's recorded setting is forgotten
    by every row, the rows that recalled it walk back to the setting they had when they
    entered it (where a fresh engine would have started), and the rows in it explore as
    new ones (:meth:`RowContexts.explore`);
    else it is kept and not checked again. A workload seen in this session is not
    checked (its setting is this session's own)."""

    def __init__(self, exp: RowExperience, engine):
        self.margin = exp.margin
        self.pending = {k: (w.best, w.level) for k, w in enumerate(exp.workloads)
                        if w.best is not None and w.level > 0}
        self.obj_cols = pi_columns(engine.reward_cfg.pis, engine.pi_names)
        self.window, self.settle = engine.mcfg.best_window, engine.cfg.settle_ticks
        self.recent = np.full((self.window, 0), np.nan)
        self.current = np.zeros(0, np.int64)    # each row's context on the tick before
        self.before: dict[int, np.ndarray] = {}  # row -> its setting when it entered it
        self.broken: list[int] = []

    def check(self, engine, tick: int, pis: np.ndarray) -> None:
        ctx = engine.row_context
        if not self.pending:
            return
        own = np.asarray(pis, np.float64)[:, self.obj_cols].sum(axis=1)
        if self.recent.shape[1] != len(own):
            self.recent = np.full((self.window, len(own)), np.nan)
        self.recent[tick % self.window] = own
        rep, control = engine.data.replay, engine.control
        at = control.indices(rep.knobs[rep.slot(tick)])
        since = ctx.hold_until - ctx.cfg.context_hold_ticks
        ready = ctx.held(tick) & (tick - since >= self.settle + self.window)
        current = ctx.signatures.current()
        if len(self.current) == len(current):
            self.before.update((int(r), at[r].copy())
                               for r in np.flatnonzero(current != self.current))
        self.current = current
        for k, (best, promised) in list(self.pending.items()):
            rows = [r for r in np.flatnonzero(current == k)
                    if np.array_equal(ctx.recalled(r, k), best)]
            if not rows or not all(ready[r] and np.array_equal(
                    at[r][control.dynamic], best[control.dynamic]) for r in rows):
                continue                         # not every row of it there yet
            del self.pending[k]
            level = float(np.nanmean(self.recent[:, rows]))
            if level >= (1.0 - self.margin) * promised:
                continue
            self.broken.append(k)
            for r in range(ctx.rows):
                if np.array_equal(ctx.recalled(r, k), best):
                    ctx.remember(r, k, None)
            ctx.target.update((r, self.before[r]) for r in rows if r in self.before)
            ctx.explore(engine, [int(r) for r in np.flatnonzero(current == k)], tick)
            log.info("tick %d: recorded workload %d's setting reaches %.3g a node here, "
                     "below %.0f %% of the %.3g it promised: forgotten, its %d row(s) "
                     "explore", tick, k, level, 100 * (1 - self.margin), promised,
                     len(rows))


class _Replayed:
    """A recorded session played back through the live engine's clustering and
    best-known rule (see the module docstring)."""

    def __init__(self, cfg, reward, model, pi_names, params, cols):
        self.cfg, self.model, self.cols = cfg, model, cols
        self.grid = StepGrid.of(params)
        self.knob_cols = [pi_names.index(p.name) for p in params]
        self.obj_cols = pi_columns(reward.pis, pi_names)
        self.objective = OBJECTIVES.build(reward.objective, reward.objective_options)

    def cluster(self, pis, offset, pool: SignatureClusters, pooled: list) -> np.ndarray:
        """(T, N) pooled workload of each row and tick (−1: absent or not yet known);
        each row's contexts join ``pool`` (and ``pooled``) by signature."""
        T, N, _ = pis.shape
        sig = RowSignatures(self.cfg, len(self.cols))
        sig.grow(N)
        sig.offset[:] = offset
        labels = np.full((T, N), -1, np.int64)
        for t in range(T):
            sig.update(pis[t][:, self.cols])
            labels[t] = sig.current()
        labels[~np.isfinite(pis[:, :, self.cols]).any(axis=2)] = -1
        to_pool = {}
        for r in range(len(sig.rows)):
            cl = sig.clusters(r)
            for k in sorted(range(cl.count), key=lambda k: -cl.n[k]):
                fits = [(pool.distance(cl.mean[k], j), j) for j in range(pool.count)]
                fits = [f for f in fits if f[0] <= pool.threshold]
                if fits:
                    j = min(fits)[1]
                else:
                    j = pool.add_known(cl.mean[k], cl.m2[k], cl.n[k])
                    pooled.append(RowWorkload(pool.mean[j], pool.m2[j], pool.n[j]))
                to_pool[(r, k)] = j
        out = np.full_like(labels, -1)
        for (r, k), j in to_pool.items():
            out[labels[:, r] == k, r] = j
        for j in np.unique(out[out >= 0]):
            pooled[j].ticks += int((out == j).sum())
        return out

    def bests(self, started: float, pis, labels, pooled: list) -> None:
        """Each visit's best-known setting (the moving-average peak's knobs) to the
        pooled workloads its rows ran; a later visit replaces an earlier one."""
        T = len(pis)
        W, lag = self.model.best_window, self.cfg.settle_ticks
        present = np.isfinite(pis[:, :, self.obj_cols]).all(axis=2)
        p = np.array([float(np.asarray(self.objective(pis[t][present[t]][None][
            :, :, self.obj_cols]), float)[0]) if present[t].any() else np.nan
            for t in range(T)])
        moved = (labels[1:] != labels[:-1]).sum(axis=1) >= min(RowContexts.MIN_ROWS,
                                                              labels.shape[1])
        cuts = [0] + (np.flatnonzero(moved) + 1).tolist() + [T]
        for a, b in zip(cuts[:-1], cuts[1:]):
            b -= RowContexts.SNAPSHOT_TICKS     # the next mix, before its rows confirm
            if b - (a + lag) < W:
                continue
            avg = np.convolve(p[a + lag:b], np.ones(W) / W, "valid")
            if not np.isfinite(avg).any():
                continue
            peak = a + lag + int(np.nanargmax(avg)) + W - 1
            at = max(a, peak - lag - W // 2)
            knobs = pis[at][:, self.knob_cols]
            own = pis[peak - W + 1:peak + 1][:, :, self.obj_cols].sum(axis=2).mean(axis=0)
            for j in np.unique(labels[peak][labels[peak] >= 0]):
                rows = (labels[peak] == j) & (labels[at] == j) & \
                    np.isfinite(knobs).all(axis=1)
                if rows.any() and (started, peak) >= pooled[j].best_at:
                    idx = self.grid.index(knobs[rows])
                    pooled[j].best = np.rint(np.median(idx, axis=0)).astype(np.int64)
                    pooled[j].best_at = (started, peak)
                    pooled[j].level = float(np.nanmean(own[rows]))


__all__ = ["Promises", "RowExperience", "RowWorkload"]
