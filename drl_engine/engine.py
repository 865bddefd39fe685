"""The engine: experience from the replay DB in, trained Q-network and actions out.

It knows nothing of the target system: its inputs are the replay DB's PIs, the
parameter specs stored with each session, and the objective named in its reward
config. The same class runs in the converge test, in ``capes drl-engine`` against a
live DB, and in offline training on merged DBs.

Per action tick: ``update()`` (refresh from the DB), ``act(session)`` (ε-greedy on the
newest observation), ``train(steps)`` (Algorithm 2 minibatches).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from capes.common import actions
from capes.common.replay_db import ReplayReader
from capes.common.step_grid import StepGrid
from drl_engine import checkpoint
from drl_engine.checkpoint import CHECKPOINT_TEMPS, remove_stale_checkpoint_temps  # noqa: F401
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.dqn import DQN, epsilon, pick_device
from drl_engine.experience import Experience
from drl_engine.context import WorkloadContexts
from drl_engine.decision import Decision
from drl_engine.guide import Guide, step_towards

CHECKPOINT_VERSION = 1       # version 1 files without a "guide" entry still load


def tuned_online(spec) -> bool:
    """Only knobs that take effect live are moved online (``ParameterSpec.cost``)."""
    return getattr(spec, "cost", "dynamic") == "dynamic"


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


class Engine:
    def __init__(self, dqn: DQNConfig, reward: RewardConfig, reader: ReplayReader,
                 device: str = "auto", seed: int = 0):
        self.cfg = dqn
        self.reward_cfg = reward
        self.device = pick_device(device)
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.experience = Experience(reader, reward, dqn.stack, dqn.missing_tolerance,
                                     dqn.normalise_inputs, dqn.n_step, dqn.gamma,
                                     dqn.return_shift)
        self.dqn: DQN | None = None
        self.checkpoints = checkpoint.Checkpoints("flat", CHECKPOINT_VERSION, "a flat-engine")
        self.action_ticks = 0
        self.train_steps = 0
        self.bumped_at: int | None = None
        self.pretrained = False          # started from another run's model (--init-model)
        self.last_loss: float | None = None
        self.guide: Guide | None = None      # the default preset's guide (cfg.guided)
        self.context: WorkloadContexts | None = None   # [context hook] built with the guide
        self._context_built = False
        self.local_bump = False              # ε raised by the guide's change detector
        self.change_alarms = 0
        self.guide_session: int | None = None  # the session the guide credits
        self._pending_state: dict | None = None
        self.restore_error: str | None = None   # why a checkpoint could not be used
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
            self.dqn = DQN(exp.obs_dim, exp.n_actions, self.cfg, self.device, self.seed)
            if self._pending_state is not None:
                state, self._pending_state = self._pending_state, None
                try:
                    self._restore(state)
                except ValueError as exc:     # another layout: start afresh, say why
                    self.restore_error = str(exc)
        return n

    def param_names(self) -> list[str]:
        """The parameters, in the order of a decision's values ([] before any data)."""
        exp = self.experience
        return list(exp.layout.param_names) if exp.ready else []

    def close(self) -> None:
        self.experience.reader.close()

    @property
    def epsilon(self) -> float:
        if self.context is not None:         # [context hook] ε on the context's own clock
            return self.context.epsilon(self)
        return epsilon(self.action_ticks, self.cfg, self.bumped_at, self.pretrained)

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
        """A new workload started: raise ε to ``workload_epsilon`` (thesis §5.1.6)."""
        self.bumped_at = self.action_ticks
        self.local_bump = False
        if self.guide is not None:
            self.guide.forget()

    # -- act ----------------------------------------------------------------------------
    def act(self, session: int, after_tick: int | None = None,
            current: list[float] | None = None) -> Decision | None:
        """Choose the action for the newest tick of ``session``; None when there is not
        enough data yet or no tick newer than ``after_tick``. ``current``: the values in
        effect now, when the caller knows them better than the DB does (a live daemon
        may not have committed the previous action yet)."""
        latest = self.experience.latest(session) if self.dqn is not None else None
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
            self.context.follow(self, self.experience.reader.sessions[session].pis, d.n, guide)
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
            action = self.context.recall_action(cur, guide, self.action_ticks)
            if action is not None:
                return action, False, None
            if (self.cfg.context_lead and self.context.leaving and self.cfg.use_q_network
                    and obs is not None):
                # the signature just changed, the context is not confirmed yet: the
                # Q-network, which sees the new signature, leads the first move
                q = self.dqn.q_values(obs[None])[0]
                return self.context.lead(int(q.argmax()), len(cur)), False, float(q.max())
            holding = self.context.holding(self.action_ticks)
        action = guide.probe_action(cur)
        if action is None and not holding and (obs is None or self.rng.random() < eps):
            guide.start_probe(self.global_share, cur)
            action = guide.probe_action(cur) or 0
        if action is not None:
            return action, True, None
        if not self.cfg.use_q_network:        # [ablation hook] greedy holds the best-known
            best = guide.best                 # setting
            return (step_towards(cur, best, guide.n_steps) if best is not None else 0), False, None
        q = self.dqn.q_values(obs[None])[0]
        return guide.guard(int(q.argmax()), cur), False, float(q.max())

    def _new_guide(self, specs) -> Guide:
        return Guide(StepGrid.of(specs), self.cfg, self.rng,
                     frozen=np.array([not tuned_online(s) for s in specs]))

    # -- train --------------------------------------------------------------------------
    def train(self, steps: int | None = None) -> float | None:
        """Run ``steps`` minibatch updates (default: train_steps_per_tick); mean loss."""
        if self.dqn is None:
            return None
        steps = self.cfg.train_steps_per_tick if steps is None else steps
        losses = []
        scale = 1.0 / self.experience.objective_std if self.cfg.scale_rewards else 1.0
        for _ in range(steps):
            batch = self.experience.sample(self.cfg.batch_size, self.rng)
            if batch is None:
                break
            tensors = self.dqn.to_tensors(batch.obs, batch.actions, batch.rewards * scale,
                                          batch.discounts, batch.next_obs)
            losses.append(self.dqn.train_step(*tensors))
            self.train_steps += 1
        if not losses:
            return None
        self.last_loss = float(torch.stack(losses).mean())
        return self.last_loss

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
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
        first removes the temp files of saves killed mid-write beside ``path``."""
        state = self.checkpoints.load(path, self.device, resume=not weights_only)
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
