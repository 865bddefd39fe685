"""A Q-network whose size does not depend on the node count (issue 11, item 5).

The paper's network reads the PIs of *all* nodes over S ticks, flattened (Table 5.3:
1,760 inputs for 4 nodes), so its first layer grows with the cluster and a node joining
means a new model. Here every node is read by the same small networks instead:

    x_i      = the node's own PIs over its last S ticks (S × P values, log1p, z-scored)
    e_i      = φ(x_i)                                encoder, weights shared by all nodes
    c        = pool(e_1 … e_N)                       cluster summary: mean ⊕ std over nodes
    Q_i(·)   = ψ(e_i ⊕ c ⊕ ā_i)                      one head per node, shared weights:
                                                     2 × knobs + 1 Q-values (±step, NULL)

ā_i is the mean field (Yang et al., "Mean Field Multi-Agent Reinforcement Learning",
ICML 2018): the distribution of the *other* nodes' actions in the same tick (in training,
from the replay; when acting, the previous tick's, as MF-Q does). Every node of a tick
gets the same cluster reward, and when the nodes move together (one shared greedy
policy in similar states: they do) most of that reward is their joint move; with ā_i
among its inputs the network explains that part by the others' actions and learns its
own action's effect from what is left, instead of crediting the crowd's move to every
node's own action.

φ and ψ are MLPs (tanh, as the paper's network); ψ is a dueling head by default
(Q = V + A − mean A: the value of a node's state is shared by its actions, so the small
differences between them are learnt apart from the large common level). The weight count
is ``in_dim``-dependent only (S × P), never N-dependent: the same checkpoint runs on 8 or
1,000 nodes, and a node that joins or leaves changes nothing but the pool.

Why mean ⊕ std and not mean ⊕ max: a minibatch pools over a random subset of the nodes
(``loss_nodes``, 64 by default) so that a training step costs the same at 8 and 1,000
nodes; the subset's mean and standard deviation are consistent estimates of the whole
cluster's, the subset's max is not (it grows with the number of nodes pooled). For the
same reason a model trained on 8 nodes would see a shifted max on 1,000. ``pool="mean_max"``
is available for comparison.

Training (:class:`NodeDQN`): DQN on per-node transitions. A minibatch is B ticks × M
nodes; node i of tick t contributes (x_i(t), a_i(t), R_t, x_i(t+n)) with the n-step return
R_t of the cluster's reward (the same for every node of a tick, see
``drl_engine/cluster_engine.py`` for why), Double DQN, the Huber loss, gradient clipping
and the soft target update θ⁻ ← (1 − α)θ⁻ + αθ after every minibatch — the ``default``
preset's choices, read from :class:`~drl_engine.config.DQNConfig`. The summary c of the
next state is pooled over the same nodes at t + n.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from drl_engine import node_backward
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig
from drl_engine.node_replay import NodeBatch
from drl_engine.qnet import CompiledOrEager, TargetNetworkLearner


class _NumpyTanhFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.from_numpy(np.tanh(x.detach().numpy()))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, = ctx.saved_tensors
        return grad * (1 - y * y)


class NumpyTanh(nn.Module):
    """tanh computed by numpy on the CPU: torch's float32 tanh took ~2.6 ns an element on
    the benchmark machine, numpy's ~0.4 (the two agree within one ulp); torch's on
    other devices. Without a gradient to keep, in place on the layer's fresh output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return torch.tanh(x)
        if x.requires_grad:
            return _NumpyTanhFn.apply(x)
        a = x.numpy()
        np.tanh(a, out=a)
        return x


