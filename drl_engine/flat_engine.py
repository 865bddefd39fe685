"""The engine's one-row mode: global knobs, the paper's setting.

The data side is :class:`~drl_engine.experience.Experience` (stacked PIs of every node,
Algorithm 2's minibatches), the Q-network the flat DQN (``drl_engine.dqn``; all of the
paper preset), the controller in the default preset the guide (``drl_engine.guide``:
GP-proposed probes, learned lags, LCB best-known setting, ±``greedy_guard_steps`` trust
region, change detector) and, with ``use_context``, the workload contexts
(``drl_engine.context``, their hooks marked ``[context hook]``). What both modes share
is :class:`drl_engine.engine.Engine`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from capes.common import actions
from capes.common.replay_db import ReplayReader
from capes.common.step_grid import StepGrid, walk_action
from drl_engine import checkpoint, demonstrations
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.context import WorkloadContexts, fresh_q
from drl_engine.costs import tuned_online
from drl_engine.decision import Decision
from drl_engine.engine import Engine, apply_action
from drl_engine.experience import Experience
from drl_engine.guide import Guide

CHECKPOINT_VERSION = 1       # version 1 files without a "guide" entry still load


class FlatNetwork:
    """The flat Q-learner (:class:`drl_engine.dqn.DQN`) once the replay DB's layout fixes
    its shape, built the first time a Q-value or a minibatch needs it: importing torch
    takes ~2 s, and the ``default`` preset's first ticks are the guide's probes, which
    need no network. Built from the seed, so with the weights an early build has."""

    def __init__(self, obs_dim: int, n_actions: int, cfg: DQNConfig, device: str,
                 seed: int):
        self.n_actions = n_actions
        self._args = (obs_dim, n_actions, cfg, device, seed)
        self._learner = None

    @property
    def learner(self):
        if self._learner is None:
            from drl_engine.dqn import DQN
            self._learner = DQN(*self._args)
        return self._learner

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        return self.learner.q_values(obs)

    def learn(self, batch):
        return self.learner.learn(batch)

    def mean_loss(self, losses) -> float | None:
        return self.learner.mean_loss(losses)

    def state_dict(self) -> dict:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.learner.load_state_dict(state)


class FlatEngine(Engine):
    """The one-row mode (``Engine(dqn, reward, reader)``)."""

    def __init__(self, dqn: DQNConfig, reward: RewardConfig,
                 reader: ReplayReader | None = None, device: str = "auto", seed: int = 0):
        super().__init__(dqn, reward, device, seed)
        self.reader = reader
        self.experience = Experience(reader, self.reward_cfg, dqn.stack,
                                     dqn.missing_tolerance, dqn.normalise_inputs, dqn.n_step,
                                     dqn.gamma, dqn.return_shift,
                                     scale_rewards=dqn.scale_rewards)
        self.dqn: FlatNetwork | None = None
        self.checkpoints = checkpoint.Checkpoints("flat", CHECKPOINT_VERSION, "a flat-engine")
        self.context: WorkloadContexts | None = None   # [context hook] built with the guide
        self.guide: Guide | None = None      # the default preset's guide (cfg.guided)
        self._context_built = False
        self.change_alarms = 0
        self.guide_session: int | None = None  # the session the guide credits
        self._pending_state: dict | None = None
        self.prior = None        # experience of earlier sessions (prior_experience.py)
        # offline training's minibatches drawn on the device (device_transitions.py)
        self.transitions = None
        self.update()

    # -- data ---------------------------------------------------------------------------
    def update(self) -> int:
        """Pull new rows from the replay DB; build the network once the shape is known."""
        n = self.experience.update()
        if self.dqn is None and self.experience.ready:
            exp = self.experience
            if exp.obs_dim > self.cfg.max_inputs:
                raise ValueError(f"the replay DB's layout makes {exp.obs_dim} network inputs "
                                 f"({len(exp.layout.node_names)} nodes × "
                                 f"{len(exp.layout.pi_names)} PIs × {self.cfg.stack} ticks), "
                                 f"more than engine.max_inputs = {self.cfg.max_inputs}")
            self.dqn = FlatNetwork(exp.obs_dim, exp.n_actions, self.cfg, self.device,
                                   self.seed)
            if self._pending_state is not None:
                state, self._pending_state = self._pending_state, None
                try:
                    self._restore(state)
                except checkpoint.UNUSABLE as exc:   # another layout: afresh, say why
                    self.restore_error = checkpoint.why(exc)
        return n

    def param_names(self) -> list[str]:
        """The parameters, in the order of a decision's values ([] before any data)."""
        exp = self.experience
        return list(exp.layout.param_names) if exp.ready else []

    @property
    def global_share(self) -> float:
        """The guide's share of global probes: from 1 down to 0 over the first
        ``global_fraction`` of the exploration period (and again after a workload
        change); local probes only after that. ``global_fraction = 0``: none, not even
        on the first tick (measured live: a uniform probe there took read_ahead_kb
        128 -> 8 KiB at the 4th second, worst 10 s 0.65x the original)."""
        if self.exploration.local or self.cfg.global_fraction <= 0:
            return 0.0
        start = self.exploration.bumped_at or 0
        span = max(1.0, self.cfg.global_fraction * self.cfg.exploration_ticks)
        return max(0.0, 1.0 - (self.action_ticks - start) / span)

    def change_detected(self) -> None:
        """The guide's detector saw the objective leave the levels its settings had: ε is
        raised as for a new workload, but probes stay local (no global search)."""
        self.exploration.bump(self.action_ticks, local=True)
        self.change_alarms += 1

    def workload_changed(self) -> None:
        """A new workload started: raise ε to ``workload_epsilon`` (thesis §5.1.6)."""
        self.exploration.bump(self.action_ticks)
        if self.guide is not None:
            self.guide.forget()

    def act(self, session: int | None = None, after_tick: int | None = None,
            current=None) -> Decision | None:
        """Choose the action for the newest tick of ``session``; None when there is not
        enough data yet or no tick newer than ``after_tick``. ``current``: the values in
        effect now, when the caller knows them better than the DB does (a live daemon
        may not have committed the previous action yet)."""
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

    def _started_elsewhere(self, session: int, current, guide) -> bool:
        """Whether the knobs are not at the defaults the replay DB assumes before the
        session's first action (a live host found at 512 with a config default of 128):
        its ticks before that action must not be credited to the defaults, or the guide
        takes the default for the setting measured there and walks to it."""
        data = self.experience.reader.sessions[session]
        if (data.actions[:data.length] >= 0).any():
            return False
        return not np.array_equal(guide.grid(current), guide.grid(data.defaults))

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
            if self.prior is not None and self.context is not None:
                self.prior.seed(self, self.context, guide)    # earlier sessions' memory
        if self.guide_session is not None and session != self.guide_session:
            guide.new_session()
            if self.context is not None:
                self.context.new_session()
        elif self.guide_session is None and self._started_elsewhere(session, current, guide):
            guide.await_action = True
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
        guide.known.setting(self.action_ticks)
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
            holding = self.context.holding(self.action_ticks, self, guide)
        action = guide.probe_action(cur)
        if action is None and not holding and (obs is None or guide.sweep
                                               or self.rng.random() < eps):
            guide.start_probe(self.global_share, cur)
            action = guide.probe_action(cur) or 0
        if action is not None:
            return action, True, None
        if not self._q_greedy or obs is None:  # greedy holds the best-known setting
            best = guide.known.best_idx       # (q_scope: the network only walks; or its
                                              # stack is not full yet: a recalled context
                                              # holding from the session's first ticks)
            return (walk_action(cur, best, guide.n_steps, straight=True) if best is not None
                    else 0), False, None
        q = self.dqn.q_values(obs[None])[0]
        return guide.guard(int(q.argmax()), cur), False, float(q.max())

    def _new_guide(self, specs) -> Guide:
        return Guide(StepGrid.of(specs), self.cfg, self.rng,
                     frozen=np.array([not tuned_online(s) for s in specs]))

    # -- train --------------------------------------------------------------------------
    def batch(self, times: int = 1):
        """An Algorithm-2 minibatch of the flat mode (``times`` × batch_size), its
        rewards in the reward's scale (``Experience.reward_scale``)."""
        batch = self.experience.sample(self.cfg.batch_size * times, self.rng)
        if batch is None:
            return None
        if self.cfg.demo_margin and self.context is not None and self.guide is not None:
            # [context hook] DQfD's demonstrations (a restored engine: after its first act)
            batch.demo = self._demo_labels(batch)
        return batch

    def learn_once(self, times: int = 1):
        """One update; its minibatch drawn on the device where offline training set
        :attr:`transitions` (``capes train``'s fast path), else :meth:`batch`'s."""
        if self.transitions is None:
            return super().learn_once(times)
        n = self.cfg.batch_size * times
        return self.dqn.learner.learn_sampled(lambda: self.transitions.batch(n),
                                              ("offline", n, 0))

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
        layout = self.experience.layout
        return {**self.checkpoints.header(),
                "dqn": self.dqn.state_dict() if self.dqn else None,
                "config": dataclasses.asdict(self.cfg),
                "reward": dataclasses.asdict(self.reward_cfg),
                "layout": dataclasses.asdict(layout) if layout else None,
                "stats": self.experience.normaliser.state(),
                **self.counters_state(), "epsilon": self.epsilon,
                # the controller: what a restart must not forget (best-known setting, ...)
                "guide": self.guide.state() if self.guide is not None else None,
                "contexts": self.context.state() if self.context is not None else None,
                "guide_session": self.guide_session, "local_bump": self.exploration.local,
                "change_alarms": self.change_alarms}

    def resume(self, state: dict, path, weights_only: bool) -> None:
        """A checkpoint of this mode: everything, or (``weights_only``) the networks,
        their layout and input statistics; kept until the network is built."""
        if weights_only:
            state = {"dqn": state["dqn"], "layout": state["layout"],
                     "stats": state.get("stats")}
            self.exploration.pretrained = True
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
            self.restore_counters(state)
            self.exploration.local = state.get("local_bump", False)
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


__all__ = ["CHECKPOINT_VERSION", "FlatEngine"]
