"""Experience from earlier sessions: what a new session starts from (issue 37).

``capes drl-engine --experience DB…`` and ``capes converge-test --experience DB…`` read
replay DBs of earlier sessions (one each, or one merged by ``capes replay merge``) and
seed each part of the engine with what they hold:

* **The per-workload memory** (``drl_engine/context.py``). The recorded ticks are told
  apart by their signature PIs with the engine's own online clustering; every workload
  found becomes a context of the new engine, with its signature (running mean and spread),
  the guide's per-setting statistics of its ticks (the objective credited to the setting
  in effect ``settle_ticks`` earlier) and so its best-known setting (the guide's lower
  confidence bound), and an exploration clock as old as its recorded ticks. A recorded
  workload that runs again is a *return*: the engine walks to its best-known setting and
  holds it, as it does for a workload seen earlier in the same session.
* **The search's start** for a workload never seen (``start``, one of :data:`STARTS`):
  the new context first walks to a proposed setting, then searches as a new workload
  does. ``memory``: the best-known setting of the nearest recorded workload (by
  signature); ``interpolate`` (the default): between the best-known settings of the two
  known workloads whose signatures enclose the new one, on the line joining them (per
  knob on its grid: a ladder's indices are its log scale), the nearest's (as ``memory``)
  when none enclose it on every signature PI or only one is known
  (:func:`interpolated_best`); ``gp``: the best mean of a Gaussian process over
  (signature, knobs) fitted on the recorded per-setting means (RGPE/OnlineTune-like);
  ``qnet``: the Q-network's own walk (``engine.context_infer``), its weights from
  ``--init-model`` trained on the merged DB (``capes train``); ``qnet_probes``: the
  setting whose observation the Q-network values most. Measured against a fresh engine in
  ``benchmarks/bench_experience.py`` (docs/engine.md, "Experience from earlier sessions").
* **A promise check.** A recorded workload's best setting comes with the level it
  reached. Held at a proposed start, a level below ``1 − PROMISE_MARGIN`` of what the
  nearest recorded workload promised ends the hold at once and the normal search starts:
  a DB from another target, whose settings do not do here what they did there, costs
  the hold's first ticks instead of 30.

A DB whose PIs or parameters differ from the session's is refused with a clear error
at load (:meth:`PriorExperience.check_layout`).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capes.common.replay_db import ReplayDBError, ReplayReader
from capes.common.step_grid import StepGrid
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.context import (SignatureClusters, WorkloadContexts, _fresh_detector,
                                _Memory, context_columns, fresh_observations)
from drl_engine.experience import Experience
from drl_engine.guide import Guide

STARTS = ("memory", "interpolate", "gp", "qnet", "qnet_probes")
NETWORK_STARTS = ("qnet", "qnet_probes")    # need the network's weights (--init-model)
DEFAULT_START = "interpolate"   # memory where no two known workloads enclose the new
PROMISE_MARGIN = 0.25      # a start below 75 % of the promised level is not trusted
GP_MAX_POINTS = 400        # recorded (workload, setting) means the GP is fitted on

log = logging.getLogger("capes.engine")


class ExperienceError(ValueError):
    """An experience DB that cannot be used (missing, not a replay DB, another layout)."""


@dataclass
class KnownWorkload:
    """One workload of the recorded sessions, as the new engine's memory keeps it."""
    log_mean: np.ndarray           # signature, on the clusters' log scale
    log_m2: np.ndarray
    n: int
    ticks: int                     # recorded ticks it ran
    keys: np.ndarray               # (V, P) grid indices of the settings it was measured at
    stats: np.ndarray              # (V, 3) sum, sum of squares, count of the objective
    best: np.ndarray | None = None  # grid indices of its best-known setting
    level: float = math.nan        # its objective there (what the setting promises)


