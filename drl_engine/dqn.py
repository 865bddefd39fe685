"""Deep Q-learning as in thesis §5.1.4–5.1.7, in one class (after CleanRL's dqn.py).

* Q-network: an MLP with ``hidden_layers`` tanh layers as wide as the input and one
  linear output per action (2 × parameters + 1, the NULL action included; the
  ``default`` preset's probe walks also move two steps a tick, ``engine.action_steps``,
  and such a move is learned as its one-step direction).
* Loss (Eq. 2.1): mean squared TD error  (r + γ · max_a' Q⁻(s', a') − Q(s, a))²,
  against a target network Q⁻ updated softly after every minibatch:
  θ⁻ ← (1 − α) · θ⁻ + α · θ.
* RMSProp (learning rate 0.001, decay 0.9); minibatch 32; γ = 0.99.
* ε-greedy (``drl_engine.exploration``): ε falls linearly from 1.0 to 0.05 over the
  exploration period and is bumped to 0.2 when a new workload starts.

Tuning never ends, so no transition is terminal. Presets: ``paper`` is exactly the
above; ``default`` adds Double DQN, the Huber loss, input normalisation, reward
scaling, gradient clipping, 5-step returns, the guide, two-step probe walks and a 3×
minibatch every 3rd tick (``train_every``), justified by the converge test (README).
The hyperparameters and presets live in the torch-free ``drl_engine.config``; the
n-step return and its discount γⁿ come with each minibatch
(``drl_engine.experience.Batch``).

This module imports torch (~2 s): the flat engine (``drl_engine.flat_engine``) imports
it the first time the network is needed, which for the ``default`` preset is after its
first probes. The machinery every learner shares (the optimiser step, CUDA graphs, the
checkpoint layout) is :class:`drl_engine.qnet.TargetNetworkLearner`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.nn import functional as F

from drl_engine.config import PRESETS, DQNConfig, with_preset  # noqa: F401  (re-exported)
from drl_engine.demonstrations import margin_loss
from drl_engine.device import device_name, pick_device  # noqa: F401  (re-exported)
from drl_engine.exploration import epsilon  # noqa: F401  (re-exported)
from drl_engine.experience import Batch
from drl_engine.qnet import QNetwork, TargetNetworkLearner, linear_grads

_TANH_BACKWARD = torch.ops.aten.tanh_backward.default


class DQN(TargetNetworkLearner):
    """The online network Q(s, ·; θ), its target Q⁻(s, ·; θ⁻), RMSProp on θ, and one
    training step on a minibatch (:class:`~drl_engine.experience.Batch`)."""

    fields = ("obs", "actions", "rewards", "discounts", "next_obs", "demo")

    def __init__(self, obs_dim: int, n_actions: int, cfg: DQNConfig,
                 device: str | torch.device = "cpu", seed: int = 0):
        self.cfg = cfg
        self.device = torch.device(device)
        self.obs_dim, self.n_actions = obs_dim, n_actions
        self._build_networks(lambda: QNetwork(obs_dim, n_actions, cfg.hidden_layers,
                                              cfg.hidden_width, cfg.numpy_tanh), seed)
        # the functional losses, not their nn.Module wrappers (same arithmetic)
        self.loss_fn = F.smooth_l1_loss if cfg.loss == "huber" else F.mse_loss
        # ... and for :meth:`_cpu_step` the kernels they call (a mean: reduction 1),
        # forward and backward, each with its extra arguments (Huber: beta = 1)
        self._loss_kernels = (
            (torch._C._nn.smooth_l1_loss, torch.ops.aten.smooth_l1_loss_backward.default,
             (1, 1.0)) if cfg.loss == "huber" else
            (torch._C._nn.mse_loss, torch.ops.aten.mse_loss_backward.default, (1,)))
        # on CPU the step's gradients by hand (:meth:`_cpu_step`), not by autograd
        self._by_hand = self.device.type == "cpu"

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        """Q(s, ·) of each observation: the greedy action is its argmax."""
        with torch.no_grad():
            x = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
            return self.q.forward(x).cpu().numpy()

    def td_target(self, rewards: torch.Tensor, discounts: torch.Tensor,
                  next_obs: torch.Tensor) -> torch.Tensor:
        """y = r + d · Q⁻(s', a*), a* = argmax Q⁻(s') (or argmax Q(s') with Double DQN).
        One-step: d = γ; with n-step returns r is the discounted sum of n rewards, s' is
        s_{t+n} and d = γⁿ."""
        with torch.no_grad():
            # ``forward``, not ``__call__``: no hooks here, the same ops without their cost
            next_q = self.target.forward(next_obs)
            if self.cfg.double_dqn:
                best = self.q.forward(next_obs).argmax(dim=1, keepdim=True)
                next_v = next_q.gather(1, best).squeeze(1)
            else:
                next_v = next_q.max(dim=1).values
            return rewards + discounts * next_v

    def train_step(self, b: Batch) -> torch.Tensor:
        """One minibatch (its :attr:`fields` tensors) of Eq. 2.1, the optimiser step on
        θ and the soft target update; returns the loss. ``b.demo``: demonstrated actions
        (−1: none), DQfD's margin loss added (``cfg.demo_margin``,
        drl_engine/demonstrations.py)."""
        y = self.td_target(b.rewards, b.discounts, b.next_obs)
        if self._by_hand and y.shape == b.actions.shape and \
                (b.demo is None or not bool((b.demo >= 0).any())):
            return self._cpu_step(b.obs, b.actions, y)
        q_all = self.q.forward(b.obs)
        loss = self.loss_fn(q_all.gather(1, b.actions.unsqueeze(1)).squeeze(1), y)
        if b.demo is not None:
            loss = loss + margin_loss(q_all, b.demo, self.cfg.demo_margin)
        return self.descend(loss)      # backward, clip, RMSProp step, θ⁻ ← lerp(θ⁻, θ, α)

    @torch.no_grad()
    def _cpu_step(self, obs: torch.Tensor, actions: torch.Tensor,
                  y: torch.Tensor) -> torch.Tensor:
        """:meth:`train_step` without a demonstration, its gradients computed by hand.

        Why: at this network's size autograd's own work (recording the graph, its
        engine's bookkeeping) is a fifth of a step: by hand one takes 0.75-0.84x as long
        (default preset, 96 x 72 inputs, under load; docs/journal.md, speed-10). These
        are the kernels autograd's backward formulas call, with the same arguments
        (addmm: ``grad.t().mm(input)`` for the weight, ``grad.sum(0)`` for the bias,
        ``grad.mm(weight)`` for the input; tanh_backward; gather: scatter_add_ into
        zeros; the loss's own backward kernel at a gradient of one), so the gradients,
        and every step after them, are bit-identical to ``loss.backward()``'s
        (tests/test_qnet_step.py checks it)."""
        layers = self.q.affine
        x, inputs = self.q.forward_inputs(obs)
        index = actions.unsqueeze(1)
        pred = x.gather(1, index).squeeze(1)
        forward, backward, extra = self._loss_kernels
        loss = forward(pred, y, *extra)
        g = backward(torch.ones_like(loss), pred, y, *extra)
        g = x.new_zeros(x.shape).scatter_add_(1, index, g.to(x.dtype).unsqueeze(1))
        grads = [None] * (2 * len(layers))
        for i in range(len(layers) - 1, -1, -1):
            g_in, grads[2 * i], grads[2 * i + 1] = linear_grads(layers[i], inputs[i], g,
                                                                 i > 0)
            if i:
                g = _TANH_BACKWARD(g_in, inputs[i])
        self._update_with(grads)
        return loss

    def state_dict(self) -> dict:
        return {**self._networks_state(), "cfg": dataclasses.asdict(self.cfg),
                "obs_dim": self.obs_dim, "n_actions": self.n_actions}

    def load_state_dict(self, state: dict) -> None:
        self._load_networks(state, ("obs_dim", "n_actions"),
                            (self.obs_dim, self.n_actions), "inputs")


__all__ = ["DQN", "DQNConfig", "PRESETS", "device_name", "epsilon", "pick_device",
           "with_preset"]