def _mlp(d_in: int, width: int, d_out: int, layers: int, last_tanh: bool,
         tanh: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    mods, d = [], d_in
    for _ in range(layers - 1):
        mods += [nn.Linear(d, width), tanh()]
        d = width
    mods.append(nn.Linear(d, d_out))
    if last_tanh:
        mods.append(tanh())
    return nn.Sequential(*mods)


def _layers(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in seq:
        x = layer.forward(x)
    return x


def pool_nodes(e: torch.Tensor, mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """Cluster summary of embeddings ``e`` (B, M, E) over the nodes where ``mask``
    (B, M) is true: mean ⊕ std (or mean ⊕ max), (B, 2E). A tick with no node gives 0."""
    if mask is None:
        mean = e.mean(dim=1)
        if how == "mean_max":
            return torch.cat([mean, e.max(dim=1).values], dim=-1)
        var = (e - mean.unsqueeze(1)).pow(2).mean(dim=1)
        return torch.cat([mean, (var + 1e-6).sqrt()], dim=-1)
    m = mask.unsqueeze(-1).to(e.dtype)
    count = m.sum(dim=1).clamp_min(1.0)
    mean = (e * m).sum(dim=1) / count
    if how == "mean_max":
        mx = e.masked_fill(~mask.unsqueeze(-1), -2.0).max(dim=1).values   # tanh > -2
        return torch.cat([mean, torch.where(count > 0, mx, torch.zeros_like(mx))], dim=-1)
    var = ((e - mean.unsqueeze(1)).pow(2) * m).sum(dim=1) / count
    return torch.cat([mean, (var + 1e-6).sqrt()], dim=-1)


class NodeQNetwork(nn.Module):
    """Shared per-node encoder φ, pooled summary, shared per-node head ψ.

    ``forward(x, mask)``: x (B, M, in_dim) — M nodes of B ticks; mask (B, M) bool, the
    nodes that exist (pooled and scored) or None for all. Returns Q (B, M, n_actions)."""

    def __init__(self, in_dim: int, n_actions: int, cfg: NodeModelConfig | None = None):
        super().__init__()
        cfg = cfg or NodeModelConfig()
        self.in_dim, self.n_actions, self.pool = in_dim, n_actions, cfg.pool
        self.dueling, self.summary_once = cfg.dueling, cfg.summary_once
        self.numpy_tanh = cfg.numpy_tanh
        tanh = NumpyTanh if cfg.numpy_tanh else nn.Tanh
        self.encoder = _mlp(in_dim, cfg.hidden, cfg.embed, cfg.encoder_layers, True, tanh)
        self.mean_field = cfg.mean_field
        extra = n_actions if cfg.mean_field else 0
        self.head = _mlp(3 * cfg.embed + extra, cfg.hidden,
                         n_actions + (1 if cfg.dueling else 0), cfg.head_layers, False, tanh)
        self._head_rest = list(self.head)[1:]     # after the first layer (summary_once)
        # what drl_engine/node_backward.py reads (its forward and gradient by hand)
        self.encoder_linears = [m for m in self.encoder if isinstance(m, nn.Linear)]
        self.head_linears = [m for m in self._head_rest if isinstance(m, nn.Linear)]
        self.by_hand = True           # False: NodeDQN's gradient always by autograd

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                abar: torch.Tensor | None = None) -> torch.Tensor:
        """``abar`` (B, M, n_actions): the other nodes' action distribution (mean field),
        needed when the model was built with ``mean_field``."""
        # each layer's own forward, not the Sequential's __call__: its hook handling
        # costs more than these small layers' arithmetic (the same ops, as QNetwork)
        e = _layers(self.encoder, x)                            # (B, M, E)
        c = pool_nodes(e, mask, self.pool)                      # (B, 2E)
        if self.summary_once:
            out = _layers(self._head_rest, self._first_head_layer(e, c, abar))
        else:
            parts = [e, c.unsqueeze(1).expand(-1, e.shape[1], -1)]
            if self.mean_field:
                parts.append(abar)
            out = _layers(self.head, torch.cat(parts, dim=-1))
        if self.dueling:
            v, a = out[..., :1], out[..., 1:]
            return v + a - a.mean(dim=-1, keepdim=True)
        return out

    def _first_head_layer(self, e: torch.Tensor, c: torch.Tensor,
                          abar: torch.Tensor | None) -> torch.Tensor:
        """The head's first layer on e ⊕ c ⊕ ā, its c columns applied once per tick (B
        rows, not B × M) and broadcast over the nodes: the same sum as on the concatenated
        row, in another order of float additions."""
        lin, d = self.head[0], e.shape[-1]
        w = lin.weight
        per_tick = F.linear(c, w[:, d:3 * d], lin.bias).unsqueeze(1)     # (B, 1, H)
        if self.mean_field:
            own = F.linear(torch.cat([e, abar], dim=-1),
                           torch.cat([w[:, :d], w[:, 3 * d:]], dim=1))
        else:
            own = F.linear(e, w[:, :d])
        return own + per_tick


def weight_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class NodeDQN(TargetNetworkLearner):
    """Online and target :class:`NodeQNetwork`, RMSProp, and the training step."""

    def __init__(self, in_dim: int, n_actions: int, dqn: DQNConfig,
                 model: NodeModelConfig | None = None, device: str | torch.device = "cpu",
                 seed: int = 0):
        self.cfg = dqn
        self.mcfg = model or NodeModelConfig()
        self.mcfg.validate()
        self.device = torch.device(device)
        self.in_dim, self.n_actions = in_dim, n_actions
        self._build_networks(lambda: NodeQNetwork(in_dim, n_actions, self.mcfg), seed)
        self.huber = dqn.loss == "huber"
        if self.compiles:                       # engine.compile_step
            self.loss = CompiledOrEager(self.loss, "the loss")   # forward and backward
            self._update_tensors = CompiledOrEager(self._update_tensors, "the update")
            logging.getLogger("capes.engine").info(
                "engine.compile_step: the training step compiles at its first calls "
                "(10-20 s on an H100); a new shape (the replay's span doubling, a node "
                "joining) compiles again")

    @property
    def compiles(self) -> bool:
        """Whether the step's parts go through torch.compile (``cfg.compile_step``: on a
        CUDA device, with the CUDA graph that captures their fused kernels; the flat
        learner's step is not compiled: its update alone cost ~9 s of an hour's wall
        time, for no gain measured)."""
        return self.device.type == "cuda" and self.cfg.cuda_graph and self.cfg.compile_step

    fields = ("obs", "mask", "actions", "returns", "discounts", "next_obs", "next_mask",
              "valid", "abar", "next_abar")

    def step_batch(self, b: NodeBatch) -> NodeBatch:
        return b.without_full_masks()

    @property
    def weights(self) -> int:
        return weight_count(self.q)

    @torch.no_grad()
    def q_values(self, x: np.ndarray, mask: np.ndarray | None = None,
                 abar: np.ndarray | None = None) -> np.ndarray:
        """Q-values (N, n_actions) of one tick's N nodes, x (N, in_dim); ``abar``
        (N, n_actions) the mean field (the others' last action distribution)."""
        xt = torch.as_tensor(x, dtype=torch.float32, device=self.device).unsqueeze(0)
        mt = None if mask is None or mask.all() else \
            torch.as_tensor(mask, device=self.device).unsqueeze(0)
        at = None if abar is None else \
            torch.as_tensor(abar, dtype=torch.float32, device=self.device).unsqueeze(0)
        return self.q.forward(xt, mt, at)[0].cpu().numpy()

    def train_step(self, b: NodeBatch) -> torch.Tensor:
        """One minibatch (a :class:`~drl_engine.node_replay.NodeBatch` of tensors):
        obs/next_obs (B, M, D); mask/next_mask (B, M) the nodes that exist at t / t+n
        (pooled; None: all); actions (B, M) int64; valid (B, M) the transitions that count
        (node present at t and t+n, action known); returns (B,) or (B, M) n-step returns;
        discounts (B,) γⁿ; abar/next_abar (B, M, A) the other nodes' action distributions
        at t and t+n (mean field). Returns the loss (0-d)."""
        # the gradient by hand (drl_engine/node_backward.py, bit-identical to autograd's)
        # where it covers the step; ``q.by_hand`` False: autograd (the tests compare)
        if not (self.q.by_hand and node_backward.supported(self.q, b)):
            def step():
                return self.descend(self.loss(b))
            # compiled: a backward that fails to compile (at its first call) runs eagerly
            return self.loss.guarded(step) if isinstance(self.loss, CompiledOrEager) \
                else step()
        y = self._td_target(b)
        loss, grads = node_backward.loss_and_grads(self.q, b, y, self.huber)
        with torch.no_grad():                   # descend's update, after its backward
            self._update_with(grads)
        return loss

    def loss(self, b: NodeBatch) -> torch.Tensor:
        """:meth:`train_step`'s loss on the batch ``b`` (tensors): the TD errors of the
        valid transitions, Huber or squared, their mean."""
        y = self._td_target(b)
        q = self.q.forward(b.obs, b.mask, b.abar).gather(
            -1, b.actions.unsqueeze(-1)).squeeze(-1)
        err = q - y
        if self.huber:
            a = err.abs()
            per = torch.where(a < 1.0, 0.5 * err * err, a - 0.5)
        else:
            per = err * err
        w = b.valid.to(per.dtype)
        return (per * w).sum() / w.sum().clamp_min(1.0)

    @torch.no_grad()
    def _td_target(self, b: NodeBatch) -> torch.Tensor:
        """y = R + γⁿ · Q⁻(s', a*) per node (B, M), a* by the online network (Double DQN)
        or the target's."""
        next_q_t = self.target.forward(b.next_obs, b.next_mask, b.next_abar)
        if self.cfg.double_dqn:
            best = self.q.forward(b.next_obs, b.next_mask, b.next_abar).argmax(
                dim=-1, keepdim=True)
        else:
            best = next_q_t.argmax(dim=-1, keepdim=True)
        next_v = next_q_t.gather(-1, best).squeeze(-1)              # (B, M)
        returns = b.returns
        if returns.dim() == 1:
            returns = returns.unsqueeze(1)
        return returns + b.discounts.unsqueeze(1) * next_v

    def state_dict(self) -> dict:
        return {**self._networks_state(), "model": dataclasses.asdict(self.mcfg),
                "in_dim": self.in_dim, "n_actions": self.n_actions}

    def load_state_dict(self, state: dict, optimizer: bool = True) -> None:
        self._load_networks(state, ("in_dim", "n_actions"), (self.in_dim, self.n_actions),
                            "per-node inputs", optimizer)


__all__ = ["NodeModelConfig", "NodeQNetwork", "NodeDQN", "pool_nodes", "weight_count"]