@dataclass
class PriorExperience:
    """The experience of earlier sessions, loaded once and seeded into an engine."""
    paths: list[str]
    pi_names: list[str]
    param_names: list[str]
    specs: list
    offset: np.ndarray | None
    workloads: list[KnownWorkload]
    sessions: int
    ticks: int
    newest_started_at: float
    start: str = DEFAULT_START
    margin: float = PROMISE_MARGIN
    refused: str | None = None      # why a session did not take it (seed)
    last_start: str | None = None   # how the latest start was proposed (the log's words)

    # -- load -----------------------------------------------------------------------------
    @classmethod
    def load(cls, paths, cfg: DQNConfig, reward: RewardConfig,
             start: str = DEFAULT_START) -> "PriorExperience":
        """Read ``paths`` (replay DBs); ExperienceError, naming the DB, when one is
        missing, unreadable, empty, or of another layout than the first."""
        if start not in STARTS:
            raise ExperienceError(f"--experience-start: one of {', '.join(STARTS)} "
                                  f"(got {start!r})")
        paths = [str(p) for p in paths]
        if not paths:
            raise ExperienceError("--experience: name at least one replay DB")
        grid = clusters = None
        layout_of = None
        per_context: dict[int, dict] = {}
        sessions = ticks = 0
        newest = 0.0
        for path in paths:
            reader = open_replay(path)
            try:
                exp = Experience(reader, reward, cfg.stack)
            except (ReplayDBError, OSError, ValueError) as exc:
                reader.close()
                raise ExperienceError(f"--experience {path}: not a usable replay DB "
                                      f"({exc})") from None
            try:
                if not exp.ready or not reader.sessions:
                    raise ExperienceError(f"--experience {path}: holds no session")
                lay = exp.layout
                names = (list(lay.pi_names), list(lay.param_names))
                if layout_of is None:
                    layout_of = names
                    specs = exp.param_specs()
                    grid = StepGrid.of(specs)
                    cols = context_columns(cfg, lay.pi_names, reward.pis, lay.param_names)
                    clusters = SignatureClusters(cfg.context_window, cfg.context_threshold,
                                                 cfg.context_floor, cfg.context_confirm,
                                                 cfg.context_floor_strict)
                elif names != layout_of:
                    raise ExperienceError(
                        f"--experience {path}: recorded with PIs {names[0]} and parameters "
                        f"{names[1]}, the first DB with {layout_of[0]} and {layout_of[1]}")
                for sid, data in reader.sessions.items():
                    d = exp.derived[sid]
                    if d.n == 0:
                        continue
                    sessions += 1
                    ticks += d.n
                    newest = max(newest, data.info.started_at)
                    clusters.recent = []
                    clusters.current = None
                    _fold_session(clusters, data.pis[:d.n], cols, d.p[:d.n],
                                  d.values[:d.n], cfg.settle_ticks, grid, per_context)
            finally:
                reader.close()
        if sessions == 0:
            raise ExperienceError(f"--experience {', '.join(paths)}: no recorded ticks")
        guide = Guide(grid, cfg, np.random.default_rng(0))
        workloads = [_known(clusters, k, per_context[k], guide)
                     for k in range(clusters.count) if k in per_context]
        return cls(paths, layout_of[0], layout_of[1], specs,
                   clusters.offset, workloads, sessions, ticks, newest, start)

    def summary(self, now: float | None = None) -> str:
        """The one log line: what the experience brought along."""
        return (f"experience: {brought(self, now)}; start for a new workload: "
                f"{self.start} ({', '.join(self.paths)})")

    def check_layout(self, pi_names, param_names) -> None:
        """ExperienceError when the session's PIs or parameters are not the recorded."""
        if list(pi_names) != self.pi_names or list(param_names) != self.param_names:
            raise ExperienceError(
                f"--experience: recorded with PIs {self.pi_names} and parameters "
                f"{self.param_names}; this session has {list(pi_names)} and "
                f"{list(param_names)} (experience from another target is not used)")

    # -- seed ---------------------------------------------------------------------------
    def seed(self, engine, contexts: WorkloadContexts, guide: Guide) -> bool:
        """Make every recorded workload a context of ``contexts`` (before its first
        tick) and install the start proposer for workloads never seen. False, with
        ``refused`` saying why, for a session of another layout or grid: a live engine
        then starts without experience rather than stop (the CLI checks what it can
        before, :meth:`check_layout`)."""
        try:
            self.check_layout(engine.experience.layout.pi_names,
                              engine.experience.layout.param_names)
            if list(guide.shape) != [int(n) + 1 for n in StepGrid.of(self.specs).n_steps]:
                raise ExperienceError("--experience: recorded with other parameter ranges "
                                      "or steps than this session's")
        except ExperienceError as exc:
            self.refused = str(exc)
            return False
        contexts.clusters.seed(None if self.offset is None else self.offset.copy(),
                               [(w.log_mean, w.log_m2, w.n) for w in self.workloads])
        contexts.memory = []
        contexts.settings[0].clear()
        for k, w in enumerate(self.workloads):
            contexts.memory.append(_Memory(
                created_at=-w.ticks, stats=_guide_stats(guide, w),
                detector=_fresh_detector(guide)))
            contexts.remember(0, k, w.best)
        contexts.prior = self
        return True

    def propose(self, engine, session: int, contexts: WorkloadContexts,
                current: np.ndarray, guide: Guide) -> np.ndarray | None:
        """The start of a workload never seen (grid indices), by ``start``; None: no
        proposal (``qnet``: the network's own walk takes it)."""
        if self.start == "memory":
            return contexts.nearest_best()
        if self.start == "interpolate":
            return self._interpolated_start(contexts, guide)
        if self.start == "gp":
            return self._gp_start(contexts.clusters.mean[contexts.current], guide)
        if self.start == "qnet_probes" and engine.dqn is not None:
            return _q_start(engine, session, guide)
        return None

    def promised(self, contexts: WorkloadContexts) -> float | None:
        """The level the nearest recorded workload reached at its best setting."""
        c, cl = contexts.current, contexts.clusters
        known = [(cl.distance(cl.mean[c], k), k) for k in range(len(self.workloads))
                 if k != c and self.workloads[k].best is not None]
        return self.level_of(min(known)[1]) if known else None

    def level_of(self, k: int) -> float | None:
        """The level recorded workload ``k`` reached at its best-known setting."""
        level = self.workloads[k].level if k < len(self.workloads) else math.nan
        return level if math.isfinite(level) else None

    def _interpolated_start(self, contexts: WorkloadContexts,
                            guide: Guide) -> np.ndarray | None:
        c, cl = contexts.current, contexts.clusters
        known = [k for k in range(len(contexts.memory))
                 if k != c and contexts.recalled(0, k) is not None]
        if not known:
            return None
        sd = [np.sqrt(cl.variance(cl.m2[k], cl.n[k])) for k in known]
        target, how = interpolated_best(cl.mean[c], [cl.mean[k] for k in known], sd,
                                        [contexts.recalled(0, k) for k in known],
                                        guide.n_steps, known)
        self.last_start = how
        log.info("experience start for a new workload: %s: %s", how,
                 ", ".join(f"{n}={spec.describe(float(v))}" for n, spec, v in
                           zip(self.param_names, self.specs,
                               guide.step_grid.values(target))))
        return target

    def _gp_start(self, signature: np.ndarray, guide: Guide) -> np.ndarray | None:
        x, y = self._gp_data(guide)
        if len(y) < 3:
            return None
        grid = np.argwhere(np.ones(guide.shape, bool))
        q = np.concatenate([np.repeat(signature[None], len(grid), 0),
                            grid / np.maximum(np.array(guide.shape) - 1, 1)], 1)
        mean = gp_mean(x, y, q)
        return grid[int(np.argmax(mean))].astype(np.int64)

    def _gp_data(self, guide: Guide):
        """(inputs, targets): per recorded (workload, setting) the mean objective; inputs
        the signature (log scale) and the knobs scaled to [0, 1]."""
        if getattr(self, "_gp_cache", None) is None:
            span = np.maximum(np.array(guide.shape) - 1, 1)
            xs, ys, ns = [], [], []
            for w in self.workloads:
                ok = w.stats[:, 2] > 0
                xs.append(np.concatenate([np.repeat(w.log_mean[None], ok.sum(), 0),
                                          w.keys[ok] / span], 1))
                ys.append(w.stats[ok, 0] / w.stats[ok, 2])
                ns.append(w.stats[ok, 2])
            x, y, n = np.concatenate(xs), np.concatenate(ys), np.concatenate(ns)
            keep = np.argsort(-n, kind="stable")[:GP_MAX_POINTS]
            self._gp_cache = (x[keep], y[keep])
        return self._gp_cache


