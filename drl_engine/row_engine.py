"""The engine's per-node mode: a row of knobs per node.

The data side is :class:`~drl_engine.node_replay.RowData` (a ring of every node's PIs),
the Q-network the shared per-node model (``drl_engine.node_model``, its size independent
of the node count), the controller :class:`~drl_engine.row_controller.RowController`
(cold start, per-row probes, moving-average-peak best-known setting, ±``guard_steps``
trust region, rollback, change detection by a vote of the rows) and the per-node
workload contexts (``drl_engine.row_context``, their hooks marked ``[row context
hook]``). Built by :meth:`Engine.over_rows <drl_engine.engine.Engine.over_rows>` (rows
fed or read from a replay DB); a live deployment's ``<node>/<knob>`` knobs are
:class:`drl_engine.per_node.DeploymentEngine`'s. What both modes share is
:class:`drl_engine.engine.Engine`.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from capes.common import actions
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader
from drl_engine import checkpoint
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig, per_node_settings
from drl_engine.decision import Decision
from drl_engine.engine import Engine
from drl_engine.node_replay import RowData, finite_or_nan
from drl_engine.row_context import RowContexts
from drl_engine.row_controller import RowController
from drl_engine.tick_frontier import TickFrontier

log = logging.getLogger("capes.engine")

ROWS_CHECKPOINT = ("node_model", 1, "a node-model")   # the per-node mode's checkpoints


@dataclasses.dataclass
class RowShape:
    """The per-node mode's shape: the PIs each node reports (its knobs among them), one
    row's knobs, and the number of rows (nodes) at the start."""
    pi_names: list[str]
    params: list[ParameterSpec]
    nodes: int


