"""The per-node data side: a ring of every node's PIs, one row per node and tick.

The engine over rows of knobs (``drl_engine.engine``, per-node mode) keeps the last ticks
of every node in :class:`NodeReplay` (``replay_mb`` of memory) and samples
:class:`NodeBatch` minibatches of ticks × nodes from it; the flat mode's data side is
:class:`~drl_engine.experience.Experience`. Each node's action at t is read back from its
knob PIs (the replay DB's action table holds one row per tick for the whole system).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import numpy as np

from capes.common.params import ParameterSpec
from drl_engine import reward_scale
from drl_engine.config import RewardConfig
from drl_engine.experience import n_step_returns
from drl_engine.rewards import OBJECTIVES, REWARD_TYPES, pi_columns

log = logging.getLogger("capes.engine")


def finite_or_nan(x: np.ndarray) -> np.ndarray:
    """``x`` with ±inf as NaN (missing): an infinite PI is no measurement, and must
    reach no sum, scale or statistic (a copy only when there is one)."""
    inf = np.isinf(x)
    return np.where(inf, np.float32(np.nan), x).astype(x.dtype, copy=False) \
        if inf.any() else x


@functools.cache
def _one_hot(n: int) -> np.ndarray:
    """(n + 1, n) float32: row a the one-hot row of action a, row n (index -1) zeros."""
    out = np.eye(n + 1, n, dtype=np.float32)
    out.setflags(write=False)
    return out


def pick_subsets(rng: np.random.Generator, rows: int, n: int, m: int) -> np.ndarray:
    """(rows, m): per row a uniform random m-subset of range(n) (m < n), sorted. Each
    row draws m integers; a value drawn again is replaced by a fresh draw until the row
    has m distinct values. Every step treats all n values alike, so every m-subset is
    equally likely; at 16 of 1,000 a row has a repeat ~11 % of the time."""
    s = np.sort(rng.integers(0, n, (rows, m)), axis=1)
    while True:
        again = s[:, 1:] == s[:, :-1]
        if not again.any():
            return s
        r, c = np.nonzero(again)
        s[r, c + 1] = rng.integers(0, n, len(r))
        s.sort(axis=1)


@dataclass
class NodeBatch:
    """A minibatch of ticks × nodes, the per-node learner's input
    (``drl_engine.node_model.NodeDQN.learn``): numpy from :meth:`RowData.sample`,
    tensors on the device from ``drl_engine.device_replay``."""
    obs: np.ndarray          # (B, M, D)
    mask: np.ndarray         # (B, M) node present at t
    actions: np.ndarray      # (B, M)
    returns: np.ndarray      # (B,) n-step return of the scaled cluster reward
    discounts: np.ndarray    # (B,)
    next_obs: np.ndarray     # (B, M, D)
    next_mask: np.ndarray    # (B, M)
    valid: np.ndarray        # (B, M) transition counts
    abar: np.ndarray | None = None       # (B, M, A) the others' actions at t (mean field)
    next_abar: np.ndarray | None = None  # (B, M, A) ... at t+n

    def without_full_masks(self) -> "NodeBatch":
        """This batch with a mask of every node (the usual case) as None: the network
        pools all nodes then, with the same sums and quotients, in ~20 fewer ops a step
        (4 %), and its gradient by hand (drl_engine/node_backward.py) applies."""
        return dataclasses.replace(
            self, mask=None if self.mask.all() else self.mask,
            next_mask=None if self.next_mask.all() else self.next_mask)


class NodeReplay:
    """A ring of the last ``capacity`` ticks of every node's PIs (stored as
    log1p(max(x, 0))), with the cluster objective p_t over the nodes present at t, the
    reward r_t of t → t+1 and each node's action at t read back from its knob PIs.
    Observations are stacked at sample time, never stored."""

    def __init__(self, nodes: int, pi_names: list[str], params: list[ParameterSpec],
                 capacity: int, reward: RewardConfig):
        self.n, self.p = nodes, len(pi_names)
        self.reward = reward
        self.pi_names = list(pi_names)
        self.params = list(params)
        self.capacity = max(16, int(capacity))
        missing = [s.name for s in params if s.name not in pi_names]
        if missing:
            raise ValueError(f"the cluster engine reads each node's knob values from its "
                             f"PIs; {missing} are not among the PIs {pi_names}")
        self.knob_cols = np.array([pi_names.index(s.name) for s in params])
        # a knob of named values (a ladder: "4", "8", ... KiB) is its value's index
        self._named = np.array([bool(s.values) for s in params], bool)
        self._sizes = np.array([len(s.values) for s in params])[self._named]
        self._misread: set[str] = set()
        self.steps = np.array([s.step for s in params], np.float64)
        self.obj_cols = pi_columns(reward.pis, pi_names)
        self.objective = OBJECTIVES.build(reward.objective, reward.objective_options)
        self.reward_fn = REWARD_TYPES.build(reward.type, reward.options)
        self.lookback = int(getattr(self.reward_fn, "lookback", 1))
        C = self.capacity
        self.lp = np.full((C, nodes, self.p), np.nan, np.float32)
        self.present = np.zeros((C, nodes), bool)
        self.tick_of = np.full(C, -1, np.int64)
        self.pobj = np.full(C, np.nan)
        self.r = np.full(C, np.nan)
        self.actions = np.full((C, nodes), -1, np.int8)
        self.knobs = np.full((C, nodes, len(params)), np.nan, np.float32)
        self.n_actions = 2 * len(params) + 1
        self.ahist = np.zeros((C, self.n_actions), np.float32)   # nodes per action at t
        self.last: int | None = None       # newest tick
        self.first: int | None = None      # oldest tick ever ingested
        self.ingested = 0
        self.seen = np.zeros(nodes, np.int64)    # per node: ingested ticks it had a row in

    def _check_indices(self, v: np.ndarray) -> None:
        """Say once per knob when a knob of named values reads off its indices (its PI
        reports the value, 128 KiB, not its index, 5): every value the engine derives
        from it (best-known setting, walks, actions learnt) would be wrong."""
        with np.errstate(invalid="ignore"):
            bad = (np.isfinite(v) & ((v != np.rint(v)) | (v < 0) | (v >= self._sizes))).any(0)
        for j in np.flatnonzero(bad):
            spec = [s for s, named in zip(self.params, self._named) if named][j]
            if spec.name not in self._misread:
                self._misread.add(spec.name)
                log.error("knob %s's PI reads %s, not an index of its %d values %s: a "
                          "knob of named values must be reported as its value's index "
                          "(%r: 0, %r: 1, ...); this engine's view of it is wrong",
                          spec.name, v[np.isfinite(v[:, j]), j][:3].tolist(),
                          len(spec.values), spec.values[:4], spec.values[0],
                          spec.values[1] if len(spec.values) > 1 else "")

    @classmethod
    def capacity_for(cls, megabytes: int, nodes: int, pis: int, knobs: int) -> int:
        per_tick = nodes * (4 * pis + 1 + 1 + 4 * knobs) + 40
        return max(64, (megabytes << 20) // per_tick)

    @property
    def oldest(self) -> int | None:
        """Oldest tick still in the ring."""
        if self.last is None:
            return None
        return max(self.first, self.last - self.capacity + 1)

    def slot(self, tick):
        return np.asarray(tick) % self.capacity

    def ingest(self, tick: int, x: np.ndarray) -> bool:
        """Add tick ``tick``'s PIs, (N, P) raw values (NaN: missing). False when the
        tick is not newer than the newest one (ignored)."""
        tick = int(tick)
        if self.last is not None and tick <= self.last:
            return False
        x = finite_or_nan(np.asarray(x, np.float32))
        if x.shape != (self.n, self.p):
            raise ValueError(f"PIs of shape {x.shape}, expected {(self.n, self.p)}")
        if self.last is not None:
            for t in range(max(self.last + 1, tick - self.capacity + 1), tick):   # a gap
                self._clear(t)
        else:
            self.first = tick
        s = tick % self.capacity
        with np.errstate(invalid="ignore"):
            self.lp[s] = np.log1p(np.maximum(x, 0.0))
        self.lp[s][np.isnan(x)] = np.nan
        present = self.present[s] = ~np.isnan(x).all(axis=1)
        self.seen += present
        self.tick_of[s] = tick
        self.knobs[s] = x[:, self.knob_cols]
        if self._named.any():
            self._check_indices(x[:, self.knob_cols[self._named]])
        self.actions[s] = -1
        self.ahist[s] = 0.0
        self.r[s] = np.nan
        pis = x[present][None][:, :, self.obj_cols]
        self.pobj[s] = float(np.asarray(self.objective(pis), float)[0]) if present.any() \
            else np.nan
        prev = tick - 1
        if self.last == prev:
            ps = prev % self.capacity
            self.actions[ps] = self._read_actions(self.knobs[ps], self.knobs[s])
            a = self.actions[ps]
            self.ahist[ps] = np.bincount(a[a >= 0], minlength=self.n_actions)
            lo = max(self.oldest, tick - self.lookback - 1)
            r = np.asarray(self.reward_fn(self.comparable(np.arange(lo, tick + 1), tick)),
                           float)
            self.r[ps] = r[-2]
        self.last = tick
        self.ingested += 1
        return True

    def comparable(self, ticks: np.ndarray, tick: int) -> np.ndarray:
        """p at ``ticks``, NaN where the ring does not hold the tick or other nodes were
        present than at ``tick``: a total over other nodes (one joined, left or lost a
        row) is not comparable, and a reward across it would credit the nodes' actions
        with the change of membership."""
        s = ticks % self.capacity
        same = (self.present[s] == self.present[tick % self.capacity]).all(axis=1)
        return np.where((self.tick_of[s] == ticks) & same, self.pobj[s], np.nan)

    def resized(self, nodes: int, capacity: int) -> "NodeReplay":
        """This ring for ``nodes`` nodes (the new ones, appended, absent so far) and
        ``capacity`` ticks, with the newest ticks that fit."""
        new = NodeReplay(nodes, self.pi_names, self.params, capacity, self.reward)
        if self.last is None:
            return new
        ticks = np.arange(max(self.oldest, self.last - new.capacity + 1), self.last + 1)
        a, b, n = ticks % self.capacity, ticks % new.capacity, self.n
        for name in ("lp", "present", "actions", "knobs"):
            getattr(new, name)[b, :n] = getattr(self, name)[a]
        for name in ("tick_of", "pobj", "r", "ahist"):
            getattr(new, name)[b] = getattr(self, name)[a]
        new.first, new.last, new.ingested = int(ticks[0]), self.last, self.ingested
        new.seen[:n] = self.seen
        return new

    def _clear(self, t: int) -> None:
        s = t % self.capacity
        self.lp[s] = np.nan
        self.present[s] = False
        self.tick_of[s] = t
        self.pobj[s] = self.r[s] = np.nan
        self.actions[s] = -1
        self.ahist[s] = 0.0
        self.knobs[s] = np.nan

    def _read_actions(self, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        """Each node's action from its knob values at t and t+1: one knob moved (its
        sign gives the action), none moved (NULL), else unknown (-1)."""
        with np.errstate(invalid="ignore"):
            d = (after.astype(np.float64) - before) / self.steps
        moved = np.abs(d) > 1e-6
        known = np.isfinite(d).all(axis=1)
        count = moved.sum(axis=1)
        k = np.argmax(moved, axis=1)
        sign = np.take_along_axis(d, k[:, None], axis=1)[:, 0]
        out = np.where(count == 0, 0, 1 + 2 * k + (sign < 0))
        out = np.where(known & (count <= 1), out, -1)
        return out.astype(np.int8)

    def mean_field(self, tick, nodes=None) -> np.ndarray:
        """The other nodes' action distribution at ``tick``: (B, M, A) for ticks (B,) and
        nodes (B, M), or (N, A) for one tick and all nodes. Each node's own action is
        left out; a tick whose actions are unknown gives zeros."""
        one = np.ndim(tick) == 0
        ticks = np.atleast_1d(np.asarray(tick, np.int64))
        s = ticks % self.capacity
        if nodes is None:
            nodes = np.broadcast_to(np.arange(self.n), (len(ticks), self.n))
        hist = self.ahist[s][:, None, :]                          # (B, 1, A)
        own = self.actions[s[:, None], nodes]                     # (B, M), -1: unknown
        # one-hot rows of the node's own action: row -1 of the (A + 1) × A identity is
        # zeros (one gather, not a zeros + put_along_axis: the same values)
        others = hist - _one_hot(self.n_actions)[own]
        out = others / np.maximum(others.sum(axis=-1, keepdims=True), 1.0)
        return out[0] if one else out

    # -- observations -------------------------------------------------------------------
    def window(self, tick, stack: int, nodes=None) -> np.ndarray:
        """log1p PIs of ticks tick−S+1..tick: (B, M, S·P) for ticks (B,) and nodes
        (B, M) (None: all); (N, S·P) for one tick and nodes None."""
        one = np.ndim(tick) == 0
        ticks = np.atleast_1d(np.asarray(tick, np.int64))
        rows = (ticks[:, None] - np.arange(stack - 1, -1, -1)[None]) % self.capacity
        if nodes is None:
            x = self.lp[rows]                                   # (B, S, N, P)
        else:
            x = self._gather(rows, nodes)                       # (B, S, M, P)
        x = x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], stack * self.p)
        return x[0] if one else x

    def _gather(self, rows: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """``lp[rows[:, :, None], nodes[:, None, :]]`` (B, S, M, P), as one ``take`` of
        whole P-rows by a flat index (the same values; numpy's 2-axis fancy indexing
        was most of a minibatch's sampling time at 1,000 nodes)."""
        flat = (rows[:, :, None] * self.n + nodes[:, None, :]).reshape(-1)
        x = np.take(self.lp.reshape(-1, self.p), flat, axis=0)
        return x.reshape(rows.shape + (nodes.shape[1], self.p))

    def window_pair(self, ticks: np.ndarray, stack: int, ahead: int, nodes: np.ndarray,
                    features) -> tuple[np.ndarray, np.ndarray]:
        """``features(window(ticks))`` and ``features(window(ticks + ahead))``, (B, M,
        S·P) each, from one gather of the S + ``ahead`` ticks they span (they overlap by
        S − ahead ticks): the same numbers, ``features`` being element-wise (it gets
        the (B, S + ahead, M, P) gather)."""
        rows = (ticks[:, None] - np.arange(stack - 1, -ahead - 1, -1)[None]) % self.capacity
        z = features(self._gather(rows, nodes))                          # (B, S+a, M, P)
        B, M = z.shape[0], z.shape[2]
        now, later = (z[:, lo:lo + stack].transpose(0, 2, 1, 3).reshape(B, M, stack * self.p)
                      for lo in (0, ahead))
        return now, later


class RowData:
    """The per-node mode's data side: the ring of every node's PIs, the input statistics
    (z-scores of the log1p PIs, fixed after ``stats_ticks`` ticks), the reward scale
    (the objective's mean level: a reward unit is 1 % of it, the same at 8 and 1,000
    nodes) and minibatches of ticks × nodes."""

    def __init__(self, dqn, reward: RewardConfig, model, pi_names: list[str],
                 params: list[ParameterSpec], nodes: int):
        self.mcfg, self.reward_cfg = model, reward
        self.pi_names, self.params, self.nodes = list(pi_names), list(params), nodes
        self.stack, self.n_step = dqn.stack, dqn.n_step
        # the returns' shift (see sample): the model's return_shift, -1: settle_ticks
        self.shift = dqn.settle_ticks if model.return_shift < 0 else model.return_shift
        self.gamma = model.gamma or dqn.gamma
        cap = NodeReplay.capacity_for(model.replay_mb, nodes, len(pi_names), len(params))
        self.replay = NodeReplay(nodes, self.pi_names, self.params, cap, reward)
        self.mean: np.ndarray | None = None     # (P,) of the log1p PIs
        self.std: np.ndarray | None = None
        self.p_scale: float | None = None       # the reward's unit (reward_scale.level)
        self._tiled: tuple | None = None        # (mean, std, both tiled to S ticks)

    def reset(self) -> None:
        """A new session: a fresh ring (the statistics and scale stay)."""
        self.replay = NodeReplay(self.nodes, self.pi_names, self.params,
                                 self.replay.capacity, self.reward_cfg)

    def grow(self, nodes: int) -> None:
        """Nodes joined: the ring widened and resized to ``replay_mb``."""
        cap = NodeReplay.capacity_for(self.mcfg.replay_mb, nodes, len(self.pi_names),
                                      len(self.params))
        self.replay = self.replay.resized(nodes, cap)
        self.nodes = nodes

    def ingest(self, tick: int, pis: np.ndarray) -> bool:
        """One tick of every node's PIs; False when it is not newer (ignored)."""
        rep = self.replay
        if not rep.ingest(tick, pis):
            return False
        if self.mean is None and rep.ingested >= self.mcfg.stats_ticks:
            self._fit_stats()
        if self.p_scale is None and rep.ingested >= min(self.mcfg.stats_ticks,
                                                        max(self.mcfg.learn_start, 8)):
            self._fit_scale()
        return True

    def _fit_stats(self) -> None:
        rep = self.replay
        filled = rep.tick_of >= 0
        with np.errstate(all="ignore"):
            lp = rep.lp[filled].reshape(-1, rep.p)
            mean = np.nanmean(lp, axis=0)
            std = np.nanstd(lp, axis=0)
        self.mean = np.nan_to_num(mean).astype(np.float32)
        self.std = np.maximum(np.nan_to_num(std), self.mcfg.std_floor).astype(np.float32)

    def _fit_scale(self) -> None:
        """The reward unit (``drl_engine.reward_scale.level``) from the ticks so far."""
        self.p_scale = reward_scale.level(self.replay.pobj[self.replay.tick_of >= 0])

    def features(self, x: np.ndarray) -> np.ndarray:
        """z-scores of log1p PI windows (..., S·P); NaN (missing) becomes 0, the mean."""
        if self.mean is None:
            return np.zeros(x.shape, np.float32)
        tiled = self._tiled
        if tiled is None or tiled[0] is not self.mean or tiled[1] is not self.std:
            tiled = self._tiled = (self.mean, self.std, np.tile(self.mean, self.stack),
                                   np.tile(self.std, self.stack))
        return self._z(x, tiled[2], tiled[3])

    def _tick_features(self, x: np.ndarray) -> np.ndarray:
        """:meth:`features` of PIs not yet stacked (..., P): the same per element."""
        return self._z(x, self.mean, self.std)

    @staticmethod
    def _z(x, mean, std) -> np.ndarray:
        z = (x - mean) / std
        # nan_to_num(z, nan=0.0), the same values: its ±inf checks cost ~40 % of this
        np.copyto(z, 0.0, where=np.isnan(z))
        if np.isinf(z).any():
            np.nan_to_num(z, copy=False)
        return z.astype(np.float32, copy=False)

    def sample(self, batch: int, rng: np.random.Generator,
               max_rounds: int = 20) -> NodeBatch | None:
        """B ticks drawn uniformly among those with a full transition (S ticks of
        history, n rewards, the node present at t and t+n, its action known), M nodes
        each (all when N ≤ ``loss_nodes``).

        The return of the action at t is r_{t+d} + … + γ^(n−1) r_{t+d+n−1} with
        d = ``return_shift`` (default ``settle_ticks``): the objective's changes from
        when the action's effect shows up (the delay the best-known setting and the
        change detector assume too),
        not r_t … r_{t+n−1}, which are mostly the effect of the d actions before it.
        Unshifted, a policy whose nodes all move together and alternate (+, −, +, …)
        sees each move credited with the opposite of its own effect (with d = 3 and
        n = 5 the return is the true gain of −a_t), learns to reverse every move and so
        keeps alternating: issue 11, seed 2 at 64 nodes sat at ~0.80 of the best static
        for the whole of phase 1, its policy pushing the window down (to ~22, best 50)
        against the trust region. The bootstrap stays Q(s_{t+n}), whose return starts
        at r_{t+n+d}: nothing is counted twice."""
        rep = self.replay
        span = self.sample_span()
        if span is None:
            return None
        lo, hi, recent = span
        n, d = self.n_step, self.shift
        picked: list[np.ndarray] = []
        got = 0
        for _ in range(max_rounds):
            t = rng.integers(lo, hi + 1, 2 * batch)
            if self.mcfg.recent_fraction > 0:
                newer = rng.random(2 * batch) < self.mcfg.recent_fraction
                t = np.where(newer, rng.integers(recent, hi + 1, 2 * batch), t)
            r = rep.r[(t[:, None] + d + np.arange(n)[None]) % rep.capacity]
            ok = np.isfinite(r).all(axis=1)
            t = t[ok]
            if len(t):
                picked.append(t)
                got += len(t)
            if got >= batch:
                break
        if got == 0:
            return None
        t = np.concatenate(picked)[:batch]
        B, N = len(t), self.nodes
        M = self.batch_nodes()
        if M == N:
            nodes = np.broadcast_to(np.arange(N), (B, N))
        elif self.mcfg.node_pick == "redraw":
            nodes = pick_subsets(rng, B, N, M)
        else:
            nodes = np.argpartition(rng.random((B, N)), M, axis=1)[:, :M]
        return self.batch_at(t, nodes)

    def sample_span(self) -> tuple[int, int, int] | None:
        """(lo, hi, recent): :meth:`sample` draws its ticks t from lo..hi (a share
        ``recent_fraction`` from recent..hi) and keeps those whose n rewards are known;
        None while it would not sample (no statistics or scale yet, fewer than
        ``learn_start`` candidate ticks)."""
        rep = self.replay
        if rep.last is None or self.mean is None or self.p_scale is None:
            return None
        S, n, d = self.stack, self.n_step, self.shift
        # the rewards of t + d … t + d + n − 1 must be known (r of tick u needs tick u + 1)
        lo, hi = rep.oldest + S - 1, rep.last - n - max(d, 1 if self.mcfg.mean_field else 0)
        if hi - lo + 1 < max(1, self.mcfg.learn_start):
            return None
        return lo, hi, max(lo, hi - self.mcfg.recent_ticks + 1)

    def batch_nodes(self) -> int:
        """M, the nodes per sampled tick: ``loss_nodes``, or all N when N ≤ it (or 0)."""
        N, most = self.nodes, self.mcfg.loss_nodes
        return N if not most or N <= most else most

    def batch_at(self, t: np.ndarray, nodes: np.ndarray) -> NodeBatch:
        """The minibatch of ticks ``t`` (B,) and nodes ``nodes`` (B, M), as :meth:`sample`
        returns it (drl_engine/device_replay.py computes the same on a torch device)."""
        rep = self.replay
        S, n, d = self.stack, self.n_step, self.shift
        B = len(t)
        s0, s1 = rep.slot(t), rep.slot(t + n)
        ret = n_step_returns(rep.r, t, n, self.gamma, shift=d, ring=True) / self.p_scale
        mask = rep.present[s0[:, None], nodes]
        next_mask = rep.present[s1[:, None], nodes]
        acts = rep.actions[s0[:, None], nodes].astype(np.int64)
        valid = mask & next_mask & (acts >= 0)
        obs, next_obs = rep.window_pair(t, S, n, nodes, self._tick_features)
        abar = next_abar = None
        if self.mcfg.mean_field:        # t and t + n in one call (row by row the same numbers)
            abar, next_abar = np.split(rep.mean_field(np.concatenate([t, t + n]),
                                                      np.concatenate([nodes, nodes])), 2)
        return NodeBatch(obs=obs, mask=mask,
                         actions=np.maximum(acts, 0), returns=ret.astype(np.float32),
                         discounts=np.full(B, self.gamma ** n, np.float32),
                         next_obs=next_obs,
                         next_mask=next_mask, valid=valid, abar=abar, next_abar=next_abar)


__all__ = ["NodeReplay", "NodeBatch", "RowData", "finite_or_nan", "pick_subsets"]
