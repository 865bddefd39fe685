"""Deep Q-learning as in thesis §5.1.4–5.1.7, in one file (after CleanRL's dqn.py).

* Q-network: an MLP with ``hidden_layers`` tanh layers as wide as the input and one
  linear output per action (2 × parameters + 1, the NULL action included; the
  ``default`` preset's probe walks also move two steps a tick, ``engine.action_steps``,
  and such a move is learned as its one-step direction).
* Loss (Eq. 2.1): mean squared TD error  (r + γ · max_a' Q⁻(s', a') − Q(s, a))²,
  against a target network Q⁻ updated softly after every minibatch:
  θ⁻ ← (1 − α) · θ⁻ + α · θ.
* RMSProp (learning rate 0.001, decay 0.9); minibatch 32; γ = 0.99.
* ε-greedy: ε falls linearly from 1.0 to 0.05 over the exploration period and is
  bumped to 0.2 when a new workload starts, then falls back over ``workload_ticks``.

Tuning never ends, so no transition is terminal. Presets: ``paper`` is exactly the
above; ``default`` adds Double DQN, the Huber loss, input normalisation, reward
scaling, gradient clipping, 5-step returns, the guide, two-step probe walks and a 3×
minibatch every 3rd tick (``train_every``), justified by the converge test (README).
The hyperparameters and presets live in the torch-free ``drl_engine.config``; the
n-step return and its discount γⁿ come with each minibatch from ``drl_engine.experience``.

This module imports no torch: the networks, the optimiser and the training step are in
:mod:`drl_engine.qnet`, which :class:`DQN` imports and builds the first time the network
is needed (a Q-value or a minibatch). The ``default`` preset's first ticks are the
guide's probes, which need no network, so a converge run's first tick does not wait for
torch (~2 s); the network is built from the same seed then, with the same weights.
"""
from __future__ import annotations

from drl_engine.config import PRESETS, DQNConfig, with_preset  # noqa: F401  (re-exported)


def epsilon(action_ticks: int, cfg: DQNConfig, bumped_at: int | None = None,
            pretrained: bool = False, start: float | None = None,
            bump_ticks: int | None = None) -> float:
    """ε after ``action_ticks`` actions; a workload change at ``bumped_at`` lifts it.
    A pretrained model starts from ``pretrained_epsilon_start``: it already knows
    something, and exploring as if it knew nothing throws that away. ``start`` and
    ``bump_ticks``: a mode's own ``epsilon_start`` and ``workload_ticks`` (per node)."""
    start = cfg.pretrained_epsilon_start if pretrained else \
        (cfg.epsilon_start if start is None else start)
    workload_ticks = cfg.workload_ticks if bump_ticks is None else bump_ticks
    frac = min(1.0, action_ticks / cfg.exploration_ticks)
    eps = start + frac * (cfg.epsilon_final - start)
    if bumped_at is not None and action_ticks >= bumped_at:
        since = action_ticks - bumped_at
        frac = min(1.0, since / workload_ticks) if workload_ticks else 1.0
        bump = cfg.workload_epsilon + frac * (cfg.epsilon_final - cfg.workload_epsilon)
        eps = max(eps, bump)
    return eps


class DQN:
    """The flat mode's deep Q-learner, in the order of the algorithm; torch and the
    networks (:class:`drl_engine.qnet.DQNLearner`) come the first time one is needed,
    built from the seed (``torch.manual_seed(seed)`` then: the weights an eager build
    would have had; nothing else draws from torch's generator)."""

    def __init__(self, obs_dim: int, n_actions: int, cfg: DQNConfig,
                 device="cpu", seed: int = 0):
        self.cfg, self.obs_dim, self.n_actions = cfg, obs_dim, n_actions
        self._build_args = (obs_dim, n_actions, cfg, device, seed)
        self.learner = None

    @property
    def built(self) -> bool:
        return self.learner is not None

    def build(self):
        """The learner (built now if it was not)."""
        if self.learner is None:
            from drl_engine.qnet import DQNLearner
            self.learner = DQNLearner(*self._build_args)
        return self.learner

    # the networks: Q(s, ·; θ), its target Q⁻(s, ·; θ⁻), RMSProp on θ
    @property
    def q(self):
        return self.build().q

    @property
    def target(self):
        return self.build().target

    @property
    def optimizer(self):
        return self.build().optimizer

    def q_values(self, obs):
        """Q(s, ·) of each observation (numpy): the greedy action is its argmax."""
        return self.build().q_values(obs)

    def td_target(self, rewards, discounts, next_obs):
        """y = r + d · Q⁻(s', a*), a* = argmax Q⁻(s') (Double DQN: argmax Q(s'))."""
        return self.build().td_target(rewards, discounts, next_obs)

    def train_step(self, obs, actions, rewards, discounts, next_obs, demo=None):
        """One minibatch (tensors) of Eq. 2.1, its gradient step on θ and the soft
        target update; the loss."""
        return self.build().train_step(obs, actions, rewards, discounts, next_obs, demo)

    def learn(self, batch):
        """:meth:`train_step` on a minibatch from the replay DB
        (``drl_engine.experience.Batch``: numpy, rewards scaled, n-step returns)."""
        return self.build().learn(batch)

    def soft_update(self) -> None:
        """θ⁻ ← (1 − α) · θ⁻ + α · θ (:meth:`train_step` does it after each step)."""
        self.build().soft_update()

    def mean_loss(self, losses) -> float | None:
        """The mean of a tick's losses, as a float."""
        return self.build().mean_loss(losses)

    def state_dict(self) -> dict:
        return self.build().state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.build().load_state_dict(state)


def device_name(requested: str = "auto") -> str:
    """:func:`pick_device` as a string, without importing torch for ``cpu``."""
    return "cpu" if requested == "cpu" else str(pick_device(requested))


def pick_device(requested: str = "auto"):
    """``auto``: CUDA when present, else CPU. ``cuda`` without a GPU is an error.
    Returns a ``torch.device``."""
    import torch
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but no CUDA device is available")
    return torch.device(requested)
