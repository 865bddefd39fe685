"""Cold start on a cluster: every node moves together until a first best-known setting.

A fresh per-node engine explores node by node (:mod:`drl_engine.row_probes`): each
node's probe moves the cluster objective by ~1/N of its effect, under the noise of every
other node's moves, so the first good setting takes long to find (64 nodes, the first
phase of ``configs/cluster-sim.toml``: ~240 simulated s to the band, where a Bayesian
optimiser of one shared setting took ~90 s). A cluster whose nodes start alike usually
has a good shared setting close to its best per-node one: search that first, coarse to
fine.

:class:`SharedColdStart` treats the present nodes as ONE row of knobs and lets the
single-node :class:`~drl_engine.guide.Guide` search it: the cluster objective p_t is
credited to the shared setting in effect (learned lags and all), probes go to the
Gaussian process's proposals and are walked ``action_steps`` steps per tick, every node
moving together. For ``ticks`` ticks it always probes (global probes first, over the
engine's ``global_fraction`` of them, then local ones around the best); then it walks
to the guide's best-known setting (lower confidence bound), holds it ``settle_ticks`` +
``best_window`` ticks so the cluster engine can measure its level there, and hands
over: the cluster engine adopts it as every node's best-known setting (the anchor of its
trust region and of rollback) and goes on per node (fine tuning). It runs once, on an
engine that starts without a model (a pretrained model already knows where to go);
``cold_start = "per_node"`` in ``[cluster_engine]`` turns it off (the ablation).
"""
from __future__ import annotations

import numpy as np

from capes.common import actions
from capes.common.step_grid import StepGrid, walk_action
from drl_engine import checkpoint
from drl_engine.guide import Guide


class SharedColdStart:
    """The shared search of a cold start; :meth:`act` gives every node's values each
    tick until it returns None (handed over: :attr:`best` is the setting found)."""

    def __init__(self, grid: StepGrid, dynamic: np.ndarray, cfg, ticks: int, hold: int,
                 seed: int):
        self.grid, self.n_steps, self.dynamic = grid, grid.n_steps, dynamic
        self.cfg, self.budget, self.hold_ticks = cfg, int(ticks), int(hold)
        self.guide = Guide(grid, cfg, np.random.default_rng([seed, 23]),
                           frozen=~dynamic)
        self.first: int | None = None     # the first tick of the search
        self.p = np.zeros(0)              # per tick since then: the cluster objective ...
        self.values = np.zeros((0, len(grid.lo)))   # ... and the shared setting in effect
        self.ticks = 0                    # ticks acted on
        self.held = 0                     # ticks held at the best after the budget
        self.done = False
        self.best: np.ndarray | None = None    # grid indices handed over (None: none)

    @property
    def active(self) -> bool:
        return not self.done

    def _record(self, replay, tick: int) -> None:
        """The objective and the shared setting (the median present node's knobs) of
        every tick since the search began, read from the engine's ring."""
        if self.first is None:
            self.first = tick
        n = tick - self.first + 1
        have = len(self.p)
        if n <= have:
            return
        ts = np.arange(self.first + have, tick + 1)
        s = replay.slot(ts)
        ok = replay.tick_of[s] == ts
        p = np.where(ok, replay.pobj[s], np.nan)
        with np.errstate(all="ignore"):
            knobs = replay.knobs[s].astype(np.float64)                    # (T, N, K)
            knobs[~replay.present[s]] = np.nan
            vals = np.nanmedian(knobs, axis=1)
        vals[~ok] = np.nan
        self.p = np.concatenate([self.p, p])
        self.values = np.concatenate([self.values, vals])

    def act(self, replay, tick: int, cur: np.ndarray, present: np.ndarray
            ) -> tuple[np.ndarray, int] | None:
        """Every node's knob values (N, K) for the newest tick and the move made (an
        action of :mod:`capes.common.actions` on the shared row), or None when the
        search is over (it hands over: :attr:`best`)."""
        if self.done:
            return None
        self._record(replay, tick)
        g = self.guide
        g.credit(self.p, self.values, len(self.p))
        g.known.setting(self.ticks)
        row = cur[present] if present.any() else cur
        shared = g.grid(np.median(row, axis=0))
        if self.ticks == 0 and g.known.best_idx is None:
            # probes stay around where the nodes are until the GP has seen a few
            # settings: a global probe would walk to a uniform target, at 64 nodes to
            # window 211 and rate limit 150 and back, ~300 ticks far from the band
            g.forget(anchor=shared)
        action = g.probe_action(shared)
        if action is None and self.ticks < self.budget:
            span = max(1.0, self.cfg.global_fraction * self.budget)
            share = max(0.0, 1.0 - self.ticks / span)
            if share and self.cfg.probe_model and g.model_target(shared) is None:
                share = 0.0           # no GP yet (too few settings): a local probe
            g.start_probe(share, shared)
            action = g.probe_action(shared) or 0
        if action is None:                      # the budget is spent: settle on the best
            best = g.known.best_idx
            if best is None or self.held >= self.hold_ticks:
                self.done, self.best = True, best
                return None
            action = walk_action(shared, best, self.n_steps, self.cfg.action_steps,
                                 straight=True)
            self.held = self.held + 1 if action == 0 else 0
        self.ticks += 1
        move = actions.decode(action, len(shared))
        target = shared if move is None else self.grid.move(shared, *move)   # over forbidden
        values = cur.copy()
        every = present[:, None] & self.dynamic[None, :]
        values = np.where(every, self.grid.values(target)[None, :], values)
        return values, int(action)

    def restart(self) -> None:
        """A new workload during the search: its statistics are forgotten, the budget
        starts over."""
        if not self.done:
            self.guide.forget()
            self.ticks = self.held = 0

    # -- checkpoints --------------------------------------------------------------------
    def state(self) -> dict:
        return {"guide": self.guide.state(),
                **{k: checkpoint.encode(getattr(self, k))
                   for k in ("first", "p", "values", "ticks", "held", "done", "best")}}

    def load_state(self, state: dict) -> None:
        self.guide.load_state(state["guide"])
        for k, v in state.items():
            if k != "guide":
                setattr(self, k, checkpoint.decode(v))


__all__ = ["SharedColdStart"]