class RowEngine(Engine):
    """The per-node mode (``Engine.over_rows``)."""

    per_node = True

    def __init__(self, dqn: DQNConfig, reward: RewardConfig,
                 reader: ReplayReader | None = None, device: str = "auto", seed: int = 0,
                 *, rows: RowShape, model: NodeModelConfig | None = None):
        super().__init__(per_node_settings(dqn), reward, device, seed)
        self._init_rows(rows, model or NodeModelConfig(), reader)

    def _init_rows(self, rows: RowShape, model: NodeModelConfig,
                   reader: ReplayReader | None) -> None:
        from drl_engine.node_model import NodeDQN     # torch model of the per-node mode
        model.validate()
        dqn = self.cfg
        self.mcfg = model
        self.checkpoints = checkpoint.Checkpoints(*ROWS_CHECKPOINT)
        self.pi_names, self.params = list(rows.pi_names), list(rows.params)
        self.nodes = rows.nodes
        self.reader = reader
        self.stack = dqn.stack
        self.n_actions = 2 * len(self.params) + 1
        if reader is not None and not reader.grow_nodes:
            raise ValueError("the per-node engine reads a replay DB opened with "
                             "grow_nodes=True (else a node joining is left out)")
        self.data = RowData(dqn, self.reward_cfg, model, self.pi_names, self.params,
                            self.nodes)
        self.in_dim = self.stack * len(self.pi_names)
        self.dqn = NodeDQN(self.in_dim, self.n_actions, dqn, model, self.device, self.seed)
        self._sampler = None
        sampling = model.device_sampling
        if sampling == "auto":
            sampling = str(self.device).startswith("cuda")
        if sampling:                               # the minibatch drawn on the device
            from drl_engine.device_replay import DeviceSampler
            self._sampler = DeviceSampler(self.device, self.seed,
                                          compiled=self.dqn.compiles)
        self._session: int | None = None
        self._seen = 0                          # reader mode: ticks of the session ingested
        self._frontier = TickFrontier(model.node_stall_ticks, model.node_lag_ticks)
        self.control = RowController(dqn, model, self.params, self.nodes, self.seed)
        self._node_obj = np.array(self.data.replay.obj_cols)
        self.row_context = RowContexts.build(dqn, self.pi_names, self.reward_cfg.pis,
                                             self.params, self.nodes)   # [row context hook]

    @property
    def compiled_parts(self) -> list:
        """``engine.compile_step``'s parts (the loss, the update, the device sampler's
        draw and gather; none where nothing compiles), each ``failed`` where it fell
        back to eager."""
        if not getattr(self.dqn, "compiles", False):
            return []
        sampler = [] if self._sampler is None else [self._sampler.draw, self._sampler.gather]
        return [self.dqn.loss, self.dqn._update_tensors, *sampler]

    @property
    def replay(self):
        """The per-node mode's ring of every node's PIs (``drl_engine.node_replay``)."""
        return self.data.replay

    @property
    def weights(self) -> int:
        return self.dqn.weights

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
            self._frontier.reset()
        if data.first_tick is None:
            return n
        if data.pis.shape[1] < self.nodes:
            raise ValueError(f"replay DB session {sid} has {data.pis.shape[1]} nodes, "
                             f"this engine {self.nodes}")
        # up to each node's own newest row (a node whose clock runs ahead waits for the
        # others; one that stopped sending or lags far behind does not hold them back)
        end = self._frontier.end(data.pis, data.first_tick, data.length, self._seen)
        for i in range(self._seen, end):
            self.ingest(data.first_tick + i, data.pis[i])
        self._seen = max(self._seen, end)
        return n

    def param_names(self) -> list[str]:
        """The parameters, in the order of a decision's values."""
        return [s.name for s in self.params]

    def new_session(self) -> None:
        """A new session: a fresh ring and detector, the same model."""
        self.data.reset()
        self.control.new_detector()

    def grow(self, nodes: int, tick: int | None = None) -> None:
        """Nodes joined, appended as the replay DB appends them: the same model (its
        size does not depend on N), the ring widened, the new rows not probing. The
        detector starts afresh and the best-known setting is forgotten as on an alarm:
        it has no row for the new nodes and was another cluster's best."""
        if nodes <= self.nodes:
            return
        log.info("tick %s: %d node(s) joined, %d in all", tick, nodes - self.nodes, nodes)
        self.data.grow(nodes)
        self.control.grow(nodes)
        if self.row_context is not None:             # [row context hook]
            self.row_context.grow(nodes)
        self.nodes = nodes
        self._forget_best(tick)

    def ingest(self, tick: int, pis: np.ndarray) -> None:
        """One tick of every node's PIs, (N, P) in ``pi_names`` order; more rows than
        the engine has nodes: the last ones joined (:meth:`grow`), a node without a row
        (all NaN) is absent: it left, or its row was lost. An infinite PI is missing."""
        pis = finite_or_nan(np.asarray(pis))
        if len(pis) > self.nodes:
            self.grow(len(pis), tick)
        if not self.data.ingest(tick, pis):
            return
        rep, control = self.data.replay, self.control
        if self.row_context is not None:     # [row context hook] store, forget, recall
            self.row_context.follow(self, int(tick), pis)
            if self.row_context.promises is not None:    # earlier sessions' settings
                self.row_context.promises.check(self, int(tick), pis)
        if control.detector is not None and control.detector.update(
                pis, rep.knobs[rep.slot(tick)], self._node_obj):
            self._alarm(tick)
        if control.best.track(rep, tick):
            self._forget_best(tick)
        s = rep.slot(tick)
        own = np.where(np.isfinite(pis[:, self._node_obj]).any(axis=1),   # each row's own
                       np.nansum(pis[:, self._node_obj], axis=1), np.nan)  # objective
        if control.sweep is not None:     # each new context's sweep measures, and what
            control.sweep.observe(int(tick), control.indices(rep.knobs[s]), own)
            control.sweep.pin(control.best)                       # it found stays best
            if self.mcfg.sweep_hold and self.row_context is not None:   # a measured
                self.row_context.hold(control.sweep.arrived, int(tick))  # setting, held
        if control.floor.active:          # a row collapsing off its best-known knobs
            judged = rep.present[s] & (not control.rollback.holding(int(tick)))
            if control.sweep is not None:
                judged[control.sweep.active] = False
            if self.row_context is not None:
                judged &= ~self.row_context.holding(int(tick))
            fell = control.floor.observe(int(tick), control.indices(rep.knobs[s]), own,
                                         control.best.best_idx, judged)
            if fell.any() and self.mcfg.floor_restarts_detector:
                control.new_detector()    # the collapse is ours and known, as a context
                                          # switch is: its echo must not forget the bounds
        control.rollback.watch(int(tick), control.best, rep.knobs[s], rep.present[s],
                               control.grid)

    def _alarm(self, tick: int) -> None:
        alarms = self.control.alarm_ticks
        alarms.append(int(tick))
        log.info("workload change detected at tick %d (alarm %d): exploration raised to "
                 "ε %.2f", tick, len(alarms), self.cfg.workload_epsilon)
        self._forget_best(tick)

    def _forget_best(self, tick: int | None = None) -> None:
        """A new workload: raise ε, forget the best-known setting, and track it afresh
        only over windows that start after the change has settled."""
        self.exploration.bump(self.action_ticks)
        self.control.forget(self.data.replay.last if tick is None else tick)

    # -- ε and the workload ---------------------------------------------------------------
    def epsilon_settings(self) -> tuple[float | None, int | None]:
        """``cluster_engine.epsilon_start`` (when set) and ``bump_ticks``."""
        return self.mcfg.epsilon_start or None, self.mcfg.bump_ticks

    @property
    def train_every(self) -> int:
        return self.mcfg.train_every

    def take_experience(self, experience) -> bool:
        """Earlier sessions' workloads known to every row (``--experience``,
        ``drl_engine.row_experience``): seeded, logged in one line; False, with a warning
        saying why, when this engine cannot take them (it starts without)."""
        if experience.seed(self):
            log.info("%s", experience.summary())
            return True
        log.warning("%s; the engine starts without it", experience.refused)
        return False

    def workload_changed(self) -> None:
        """A new workload started: as an alarm, uncounted (a cold start under way starts
        its search over)."""
        self._forget_best()
        if self.control.cold is not None:
            self.control.cold.restart()

    # -- act ----------------------------------------------------------------------------
    def act(self, session: int | None = None, after_tick: int | None = None,
            current=None) -> Decision | None:
        """Every row's action for the newest tick newer than ``after_tick`` (None: none
        yet); ``current``: the values in effect, (N, K). ``session``: the newest is the
        one read."""
        return self._act_rows(after_tick, current)

    def _act_rows(self, after_tick: int | None, current) -> Decision | None:
        """Every node's action for the newest tick, in the controller's order: cold
        start, rollback (and its hold), probes, greedy moves over the margin, idle
        nodes held, the trust region."""
        rep, control, data = self.data.replay, self.control, self.data
        if rep.last is None or (after_tick is not None and rep.last <= after_tick):
            return None
        tick = rep.last
        s = rep.slot(tick)
        cur = rep.knobs[s].astype(np.float64) if current is None else \
            np.asarray(current, np.float64).reshape(self.nodes, -1)
        present = rep.present[s]
        cur = np.where(np.isfinite(cur), cur, control.lo)
        idx = control.grid.index(cur)
        eps = self.epsilon
        none = np.zeros(self.nodes, np.int16)
        cold = control.cold
        if cold is not None and cold.active and not self.exploration.pretrained:
            control.rollback.due = False         # the search owns the setting until then
            out = cold.act(rep, int(tick), cur, present)
            if out is None:
                control.hand_over(int(tick), rep)
            else:
                values, action = out
                if self.mcfg.rollback_walk:      # a row off the shared setting (a node
                    # that joined) walks to it: the daemon refuses two knobs of a row
                    every = present[:, None] & cold.dynamic[None, :]
                    values = control.walk_to(cur, control.grid.index(values), every)
                self.action_ticks += 1
                moved = present & (values != cur).any(axis=1)
                code = int(np.asarray(actions.direction(action, len(self.params))))
                return self._decision(tick, np.where(moved, code, 0).astype(np.int16),
                                      values, eps, present.copy(), None)
        recalled = None if self.row_context is None else \
            self.row_context.recall(cur, present, control, int(tick), self.mcfg.rollback_walk)
        if recalled is not None:             # [row context hook] set at once, or searching
            self.action_ticks += 1
            return self._decision(tick, none, recalled, eps, np.zeros(self.nodes, bool), None)
        if control.rollback.due:
            values = control.roll_back(int(tick), cur, present)
            self.action_ticks += 1
            return self._decision(tick, none, values, eps, np.zeros(self.nodes, bool), None,
                                  rolled_back=True)
        if control.rollback.holding(tick):      # walking back, or measuring the setting
            self.action_ticks += 1
            values = control.walk_back(cur) if self.mcfg.rollback_walk else cur
            return self._decision(tick, none, values, eps, np.zeros(self.nodes, bool), None)
        explore, acts = control.explore(idx, eps, self.rng)
        q_max = None
        greedy = ~explore & present
        have_history = rep.last - rep.oldest + 1 >= self.stack
        window = rep.window(tick, self.stack) if have_history else None   # read once
        if greedy.any() and data.mean is not None and have_history:
            x = data.features(window)
            abar = rep.mean_field(tick - 1) if self.mcfg.mean_field else None
            q = self.dqn.q_values(x, present, abar)
            if not control.allowed.all():        # knobs that are not dynamic never move
                q = np.where(control.allowed, q, -np.inf)
            best, top = q.argmax(axis=1), q.max(axis=1)
            # move only for an expected gain: NULL unless the best beats it by the margin
            best = np.where(top - q[:, 0] > control.act_margin, best, 0)
            acts = np.where(greedy, best, acts)
            q_max = float(top[greedy].mean())
        if self.mcfg.idle_hold and have_history:
            # a node that moved no data over its whole window tells nothing about its
            # knobs: it keeps them (and does not explore) until it does I/O again
            w = window.reshape(self.nodes, self.stack, rep.p)
            idle = ~(w[:, :, rep.obj_cols] > 0).any(axis=(1, 2))     # NaN > 0 is False
            acts = np.where(idle, 0, acts)
            explore = explore & ~idle
            control.probes.knob[idle] = -1
        if self.row_context is not None:     # [row context hook] held rows stay
            held = self.row_context.holding(int(tick))
            acts = np.where(held, 0, acts)
            explore = explore & ~held
            control.probes.knob[held] = -1
        sweeping = control.sweep.active if control.sweep is not None else []
        if len(sweeping):                    # sweeping rows: held, then moved below
            acts[sweeping] = 0
            explore[sweeping] = False
            control.probes.knob[sweeping] = -1
        fallen = control.floor.returning     # walking back below, no move of their own
        if fallen.any():
            acts = np.where(fallen, 0, acts)
            explore = explore & ~fallen
            control.probes.knob[fallen] = -1
        acts = np.where(present, acts, 0).astype(np.int64)
        acts = control.guard(idx, acts, explore)
        acts = control.floor_guard(idx, acts, explore)
        values = control.floor_walk(control.apply(cur, acts), cur, present)
        if self.row_context is not None:     # [row context hook] walking rows' step
            values = self.row_context.walk(values, cur, present, control, int(tick))
        if len(sweeping):                    # one tick of each sweeping row's walk
            targets = control.sweep.targets()
            to, cells = idx.copy(), np.zeros(idx.shape, bool)
            for r, t in targets.items():
                if r < len(to) and present[r]:
                    to[r], cells[r] = t, control.dynamic
            stepped = control.walk_to(cur, to, cells)
            rows = cells.any(axis=1)
            values = np.where(rows[:, None], stepped, values)
        self.action_ticks += 1
        return self._decision(tick, acts.astype(np.int16), values, eps, explore & present,
                              q_max)

    @staticmethod
    def _decision(tick, row_actions: np.ndarray, values: np.ndarray, eps: float,
                  explored: np.ndarray, q_max: float | None,
                  rolled_back: bool = False) -> Decision:
        """Every row's action as one :class:`Decision` of rows."""
        return Decision(int(tick), actions.ROWS, values, eps, bool(explored.any()), q_max,
                        rolled_back, row_actions=row_actions, row_explored=explored)

    def recommendations(self) -> list[dict]:
        """The knobs whose cost category keeps them from being tuned online, with what
        the ring says of their values (:meth:`RowController.recommendations`)."""
        return self.control.recommendations(self.data.replay)

    # -- train --------------------------------------------------------------------------
    def batch(self, times: int = 1):
        """A minibatch of (``times`` × batch_size) ticks × nodes (``RowData.sample``,
        its returns in the reward's scale: ``RowData.p_scale``)."""
        return self.data.sample(self.cfg.batch_size * times, self.rng)

    def learn_once(self, times: int = 1):
        """One update, its minibatch drawn on the device where
        ``cluster_engine.device_sampling`` says so."""
        if self._sampler is not None:
            return self._sampler.learn(self.dqn, self.data, self.cfg.batch_size * times)
        return super().learn_once(times)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        data, control = self.data, self.control
        return {**self.checkpoints.header(),
                "dqn": self.dqn.state_dict(), "config": dataclasses.asdict(self.cfg),
                "reward": dataclasses.asdict(self.reward_cfg),
                "pi_names": self.pi_names, "param_names": [s.name for s in self.params],
                "stats": None if data.mean is None else
                {"mean": data.mean.tolist(), "std": data.std.tolist()},
                "nodes_trained": self.nodes, "weights": self.weights,
                **self.counters_state(),
                "alarm_ticks": list(control.alarm_ticks),
                "rollback_ticks": list(control.rollback.rollback_ticks),
                "stale_bests": control.rollback.stale_bests,
                "unconfirmed_rollbacks": control.rollback.unconfirmed,
                "cold_start": None if control.cold is None else control.cold.state(),
                "handed_over_at": control.handed_over_at,
                # what a restart must not forget beyond the counters (per node: kept only
                # for a cluster of the same size), and the reward scale
                "controller": {**control.state(), "p_scale": checkpoint.encode(data.p_scale)},
                "row_contexts": None if self.row_context is None else   # [row context hook]
                self.row_context.state()}

    def resume(self, state: dict, path, weights_only: bool) -> None:
        """Resume the per-node mode, from a cluster of any size (the model does not
        depend on N); ``weights_only``: the networks and input statistics only. The
        controller's state is kept only for a cluster of the same size."""
        names = [s.name for s in self.params]
        if state["pi_names"] != self.pi_names or state["param_names"] != names:
            raise ValueError(f"{path}: trained on PIs {state['pi_names']} and knobs "
                             f"{state['param_names']}, this cluster has {self.pi_names} "
                             f"and {names}")
        checkpoint.validate(state, self.state_dict(), path, weights_only)
        data, control = self.data, self.control
        self.dqn.load_state_dict(state["dqn"], optimizer=True)
        if state.get("stats"):
            data.mean = np.asarray(state["stats"]["mean"], np.float32)
            data.std = np.asarray(state["stats"]["std"], np.float32)
        if weights_only:
            self.exploration.pretrained = True
            return
        self.restore_counters(state)
        control.alarm_ticks = list(state.get("alarm_ticks", []))
        control.rollback.rollback_ticks = list(state.get("rollback_ticks", []))
        control.rollback.stale_bests = int(state.get("stale_bests", 0))
        control.rollback.unconfirmed = int(state.get("unconfirmed_rollbacks", 0))
        control.handed_over_at = state.get("handed_over_at")
        if control.cold is not None:     # a resumed engine never starts its search over
            if state.get("cold_start") is not None:
                control.cold.load_state(state["cold_start"])
            elif self.action_ticks:
                control.cold.done = True
        if state.get("controller") and state.get("nodes_trained") == self.nodes:
            saved = dict(state["controller"])
            if "p_scale" in saved:
                data.p_scale = checkpoint.decode(saved.pop("p_scale"))
            control.load_state(saved)
            if state.get("row_contexts") is not None and self.row_context is not None:
                self.row_context.load_state(state["row_contexts"])   # [row context hook]

    def counters(self) -> dict:
        """The per-node mode's counters, as the cluster test reports them."""
        control = self.control
        return {"action_ticks": self.action_ticks, "train_steps": self.train_steps,
                "epsilon": self.epsilon, "alarms": len(control.alarm_ticks),
                "guarded": control.guarded,
                "rollbacks": len(control.rollback.rollback_ticks),
                "rollback_ticks": list(control.rollback.rollback_ticks),
                "stale_bests": control.rollback.stale_bests,
                "unconfirmed_rollbacks": control.rollback.unconfirmed,
                "floor_falls": control.floor.fall_count,
                "floor_blocked": control.floor.blocked,
                "alarm_ticks": list(control.alarm_ticks), "weights": self.weights,
                "handed_over_at": control.handed_over_at,
                "replay_capacity_ticks": self.data.replay.capacity}


__all__ = ["ROWS_CHECKPOINT", "RowEngine", "RowShape"]
