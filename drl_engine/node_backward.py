"""The per-node network's training gradient written out by hand, without autograd.

Why: a training step of :class:`~drl_engine.node_model.NodeDQN` (32 ticks × 16 nodes) is
small, and recording autograd's graph of ~390 ops, then walking it, cost 15–18 % of the
step at 1,000 nodes (``learn`` 0.82–0.85× CPU without it; docs/journal.md, speed-11).
:func:`loss_and_grads` runs the forward once without a graph, keeping what the backward
reads, then the backward as the same torch ops that autograd's derivative formulas run
(``addmm``/``mm`` with the same operand layouts, the reductions over the same dimensions,
the gradient contributions summed in autograd's order), so the gradients, and the weights
after the update, are bit-identical to autograd's (``tests/test_cluster_engine.py``
checks it). It covers the model as the ``default`` preset builds it (numpy tanh, the
summary applied once, mean ⊕ std pooling, every node of the minibatch present at t) on
the CPU; :func:`supported` says when, and the learner falls back to autograd otherwise.
"""
from __future__ import annotations

import numpy as np
import torch

from drl_engine.qnet import linear_grads


def supported(net, b) -> bool:
    """Whether :func:`loss_and_grads` computes the step of minibatch ``b`` (a
    ``NodeBatch`` of tensors; else: autograd)."""
    x = b.obs
    return (b.mask is None and x.device.type == "cpu" and x.dtype == torch.float32
            and x.is_contiguous() and net.pool == "mean_std" and net.summary_once
            and net.numpy_tanh)


def _tanh(h: torch.Tensor) -> torch.Tensor:
    """numpy's tanh of a fresh tensor, as ``_NumpyTanhFn.forward`` computes it."""
    return torch.from_numpy(np.tanh(h.numpy()))


def _tanh_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return g * (1 - y * y)                  # _NumpyTanhFn.backward


def _forward(net, x: torch.Tensor, abar):
    """``net.forward(x, None, abar)``'s ops on (B, M, D) ``x``, without a graph, tanh out
    of place as in ``_NumpyTanhFn``. Returns Q (B, M, A) and what the backward reads."""
    B, M = x.shape[0], x.shape[1]
    rows, tanhs = [], []
    u = x.view(B * M, x.shape[-1])
    for lin in net.encoder_linears:             # F.linear on (B, M, K): addmm on the rows
        rows.append(u)
        u = _tanh(torch.addmm(lin.bias, u, lin.weight.t()))
        tanhs.append(u)
    e = u.view(B, M, -1)
    E = e.shape[-1]
    mean = e.mean(dim=1)                        # pool_nodes, mean ⊕ std
    d = e - mean.unsqueeze(1)
    var = d.pow(2).mean(dim=1)
    std = (var + 1e-6).sqrt()
    c = torch.cat([mean, std], dim=-1)                              # (B, 2E)
    first = net.head[0]                         # NodeQNetwork._first_head_layer
    w = first.weight
    w_c = w[:, E:3 * E]
    per_tick = torch.addmm(first.bias, c, w_c.t())                   # (B, H)
    if net.mean_field:
        own_in = torch.cat([e, abar], dim=-1)
        w_own = torch.cat([w[:, :E], w[:, 3 * E:]], dim=1)
    else:
        own_in, w_own = e, w[:, :E]
    own2d = own_in.view(B * M, -1)
    h = torch.mm(own2d, w_own.t()).view(B, M, -1) + per_tick.unsqueeze(1)
    head_rows = []                              # each later head layer's input (tanh)
    for lin in net.head_linears:
        u = _tanh(h.view(B * M, -1))
        head_rows.append(u)
        h = torch.addmm(lin.bias, u, lin.weight.t()).view(B, M, -1)
    if net.dueling:
        v, a = h[..., :1], h[..., 1:]
        q = v + a - a.mean(dim=-1, keepdim=True)
    else:
        q = h
    return q, (rows, tanhs, e, d, std, c, w_c, own_in, own2d, w_own, head_rows)