def open_replay(path: str, grow_nodes: bool = False) -> ReplayReader:
    """One ``--experience`` DB opened; ExperienceError naming it when it is missing or
    not a replay DB (both modes' loaders, ``drl_engine/row_experience.py``)."""
    if not Path(path).is_file():
        raise ExperienceError(f"--experience {path}: no such file")
    try:
        return ReplayReader(path, grow_nodes=grow_nodes)
    except (ReplayDBError, OSError, ValueError) as exc:
        raise ExperienceError(f"--experience {path}: not a usable replay DB "
                              f"({exc})") from None


def gp_mean(x: np.ndarray, y: np.ndarray, q: np.ndarray, noise: float = 0.05) -> np.ndarray:
    """A Gaussian process's posterior mean at ``q`` (RBF kernel, inputs standardised per
    column, length scale picked from a few by the marginal likelihood)."""
    mu, sd = x.mean(0), x.std(0) + 1e-9
    xs, qs = (x - mu) / sd, (q - mu) / sd
    ym, ys = y.mean(), y.std() + 1e-9
    t = (y - ym) / ys
    d2 = ((xs[:, None] - xs[None]) ** 2).sum(-1)
    best = None
    for ls in (0.3, 0.5, 1.0, 2.0):
        k = np.exp(-0.5 * d2 / ls ** 2) + noise * np.eye(len(xs))
        try:
            chol = np.linalg.cholesky(k)
        except np.linalg.LinAlgError:
            continue
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, t))
        ll = -0.5 * t @ alpha - np.log(np.diag(chol)).sum()
        if best is None or ll > best[0]:
            best = (ll, ls, alpha)
    if best is None:
        return np.full(len(q), ym)
    _, ls, alpha = best
    out = np.empty(len(q))
    for i in range(0, len(q), 512):
        kq = np.exp(-0.5 * ((qs[i:i + 512, None] - xs[None]) ** 2).sum(-1) / ls ** 2)
        out[i:i + 512] = kq @ alpha
    return out * ys + ym


