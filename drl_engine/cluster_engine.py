"""The cluster engine: one shared per-node Q-network tuning every node's knobs at once.

The single-node :class:`~drl_engine.engine.Engine` flattens every node's PIs into one
observation and picks one action for the whole system; on a cluster whose nodes each
have their own knobs that is a 440,000-wide input at 1,000 nodes and one knob moved per
second for the whole cluster. This engine keeps the engine's interface (``update``,
``act``, ``train``, ``workload_changed``, ``save``/``load``, so
:func:`drl_engine.loop.run_ticks` drives it) and changes what is inside:

* **Model** (:mod:`drl_engine.node_model`): a shared per-node encoder over the node's
  last S ticks of PIs (its knob values are among them), pooled into a cluster summary,
  and a shared per-node head: every node gets its own action (2 × knobs + 1) every tick.
  The weight count does not depend on the node count.
* **Data**: the replay DB's rows, one per node and tick. ``update()`` refreshes a
  :class:`~capes.common.replay_db.ReplayReader` and copies new ticks into a ring of the
  last ticks (``replay_mb`` of memory); or the caller feeds the same rows with
  ``ingest(tick, pis)`` — at 1,000 nodes a refresh costs ~4-8 ms a tick in the reader's
  per-row decode loop (``benchmarks/bench_cluster_engine.py --part replay``), so the
  converge harness feeds the rows it has just committed there above 64 nodes. Each node's
  action at t is read back from its knob PIs (value at t+1 − value at t, one step of one
  knob; anything else is "unknown" and not trained on): the replay DB's action table
  holds one row per tick for the whole system and has no room for per-node actions.
* **Nodes joining and leaving**: nothing in the model depends on N, so the same engine
  and weights go on. A node that joins is a new node index, appended (the replay DB
  appends its name to the session: the reader is opened with ``grow_nodes``; fed rows,
  an (N + 1, P) array): the ring grows (:meth:`ClusterEngine.grow`), the change detector
  starts afresh and the best-known setting is forgotten as on an alarm. A node that
  stops sending is absent (its row all NaN): it gets no action and is left out of the
  pool (the mask) and of the objective, which is over the nodes present; a reward, or a
  level of the best-known setting, is taken only between ticks with the same nodes
  present, and a best-known setting is forgotten once a whole ``best_window`` has run
  with other nodes (a lost row is not a node leaving).
* **Reward**: the ``[reward]`` plug-ins on the *cluster* objective p_t (total throughput
  by default), as a percentage of the objective's mean level over the first ticks
  (``r̃ = 100 · r / p̄``: the same scale at 8 and 1,000 nodes), the same r̃_t for every
  node of tick t. Why the cluster's change and not a per-node contribution: a node's own
  throughput rewards selfishness (a larger window always raises it, at its neighbours'
  cost — the simulator's contention), and a node's true contribution (the objective
  with and without its action) is not observable. With shared weights the common
  reward is still informative: each tick is a regression of r̃_t on the N actions with
  one shared coefficient, whose error falls like 1/√ticks whatever N is (the other
  nodes' moves are noise of order √N, the signal of N moves is of order N·β).
  An action's n-step return starts ``settle_ticks`` after it, when its effect shows up
  (:meth:`ClusterEngine.sample`): unshifted, nodes that all move together and alternate
  have every move credited with the previous moves' effect, the opposite of its own.
* **Exploration**: per node. ε is the share of nodes exploring at a time: a node not
  already probing starts a probe (``explore="probe"``, the guide's temporally extended
  exploration) with the probability that keeps that share: a target for one knob drawn
  around its current value (``probe_steps`` steps), walked to one step per tick, held
  ``probe_dwell`` ticks (the delayed effect is measured) and walked back to where it
  started — an excursion, so exploration never displaces a node for good and knobs the
  objective does not depend on do not random-walk away. ``explore="random"``: one
  uniform random action. ε follows the engine's schedule (:func:`drl_engine.dqn.epsilon`).
* **Cold start** (``cold_start = "shared"``, :mod:`drl_engine.cold_start`): before any
  of that, every node moves together while the guide's GP probes search one shared
  setting for ``cold_start_ticks`` ticks; its best becomes every node's best-known
  setting and the per-node engine takes over (node by node, a fresh engine needed
  ~250 simulated s to the first band at 64 nodes, the shared search ~15 s).
* **Greedy moves**: a node moves only when its best action's Q beats NULL's by
  ``act_margin`` (tie noise would otherwise make every node dither), scaled by
  ``margin_nodes / N`` above ``margin_nodes`` nodes: the reward is the cluster's, so a
  node's own Q advantage shrinks like 1/N (at 1,000 nodes the unscaled margin kept every
  greedy node at NULL through the first phase); a node that moved
  no data over its whole window is idle and keeps its knobs (``idle_hold``: its
  transitions carry no information about them, and an idle node's knobs would drift and
  hurt when it resumes).
* **Trust region** (the guide's, per node): the best-known setting is every node's
  knobs when the cluster objective's ``best_window``-tick moving average was highest
  (decaying by ``best_decay`` a tick, forgotten on an alarm); a move that takes a knob
  more than ``guard_steps`` steps from it, and not back towards it, becomes a step back.
* **Change detection**: :class:`~drl_engine.change_detection.SettingResidualDetector`,
  one stream per node keyed by its knob values (delayed by ``settle_ticks``; a fixed
  random sample of ``detect_nodes`` nodes on larger clusters), an alarm when
  ``detect_vote`` of them (at least 2) vote within 10 ticks. The stream is the
  node's share of the mean per-node objective (``detect_signal="share"``): when every
  node moves together (one greedy policy) every node's level shifts through contention
  and the raw throughput alarms often (measured: ~13 false alarms per simulated hour at
  64 nodes against ~3-6 for the share); the share is blind to a change that scales every
  node alike (a uniformly slower back end): ``detect_signal="throughput"`` sees those.
  The residuals are relative, and their robust scale has a floor,
  ``detect_scale_floor`` = 0.2: a node's share also moves by a few % when its
  neighbours move (contention), which at the 1 % noise's own scale hits the ±5 σ
  winsorising as hard as a workload change that halves or doubles it; with the floor a
  shift must exceed ~k · 0.2 = 10 % of a node's level to accumulate (measured on the
  stationary cluster game, 3 seeds: 13.5 → 0.3 false alarms per simulated hour at 8
  nodes, 2.5 → 0 at 64; on the phased game 5 of 6 changes found at 8 nodes, 6 of 6 at
  64, 4 of 4 at 1,000, median delay 3 s). The thresholds are the engine's own
  (``detect_threshold``, ``detect_drift``), not the detector's defaults.
  An alarm raises ε to ``workload_epsilon``, annealed back over ``bump_ticks`` —
  locally: probes stay around each node's current setting and inside the trust region,
  never uniform over the range. Alarms are logged and counted (``alarm_ticks``).
* **Rollback**: the best-known setting is per workload (an alarm forgets it; it is
  tracked afresh over windows that start after the change has settled). When the
  objective's ``best_window``-tick average stays below ``rollback_fraction`` of the
  best-known level for ``rollback_ticks`` ticks, every node's dynamic knobs jump back to
  it at once (``Decision.rolled_back``; counted in ``rollback_ticks``) and holds
  there for ``settle_ticks`` + ``best_window`` ticks to measure it; still below then,
  that best is no longer reachable (a change the detector missed, or a transient): it
  is dropped and counted (``stale_bests``).
* **Cost categories** (seed 000, table 9.1): a knob's ``cost`` (``dynamic``,
  ``remount``, ``reboot``, ``reformat``; read as ``getattr(spec, "cost", "dynamic")``)
  — only dynamic knobs are moved online (exploration, greedy actions, the trust region
  and rollback skip the others); :meth:`ClusterEngine.recommendations` reports the
  others with the objective's mean level at each value the ring has seen.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import torch

from capes.common.actions import ROWS
from capes.common.actions import direction as step_direction
from capes.common.params import ParameterSpec
from capes.common.step_grid import StepGrid
from capes.common.replay_db import ReplayReader
from drl_engine import checkpoint, row_probes, trust_region
from drl_engine.best_known import PeakTracker
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.cold_start import SharedColdStart
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.decision import Decision
from drl_engine.dqn import epsilon as epsilon_schedule
from drl_engine.dqn import pick_device
from drl_engine.experience import n_step_returns
from drl_engine.costs import knob_cost
from drl_engine.node_model import NodeDQN
from drl_engine.node_replay import NodeBatch, NodeReplay
from drl_engine.rollback import Rollback
from drl_engine.row_detector import RowChangeDetector
from drl_engine.row_probes import RowProbes

log = logging.getLogger("capes.cluster_engine")

CHECKPOINT_KIND = "node_model"
CHECKPOINT_VERSION = 1


class ClusterEngine:
    """See the module docstring. ``reader`` (optional): the replay DB to pull rows from
    in ``update()``; without one, feed ticks with :meth:`ingest`."""

    def __init__(self, dqn: DQNConfig, reward: RewardConfig, pi_names: list[str],
                 params: list[ParameterSpec], nodes: int,
                 model: NodeModelConfig | None = None, reader: ReplayReader | None = None,
                 device: str = "cpu", seed: int = 0):
        self.cfg = dqn
        self.mcfg = model or NodeModelConfig()
        self.mcfg.validate()
        self.reward_cfg = reward
        self.device = pick_device(device)
        self.checkpoints = checkpoint.Checkpoints(CHECKPOINT_KIND, CHECKPOINT_VERSION,
                                                  "a node-model")
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.pi_names, self.params = list(pi_names), list(params)
        self.nodes = nodes
        self.reader = reader
        self.stack = dqn.stack
        self.n_step = dqn.n_step
        self.gamma = self.mcfg.gamma or dqn.gamma
        self.n_actions = 2 * len(params) + 1
        if reader is not None and not reader.grow_nodes:
            raise ValueError("the cluster engine reads a replay DB opened with "
                             "grow_nodes=True (else a node joining is left out)")
        cap = NodeReplay.capacity_for(self.mcfg.replay_mb, nodes, len(pi_names), len(params))
        self.replay = NodeReplay(nodes, self.pi_names, self.params, cap, reward)
        self.in_dim = self.stack * len(pi_names)
        self.dqn = NodeDQN(self.in_dim, self.n_actions, dqn, self.mcfg, self.device, seed)
        self.mean: np.ndarray | None = None     # (P,) of the log1p PIs
        self.std: np.ndarray | None = None
        self.p_scale: float | None = None       # the objective's level: reward unit 1 %
        self.action_ticks = 0
        self.train_steps = 0
        self.bumped_at: int | None = None
        self.pretrained = False
        self.last_loss: float | None = None
        self._session: int | None = None
        self._seen = 0                          # reader mode: ticks of the session ingested
        # knobs on their step grids
        g = self.grid = StepGrid.of(params)            # capes.common.step_grid
        self.lo, self.hi, self.step, self.n_steps = g.lo, g.hi, g.step, g.n_steps
        # cost categories: only dynamic knobs move online
        self.costs = [knob_cost(s) for s in params]
        self.dynamic = np.array([c == "dynamic" for c in self.costs], bool)
        self.allowed = np.concatenate([[True], np.repeat(self.dynamic, 2)])   # (A,)
        # probes: per node (drl_engine.row_probes)
        self.probes = RowProbes(nodes, self.mcfg, self.n_steps, self.dynamic, self.allowed)
        # cold start: one shared setting for every node first (drl_engine.cold_start)
        self.cold: SharedColdStart | None = None
        self.handed_over_at: int | None = None      # the tick the cold start ended
        if self.mcfg.cold_start == "shared" and self.mcfg.cold_start_ticks > 0:
            self.cold = SharedColdStart(self.grid, self.dynamic, dqn,
                                        self.mcfg.cold_start_ticks,
                                        dqn.settle_ticks + self.mcfg.best_window, seed)
        # the best-known setting (drl_engine.best_known), the trust region around it
        self.best = PeakTracker(self.mcfg, dqn.settle_ticks, self.grid)
        self.guarded = 0                            # moves the guard turned back
        # rollback to the best-known setting (drl_engine.rollback)
        self.rollback = Rollback(self.mcfg, dqn.settle_ticks)
        # change detection
        self.alarm_ticks: list[int] = []
        self._new_detector()
        self._node_obj = np.array(self.replay.obj_cols)

    def _new_detector(self) -> None:
        """The change detector, from scratch (``drl_engine.row_detector``)."""
        self.detector = (RowChangeDetector(self.mcfg, self.cfg.settle_ticks, self.seed,
                                           self.nodes) if self.mcfg.detect else None)

    # -- shape ------------------------------------------------------------------------
    @property
    def weights(self) -> int:
        return self.dqn.weights

    @property
    def act_margin(self) -> float:
        """The greedy margin on this cluster: ``act_margin`` up to ``margin_nodes``
        nodes, shrinking like 1/N above (a node's share of the cluster reward)."""
        m = self.mcfg
        if not m.margin_nodes or self.nodes <= m.margin_nodes:
            return m.act_margin
        return m.act_margin * m.margin_nodes / self.nodes

    @property
    def epsilon(self) -> float:
        cfg = dataclasses.replace(self.cfg, workload_ticks=self.mcfg.bump_ticks)
        if self.mcfg.epsilon_start:
            cfg = dataclasses.replace(cfg, epsilon_start=self.mcfg.epsilon_start)
        return epsilon_schedule(self.action_ticks, cfg, self.bumped_at, self.pretrained)

    # -- data ---------------------------------------------------------------------------
    def update(self) -> int:
        """Reader mode: pull new rows and ingest the ticks that are complete."""
        if self.reader is None:
            return 0
        n = self.reader.refresh()
        if not self.reader.sessions:
            return n
        sid = max(self.reader.sessions)
        data = self.reader.sessions[sid]
        if sid != self._session:
            if self._session is not None:
                self.new_session()
            self._session, self._seen = sid, 0
        if data.first_tick is None:
            return n
        if data.pis.shape[1] < self.nodes:
            raise ValueError(f"replay DB session {sid} has {data.pis.shape[1]} nodes, "
                             f"this engine {self.nodes}")
        end = data.length
        if end > self._seen:
            # the newest tick is partial while a node of the tick before has no row in it
            # yet (a node that stopped sending holds it back once, not for good)
            gone = np.isnan(data.pis[end - 1]).all(axis=1)
            if end >= 2:
                gone &= ~np.isnan(data.pis[end - 2]).all(axis=1)
            end -= bool(gone.any())
        for i in range(self._seen, end):
            self.ingest(data.first_tick + i, data.pis[i])
        self._seen = max(self._seen, end)
        return n

    def new_session(self) -> None:
        """A new session: a fresh ring and detector, the same model."""
        self.replay = NodeReplay(self.nodes, self.pi_names, self.params,
                                 self.replay.capacity, self.reward_cfg)
        self._new_detector()

    def grow(self, nodes: int, tick: int | None = None) -> None:
        """Nodes joined, appended as the replay DB appends them: the same model (its
        size does not depend on N), the ring widened and resized to ``replay_mb``, the
        new nodes not probing. The detector starts afresh (a node joining moves every
        node's share) and the best-known setting is forgotten as on an alarm: it has no
        row for the new nodes and was another cluster's best."""
        if nodes <= self.nodes:
            return
        log.info("tick %s: %d node(s) joined, %d in all", tick, nodes - self.nodes, nodes)
        cap = NodeReplay.capacity_for(self.mcfg.replay_mb, nodes, len(self.pi_names),
                                      len(self.params))
        self.replay = self.replay.resized(nodes, cap)
        self.probes.grow(nodes - self.nodes)
        self.nodes = nodes
        self._new_detector()
        self._forget_best(tick)

    def ingest(self, tick: int, pis: np.ndarray) -> None:
        """One tick of every node's PIs, (N, P) in ``pi_names`` order; more rows than
        the engine has nodes: the last ones joined (:meth:`grow`), a node without a row
        (all NaN) is absent: it left, or its row was lost."""
        if len(pis) > self.nodes:
            self.grow(len(pis), tick)
        rep = self.replay
        if not rep.ingest(tick, pis):
            return
        s = rep.slot(tick)
        if self.detector is not None and self.detector.update(pis, rep.knobs[s],
                                                              self._node_obj):
            self._alarm(tick)
        if self.best.track(rep, tick):
            self._forget_best(tick)
        self.rollback.watch(int(tick), self.best)
        if self.mean is None and rep.ingested >= self.mcfg.stats_ticks:
            self._fit_stats()
        if self.p_scale is None and rep.ingested >= min(self.mcfg.stats_ticks,
                                                        max(self.mcfg.learn_start, 8)):
            self._fit_scale()

    def _fit_stats(self) -> None:
        rep = self.replay
        filled = rep.tick_of >= 0
        with np.errstate(all="ignore"):
            lp = rep.lp[filled].reshape(-1, rep.p)
            mean = np.nanmean(lp, axis=0)
            std = np.nanstd(lp, axis=0)
        self.mean = np.nan_to_num(mean).astype(np.float32)
        self.std = np.maximum(np.nan_to_num(std), self.mcfg.std_floor).astype(np.float32)

    def _fit_scale(self) -> None:
        p = self.replay.pobj[self.replay.tick_of >= 0]
        level = float(np.nanmean(np.abs(p))) if np.isfinite(p).any() else 0.0
        self.p_scale = level / 100.0 if level > 0 else 1.0

    def _alarm(self, tick: int) -> None:
        self.alarm_ticks.append(int(tick))
        log.info("workload change detected at tick %d (alarm %d): exploration raised to "
                 "ε %.2f", tick, len(self.alarm_ticks), self.cfg.workload_epsilon)
        self._forget_best(tick)

    def _forget_best(self, tick: int | None = None) -> None:
        """A new workload: raise ε, forget the best-known setting, and track it afresh
        only over windows that start after the change has settled."""
        self.bumped_at = self.action_ticks
        self.rollback.reset()
        self.best.forget(self.replay.last if tick is None else tick)

    def workload_changed(self) -> None:
        """Told of a new workload (the control plane's notice): as an alarm, uncounted
        (a cold start under way starts its search over)."""
        self._forget_best()
        if self.cold is not None:
            self.cold.restart()

    def features(self, x: np.ndarray) -> np.ndarray:
        """z-scores of log1p PI windows (..., S·P); NaN (missing) becomes 0, the mean."""
        if self.mean is None:
            return np.zeros(x.shape, np.float32)
        mean = np.tile(self.mean, self.stack)
        std = np.tile(self.std, self.stack)
        z = (x - mean) / std
        return np.nan_to_num(z, nan=0.0).astype(np.float32)

    # -- act ----------------------------------------------------------------------------
    def act(self, session: int | None = None, after_tick: int | None = None,
            current: np.ndarray | None = None) -> Decision | None:
        """Every node's action for the newest tick; None without a tick newer than
        ``after_tick``. ``current``: the knob values in effect (N, K), if known better
        than the newest PIs."""
        rep = self.replay
        if rep.last is None or (after_tick is not None and rep.last <= after_tick):
            return None
        tick = rep.last
        s = rep.slot(tick)
        cur = rep.knobs[s].astype(np.float64) if current is None else \
            np.asarray(current, np.float64).reshape(self.nodes, -1)
        present = rep.present[s]
        cur = np.where(np.isfinite(cur), cur, self.lo)
        idx = self.grid.index(cur)
        eps = self.epsilon
        if self.cold is not None and self.cold.active and not self.pretrained:
            shared = self._cold_start(int(tick), cur, present, eps)
            if shared is not None:
                return shared
        if self.rollback.due:
            return self._rollback(int(tick), cur, present, eps)
        if self.rollback.holding(tick):
            self.action_ticks += 1                       # measuring the rolled-back setting
            return self._decision(tick, np.zeros(self.nodes, np.int16), cur, eps,
                                  np.zeros(self.nodes, bool), None)
        explore, actions = self._explore(idx, eps)
        q_max = None
        greedy = ~explore & present
        have_history = rep.last - rep.oldest + 1 >= self.stack
        if greedy.any() and self.mean is not None and have_history:
            x = self.features(rep.window(tick, self.stack))
            abar = rep.mean_field(tick - 1) if self.mcfg.mean_field else None
            q = self.dqn.q_values(x, present, abar)
            if not self.allowed.all():           # knobs that are not dynamic never move
                q = np.where(self.allowed, q, -np.inf)
            best = q.argmax(axis=1)
            # move only for an expected gain: NULL unless the best beats it by the margin
            best = np.where(q.max(axis=1) - q[:, 0] > self.act_margin, best, 0)
            actions = np.where(greedy, best, actions)
            q_max = float(q.max(axis=1)[greedy].mean())
        if self.mcfg.idle_hold and have_history:
            # a node that moved no data over its whole window tells nothing about its
            # knobs: it keeps them (and does not explore) until it does I/O again
            w = rep.window(tick, self.stack).reshape(self.nodes, self.stack, rep.p)
            idle = ~(np.nan_to_num(w[:, :, self.replay.obj_cols]) > 0).any(axis=(1, 2))
            actions = np.where(idle, 0, actions)
            explore = explore & ~idle
            self.probes.knob[idle] = -1
        actions = np.where(present, actions, 0).astype(np.int64)
        actions = self._guard(idx, actions, explore)
        values = self._apply(cur, actions)
        self.action_ticks += 1
        return self._decision(tick, actions.astype(np.int16), values, eps,
                              explore & present, q_max)

    @staticmethod
    def _decision(tick, row_actions: np.ndarray, values: np.ndarray, eps: float,
                  explored: np.ndarray, q_max: float | None,
                  rolled_back: bool = False) -> Decision:
        """Every row's (node's) action as one :class:`Decision` of rows."""
        return Decision(int(tick), ROWS, values, eps, bool(explored.any()), q_max,
                        rolled_back, row_actions=row_actions, row_explored=explored)

    def _cold_start(self, tick: int, cur: np.ndarray, present: np.ndarray,
                    eps: float) -> Decision | None:
        """A tick of the cold start's shared search (every present node moved alike);
        None once it has handed over: its best shared setting is then every node's
        best-known setting, at the level measured while the nodes held it."""
        self.rollback.due = False            # the search owns the setting until then
        out = self.cold.act(self.replay, tick, cur, present)
        if out is None:
            self.handed_over_at = tick
            best = self.cold.best
            log.info("tick %d: the cold start hands over at %s", tick,
                     None if best is None else self.grid.values(best).tolist())
            if best is not None:
                self.best.take(np.tile(best, (self.nodes, 1)).astype(np.int64), tick,
                               self.replay.present[self.replay.slot(tick)])
                self.rollback.below = 0
            return None
        values, action = out
        self.action_ticks += 1
        moved = present & (values != cur).any(axis=1)
        code = int(np.asarray(step_direction(action, len(self.params))))
        return self._decision(tick, np.where(moved, code, 0).astype(np.int16), values, eps,
                              present.copy(), None)

    def _rollback(self, tick: int, cur: np.ndarray, present: np.ndarray,
                  eps: float) -> Decision:
        """Every present node's dynamic knobs back to the best-known setting at once
        (probes end); counted in ``rollback_ticks``."""
        self.rollback.start(tick)
        best = self.grid.values(self.best.best_idx)
        move = present[:, None] & self.dynamic[None, :]
        values = np.where(move, best, cur)
        self.probes.knob[:] = -1
        level = self.best.level
        log.info("rollback at tick %d (rollback %d): the objective's level %.4g stayed "
                 "below %.0f %% of the best-known %.4g for %d ticks", tick,
                 len(self.rollback.rollback_ticks), math.nan if level is None else level,
                 100 * self.mcfg.rollback_fraction, self.best.best_level,
                 self.mcfg.rollback_ticks)
        self.action_ticks += 1
        return self._decision(tick, np.zeros(self.nodes, np.int16), values, eps,
                              np.zeros(self.nodes, bool), None, rolled_back=True)

    def recommendations(self) -> list[dict]:
        """The knobs that are not dynamic (their cost category says remount, reboot or
        reformat), which the engine never changes online: for each, the value in effect
        (median over the nodes), the best-known setting's, and the objective's mean level
        at each value the ring holds (a value held by the median node over at least
        ``best_window`` ticks). ``suggest``: the value with the best mean level when the
        ring holds more than one (they were set by an operator: remounts between
        workloads confound it, which is why it is a recommendation), else None with
        ``evidence = "not varied"``."""
        out = []
        rep = self.replay
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

    def _explore(self, idx: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """Which nodes explore this tick and their actions (``drl_engine.row_probes``)."""
        return self.probes.explore(idx, eps, self.rng, self.best.best_idx,
                                   self.cfg.guard_steps)

    def _guard(self, idx: np.ndarray, actions: np.ndarray, explore: np.ndarray) -> np.ndarray:
        """The trust region: a move that takes a knob more than ``guard_steps`` steps
        from the node's best-known setting (and not closer to it) becomes a step back
        towards it; a probe so blocked ends."""
        g = self.cfg.guard_steps
        best = self.best.best_idx
        if best is None or g <= 0:
            return actions
        k = np.maximum(actions - 1, 0) // 2
        sign = np.where(actions == 0, 0, np.where((actions - 1) % 2 == 0, 1, -1))
        # a knob that never moves online is not guarded
        bad, back = trust_region.outside(idx, k, sign, best, self.n_steps, g, self.dynamic)
        if not bad.any():
            return actions
        self.probes.knob[bad & explore] = -1
        self.guarded += int(bad.sum())
        return np.where(bad, back, actions)

    def _apply(self, cur: np.ndarray, actions: np.ndarray) -> np.ndarray:
        k = np.maximum(actions - 1, 0) // 2
        sign = np.where(actions == 0, 0.0, np.where((actions - 1) % 2 == 0, 1.0, -1.0))
        out = cur.copy()
        rows = np.arange(len(actions))
        out[rows, k] = np.clip(cur[rows, k] + sign * self.step[k], self.lo[k], self.hi[k])
        return out

    # -- train --------------------------------------------------------------------------
    def sample(self, batch: int, rng: np.random.Generator | None = None,
               max_rounds: int = 20) -> NodeBatch | None:
        """B ticks drawn uniformly among those with a full transition (S ticks of
        history, n rewards, the node present at t and t+n, its action known), M nodes
        each (all when N ≤ ``loss_nodes``).

        The return of the action at t is r_{t+d} + … + γ^(n−1) r_{t+d+n−1} with
        d = ``settle_ticks``: the objective's changes from when the action's effect
        shows up (the delay the best-known setting and the change detector assume too),
        not r_t … r_{t+n−1}, which are mostly the effect of the d actions before it.
        Unshifted, a policy whose nodes all move together and alternate (+, −, +, …)
        sees each move credited with the opposite of its own effect (with d = 3 and
        n = 5 the return is the true gain of −a_t), learns to reverse every move and so
        keeps alternating: issue 11, seed 2 at 64 nodes sat at ~0.80 of the best static
        for the whole of phase 1, its policy pushing the window down (to ~22, best 50)
        against the trust region. The bootstrap stays Q(s_{t+n}), whose return starts
        at r_{t+n+d}: nothing is counted twice."""
        rng = rng or self.rng
        rep = self.replay
        if rep.last is None or self.mean is None or self.p_scale is None:
            return None
        S, n, d = self.stack, self.n_step, self.cfg.settle_ticks
        mf = self.mcfg.mean_field
        # the rewards of t + d … t + d + n − 1 must be known (r of tick u needs tick u + 1)
        lo, hi = rep.oldest + S - 1, rep.last - n - max(d, 1 if mf else 0)
        if hi - lo + 1 < max(1, self.mcfg.learn_start):
            return None
        picked: list[np.ndarray] = []
        got = 0
        recent = max(lo, hi - self.mcfg.recent_ticks + 1)
        for _ in range(max_rounds):
            t = rng.integers(lo, hi + 1, 2 * batch)
            if self.mcfg.recent_fraction > 0:
                newer = rng.random(2 * batch) < self.mcfg.recent_fraction
                t = np.where(newer, rng.integers(recent, hi + 1, 2 * batch), t)
            r = rep.r[(t[:, None] + d + np.arange(n)[None]) % rep.capacity]
            ok = np.isfinite(r).all(axis=1)
            t = t[ok]
            if len(t):
                picked.append(t)
                got += len(t)
            if got >= batch:
                break
        if got == 0:
            return None
        t = np.concatenate(picked)[:batch]
        B, N = len(t), self.nodes
        M = N if not self.mcfg.loss_nodes or N <= self.mcfg.loss_nodes else self.mcfg.loss_nodes
        if M == N:
            nodes = np.broadcast_to(np.arange(N), (B, N))
        else:
            nodes = np.argpartition(rng.random((B, N)), M, axis=1)[:, :M]
        s0, s1 = rep.slot(t), rep.slot(t + n)
        ret = n_step_returns(rep.r, t, n, self.gamma, shift=d, ring=True) / self.p_scale
        mask = rep.present[s0[:, None], nodes]
        next_mask = rep.present[s1[:, None], nodes]
        acts = rep.actions[s0[:, None], nodes].astype(np.int64)
        valid = mask & next_mask & (acts >= 0)
        return NodeBatch(obs=self.features(rep.window(t, S, nodes)), mask=mask,
                         actions=np.maximum(acts, 0), returns=ret.astype(np.float32),
                         discounts=np.full(B, self.gamma ** n, np.float32),
                         next_obs=self.features(rep.window(t + n, S, nodes)),
                         next_mask=next_mask, valid=valid,
                         abar=rep.mean_field(t, nodes) if mf else None,
                         next_abar=rep.mean_field(t + n, nodes) if mf else None)

    def train(self, steps: int | None = None) -> float | None:
        """``steps`` minibatch updates (default ``train_steps_per_tick``); mean loss."""
        steps = self.cfg.train_steps_per_tick if steps is None else steps
        losses = []
        dev = self.device
        for _ in range(steps):
            b = self.sample(self.cfg.batch_size)
            if b is None:
                break
            t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=dev)  # noqa: E731
            mf = b.abar is not None
            losses.append(self.dqn.train_step(t(b.obs), t(b.mask), t(b.actions),
                                               t(b.returns), t(b.discounts), t(b.next_obs),
                                               t(b.next_mask), t(b.valid),
                                               t(b.abar) if mf else None,
                                               t(b.next_abar) if mf else None))
            self.train_steps += 1
        if not losses:
            return None
        self.last_loss = float(torch.stack(losses).mean())
        return self.last_loss

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {**self.checkpoints.header(),
                "dqn": self.dqn.state_dict(), "config": dataclasses.asdict(self.cfg),
                "reward": dataclasses.asdict(self.reward_cfg),
                "pi_names": self.pi_names, "param_names": [s.name for s in self.params],
                "stats": None if self.mean is None else
                {"mean": self.mean.tolist(), "std": self.std.tolist()},
                "nodes_trained": self.nodes, "weights": self.weights,
                "action_ticks": self.action_ticks, "train_steps": self.train_steps,
                "bumped_at": self.bumped_at, "pretrained": self.pretrained,
                "alarm_ticks": list(self.alarm_ticks),
                "rollback_ticks": list(self.rollback.rollback_ticks),
                "stale_bests": self.rollback.stale_bests,
                "rng": self.rng.bit_generator.state,
                "cold_start": None if self.cold is None else self.cold.state(),
                "handed_over_at": self.handed_over_at,
                "controller": {k: checkpoint.encode(getattr(self._part(k), a))
                               for k, (_, a) in self.CONTROLLER.items()}}

    # what a restart must not forget beyond the counters: the best-known setting and its
    # level, rollback, the probes, the change detector and the reward scale (per node:
    # kept only for a cluster of the same size)
    # (checkpoint name: the part that holds it, its attribute there)
    CONTROLLER = {
        **{k: ("best", k) for k in ("best_level", "best_idx", "best_tick", "best_nodes",
                                    "level")},
        "_best_from": ("best", "best_from"), "below": ("rollback", "below"),
        "_rollback_due": ("rollback", "due"), "_hold_until": ("rollback", "hold_until"),
        **{k: ("probes", a) for k, a in row_probes.STATE.items()},
        "p_scale": (None, "p_scale"), "guarded": (None, "guarded")}

    def _part(self, name: str):
        part = self.CONTROLLER[name][0]
        return self if part is None else getattr(self, part)

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint atomically and durably (``drl_engine.checkpoint``); the
        temp file of a save killed mid-write is removed by the next ``load`` or ``save``."""
        return self.checkpoints.save(self.state_dict(), path)

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        """Resume from a checkpoint, which may come from a cluster of any size (the
        model does not depend on N). ``weights_only``: the networks and the input
        statistics only, exploring from ``pretrained_epsilon_start``. The reward scale
        is always this cluster's own (it depends on N)."""
        state = self.checkpoints.load(path, self.device, resume=not weights_only)
        names = [s.name for s in self.params]
        if state["pi_names"] != self.pi_names or state["param_names"] != names:
            raise ValueError(f"{path}: trained on PIs {state['pi_names']} and knobs "
                             f"{state['param_names']}, this cluster has {self.pi_names} "
                             f"and {names}")
        self.dqn.load_state_dict(state["dqn"], optimizer=True)
        if state.get("stats"):
            self.mean = np.asarray(state["stats"]["mean"], np.float32)
            self.std = np.asarray(state["stats"]["std"], np.float32)
        if weights_only:
            self.pretrained = True
            return
        self.action_ticks = state["action_ticks"]
        self.train_steps = state["train_steps"]
        self.bumped_at = state["bumped_at"]
        self.pretrained = state.get("pretrained", False)
        self.alarm_ticks = list(state.get("alarm_ticks", []))
        self.rollback.rollback_ticks = list(state.get("rollback_ticks", []))
        self.rollback.stale_bests = int(state.get("stale_bests", 0))
        self.rng.bit_generator.state = state["rng"]
        self.handed_over_at = state.get("handed_over_at")
        if self.cold is not None:        # a resumed engine never starts its search over
            if state.get("cold_start") is not None:
                self.cold.load_state(state["cold_start"])
            elif self.action_ticks:
                self.cold.done = True
        if state.get("controller") and state.get("nodes_trained") == self.nodes:
            for k, v in state["controller"].items():
                if k in self.CONTROLLER:
                    setattr(self._part(k), self.CONTROLLER[k][1], checkpoint.decode(v))

    def counters(self) -> dict:
        return {"action_ticks": self.action_ticks, "train_steps": self.train_steps,
                "epsilon": self.epsilon, "alarms": len(self.alarm_ticks),
                "guarded": self.guarded, "rollbacks": len(self.rollback.rollback_ticks),
                "rollback_ticks": list(self.rollback.rollback_ticks),
                "stale_bests": self.rollback.stale_bests,
                "alarm_ticks": list(self.alarm_ticks), "weights": self.weights,
                "handed_over_at": self.handed_over_at,
                "replay_capacity_ticks": self.replay.capacity}


__all__ = ["ClusterEngine", "NodeReplay", "NodeBatch"]
