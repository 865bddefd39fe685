"""The controller over many rows of knobs (the engine's per-node mode), one job a part.

What the engine does around its Q-network when every node has its own row of knobs:
the cold start (``drl_engine.cold_start``: one shared setting for every row first), the
per-row sweep of a new context's ladder knobs (``drl_engine.row_sweep``), the
per-row probes (``drl_engine.row_probes``), the best-known setting by the objective's
moving-average peak (``drl_engine.best_known``), the trust region around it
(``drl_engine.trust_region``), rollback to it (``drl_engine.rollback``), change
detection with a vote of the rows (``drl_engine.row_detector``) and the cost categories
(``drl_engine.costs``). This class holds those parts and their state (what a checkpoint
must keep); the engine (``drl_engine.engine``) decides in which order they act. The
one-row (flat) mode's controller is the guide (``drl_engine.guide``).
"""
from __future__ import annotations

import logging

import numpy as np

from capes.common import actions
from capes.common.step_grid import StepGrid
from drl_engine import checkpoint, row_probes, trust_region
from drl_engine.best_known import PeakTracker
from drl_engine.cold_start import SharedColdStart
from drl_engine.costs import knob_cost
from drl_engine.rollback import Rollback
from drl_engine.row_detector import RowChangeDetector
from drl_engine.row_floor import RowFloor
from drl_engine.row_probes import RowProbes
from drl_engine.row_sweep import RowSweep

log = logging.getLogger("capes.engine")

# a checkpoint's controller entry: (name there: the part that holds it, its attribute)
STATE = {
    **{k: ("best", k) for k in ("best_level", "best_idx", "best_tick", "best_nodes",
                                "level")},
    "_best_from": ("best", "best_from"), "below": ("rollback", "below"),
    "_rollback_due": ("rollback", "due"), "_hold_until": ("rollback", "hold_until"),
    **{f"_rollback_{a}": ("rollback", a) for a in ("target", "cells", "since", "deadline")},
    **{k: ("probes", a) for k, a in row_probes.STATE.items()},
    "guarded": (None, "guarded")}


