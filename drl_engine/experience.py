"""Experience: transitions (s_t, a_t, r_t, s_{t+1}) drawn from the replay DB.

Wraps a :class:`~capes.common.replay_db.ReplayReader` and keeps, per session, what training
needs beside the raw PIs: the objective p_t, the reward r_t, how many entries of each
tick are missing, and the parameter values in effect. These are updated incrementally
after each refresh. Observations are stacked at sample time from the cached ticks
(never stored as copies), and minibatches are built by Algorithm 2 of the thesis:
draw ticks uniformly, keep those with enough data at t and t + 1, redraw the rest.

Observation at tick t: the PIs of all nodes over ticks t−S+1..t, flattened, followed
by the current value of every tuned parameter scaled to [0, 1] by its valid range.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capes.common import actions
from capes.common.replay_db import ReplayReader, SessionData
from drl_engine.config import RewardConfig
from drl_engine.normaliser import Normaliser
from drl_engine.rewards import OBJECTIVES, REWARD_TYPES, pi_columns
from drl_engine.tick_frontier import TickFrontier


def n_step_returns(r: np.ndarray, t: np.ndarray, n: int, gamma: float, shift: int = 0,
                   ring: bool = False) -> np.ndarray:
    """The n-step return of the actions at ticks ``t``, for every engine:
    r[t+d] + γ r[t+d+1] + … + γ^(n−1) r[t+d+n−1], with d = ``shift`` (r[u]: the reward of
    tick u → u+1). An action's effect may show up d ticks late (the game's window acts 3
    ticks late, a node's knobs take ``settle_ticks``): unshifted, its return is mostly
    the effect of the d actions before it. The bootstrap stays Q(s_{t+n}), whose own
    return starts at r[t+n+d], so nothing is counted twice. ``ring``: ``r`` is a ring
    buffer indexed modulo its length (the cluster engine's replay)."""
    idx = np.asarray(t)[:, None] + shift + np.arange(n)[None]
    if ring:
        idx %= len(r)
    return r[idx] @ gamma ** np.arange(n)


@dataclass
class Batch:
    """A minibatch of transitions, the flat learner's input (``drl_engine.dqn.DQN.learn``:
    numpy here, its step's fields as tensors on the device there)."""
    obs: np.ndarray        # (B, obs_dim) float32
    actions: np.ndarray    # (B,) int64
    rewards: np.ndarray    # (B,) float32: the n-step return r_t + γ r_{t+1} + … + γ^{n−1} r_{t+n−1}
    next_obs: np.ndarray   # (B, obs_dim) float32: s_{t+n}
    discounts: np.ndarray  # (B,) float32: γ^n, what the TD target multiplies max Q⁻(s_{t+n}) by
    sessions: np.ndarray | None = None   # (B,) session ids
    ticks: np.ndarray | None = None      # (B,) ticks t
    demo: np.ndarray | None = None   # (B,) demonstrated actions (−1: none), DQfD's


def _zero_nonfinite(a: np.ndarray) -> np.ndarray:
    """``np.nan_to_num(a, nan=0.0)`` in place (``a`` is the caller's own array); a
    finite array, the usual case, is returned as it is after one check, instead of
    nan_to_num's six passes and Python overhead (every tick's observation comes here)."""
    return a if np.isfinite(a).all() else np.nan_to_num(a, copy=False, nan=0.0)


_NOT_BUILT = np.empty(0, np.float32)       # latest(build=False)'s observation
_NOT_BUILT.flags.writeable = False


class _Derived:
    """Per-session series derived from the cache, extended as the cache grows."""

    def __init__(self):
        self.n = 0                                  # ticks derived so far
        self.p = np.zeros(0)                        # objective
        self.r = np.zeros(0)                        # reward of transition t -> t+1
        self.missing_cum = np.zeros(1, np.int64)    # cumulative missing entries
        self.values = np.zeros((0, 0), np.float32)  # parameter values in effect ...
        self.values_buf: np.ndarray | None = None   # ... a view of this, grown by doubling


class Experience:
    def __init__(self, reader: ReplayReader, reward: RewardConfig, stack: int,
                 missing_tolerance: float = 0.2, normalise: bool = False,
                 n_step: int = 1, gamma: float = 0.99, return_shift: int = 0,
                 scale_rewards: bool = False):
        self.reader = reader
        self.scale_rewards = scale_rewards      # minibatch rewards in reward_scale's unit
        self.n_step = n_step
        self.shift = return_shift       # the returns start this many ticks after t
        self.gamma = gamma
        self.reward = reward
        self.stack = stack
        self.tolerance = missing_tolerance
        self.normalise = normalise
        self.normaliser = Normaliser()
        self.derived: dict[int, _Derived] = {}
        self.objective = OBJECTIVES.build(reward.objective, reward.objective_options)
        self.reward_fn = REWARD_TYPES.build(reward.type, reward.options)
        self._cols: list[int] | None = None
        # per session: its read frontier and the index up to which every node still
        # sending has a row (drl_engine/tick_frontier.py): the newest observation is
        # taken there, not at a tick only a node whose clock runs ahead has reached
        self._frontiers: dict[int, tuple[TickFrontier, int]] = {}
        self.update()

    # -- shape ------------------------------------------------------------------------
    @property
    def layout(self):
        return self.reader.layout

    @property
    def ready(self) -> bool:
        return self.layout is not None

    @property
    def obs_dim(self) -> int:
        lay = self.layout
        return self.stack * len(lay.node_names) * len(lay.pi_names) + len(lay.param_names)

    @property
    def n_actions(self) -> int:
        """The Q-network's outputs: the thesis' 2P + 1 one-step actions."""
        return actions.count(len(self.layout.param_names))

    def param_specs(self):
        """Specs of the layout's parameters, taken from the newest session that has them."""
        for data in reversed(list(self.reader.sessions.values())):
            if data.info.param_names == list(self.layout.param_names):
                return data.info.params
        raise ValueError("no session carries the layout's parameters")

    # -- refresh ----------------------------------------------------------------------
    def update(self) -> int:
        """Refresh the reader and extend every session's derived series."""
        n = self.reader.refresh()
        if not self.ready:
            return n
        if self._cols is None:
            self._cols = pi_columns(self.reward.pis, self.layout.pi_names)
            specs = self.param_specs()
            self._param_lo = np.array([s.min for s in specs], np.float32)
            self._param_span = np.array([max(s.max - s.min, 1e-12) for s in specs],
                                        np.float32)
        for sid, data in self.reader.sessions.items():
            d = self.derived.setdefault(sid, _Derived())
            start = min(d.n, data.dirty_from)
            if data.length > start or data.length != d.n:
                self._derive(data, d, start)
            data.dirty_from = data.length
            if data.first_tick is not None:
                f, end = self._frontiers.get(sid) or (TickFrontier(), 0)
                self._frontiers[sid] = f, f.end(data.pis, data.first_tick, data.length,
                                                min(end, data.length))
        if self.normalise:
            sessions = self.reader.sessions
            self.normaliser.maybe_update(
                [sessions[sid].pis[:d.n] for sid, d in self.derived.items()],
                [d.p[:d.n] for d in self.derived.values()])
        return n

    @property
    def objective_std(self) -> float:
        """Spread of the objective, the reward's unit (``drl_engine.reward_scale.spread``;
        1 before statistics exist)."""
        return self.normaliser.objective_std

    @property
    def reward_scale(self) -> float:
        """What a minibatch's rewards are multiplied by: 1 / the reward's unit with
        ``engine.scale_rewards``, else 1 (``drl_engine.reward_scale``: both modes')."""
        return 1.0 / self.objective_std if self.scale_rewards else 1.0

    def _derive(self, data: SessionData, d: _Derived, start: int) -> None:
        L = data.length
        pis = data.pis[:L]
        for name in ("p", "r"):
            arr = getattr(d, name)
            if len(arr) < len(data.pis):
                grown = np.full(len(data.pis), np.nan)
                grown[:len(arr)] = arr
                setattr(d, name, grown)
        d.p[start:L] = self.objective(pis[start:L][:, :, self._cols])
        # rewards that can change: from the first changed tick minus one (r_t uses p_{t+1})
        r0 = max(0, start - 1)
        lo = max(0, r0 - self.reward_fn.lookback)
        r = self.reward_fn(d.p[lo:L])
        d.r[r0:L] = r[r0 - lo:]
        missing = np.isnan(pis[start:L]).reshape(L - start, -1).sum(axis=1)
        cum = np.empty(L + 1, np.int64)
        cum[:start + 1] = d.missing_cum[:start + 1]
        cum[start + 1:] = cum[start] + np.cumsum(missing)
        d.missing_cum = cum
        d.values = self._values_in_effect(data, d, start)
        d.n = L

    @staticmethod
    def _values_in_effect(data: SessionData, d: _Derived, start: int) -> np.ndarray:
        """``data.values_in_effect()``, extended in place: the values up to tick
        ``start`` have not changed (an action at tick i moves the values from i + 1 on),
        so only the ticks after it are read each refresh, not the whole session."""
        L, buf = data.length, d.values_buf
        if buf is None or start == 0 or start > d.n or buf.shape[1] != data.after.shape[1]:
            buf = d.values_buf = np.empty((max(1024, 2 * L),) + data.after.shape[1:],
                                          np.float32)
            buf[:L] = data.values_in_effect()
            return buf[:L]
        if L > len(buf):
            grown = np.empty((2 * L,) + buf.shape[1:], np.float32)
            grown[:start] = buf[:start]
            buf = d.values_buf = grown
        if L - start <= 4:      # every tick's refresh: a loop costs less than the vector
            for i in range(start, L):   # path's dozen numpy calls (same values, copied)
                after = data.after[i - 1]
                buf[i] = buf[i - 1] if np.isnan(after).all() else after
        else:
            buf[start:L] = data.values_in_effect(start, before=buf[start - 1])
        return buf[:L]

    # -- observations -------------------------------------------------------------------
    def observations(self, sid: int, ticks: np.ndarray) -> np.ndarray:
        """Stacked observations at session indices ``ticks`` (each >= stack − 1)."""
        data = self.reader.sessions[sid]
        S = self.stack
        idx = ticks[:, None] + np.arange(-S + 1, 1)
        x = data.pis[idx]                                   # (B, S, N, P), a copy
        if self.normalise:
            x = self.normaliser(x)
        x = _zero_nonfinite(x.reshape(len(ticks), -1))
        vals = self.derived[sid].values[ticks]
        v = _zero_nonfinite((vals - self._param_lo) / self._param_span)
        return np.concatenate([x, v], axis=1).astype(np.float32, copy=False)

    def latest(self, sid: int, build: bool = True) -> tuple[int, np.ndarray] | None:
        """(tick, observation) for the newest tick of session ``sid`` with a full stack.
        ``build`` false: the observation is an empty array (the caller reads only that
        there is one)."""
        data = self.reader.sessions.get(sid)
        end = self._frontiers.get(sid, (None, 0))[1]
        if data is None or end < self.stack:
            return None
        i = end - 1
        return data.first_tick + i, (self.observations(sid, np.array([i]))[0] if build
                                     else _NOT_BUILT)

    # -- Algorithm 2 --------------------------------------------------------------------
    def _valid(self, data: SessionData, d: _Derived, i: np.ndarray) -> np.ndarray:
        """Algorithm 2's test: an action at t, a reward, and at most the tolerated share
        of missing entries in s_t and in s_{t+n}."""
        S, n = self.stack, self.n_step
        limit = self.tolerance * S * data.pis.shape[1] * data.pis.shape[2]
        cum = d.missing_cum
        miss_t = cum[i + 1] - cum[i + 1 - S]
        miss_tn = cum[i + 1 + n] - cum[i + 1 + n - S]
        ok = (data.actions[i] >= 0) & (miss_t <= limit) & (miss_tn <= limit)
        for k in range(n):
            ok &= np.isfinite(d.r[i + self.shift + k])
        return ok

    def candidates(self) -> tuple[list[int], np.ndarray]:
        """Sessions and their number of candidate ticks t in [S−1, length−1−n−shift]
        (the last return's reward needs the tick after it)."""
        sids = list(self.derived)
        lost = self.stack + self.n_step + self.shift - 1
        counts = np.array([max(0, self.derived[s].n - lost) for s in sids], np.int64)
        return sids, counts

    def sample(self, n: int, rng: np.random.Generator, max_rounds: int = 50) -> Batch | None:
        """Algorithm 2: a minibatch of ``n`` transitions, or None while too few exist."""
        sids, counts = self.candidates()
        total = int(counts.sum())
        if total == 0:
            return None
        bounds = np.cumsum(counts)
        picked: list[tuple[int, np.ndarray]] = []
        need = n
        for _ in range(max_rounds):
            g = rng.integers(0, total, size=need)
            if len(sids) == 1:                # one session (the usual case): all of g
                which, ks = None, (0,)
            else:
                which = np.searchsorted(bounds, g, side="right")
                ks = np.unique(which)
            for k in ks:
                sid = sids[k]
                data, d = self.reader.sessions[sid], self.derived[sid]
                offset = bounds[k] - counts[k]
                i = (g if which is None else g[which == k]) - offset + self.stack - 1
                ok = i[self._valid(data, d, i)]
                if len(ok):
                    picked.append((sid, ok))
            need = n - sum(len(t) for _, t in picked)
            if need <= 0:
                break
        if need > 0:
            return None
        return self._assemble(picked, n)

    def _assemble(self, picked, n) -> Batch:
        obs, nxt, act, rew, ss, ts = [], [], [], [], [], []
        for sid, i in picked:
            data, d = self.reader.sessions[sid], self.derived[sid]
            both = self.observations(sid, np.concatenate([i, i + self.n_step]))  # s_t, s_t+n
            obs.append(both[:len(i)])
            nxt.append(both[len(i):])
            # a move of several steps (a probe's walk) is learned as its direction
            act.append(actions.direction(data.actions[i].astype(np.int64),
                                         len(self.layout.param_names)))
            rew.append(n_step_returns(d.r, i, self.n_step, self.gamma, self.shift))
            ss.append(np.full(len(i), sid))
            ts.append(i + data.first_tick)
        cat = lambda xs: np.concatenate(xs)[:n]  # noqa: E731
        discounts = np.full(n, self.gamma ** self.n_step, np.float32)
        return Batch(cat(obs), cat(act), cat(rew).astype(np.float32) * self.reward_scale,
                     cat(nxt), discounts, cat(ss), cat(ts))

