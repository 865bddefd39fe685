"""Demonstrations for the Q-network (``engine.demo_margin``, issue 25 round 4): the
per-workload memory tells the network where each workload's best setting is.

Why: trained online on the diff reward alone, the network's greedy move on a workload
it has not seen pointed 6–16 steps past the optimum (``docs/journal.md``, recall round 3), so
its walk at a new workload was no better than "the nearest known workload's best
setting". The contexts (``drl_engine/context.py``) know, for every tick of the
session, which workload ran and that workload's best-known setting. Each replayed
transition gets the move a tuner who knew it would make (the *demonstration*: one step
of the knob farthest from that setting, relative to its range; NULL at it), and the
network is trained with DQfD's large-margin loss (Hester et al., 2018, Eq. 4) added to
its TD loss:

    J_E(Q) = max_a [Q(s, a) + l(a_E, a)] − Q(s, a_E),   l = margin for a ≠ a_E, else 0

so its greedy action imitates "go to the best setting of the workload whose signature
this is", a map from signature to setting that a smooth network can interpolate to a
workload between the known ones, which a table of contexts cannot.

Only transitions whose tick lies in a context of the current session are labelled
(the first context's ticks before its first confirmation are not); the stationary game
builds no context, so there the loss never acts and its trace is unchanged.
"""
from __future__ import annotations

import numpy as np

from capes.common import actions
from capes.common.step_grid import walk

NONE = -1      # no demonstration for this transition


def demo_actions(current: np.ndarray, best: np.ndarray, n_steps: np.ndarray,
                 frozen: np.ndarray) -> np.ndarray:
    """The demonstrated one-step action per row: the knob farthest from ``best``
    (grid indices, (B, K); relative to its range) one step towards it; NULL (0) at it.
    Frozen knobs never move."""
    k, steps = walk(current, best, n_steps, 1, ~np.asarray(frozen, bool))   # the one walk
    return actions.encode_rows(k, steps, np.shape(current)[1]).astype(np.int64)


def labels(contexts, guide, values: np.ndarray, sessions: np.ndarray, index: np.ndarray,
           session: int | None) -> np.ndarray:
    """Demonstrated actions for a minibatch (``NONE`` where there is none): rows of
    ``session`` (the guide's) whose session index lies in a context with a best-known
    setting. ``values``: each row's parameter values; ``index``: its session index."""
    out = np.full(len(index), NONE, np.int64)
    bounds, ctx = contexts.session_contexts()
    if session is None or not len(bounds):
        return out
    which = np.searchsorted(bounds, index, side="right") - 1
    ok = (sessions == session) & (which >= 0)
    if not ok.any():
        return out
    best = {}
    for k in set(ctx[which[ok]].tolist()):
        b = contexts.best_of(k, guide)
        if b is not None:
            best[k] = b
    rows = np.flatnonzero(ok)
    rows = rows[np.isin(ctx[which[rows]], list(best))]
    if not len(rows):
        return out
    target = np.stack([best[k] for k in ctx[which[rows]].tolist()])
    cur = guide.grid(values[rows])
    out[rows] = demo_actions(cur, target, guide.n_steps, guide.frozen)
    return out


def margin_loss(q_all, demo, margin: float):
    """DQfD's J_E over the rows with a demonstration (``demo`` ≥ 0): the mean of
    max_a [Q(s, a) + margin · (a ≠ a_E)] − Q(s, a_E); 0 when no row has one."""
    import torch
    have = demo >= 0
    if q_all.is_cuda:              # no host sync, no data-dependent shape: graph-capturable
        a = demo.clamp_min(0).unsqueeze(1)
        l = torch.full_like(q_all, margin).scatter_(1, a, 0.0)
        per = (q_all + l).max(dim=1).values - q_all.gather(1, a).squeeze(1)
        w = have.to(per.dtype)
        return (per * w).sum() / w.sum().clamp_min(1.0)
    if not bool(have.any()):
        return q_all.new_zeros(())
    q, a = q_all[have], demo[have]
    l = torch.full_like(q, margin)
    l.scatter_(1, a.unsqueeze(1), 0.0)
    return ((q + l).max(dim=1).values - q.gather(1, a.unsqueeze(1)).squeeze(1)).mean()