def interpolated_best(signature: np.ndarray, means: list, spreads: list, bests: list,
                      n_steps: np.ndarray, names=None) -> tuple[np.ndarray, str]:
    """A new workload's start from known ones' best settings (grid indices): on the line
    from the nearest known signature ``a`` to another ``b``, at the new signature's
    projection ``t`` (spread-scaled), ``best_a + t·(best_b − best_a)`` per knob, rounded
    to the grid. Only where ``b`` encloses it with ``a``: 0 ≤ t ≤ 1 and, on every
    signature PI, the new value between theirs (± their spread); of such ``b`` the
    nearest. Else (one known workload, or a signature outside the known ones, where a
    fit would extrapolate, or across a dissimilar workload) the nearest's best setting.
    Returns (indices, how it was chosen, in words)."""
    names = list(range(len(means))) if names is None else list(names)
    u = np.asarray(signature, np.float64)
    dist = [float(np.max(np.abs(u - m) / s)) for m, s in zip(means, spreads)]
    order = np.argsort(dist, kind="stable")
    a = int(order[0])
    best_a = np.asarray(bests[a], np.float64)
    if len(means) < 2:
        return best_a.astype(np.int64), f"the only known workload {names[a]}'s best"
    for b in order[1:]:
        b = int(b)
        scale = np.sqrt((spreads[a] ** 2 + spreads[b] ** 2) / 2)
        ma, mb = means[a] / scale, means[b] / scale
        d = mb - ma
        dd = float(d @ d)
        if dd <= 0:
            continue
        t = float((u / scale - ma) @ d / dd)
        tol = np.maximum(spreads[a], spreads[b])
        inside = np.all((u >= np.minimum(means[a], means[b]) - tol)
                        & (u <= np.maximum(means[a], means[b]) + tol))
        if 0.0 <= t <= 1.0 and inside:
            est = best_a + t * (np.asarray(bests[b], np.float64) - best_a)
            idx = np.clip(np.rint(est), 0, n_steps).astype(np.int64)
            return idx, (f"interpolated between known workloads {names[a]} (nearest) and "
                         f"{names[b]} (t = {t:.2f})")
    return best_a.astype(np.int64), (f"the nearest known workload {names[a]}'s best (the "
                                     f"signature lies outside the known ones)")