def loss_and_grads(net, b, y, huber: bool):
    """The loss of :meth:`NodeDQN.loss` (mask None) and the gradient of every parameter
    of ``net`` in ``net.parameters()`` order, for the minibatch ``b`` (a ``NodeBatch`` of
    tensors: obs (B, M, D), actions (B, M) int64, valid (B, M), abar (B, M, A) or None)
    and its TD targets ``y`` (B, M)."""
    x, actions, valid, abar = b.obs, b.actions, b.valid, b.abar
    B, M = x.shape[0], x.shape[1]
    enc, rest = net.encoder_linears, net.head_linears
    with torch.no_grad():
        q, kept = _forward(net, x, abar)
        rows, tanhs, e, d, std, c, w_c, own_in, own2d, w_own, head_rows = kept
        E = e.shape[-1]
        n_act = q.shape[-1]
        idx = actions.unsqueeze(-1)
        err = q.gather(-1, idx).squeeze(-1) - y
        if huber:
            absolute = err.abs()
            small = absolute < 1.0
            half = 0.5 * err
            per = torch.where(small, half * err, absolute - 0.5)
        else:
            per = err * err
        wv = valid.to(per.dtype)
        count = wv.sum().clamp_min(1.0)
        loss = (per * wv).sum() / count

        # -- backward: autograd's derivative formulas, in its order ---------------------
        g_per = (torch.ones((), dtype=per.dtype) / count).expand(B, M) * wv
        if huber:
            g_small = torch.where(small, g_per, 0.0)
            g_err = g_small * half + (g_small * err) * 0.5 + \
                torch.where(small, 0.0, g_per) * err.sgn()
        else:
            g_err = g_per * err
            g_err = g_err + g_err
        # gather's backward: scatter_add into zeros (so -0 becomes +0, as there)
        g_q = torch.zeros(B, M, n_act).scatter_add_(-1, idx, g_err.unsqueeze(-1))
        if net.dueling:
            g_a = g_q + (-g_q).sum(-1, keepdim=True).expand(B, M, n_act) / n_act
            # slices' backward: each into zeros, summed (+ 0.0: the same signed zeros)
            g_out = torch.cat([g_q.sum(-1, keepdim=True), g_a], dim=-1) + 0.0
        else:
            g_out = g_q
        head_grads = []
        g = g_out.reshape(B * M, -1)
        for lin, u2d in zip(reversed(rest), reversed(head_rows)):
            gu, gw, gb = linear_grads(lin, u2d, g, True)
            head_grads.append((gw, gb))
            g = _tanh_grad(gu, u2d)             # the layer's input is the tanh's output
        head_grads.reverse()
        g_h = g.view(B, M, -1)                                        # (B, M, H)
        g_pt = g_h.sum(1, keepdim=True).squeeze(1)                    # (B, H)
        g2d = g_h.reshape(B * M, -1)
        # mm's weight gradient as autograd takes it: a contiguous weight (the mean
        # field's concatenation) is column-major transposed, a slice of w is not
        g_own_w = g2d.t().mm(own2d) if net.mean_field else own2d.t().mm(g2d).t()
        g_own_in = g2d.mm(w_own).view(B, M, -1)
        g_c = g_pt.mm(w_c)                                            # (B, 2E)
        g_wc = c.t().mm(g_pt).t()
        g_w1 = torch.cat([g_own_w[:, :E], g_wc, g_own_w[:, E:]], dim=1) + 0.0
        g_b1 = g_pt.sum(0)
        # the pool: mean ⊕ sqrt(var + 1e-6)
        g_var = g_c[:, E:] / (2 * std)
        g_d = (g_var.unsqueeze(1).expand(B, M, E) / M) * (2.0 * d)
        g_mean = g_c[:, :E] + (-g_d).sum(1, keepdim=True).squeeze(1)
        g_e = g_own_in[..., :E] + g_d + g_mean.unsqueeze(1).expand(B, M, E) / M
        enc_grads = []
        g = g_e.reshape(B * M, E)
        for i in range(len(enc) - 1, -1, -1):
            g = _tanh_grad(g, tanhs[i])
            gu, gw, gb = linear_grads(enc[i], rows[i], g, i > 0)
            enc_grads.append((gw, gb))
            g = gu
        enc_grads.reverse()
    grads = [t for pair in enc_grads for t in pair] + [g_w1, g_b1] + \
        [t for pair in head_grads for t in pair]
    return loss, grads


__all__ = ["loss_and_grads", "supported"]
