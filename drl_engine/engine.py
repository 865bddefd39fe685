"""The engine: experience from the replay DB in, trained Q-network and actions out.

It knows nothing of the target system: its inputs are the replay DB's PIs, the
parameter specs stored with each session, and the objective named in its reward
config. It runs the converge test, the cluster test, ``capes drl-engine`` against a
live DB (global or per-node knobs) and offline training on merged DBs, always through
the tick loop (:func:`drl_engine.loop.run_ticks`, whose ``Tuner`` it is).

Knobs come in rows (``drl_engine.decision``), and the engine has two modes, each a
class of its own behind the same surface (``update``, ``act``, ``train``,
``workload_changed``, ``save``/``load``):

* **one row** (:class:`~drl_engine.flat_engine.FlatEngine`, built by
  ``Engine(dqn, reward, reader)``; the paper's global knobs): the data side is
  :class:`~drl_engine.experience.Experience` (stacked PIs of every node), the Q-network
  the flat DQN (``drl_engine.dqn``), the controller the guide (``drl_engine.guide``).
* **a row per node** (:class:`~drl_engine.row_engine.RowEngine`, built by
  :meth:`Engine.over_rows` or :meth:`Engine.for_deployment`; per-node knobs): the data
  side is :class:`~drl_engine.node_replay.RowData`, the Q-network the shared per-node
  model (``drl_engine.node_model``), the controller
  :class:`~drl_engine.row_controller.RowController`.

This module keeps what both share: the counters, ε (one schedule, one way in, one
state changed in one place: ``drl_engine.exploration.Exploration``), the training loop
and the checkpoint's save and load; the one apply of an action (``StepGrid.apply``, over forbidden values) and the one walk
(``capes.common.step_grid.walk``) live with the step grid. ``docs/engine.md`` has the
why of each part.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from capes.common import actions
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader
from capes.common.step_grid import StepGrid
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.device import device_name
from drl_engine.exploration import Exploration
from drl_engine.tuner import Checkpointed

action_name = actions.name


def apply_action(action: int, values, specs) -> list[float]:
    """New parameter values after ``action``: moved by its steps, kept in range, over
    forbidden values (``StepGrid.apply``, the per-node mode's too, as the daemon's step
    rule)."""
    return StepGrid.of(specs).apply([float(v) for v in values], action).tolist()


class Engine(Checkpointed):
    """What both modes share (see the module docstring). ``Engine(dqn, reward, reader)``
    builds the one-row mode; ``rows`` or ``deployment`` (:meth:`over_rows`,
    :meth:`for_deployment`) the per-node mode."""

    per_node = False             # the mode (a class attribute of each)

    def __new__(cls, *args, rows=None, deployment=None, **kwargs):
        if cls is Engine:            # the mode's class, chosen by what it is built over
            if deployment is not None:
                from drl_engine.per_node import DeploymentEngine as cls
            elif rows is not None:
                from drl_engine.row_engine import RowEngine as cls
            else:
                from drl_engine.flat_engine import FlatEngine as cls
        return super().__new__(cls)

    def __init__(self, dqn: DQNConfig, reward: RewardConfig, device: str = "auto",
                 seed: int = 0):
        self.cfg = dqn
        self.reward_cfg = reward
        self.device = device_name(device)      # torch is imported when the network is built
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.action_ticks = 0
        self.train_steps = 0
        self.exploration = Exploration(dqn)   # ε's bump and pretrained start
        self.last_loss: float | None = None
        self._train_calls = 0                  # calls of train() on the tick schedule
        self.restore_error: str | None = None   # why a checkpoint could not be used
        self.context = None              # the one-row mode's workload contexts, if any
        self.dqn = None                  # the mode's learner, once its shape is known
        self.reader: ReplayReader | None = None

    @classmethod
    def for_deployment(cls, dqn: DQNConfig, reward: RewardConfig, db: str | Path, rows,
                       model=None, device: str = "auto", seed: int = 0) -> "Engine":
        """The per-node mode on a live replay DB for a deployment of per-node knobs
        (``rows``: :class:`~drl_engine.per_node.Rows`, the ``<node>/<knob>`` layout). It
        is built once every row's node is in the DB (as the one-row mode builds its
        network once the layout is known); a decision's values are then the flat
        ``<node>/<knob>`` list in the deployment's order."""
        return Engine(dqn, reward, ReplayReader(db, grow_nodes=True), device, seed,
                      model=model, deployment=rows)

    @classmethod
    def over_rows(cls, dqn: DQNConfig, reward: RewardConfig, pi_names: list[str],
                  params: list[ParameterSpec], nodes: int, model=None,
                  reader: ReplayReader | None = None, device: str = "cpu",
                  seed: int = 0) -> "Engine":
        """The per-node mode: ``nodes`` rows of ``params``, read back from each node's
        ``pi_names``. ``reader`` (optional, opened with ``grow_nodes``): the replay DB to
        pull rows from in ``update()``; without one, feed ticks with ``ingest``."""
        from drl_engine.row_engine import RowShape
        return Engine(dqn, reward, reader, device, seed, model=model,
                      rows=RowShape(list(pi_names), list(params), nodes))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    # -- ε ------------------------------------------------------------------------------
    @property
    def epsilon(self) -> float:
        """ε now, the one way in: the exploration state's schedule on the engine's
        clock, or on the current workload context's (its ticks counted from the
        context's first: ``WorkloadContexts.origin``), with the mode's own start and
        bump length (:meth:`epsilon_settings`)."""
        origin = self.context.origin if self.context is not None else None
        start, bump_ticks = self.epsilon_settings()
        return self.exploration.epsilon(self.action_ticks, origin, start, bump_ticks)

    def epsilon_settings(self) -> tuple[float | None, int | None]:
        """The mode's own ε start and bump length (None: ``engine.epsilon_start``,
        ``workload_ticks``)."""
        return None, None

    # -- train --------------------------------------------------------------------------
    @property
    def train_every(self) -> int:
        """Train on every k-th call of :meth:`train` (on k times as large a batch)."""
        return self.cfg.train_every

    def train(self, steps: int | None = None) -> float | None:
        """Run ``steps`` minibatch updates (default: train_steps_per_tick, on every
        ``train_every``-th call only, each minibatch that many times as large); mean
        loss. An explicit ``steps`` (offline training) runs exactly that many."""
        if self.dqn is None:
            return None
        every = 1 if steps is not None else self.train_every
        if every > 1:                              # the tick schedule: every k-th, k× batch
            self._train_calls += 1
            if self._train_calls % every:
                return None
        steps = self.cfg.train_steps_per_tick if steps is None else steps
        losses = []
        for _ in range(steps):
            loss = self.learn_once(every)
            if loss is None:
                break
            losses.append(loss)
            self.train_steps += 1
        if not losses:
            return None
        self.last_loss = self.dqn.mean_loss(losses)
        return self.last_loss

    def learn_once(self, times: int = 1):
        """One minibatch update on ``times`` × batch_size (None: too little data): the
        mode's typed batch (:meth:`batch`) into its learner."""
        b = self.batch(times)
        return None if b is None else self.dqn.learn(b)

    def batch(self, times: int = 1):
        """The mode's minibatch of ``times`` × batch_size (None: too little data)."""
        raise NotImplementedError

    # -- checkpoints --------------------------------------------------------------------
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
        self.resume(state, path, weights_only)

    def resume(self, state: dict, path, weights_only: bool) -> None:
        """The mode's part of :meth:`load`, given the checked checkpoint."""
        raise NotImplementedError

    def counters_state(self) -> dict:
        """The counters a checkpoint keeps (both modes), and the random generator."""
        return {"action_ticks": self.action_ticks, "train_steps": self.train_steps,
                "bumped_at": self.exploration.bumped_at,
                "pretrained": self.exploration.pretrained,
                "rng": self.rng.bit_generator.state}

    def restore_counters(self, state: dict) -> None:
        """:meth:`counters_state`'s counters back."""
        self.action_ticks = state["action_ticks"]
        self.train_steps = state["train_steps"]
        x = self.exploration
        x.bump(state["bumped_at"], x.local)
        x.pretrained = state.get("pretrained", False)
        self.rng.bit_generator.state = state["rng"]

    def recommendations(self) -> list[dict]:
        """Knobs the engine does not tune online, with advice (the per-node mode's)."""
        return []


__all__ = ["Engine", "action_name", "apply_action"]
