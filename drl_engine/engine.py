"""The engine: experience from the replay DB in, trained Q-network and actions out.

It knows nothing of the target system: its inputs are the replay DB's PIs, the
parameter specs stored with each session, and the objective named in its reward
config. The one class runs the converge test, the cluster test, ``capes drl-engine``
against a live DB (global or per-node knobs) and offline training on merged DBs.

Knobs come in rows (``drl_engine.decision``), and the engine has two modes, each a set
of plug-ins behind the same surface (``update``, ``act``, ``train``,
``workload_changed``, ``save``/``load``, driven by :func:`drl_engine.loop.run_ticks`):

* **one row** (``Engine(dqn, reward, reader)``, the paper's global knobs): the data side
  is :class:`~drl_engine.experience.Experience` (stacked PIs of every node), the
  Q-network the flat DQN (``drl_engine.dqn``; the paper preset's), the controller the
  guide (``drl_engine.guide``: GP-proposed probes, learned lags, LCB best-known setting,
  ±``greedy_guard_steps`` trust region, change detector).
* **a row per node** (:meth:`Engine.over_rows`, per-node knobs): the data side is
  :class:`~drl_engine.node_replay.RowData` (a ring of every node's PIs), the Q-network
  the shared per-node model (``drl_engine.node_model``, its size independent of the
  node count), the controller :class:`~drl_engine.row_controller.RowController`
  (cold start, per-row probes, moving-average-peak best-known setting,
  ±``guard_steps`` trust region, rollback, change detection by a vote of the rows).
  ``docs/engine.md`` has the why of each part.

Shared by both: the counters and ε schedule, the training loop, the checkpoint writer
(``drl_engine.checkpoint``), the trust-region function, the step grid, the n-step
return function and the :class:`~drl_engine.decision.Decision` type.

Per action tick: ``update()`` (refresh from the DB), ``act(session)`` (ε-greedy on the
newest observation), ``train(steps)`` (Algorithm 2 minibatches).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from capes.common import actions
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader
from capes.common.step_grid import StepGrid
from drl_engine import checkpoint
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.costs import tuned_online
from drl_engine.dqn import DQN, device_name, epsilon
from drl_engine.experience import Experience
from drl_engine import demonstrations
from drl_engine.context import WorkloadContexts, fresh_q
from drl_engine.decision import Decision
from drl_engine.guide import Guide, step_towards
from drl_engine.node_replay import RowData, finite_or_nan
from drl_engine.row_context import RowContexts
from drl_engine.row_controller import RowController
from drl_engine.tick_frontier import TickFrontier

log = logging.getLogger("capes.engine")

CHECKPOINT_VERSION = 1       # version 1 files without a "guide" entry still load
ROWS_CHECKPOINT = ("node_model", 1, "a node-model")   # the per-node mode's checkpoints


action_name = actions.name


def apply_action(action: int, values, specs) -> list[float]:
    """New parameter values after ``action``: moved by its steps, kept in range, over
    forbidden values (``ParameterSpec.next_value``, as the daemon's step rule)."""
    out = [float(v) for v in values]
    move = actions.decode(action, len(specs))
    if move is not None:
        k, steps = move
        out[k] = actions.moved(specs[k], out[k], steps)
    return out


@dataclasses.dataclass
class RowShape:
    """The per-node mode's shape: the PIs each node reports (its knobs among them), one
    row's knobs, and the number of rows (nodes) at the start."""
    pi_names: list[str]
    params: list[ParameterSpec]
    nodes: int


class Engine:
    """See the module docstring. ``rows`` or ``deployment`` (None: one row) select the
    per-node mode; :meth:`over_rows` and :meth:`for_deployment` build it."""

    def __init__(self, dqn: DQNConfig, reward: RewardConfig,
                 reader: ReplayReader | None = None, device: str = "auto", seed: int = 0,
                 *, rows: RowShape | None = None, model: NodeModelConfig | None = None,
                 deployment=None):
        self.cfg = dqn
        self.reward_cfg = reward
        self.device = device_name(device)      # torch is imported when the network is built
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.per_node = rows is not None or deployment is not None
        self.deployment = deployment         # per-node rows of a live deployment
        self.action_ticks = 0
        self.train_steps = 0
        self.bumped_at: int | None = None
        self.pretrained = False          # started from another run's model (--init-model)
        self.last_loss: float | None = None
        self._train_calls = 0                  # calls of train() on the tick schedule
        self.restore_error: str | None = None   # why a checkpoint could not be used
        self.context: WorkloadContexts | None = None   # [context hook] built with the guide
        self._eps_cfg: tuple | None = None     # (cfg, mcfg, the per-node mode's ε cfg)
        if deployment is not None:           # the per-node mode, built by update()
            self.mcfg = model or NodeModelConfig()
            self.reader, self.dqn, self.data = reader, None, None
            self._pending_load: tuple[Path, bool] | None = None
            self.update()
        elif rows is None:
            self._init_flat(reader)
        else:
            self._init_rows(rows, model or NodeModelConfig(), reader)

    @classmethod
    def for_deployment(cls, dqn: DQNConfig, reward: RewardConfig, db: str | Path, rows,
                       model: NodeModelConfig | None = None, device: str = "auto",
                       seed: int = 0) -> "Engine":
        """The per-node mode on a live replay DB for a deployment of per-node knobs
        (``rows``: :class:`~drl_engine.per_node.Rows`, the ``<node>/<knob>`` layout). It
        is built once every row's node is in the DB (as the one-row mode builds its
        network once the layout is known); a decision's values are then the flat
        ``<node>/<knob>`` list in the deployment's order."""
        return cls(dqn, reward, ReplayReader(db, grow_nodes=True), device, seed, model=model,
                   deployment=rows)

    @classmethod
    def over_rows(cls, dqn: DQNConfig, reward: RewardConfig, pi_names: list[str],
                  params: list[ParameterSpec], nodes: int,
                  model: NodeModelConfig | None = None, reader: ReplayReader | None = None,
                  device: str = "cpu", seed: int = 0) -> "Engine":
        """The per-node mode: ``nodes`` rows of ``params``, read back from each node's
        ``pi_names``. ``reader`` (optional, opened with ``grow_nodes``): the replay DB to
        pull rows from in ``update()``; without one, feed ticks with :meth:`ingest`."""
        return cls(dqn, reward, reader, device, seed, rows=RowShape(list(pi_names),
                                                                    list(params), nodes),
                   model=model)

    def _init_flat(self, reader: ReplayReader) -> None:
        dqn = self.cfg
        self.experience = Experience(reader, self.reward_cfg, dqn.stack,
                                     dqn.missing_tolerance, dqn.normalise_inputs, dqn.n_step,
                                     dqn.gamma, dqn.return_shift)
        self.dqn: DQN | None = None
        self.checkpoints = checkpoint.Checkpoints("flat", CHECKPOINT_VERSION, "a flat-engine")
        self.guide: Guide | None = None      # the default preset's guide (cfg.guided)
        self._context_built = False
        self.local_bump = False              # ε raised by the guide's change detector
        self.change_alarms = 0
        self.guide_session: int | None = None  # the session the guide credits
        self._pending_state: dict | None = None
        self.update()

    # -- data ---------------------------------------------------------------------------
    def update(self) -> int:
        """Pull new rows from the replay DB; build the network once the shape is known."""
        if self.per_node:
            return self._update_rows()
        n = self.experience.update()
        if self.dqn is None and self.experience.ready:
            exp = self.experience
            if exp.obs_dim > self.cfg.max_inputs:
                raise ValueError(f"the replay DB's layout makes {exp.obs_dim} network inputs "
                                 f"({len(exp.layout.node_names)} nodes × "
                                 f"{len(exp.layout.pi_names)} PIs × {self.cfg.stack} ticks), "
                                 f"more than engine.max_inputs = {self.cfg.max_inputs}")
            self.dqn = DQN(exp.obs_dim, exp.n_actions, self.cfg, self.device, self.seed)
            if self._pending_state is not None:
                state, self._pending_state = self._pending_state, None
                try:
                    self._restore(state)
                except checkpoint.UNUSABLE as exc:   # another layout: afresh, say why
                    self.restore_error = checkpoint.why(exc)
        return n

    def param_names(self) -> list[str]:
        """The parameters, in the order of a decision's values ([] before any data)."""
        if self.per_node:
            if self.deployment is not None:
                return list(self.deployment.names)
            return [s.name for s in self.params]
        exp = self.experience
        return list(exp.layout.param_names) if exp.ready else []

    def close(self) -> None:
        reader = self.reader if self.per_node else self.experience.reader
        if reader is not None:
            reader.close()

    @property
    def epsilon(self) -> float:
        if self.context is not None:         # [context hook] ε on the context's own clock
            return self.context.epsilon(self)
        cfg = self.cfg
        if self.per_node:                    # the per-node mode's own bump and start
            cfg = self._per_node_eps_cfg()
        return epsilon(self.action_ticks, cfg, self.bumped_at, self.pretrained)

    def _per_node_eps_cfg(self):
        """The per-node mode's ε settings, built once per (cfg, mcfg) pair: a
        ``dataclasses.replace`` every tick was ~0.1 ms, 1 % of a 1,000-node tick."""
        cached = self._eps_cfg
        if cached is not None and cached[0] is self.cfg and cached[1] is self.mcfg:
            return cached[2]
        cfg = dataclasses.replace(self.cfg, workload_ticks=self.mcfg.bump_ticks)
        if self.mcfg.epsilon_start:
            cfg = dataclasses.replace(cfg, epsilon_start=self.mcfg.epsilon_start)
        self._eps_cfg = (self.cfg, self.mcfg, cfg)
        return cfg

    @property
    def global_share(self) -> float:
        """The guide's share of global probes: from 1 down to 0 over the first
        ``global_fraction`` of the exploration period (and again after a workload
        change); local probes only after that. ``global_fraction = 0``: none, not even
        on the first tick (measured live: a uniform probe there took read_ahead_kb
        128 -> 8 KiB at the 4th second, worst 10 s 0.65x the original)."""
        if self.local_bump or self.cfg.global_fraction <= 0:
            return 0.0
        start = self.bumped_at or 0
        span = max(1.0, self.cfg.global_fraction * self.cfg.exploration_ticks)
        return max(0.0, 1.0 - (self.action_ticks - start) / span)

    def change_detected(self) -> None:
        """The guide's detector saw the objective leave the levels its settings had: ε is
        raised as for a new workload, but probes stay local (no global search)."""
        self.bumped_at = self.action_ticks
        self.local_bump = True
        self.change_alarms += 1

    def workload_changed(self) -> None:
        """A new workload started: raise ε to ``workload_epsilon`` (thesis §5.1.6). Per
        node: as an alarm, uncounted (a cold start under way starts its search over)."""
        if self.per_node:
            if self.data is None:
                return
            self._forget_best()
            if self.control.cold is not None:
                self.control.cold.restart()
            return
        self.bumped_at = self.action_ticks
        self.local_bump = False
        if self.guide is not None:
            self.guide.forget()

    # -- act ----------------------------------------------------------------------------
    def act(self, session: int | None = None, after_tick: int | None = None,
            current=None) -> Decision | None:
        """Choose the action for the newest tick of ``session``; None when there is not
        enough data yet or no tick newer than ``after_tick``. ``current``: the values in
        effect now, when the caller knows them better than the DB does (a live daemon
        may not have committed the previous action yet; per node: (N, K))."""
        if self.per_node:
            if self.deployment is not None:
                return self._act_deployment(after_tick, current)
            return self._act_rows(after_tick, current)
        # guided, where the network reads only fresh observations (q_scope new_contexts)
        # or nothing: no choice reads this observation's values, only whether its stack
        # is full (3 % of an hour). Decided from the config, not from _q_greedy, which a
        # context switch later in this tick may turn on ("first_visits")
        build = not (self.cfg.guided and (not self.cfg.use_q_network
                                          or self.cfg.q_scope == "new_contexts"))
        latest = self.experience.latest(session, build) if self.dqn is not None else None
        if latest is None and self.cfg.guided and self.dqn is not None:
            latest = self._newest_tick(session)      # the guide's probes need no stack
        if latest is None or (after_tick is not None and latest[0] <= after_tick):
            return None
        tick, obs = latest
        eps = self.epsilon
        specs = self.experience.param_specs()
        if current is None:
            current = self.experience.reader.sessions[session].current_values()
        if self.cfg.guided:
            action, explored, q_max = self._guided_action(session, obs, current, specs, eps)
        else:
            explored = bool(self.rng.random() < eps)
            if explored:
                action, q_max = int(self.rng.integers(self.dqn.n_actions)), None
            elif not self.cfg.use_q_network:     # [ablation hook] greedy: no move
                action, q_max = 0, None
            else:
                q = self.dqn.q_values(obs[None])[0]
                action, q_max = int(q.argmax()), float(q.max())
        if action and not tuned_online(specs[actions.decode(action, len(specs))[0]]):
            action = 0            # a remount/reboot knob: never moved online (cost)
        values = apply_action(action, current, specs)
        self.action_ticks += 1
        return Decision(tick, action, values, eps, explored, q_max)

    @property
    def _q_greedy(self) -> bool:
        """Whether the Q-network chooses the guided greedy action: not with
        ``use_q_network = false``, nor with ``q_scope = "new_contexts"``, where it acts
        only in a new workload's inference walk (``WorkloadContexts.infer_action``), nor
        with ``"first_visits"`` outside a later workload's first visit (round 7)."""
        scope = self.cfg.q_scope
        if not self.cfg.use_q_network or scope == "new_contexts":
            return False
        return scope == "everywhere" or (self.context is not None and self.context.first_visit)

    def _newest_tick(self, session: int) -> tuple[int, None] | None:
        """(newest tick, no observation) while the session's first stack fills up."""
        data = self.experience.reader.sessions.get(session)
        if data is None or data.length == 0:
            return None
        return data.first_tick + data.length - 1, None

    def _guided_action(self, session: int, obs, current, specs, eps: float):
        """The default preset's choice (drl_engine/guide.py): continue a probe, start one
        with probability ε (always before the first full observation, ``obs`` None: the
        probes need none, the network does), else the greedy action inside the trust
        region."""
        guide = self.guide
        if guide is None:
            guide = self.guide = self._new_guide(specs)
        if self.cfg.use_context and not self._context_built:     # [context hook]
            self.context = WorkloadContexts.build(self.cfg, self.experience.layout,
                                                  self.reward_cfg.pis)
            self._context_built = True
        if self.guide_session is not None and session != self.guide_session:
            guide.new_session()
            if self.context is not None:
                self.context.new_session()
        self.guide_session = session
        d = self.experience.derived[session]
        if self.context is not None:          # [context hook] switch the guide's memory
            switches = len(self.context.switches)
            self.context.follow(self, self.experience.reader.sessions[session].pis, d.n, guide)
            if len(self.context.switches) != switches:
                guide.drop_sweep()            # a sweep belongs to the workload it began in
                if self.context.switches[-1].new and len(self.context.memory) > 1:
                    guide.new_workload(context=True)   # (not the first context: explored
                                                       # all along)
        first_action = None
        if guide.await_action:
            acted = self.experience.reader.sessions[session].actions[:d.n] >= 0
            first_action = int(np.argmax(acted)) if acted.any() else None
        if guide.credit(d.p, d.values, d.n, first_action):
            self.change_detected()
        guide.best_setting(self.action_ticks)
        cur = guide.grid(current)
        holding = False
        if self.context is not None:          # [context hook] a return: walk to its best
            if self.context.inferring:        # ... a new workload: where the network points
                action = self.context.infer_action(self, session, cur, guide)
                if action is not None:
                    return action, False, None
            action = self.context.recall_action(cur, guide, self.action_ticks)
            if action is not None:
                return action, False, None
            if (self.cfg.context_lead and self.context.leaving and self.cfg.use_q_network
                    and obs is not None):
                # the signature just changed, the context is not confirmed yet: the
                # Q-network, which sees the new signature, leads the first move (scoped:
                # on fresh observations, as its walk reads them; issue 25 round 7)
                q = fresh_q(self, session, cur, guide) if self.cfg.q_scope == "new_contexts" \
                    else self.dqn.q_values(obs[None])[0]
                return self.context.lead(int(q.argmax()), len(cur)), False, float(q.max())
            holding = self.context.holding(self.action_ticks)
        action = guide.probe_action(cur)
        if action is None and not holding and (obs is None or guide.sweep
                                               or self.rng.random() < eps):
            guide.start_probe(self.global_share, cur)
            action = guide.probe_action(cur) or 0
        if action is not None:
            return action, True, None
        if not self._q_greedy:                # [ablation hook] greedy holds the best-known
            best = guide.best                 # setting (q_scope: the network only walks)
            return (step_towards(cur, best, guide.n_steps) if best is not None else 0), False, None
        q = self.dqn.q_values(obs[None])[0]
        return guide.guard(int(q.argmax()), cur), False, float(q.max())

    def _new_guide(self, specs) -> Guide:
        return Guide(StepGrid.of(specs), self.cfg, self.rng,
                     frozen=np.array([not tuned_online(s) for s in specs]))

    # -- train --------------------------------------------------------------------------
    def train(self, steps: int | None = None) -> float | None:
        """Run ``steps`` minibatch updates (default: train_steps_per_tick, on every
        ``train_every``-th call only, each minibatch that many times as large); mean
        loss. An explicit ``steps`` (offline training) runs exactly that many."""
        if self.dqn is None:
            return None
        every = 1 if steps is not None else \
            self.mcfg.train_every if self.per_node else self.cfg.train_every
        if every > 1:                              # the tick schedule: every k-th, k× batch
            self._train_calls += 1
            if self._train_calls % every:
                return None
        steps = self.cfg.train_steps_per_tick if steps is None else steps
        losses = []
        batch = self._rows_batch if self.per_node else self._flat_batch
        sampler = self._sampler if self.per_node else None
        for _ in range(steps):
            if sampler is not None:                # cluster_engine.device_sampling
                loss = sampler.learn(self.dqn, self.data, self.cfg.batch_size * every)
            else:
                arrays = batch(every)
                loss = None if arrays is None else self.dqn.learn(*arrays)
            if loss is None:
                break
            losses.append(loss)
            self.train_steps += 1
        if not losses:
            return None
        self.last_loss = self.dqn.mean_loss(losses)
        return self.last_loss

    def _flat_batch(self, times: int = 1):
        """An Algorithm-2 minibatch of the flat mode (``times`` × batch_size): the DQN's
        ``train_step`` arguments as numpy arrays."""
        batch = self.experience.sample(self.cfg.batch_size * times, self.rng)
        if batch is None:
            return None
        scale = 1.0 / self.experience.objective_std if self.cfg.scale_rewards else 1.0
        arrays = [batch.obs, batch.actions, batch.rewards * scale, batch.discounts,
                  batch.next_obs]
        if self.cfg.demo_margin and self.context is not None and self.guide is not None:
            # [context hook] DQfD's demonstrations (a restored engine: after its first act)
            arrays.append(self._demo_labels(batch))
        return arrays

    def _demo_labels(self, batch) -> np.ndarray:
        """Each transition's demonstrated action (drl_engine/demonstrations.py)."""
        index = np.zeros(len(batch.ticks), np.int64)
        values = np.zeros((len(batch.ticks), len(self.guide.n_steps)))
        for sid in np.unique(batch.sessions):
            rows = batch.sessions == sid
            index[rows] = batch.ticks[rows] - self.experience.reader.sessions[sid].first_tick
            values[rows] = self.experience.derived[sid].values[index[rows]]
        return demonstrations.labels(self.context, self.guide, values, batch.sessions,
                                     index, self.guide_session)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.per_node:
            return self._rows_state()
        layout = self.experience.layout
        return {**self.checkpoints.header(),
                "dqn": self.dqn.state_dict() if self.dqn else None,
                "config": dataclasses.asdict(self.cfg),
                "reward": dataclasses.asdict(self.reward_cfg),
                "layout": dataclasses.asdict(layout) if layout else None,
                "stats": self.experience.normaliser.state(),
                "action_ticks": self.action_ticks, "train_steps": self.train_steps,
                "bumped_at": self.bumped_at, "epsilon": self.epsilon,
                "pretrained": self.pretrained,
                "rng": self.rng.bit_generator.state,
                # the controller: what a restart must not forget (best-known setting, ...)
                "guide": self.guide.state() if self.guide is not None else None,
                "contexts": self.context.state() if self.context is not None else None,
                "guide_session": self.guide_session, "local_bump": self.local_bump,
                "change_alarms": self.change_alarms}

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint atomically and durably (``capes.common.atomic``): a temp
        file beside it, fsynced, renamed into place, the directory fsynced. A crash or a
        power cut leaves the old checkpoint or the new one, never half of one; the temp
        file of a save killed mid-write is removed by the next ``load`` or ``save``."""
        return self.checkpoints.save(self.state_dict(), path)

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        """Resume from a checkpoint: model, target, optimiser, counters and ε.
        ``weights_only`` takes just the networks (to start a new run from a model,
        exploring from ``pretrained_epsilon_start``). Resuming (not ``weights_only``)
        first removes the temp files of saves killed mid-write beside ``path``. Per
        node: from a cluster of any size (``_load_rows``); a deployment's engine not
        built yet (its nodes not all in the DB) loads it once it is."""
        if self.per_node and self.data is None:      # built later: loaded then
            self._pending_load = (Path(path), weights_only)
            return
        state = self.checkpoints.load(path, self.device, resume=not weights_only)
        if self.per_node:
            return self._load_rows(state, path, weights_only)
        if weights_only:
            state = {"dqn": state["dqn"], "layout": state["layout"],
                     "stats": state.get("stats")}
            self.pretrained = True
        if self.dqn is None:
            self._pending_state = state
        else:
            self._restore(state)

    def _restore(self, state: dict) -> None:
        layout = self.experience.layout
        if state.get("layout") and layout and state["layout"] != dataclasses.asdict(layout):
            raise ValueError("checkpoint was trained on another layout of nodes, PIs or "
                             "parameters than this replay DB holds")
        checkpoint.validate(state, self.state_dict(), "checkpoint",
                            weights_only="action_ticks" not in state)
        if state.get("dqn"):
            self.dqn.load_state_dict(state["dqn"])
        if state.get("stats") and self.cfg.normalise_inputs:
            self.experience.normaliser.load(state["stats"])
        if "action_ticks" in state:
            self.action_ticks = state["action_ticks"]
            self.train_steps = state["train_steps"]
            self.bumped_at = state["bumped_at"]
            self.pretrained = state.get("pretrained", False)
            self.rng.bit_generator.state = state["rng"]
            self.local_bump = state.get("local_bump", False)
            self.change_alarms = state.get("change_alarms", 0)
        if state.get("guide") is not None and self.cfg.guided:
            guide = self._new_guide(self.experience.param_specs())
            guide.load_state(state["guide"])
            self.guide, self.guide_session = guide, state.get("guide_session")
        if state.get("contexts") is not None and self.cfg.use_context:   # [context hook]
            context = WorkloadContexts.build(self.cfg, self.experience.layout,
                                             self.reward_cfg.pis)
            if context is not None:
                context.load_state(state["contexts"])
                self.context, self._context_built = context, True

    # -- the per-node mode: a row of knobs per node ---------------------------------------
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

    def _update_rows(self) -> int:
        """Reader mode: pull new rows and ingest the ticks that are complete."""
        if self.reader is None:
            return 0
        if self.data is None and not self._build_deployment():
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

    def _build_deployment(self) -> bool:
        """Build the per-node mode once every deployment row's node is in the replay DB
        (False: not yet); then resume a checkpoint ``load`` was given before."""
        self.reader.refresh()
        layout, rows = self.reader.layout, self.deployment
        if layout is None or not self.reader.sessions or \
                not set(rows.nodes) <= set(layout.node_names):
            return False
        missing = [k.name for k in rows.knobs if k.name not in layout.pi_names]
        if missing:
            raise ValueError(f"per-node knobs {missing} are not among the PIs the "
                             f"nodes report ({list(layout.pi_names)}): each node's "
                             f"monitoring agent must report each knob's value")
        self._init_rows(RowShape(list(layout.pi_names), rows.knobs, len(layout.node_names)),
                        self.mcfg, self.reader)
        if self._pending_load is not None:
            path, weights_only = self._pending_load
            self._pending_load = None
            try:
                self.load(path, weights_only)
            except checkpoint.UNUSABLE as exc:   # another layout or config: afresh, say why
                self.restore_error = checkpoint.why(exc)
                self._init_rows(RowShape(list(layout.pi_names), rows.knobs,
                                         len(layout.node_names)), self.mcfg, self.reader)
                self.action_ticks = self.train_steps = 0      # (validated first: a part's
                self.bumped_at, self.pretrained = None, False  # own load may have failed
                self.rng = np.random.default_rng(self.seed)   # after these were set)
        return True

    def _row_index(self) -> np.ndarray:
        """Each deployment row's node index in the engine (the replay DB's node order)."""
        order = list(self.reader.layout.node_names)
        return np.array([order.index(n) for n in self.deployment.nodes])

    def _act_deployment(self, after_tick: int | None, current) -> Decision | None:
        """A per-node decision in the deployment's terms: ``current`` and the values are
        the flat ``<node>/<knob>`` lists, the rows in the deployment's order."""
        if self.data is None or self.data.replay.last is None:
            return None
        rep, idx, cells = self.data.replay, self._row_index(), self.deployment.cells
        now = rep.knobs[rep.slot(rep.last)].astype(np.float64)    # (nodes, knobs)
        if current is not None:           # the daemon's values: newer than the PIs
            for (i, j), v in zip(cells, current):
                now[idx[i], j] = v
        d = self._act_rows(after_tick, now)
        if d is None:
            return None
        values = [float(d.values[idx[i], j]) for i, j in cells]
        return dataclasses.replace(d, values=values, explored=bool(d.row_explored[idx].any()),
                                   row_actions=d.row_actions[idx],
                                   row_explored=d.row_explored[idx])

    def best_values(self) -> dict[str, float] | None:
        """The per-node best-known setting, per ``<node>/<knob>`` (None: none yet, or
        not a deployment's per-node mode)."""
        if self.deployment is None or self.data is None:
            return None
        best = self.control.best.best_idx
        if best is None:
            return None
        vals, idx = self.control.grid.values(best), self._row_index()
        return {n: float(vals[idx[i], j])
                for n, (i, j) in zip(self.deployment.names, self.deployment.cells)}

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
        if control.detector is not None and control.detector.update(
                pis, rep.knobs[rep.slot(tick)], self._node_obj):
            self._alarm(tick)
        if control.best.track(rep, tick):
            self._forget_best(tick)
        s = rep.slot(tick)
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
        self.bumped_at = self.action_ticks
        self.control.forget(self.data.replay.last if tick is None else tick)

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
        if cold is not None and cold.active and not self.pretrained:
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
        acts = np.where(present, acts, 0).astype(np.int64)
        acts = control.guard(idx, acts, explore)
        values = control.apply(cur, acts)
        if self.row_context is not None:     # [row context hook] walking rows' step
            values = self.row_context.walk(values, cur, present, control, int(tick))
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
        return self.control.recommendations(self.data.replay) if self.per_node else []

    def _rows_batch(self, times: int = 1):
        """A minibatch of (``times`` × batch_size) ticks × nodes (``RowData.sample``): the
        model's ``train_step`` arguments as numpy arrays."""
        b = self.data.sample(self.cfg.batch_size * times, self.rng)
        if b is None:
            return None
        # a mask of every node (the usual case) is passed as None: the network pools all
        # nodes then, with the same sums and quotients, in ~20 fewer ops a step (4 %)
        mask = None if b.mask.all() else b.mask
        next_mask = None if b.next_mask.all() else b.next_mask
        return (b.obs, mask, b.actions, b.returns, b.discounts, b.next_obs, next_mask,
                b.valid, b.abar, b.next_abar)

    def _rows_state(self) -> dict:
        data, control = self.data, self.control
        return {**self.checkpoints.header(),
                "dqn": self.dqn.state_dict(), "config": dataclasses.asdict(self.cfg),
                "reward": dataclasses.asdict(self.reward_cfg),
                "pi_names": self.pi_names, "param_names": [s.name for s in self.params],
                "stats": None if data.mean is None else
                {"mean": data.mean.tolist(), "std": data.std.tolist()},
                "nodes_trained": self.nodes, "weights": self.weights,
                "action_ticks": self.action_ticks, "train_steps": self.train_steps,
                "bumped_at": self.bumped_at, "pretrained": self.pretrained,
                "alarm_ticks": list(control.alarm_ticks),
                "rollback_ticks": list(control.rollback.rollback_ticks),
                "stale_bests": control.rollback.stale_bests,
                "unconfirmed_rollbacks": control.rollback.unconfirmed,
                "rng": self.rng.bit_generator.state,
                "cold_start": None if control.cold is None else control.cold.state(),
                "handed_over_at": control.handed_over_at,
                # what a restart must not forget beyond the counters (per node: kept only
                # for a cluster of the same size), and the reward scale
                "controller": {**control.state(), "p_scale": checkpoint.encode(data.p_scale)},
                "row_contexts": None if self.row_context is None else   # [row context hook]
                self.row_context.state()}

    def _load_rows(self, state: dict, path, weights_only: bool) -> None:
        """Resume the per-node mode, from a cluster of any size (the model does not
        depend on N); ``weights_only``: the networks and input statistics only. The
        controller's state is kept only for a cluster of the same size."""
        names = [s.name for s in self.params]
        if state["pi_names"] != self.pi_names or state["param_names"] != names:
            raise ValueError(f"{path}: trained on PIs {state['pi_names']} and knobs "
                             f"{state['param_names']}, this cluster has {self.pi_names} "
                             f"and {names}")
        checkpoint.validate(state, self._rows_state(), path, weights_only)
        data, control = self.data, self.control
        self.dqn.load_state_dict(state["dqn"], optimizer=True)
        if state.get("stats"):
            data.mean = np.asarray(state["stats"]["mean"], np.float32)
            data.std = np.asarray(state["stats"]["std"], np.float32)
        if weights_only:
            self.pretrained = True
            return
        self.action_ticks = state["action_ticks"]
        self.train_steps = state["train_steps"]
        self.bumped_at = state["bumped_at"]
        self.pretrained = state.get("pretrained", False)
        control.alarm_ticks = list(state.get("alarm_ticks", []))
        control.rollback.rollback_ticks = list(state.get("rollback_ticks", []))
        control.rollback.stale_bests = int(state.get("stale_bests", 0))
        control.rollback.unconfirmed = int(state.get("unconfirmed_rollbacks", 0))
        self.rng.bit_generator.state = state["rng"]
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
                "alarm_ticks": list(control.alarm_ticks), "weights": self.weights,
                "handed_over_at": control.handed_over_at,
                "replay_capacity_ticks": self.data.replay.capacity}