class RowController:
    def __init__(self, dqn, model, params, nodes: int, seed: int):
        self.cfg, self.mcfg, self.params, self.nodes, self.seed = dqn, model, params, nodes, seed
        # knobs on their step grids
        g = self.grid = StepGrid.of(params)            # capes.common.step_grid
        self.lo, self.hi, self.step, self.n_steps = g.lo, g.hi, g.step, g.n_steps
        # cost categories: only dynamic knobs move online
        self.costs = [knob_cost(s) for s in params]
        self.dynamic = np.array([c == "dynamic" for c in self.costs], bool)
        self.allowed = np.concatenate([[True], np.repeat(self.dynamic, 2)])   # (A,)
        self.probes = RowProbes(nodes, model, self.n_steps, self.dynamic, self.allowed)
        # each row's sweep of its ladder knobs in a new context (None: none swept)
        self.sweep = RowSweep.build(dqn, model, g, self.dynamic)
        # cold start: one shared setting for every row first (not where every dynamic
        # knob is swept per row: each row's sweep is its own cold start)
        self.cold: SharedColdStart | None = None
        self.handed_over_at: int | None = None      # the tick the cold start ended
        swept = self.sweep is not None and self.sweep.covers(self.dynamic)
        if model.cold_start == "shared" and model.cold_start_ticks > 0 and not swept:
            self.cold = SharedColdStart(self.grid, self.dynamic, dqn, model.cold_start_ticks,
                                        dqn.settle_ticks + model.best_window, seed)
        self.best = PeakTracker(model, dqn.settle_ticks, self.grid)
        self.guarded = 0                            # moves the guard turned back
        self.rollback = Rollback(model, dqn.settle_ticks)
        # a row whose own objective collapses away from its best-known knobs goes back
        self.floor = RowFloor(nodes, len(params), model.row_floor, dqn.settle_ticks)
        self.alarm_ticks: list[int] = []
        self.new_detector()

    def new_detector(self) -> None:
        """The change detector, from scratch."""
        self.detector = (RowChangeDetector(self.mcfg, self.cfg.settle_ticks, self.seed,
                                           self.nodes) if self.mcfg.detect else None)

    def grow(self, nodes: int) -> None:
        """Rows appended (nodes joined): not probing; the detector starts afresh (a node
        joining moves every node's share). The caller forgets the best-known setting."""
        self.probes.grow(nodes - self.nodes)
        self.floor.grow(nodes - self.nodes)
        self.nodes = nodes
        self.new_detector()

    def forget(self, tick: int | None) -> None:
        """A new workload: forget the best-known setting, nothing pending to roll back."""
        self.rollback.reset()
        self.floor.reset()
        self.best.forget(tick)

    @property
    def act_margin(self) -> float:
        """The greedy margin: ``act_margin`` up to ``margin_nodes`` rows, shrinking like
        1/N above (a row's share of the cluster reward)."""
        m = self.mcfg
        if not m.margin_nodes or self.nodes <= m.margin_nodes:
            return m.act_margin
        return m.act_margin * m.margin_nodes / self.nodes

    # -- parts of an action tick, in the engine's order ---------------------------------
    def hand_over(self, tick: int, rep) -> None:
        """The cold start is over: its best shared setting becomes every row's
        best-known setting, at the level measured while the rows held it."""
        self.handed_over_at = tick
        best = self.cold.best
        log.info("tick %d: the cold start hands over at %s", tick,
                 None if best is None else self.grid.values(best).tolist())
        if best is not None:
            self.best.take(np.tile(best, (self.nodes, 1)).astype(np.int64), tick,
                           rep.present[rep.slot(tick)])
            self.rollback.below = 0

    def roll_back(self, tick: int, cur: np.ndarray, present: np.ndarray) -> np.ndarray:
        """Every present row's dynamic knobs back to the best-known setting, walked
        (``rollback_walk``: :meth:`walk_back`) or at once (probes end); counted in
        ``rollback.rollback_ticks``. The hold's measure waits for the nodes' knob PIs
        to show it (``drl_engine.rollback``)."""
        target = self.best.best_idx
        move = present[:, None] & self.dynamic[None, :]
        walk = self.walk_ticks(cur, target, move) if self.mcfg.rollback_walk else 0
        self.rollback.start(tick, target, move, walk)
        values = self.walk_back(cur) if self.mcfg.rollback_walk else \
            np.where(move, self.grid.values(target), cur)
        self.probes.knob[:] = -1
        level = self.best.level
        log.info("rollback at tick %d (rollback %d): the objective's level %.4g stayed "
                 "below %.0f %% of the best-known %.4g for %d ticks", tick,
                 len(self.rollback.rollback_ticks), np.nan if level is None else level,
                 100 * self.mcfg.rollback_fraction, self.best.best_level,
                 self.mcfg.rollback_ticks)
        return values

    def indices(self, knobs: np.ndarray) -> np.ndarray:
        """Grid indices of knob values (N, K), a missing value (NaN) read as its min."""
        knobs = np.asarray(knobs, np.float64)
        return self.grid.index(np.where(np.isfinite(knobs), knobs, self.lo))

    def walk_back(self, cur: np.ndarray) -> np.ndarray:
        """One tick of the walk to the setting rolled back to (:meth:`walk_to`); ``cur``
        once every row is there."""
        rb = self.rollback
        return cur if rb.target is None else self.walk_to(cur, rb.target, rb.cells)

    def walk_to(self, cur: np.ndarray, target: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """One tick of a walk to the grid indices ``target`` (N, K) on ``cells`` (N, K):
        in each row not on it, the knob farthest from it (relative to its range) moved
        towards it by up to ``actions.MAX_STEPS`` steps, as the interface daemon's
        per-node step rule allows (one knob of a row a tick). The rollback's walk and the
        recall's of a known workload (``drl_engine.row_context``)."""
        idx = self.grid.index(cur)
        knob, steps = self.grid.walk(idx, target, actions.MAX_STEPS, cells)
        rows = np.flatnonzero(steps)
        k = knob[rows]
        out = cur.copy()          # the row's other knobs as they are, even off the grid
        out[rows, k] = self.grid.values(self.grid.move(idx[rows], k, steps[rows]))[
            np.arange(len(rows)), k]
        return out

    def walk_ticks(self, cur: np.ndarray, target: np.ndarray, cells: np.ndarray) -> int:
        """The longest row's walk (:meth:`walk_to`) to ``target`` on ``cells``, in ticks."""
        far = np.where(cells, np.abs(target - self.grid.index(cur)), 0)
        return int((-(-far // actions.MAX_STEPS)).sum(axis=1).max(initial=0))

    def explore(self, idx: np.ndarray, eps: float, rng) -> tuple[np.ndarray, np.ndarray]:
        """Which rows explore this tick and their actions (``drl_engine.row_probes``)."""
        return self.probes.explore(idx, eps, rng, self.best.best_idx, self.cfg.guard_steps)

    def guard(self, idx: np.ndarray, acts: np.ndarray, explore: np.ndarray) -> np.ndarray:
        """The trust region: a move that takes a knob more than ``guard_steps`` steps
        from the row's best-known setting (and not closer to it) becomes a step back
        towards it; a probe so blocked ends. A greedy move (a row not exploring) of a
        ladder knob may go ``greedy_guard_steps`` rungs from it, as in the one-row mode
        (``cluster_engine.greedy_guard``; off: ``guard_steps``): a rung of a ladder is a
        doubling, 3 of them 8x. A move over a forbidden value is judged where it lands."""
        g = self.cfg.guard_steps
        best = self.best.best_idx
        if best is None or g <= 0:
            return acts
        if self.mcfg.greedy_guard and self.grid.ladder.any():
            greedy = ~np.asarray(explore, bool)[:, None] & self.grid.ladder[None, :]
            g = np.where(greedy, min(g, self.cfg.greedy_guard_steps), g)
        k, steps = actions.decode_rows(acts, len(self.params))
        after = self.grid.move(idx, k, steps) if self.grid.forbids.any() else None
        # a knob that never moves online is not guarded
        bad, back = trust_region.outside(idx, k, steps, best, self.n_steps, g, self.dynamic,
                                         after)
        if not bad.any():
            return acts
        self.probes.knob[bad & explore] = -1
        self.guarded += int(bad.sum())
        return np.where(bad, back, acts)

    def floor_guard(self, idx: np.ndarray, acts: np.ndarray, explore: np.ndarray
                    ) -> np.ndarray:
        """The row floor's bounds (``drl_engine.row_floor``): a move onto or past a value
        a row fell at becomes NULL; a probe so blocked ends."""
        if not self.floor.active or not (acts != 0).any():
            return acts
        k, steps = actions.decode_rows(acts, len(self.params))
        out = self.floor.block(idx, self.grid.move(idx, k, steps), acts)
        self.probes.knob[(out != acts) & explore] = -1
        return out

    def floor_walk(self, values: np.ndarray, cur: np.ndarray, present: np.ndarray
                   ) -> np.ndarray:
        """One tick of the fallen rows' walk back to their best-known knobs."""
        rows = self.floor.returning & present
        if not rows.any() or self.best.best_idx is None:
            return values
        stepped = self.walk_to(cur, self.best.best_idx, rows[:, None] & self.dynamic[None, :])
        return np.where(rows[:, None], stepped, values)

    def apply(self, cur: np.ndarray, acts: np.ndarray) -> np.ndarray:
        """Every row's knob values after its action: one knob moved, in range, over
        forbidden values (``StepGrid.apply``, as the one-row mode and the daemon)."""
        return self.grid.apply(cur, acts)

    def recommendations(self, rep) -> list[dict]:
        """The knobs that are not dynamic (their cost category says remount, reboot or
        reformat), which the engine never changes online: for each, the value in effect
        (median over the rows), the best-known setting's, and the objective's mean level
        at each value the ring holds (a value held by the median row over at least
        ``best_window`` ticks). ``suggest``: the value with the best mean level when the
        ring holds more than one (they were set by an operator: remounts between
        workloads confound it, which is why it is a recommendation), else None with
        ``evidence = "not varied"``."""
        out = []
        for k in np.flatnonzero(~self.dynamic):
            spec = self.params[k]
            item = {"name": spec.name, "cost": self.costs[k], "current": None,
                    "best_known": None, "levels": {}, "suggest": None,
                    "evidence": "no data"}
            if rep.last is not None:
                ticks = np.arange(rep.oldest, rep.last + 1)
                s = ticks % rep.capacity
                with np.errstate(all="ignore"):
                    med = np.nanmedian(rep.knobs[s][:, :, k], axis=1)
                item["current"] = None if not np.isfinite(med[-1]) else float(med[-1])
                ok = np.isfinite(med) & np.isfinite(rep.pobj[s])
                vals, counts = np.unique(med[ok], return_counts=True)
                levels = {float(v): float(rep.pobj[s][ok][med[ok] == v].mean())
                          for v, c in zip(vals, counts) if c >= self.mcfg.best_window}
                item["levels"] = levels
                if len(levels) > 1:
                    item["suggest"] = max(levels, key=levels.get)
                    item["evidence"] = f"{len(levels)} values seen"
                elif levels:
                    item["evidence"] = "not varied"
            if self.best.best_idx is not None:
                item["best_known"] = float(self.grid.values(
                    np.median(self.best.best_idx, axis=0))[k])
            out.append(item)
        return out

    # -- checkpoints --------------------------------------------------------------------
    def _part(self, name: str):
        part = STATE[name][0]
        return self if part is None else getattr(self, part)

    def state(self) -> dict:
        """What a restart must not forget: the best-known setting and its level,
        rollback, the probes (per row: kept only for as many rows)."""
        return {k: checkpoint.encode(getattr(self._part(k), a)) for k, (_, a) in STATE.items()}

    def load_state(self, state: dict) -> None:
        for k, v in state.items():
            if k in STATE:
                setattr(self._part(k), STATE[k][1], checkpoint.decode(v))


__all__ = ["RowController", "STATE"]