def _q_start(engine, session: int, guide: Guide) -> np.ndarray:
    """The setting whose fresh observation the Q-network values most (max over actions)."""
    grid = np.argwhere(np.ones(guide.shape, bool))
    values = guide.step_grid.values(grid)
    q = engine.dqn.q_values(fresh_observations(engine.experience, session, values))
    return grid[int(np.argmax(q.max(1)))].astype(np.int64)


def _fold_session(clusters: SignatureClusters, pis, cols, p, values, lag: int,
                  grid: StepGrid, per_context: dict) -> None:
    """Cluster one recorded session's ticks by signature and credit each tick's objective
    to its context's setting ``lag`` ticks earlier."""
    label = np.full(len(p), -1)
    for i in range(len(p)):
        clusters.update(pis[i][:, cols].reshape(-1))
        if clusters.current is not None:
            label[i] = clusters.current
    for t in range(lag, len(p)):
        k = label[t]
        if k < 0 or label[t - lag] != k or not math.isfinite(p[t]):
            continue
        setting = values[t - lag]
        if not np.isfinite(setting).all():
            continue
        key = tuple(int(v) for v in grid.index(setting))
        acc = per_context.setdefault(k, {"ticks": 0, "cells": {}})
        s = acc["cells"].setdefault(key, [0.0, 0.0, 0.0])
        s[0] += p[t]
        s[1] += p[t] * p[t]
        s[2] += 1.0
    for k in set(label[label >= 0].tolist()):
        per_context.setdefault(k, {"ticks": 0, "cells": {}})["ticks"] += int((label == k).sum())


def _known(clusters: SignatureClusters, k: int, acc: dict, guide: Guide) -> KnownWorkload:
    cells = acc["cells"]
    keys = np.array(list(cells), np.int64).reshape(-1, len(guide.shape))
    stats = np.array(list(cells.values()), np.float64).reshape(-1, 3)
    w = KnownWorkload(clusters.mean[k].copy(), clusters.m2[k].copy(), clusters.n[k],
                      acc["ticks"], keys, stats)
    if len(keys):
        g = Guide(guide.step_grid, guide.cfg, np.random.default_rng(0))
        g.grid_stats = _guide_stats(g, w) if g.dense else None
        g.sums = {} if g.dense else _guide_stats(g, w)
        w.best = g.known.setting(0)
        if w.best is not None:
            hit = (keys == w.best).all(1)
            w.level = float(stats[hit, 0].sum() / stats[hit, 2].sum()) if hit.any() \
                else math.nan
    return w


def _guide_stats(guide: Guide, w: KnownWorkload):
    """A workload's per-setting sums in the guide's own form (dense array or dict)."""
    if guide.dense:
        out = np.zeros((3,) + guide.shape)
        for key, s in zip(w.keys, w.stats):
            out[(slice(None),) + tuple(key)] = s
        return out
    return {tuple(int(i) for i in key): [float(s[0]), float(s[1]), int(s[2])]
            for key, s in zip(w.keys, w.stats)}


def brought(exp, now: float | None = None) -> str:
    """What an experience (either mode's) brought, in the log line's words: workloads
    known, those with a best setting, sessions, ticks, the newest session's age."""
    now = time.time() if now is None else now
    known = sum(w.best is not None for w in exp.workloads)
    return (f"{_n(len(exp.workloads), 'workload')} known ({known} with a best setting) "
            f"from {_n(exp.sessions, 'session')}, {exp.ticks:,} ticks, newest "
            f"{_age(max(0.0, now - exp.newest_started_at))} old")


def _n(count: int, what: str) -> str:
    return f"{count} {what}" if count == 1 else f"{count} {what}s"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


__all__ = ["DEFAULT_START", "ExperienceError", "KnownWorkload", "NETWORK_STARTS",
           "PriorExperience", "STARTS", "gp_mean", "brought", "interpolated_best",
           "open_replay"]
