"""The guide: where to explore and what not to lose (the ``default`` preset).

Uniform ε-greedy over ±step actions is a random walk: it needs ~d² ticks to travel d
steps, drops production wherever it wanders, and a greedy policy on a noisy Q-network
dithers around the optimum. The guide keeps the RL action space (one move of one
parameter or NULL per tick, so every transition is a normal Algorithm-2 transition in the
replay DB) and changes *which* actions are taken:

* **Best-known setting.** Every tick's objective p_t is credited to the setting that
  produced it: each knob's value ``settle_ticks`` earlier (the system's reaction delay),
  or, once the guide has learned a knob's own delay (``learn_lags``,
  :meth:`Guide._learn_lags`), that many ticks earlier — a rate limit acts at once, a
  window after the queue drains, and crediting a rate limit's cliff to the setting it
  left sent probes further down the cliff. Per setting (values
  on the step grid) the guide keeps the sum and count; a setting's score is the
  kernel-smoothed mean over its neighbours (Gaussian, ``kernel_steps`` steps wide) minus
  ``lcb_kappa`` standard errors — a lower confidence bound, so one lucky noisy sample
  does not become "the best"; with ``lcb_pooled_noise`` each setting's variance is at
  least the one pooled within settings, so a setting whose few samples agree is not
  thereby certain (the estimator, :class:`~drl_engine.best_known.LowerBound`, and the
  state both modes share live in ``drl_engine.best_known``).
* **Probes.** An exploration decision starts a probe: a target setting, walked to by
  moves of up to ``action_steps`` steps per tick (temporally extended exploration, after
  Dabney et al.'s εz-greedy; two steps halve the walk, which was most of the early
  loss), then held for ``probe_dwell`` ticks so its delayed effect is measured. A global probe
  (probability ``global_share``, 1 → 0 over ``global_fraction`` of the exploration
  period) may go anywhere in the range, a local one stays around the best-known setting
  (``probe_local_steps`` steps, inside the guard band).
* **Model-proposed targets** (``probe_model``). A Gaussian process over the credited
  per-setting means (:meth:`Guide.model_target`) picks each target: the highest upper
  confidence bound (mean + ``model_beta`` sd) less ``model_travel`` per tick of walking
  there; global probes score the whole grid (and are re-aimed every settle+1 moves of
  their walk, as the walk's own ticks come in), local ones a handful of candidates around
  the best. Without it targets are uniform (global) or Gaussian jitter (local). This is
  what took the default game's median first win from ~250 to ~120 simulated s.
* **Trust region.** A greedy action that would take a parameter more than
  ``greedy_guard_steps`` steps away from the best-known setting is replaced by one step
  back towards it; inside the region the Q-network decides. Local probes may go
  further (``guard_steps``): a noisy Q-network left to wander ±3 steps cost more than
  the probes did (1 % noise, seeds 0–7: 6.1 vs 1.4 ideal-seconds lost in the last half
  hour with ±3 and ±1). A workload change forgets the
  statistics (the optimum may have moved).
* **Change detection.** Each credited p_t also feeds a CUSUM on its residual against the
  expected level of the setting that produced it (``drl_engine.change_detection``), so
  the agent's own moves are not mistaken for a new workload; only ticks whose setting
  held over the whole settle time count (a knob that acts at once would key residuals
  to the wrong setting after every move). An alarm forgets the
  statistics, keeps the current setting as the anchor of the trust region and lets the
  engine raise ε — exploration restarts locally, not uniformly.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import numpy as np

from capes.common import actions
from capes.common.step_grid import StepGrid, local_draw, sweep_order, walk, walk_action
from drl_engine import checkpoint, trust_region
from drl_engine.best_known import LowerBound
from drl_engine.change_detection import ChangeDetectorConfig, SettingResidualDetector


@dataclass
class Probe:
    target: np.ndarray        # grid indices
    dwell_left: int
    replan: bool = False      # a model probe: re-aimed while it walks, as data comes in
    walked: int = 0
    back: bool = False        # the walk back to the best-known setting (probe_floor)


class Guide:
    DENSE_CELLS = 1_000_000       # grids up to this many settings are kept as arrays
    MODEL_MAX_CELLS = 100         # the GP sees at most this many (merged) settings
    MODEL_MAX_CANDIDATES = 1024   # settings scored per proposal
    LAG_T = 5.0                   # t statistic a knob's own lag needs before it is used
    LOCAL_CANDIDATES = 16         # local probe targets drawn around the best (model picks)
    KEY_MEMO = 100_000            # settings whose grid index credit keeps
    NOISY_FLOOR = 0.2             # probe_floor_noise: the best's own values fall below the
    NOISY_TESTS = 100             # floor this often (of at least this many held ticks)
    SAFE_Z = 2.0                  # probe_safe: a setting is safe where its mean − 2 sd clears
                                  # the probe floor
    WIDE_RATIO = 2.0              # an alarm whose anchor's level moved this factor re-explores
                                  # wide (alarm_guard_steps); a smaller move was noise

    def __init__(self, step_grid: StepGrid, cfg, rng: np.random.Generator,
                 frozen: np.ndarray | None = None):
        self.step_grid = step_grid                 # the knobs' grids (capes.common.step_grid)
        n_steps = self.n_steps = step_grid.n_steps    # per parameter
        # parameters never moved online (a remount/reboot cost): probes keep their value
        self.frozen = np.zeros(len(n_steps), bool) if frozen is None else frozen
        self.cfg, self.rng = cfg, rng
        self.shape = tuple(int(n) + 1 for n in n_steps)
        self.dense = int(np.prod(self.shape)) <= self.DENSE_CELLS
        # per grid cell: sum, sum of squares and count of the credited objective values;
        # dense arrays for small grids (smoothed by separable convolution), else a dict
        self.sums: dict[tuple, list[float]] = {}
        self.grid_stats = np.zeros((3,) + self.shape) if self.dense else None
        self.seen_until = 0                          # ticks of the session credited so far
        self.probe: Probe | None = None
        # the best-known setting, by its lower confidence bound (drl_engine.best_known)
        self.known = LowerBound(cfg, self)
        self.resets = 0
        self.detector = (SettingResidualDetector(ChangeDetectorConfig())
                         if cfg.detect_changes else None)
        self.alarms: list[int] = []                  # ticks (session indices) of alarms
        # the least-squares sums behind each knob's learned reaction delay (_learn_lags)
        width = 1 + len(n_steps) * (cfg.settle_ticks + 1)
        self.lag_xx, self.lag_xy = np.zeros((width, width)), np.zeros(width)
        self.lag_yy, self.lag_n, self._lag_seen = 0.0, 0, 0
        self._lag_unfit = 0            # ticks added to the sums since the last solve
        self.lags = np.full(len(n_steps), cfg.settle_ticks)       # per knob, in ticks
        self.await_action = False      # credit nothing before the session's first action
        self.last_p: float | None = None   # the newest objective value (probe_floor)
        self.floor_held = 0            # ticks the best-known setting held (probe_floor_noise)
        self.floor_under = 0           # ... whose value fell below the floor
        self.wide_left = 0             # local probes left with the wide band (alarm_*)
        self.sweep: list[list[int]] = []   # the coarse sweep's targets left (sweep_points)
        self.sweep_due = False         # a new workload: sweep once its anchor is measured
        self.replan_uniform = False    # a new context's uniform first probes are re-aimed
                                       # by the model along their walk (context_replan)
        self.level_before: float | None = None   # the anchor's level before an alarm
        self._grid_keys: dict[bytes, tuple] = {}   # credit's memo: values -> grid index
        self.anchor: np.ndarray | None = None    # first_probe "local": where the anchor
                                                 # probe held (the greedy guard's centre
                                                 # while no best is known)

    # -- checkpoints --------------------------------------------------------------------
    # built from the parameter specs and the config, never kept in a checkpoint
    STRUCTURE = ("step_grid", "n_steps", "frozen", "shape", "dense", "probe", "known",
                 "_grid_keys")
    KNOWN = {"best": "best_idx", "_best_at": "best_tick", "had_best": "had_best"}

    def state(self) -> dict:
        """What a restart must not forget: the per-setting statistics and the best-known
        setting, the learned lags, the change detector, the running probe
        (``drl_engine.checkpoint`` makes it loadable with ``weights_only``)."""
        out = checkpoint.state_of(self, skip=self.STRUCTURE)
        out.update({k: checkpoint.encode(getattr(self.known, a))
                    for k, a in self.KNOWN.items()})     # (the names kept before 39)
        out["shape"] = list(self.shape)
        out["probe"] = None if self.probe is None else checkpoint.encode(asdict(self.probe))
        return out

    def load_state(self, state: dict) -> None:
        """Resume from :meth:`state`; ValueError when it was kept for another grid (other
        parameter ranges or steps)."""
        if list(state.get("shape", ())) != list(self.shape):
            raise ValueError(f"the guide's state is for a grid of {state.get('shape')} "
                             f"settings, these parameters make {list(self.shape)}")
        checkpoint.restore_into(self, {k: v for k, v in state.items()
                                       if k not in ("shape", "probe", *self.KNOWN)})
        for k, a in self.KNOWN.items():
            if k in state:
                setattr(self.known, a, checkpoint.decode(state[k]))
        probe = state.get("probe")
        self.probe = None if probe is None else Probe(**checkpoint.decode(probe))

    def new_session(self) -> None:
        """Another session of the replay DB (the interface daemon restarted): the
        statistics, lags and best-known setting stay; the session's ticks are credited
        from its first action on, since before it the DB can only assume the
        parameters' defaults, not the values the nodes kept (see :meth:`credit`)."""
        self.seen_until = self._lag_seen = 0
        self.probe = None
        self.await_action = True

    # -- statistics ---------------------------------------------------------------------
    def grid(self, values) -> np.ndarray:
        return self.step_grid.index(values)

    def values(self, idx: np.ndarray) -> list[float]:
        return [float(v) for v in self.step_grid.values(idx)]

    def credit(self, p: np.ndarray, values: np.ndarray, n: int,
               first_action: int | None = None) -> bool:
        """Credit objective values p[t] to the setting in effect at t − settle, for the
        ticks of the session not yet credited (``n``: ticks derived so far). True when
        the change detector raised an alarm (the statistics are then forgotten).
        ``first_action``: the session's first tick with an action (None: none yet),
        where a guide resumed into a new session starts crediting."""
        lag = self.cfg.settle_ticks
        if self.await_action:
            if first_action is None:
                return False
            self.seen_until = self._lag_seen = first_action + 1 + int(max(lag, *self.lags))
            self.await_action = False
        start = max(self.seen_until, lag)
        alarm = False
        if self.cfg.learn_lags:
            self._learn_lags(p, values, n)
        cols = np.arange(values.shape[1])
        keys = self._grid_keys
        for t in range(start, n):
            setting = values[t - self.lags, cols]     # each knob as it was its lag ago
            if not math.isfinite(p[t]) or not np.isfinite(setting).all():
                continue
            raw = setting.tobytes()          # the grid index of values seen before: a
            key = keys.get(raw)              # dict look-up, not StepGrid.index's arithmetic
            if key is None:
                if len(keys) >= self.KEY_MEMO:
                    keys.clear()
                key = keys[raw] = tuple(int(i) for i in self.grid(setting))
            # the detector only hears ticks whose setting held over the whole lag: a knob
            # that acts at once (a binding rate limit) would otherwise leave ``lag``
            # residuals keyed to the wrong setting after every move, and alarm
            held = (values[t - lag:t + 1] == values[t - lag]).all()
            if held and self.cfg.detect_fresh_only and t > 0 and p[t] == p[t - 1]:
                held = False                 # a stale re-read: heard once already
            if self.detector is not None and held and self.detector.update(p[t], key):
                alarm = True
                self.alarms.append(t)
                self.level_before = self._level(np.array(key))    # (alarm_guard_steps)
                self.forget(anchor=np.array(key))
                continue
            if self.dense:               # one scalar add each: the same sums, no array
                stats, pt = self.grid_stats, float(p[t])
                stats[(0,) + key] += pt
                stats[(1,) + key] += pt * pt
                stats[(2,) + key] += 1.0
            else:
                s = self.sums.setdefault(key, [0.0, 0.0, 0])
                s[0] += p[t]
                s[1] += p[t] * p[t]
                s[2] += 1
        self.seen_until = max(self.seen_until, n)
        if n > 0 and np.isfinite(p[n - 1]):
            self.last_p = float(p[n - 1])
            if self.cfg.probe_floor_noise > 0 and n > lag:
                self._count_floor(values[n - 1 - lag:n])
        return alarm

    def _count_floor(self, recent: np.ndarray) -> None:
        """Count whether the newest value, measured at the best-known setting, set
        there the settle ticks before too (``recent``: the settings since), fell below
        the probe floor: how often the floor would end a probe on the best's own noise."""
        best = self.known.best_idx
        if best is None or not (recent[0] == recent[-1]).all():
            return
        if not np.array_equal(self.grid(recent[-1]), best):
            return
        level = self._level(best)
        if level is not None and level > 0:
            self.floor_held += 1
            self.floor_under += self.last_p < self.cfg.probe_floor * level

    def _learn_lags(self, p: np.ndarray, values: np.ndarray, n: int) -> None:
        """Each knob's reaction delay, learned: a least-squares fit of the objective's
        tick-to-tick change |Δp_t| on indicators "knob k moved l ticks ago" (every knob,
        l = 0..settle, and a constant), so moves in a row are told apart. A knob's lag is
        the l with the largest coefficient once its t statistic reaches ``LAG_T``; until
        then (no effect seen, or noise hides it) the knob keeps ``settle_ticks``.
        Sign-free, since a move helps on one side of an optimum and hurts on the other.
        A rate limit acts at once, a window only after the queue drains: crediting both
        ``settle`` ticks back would pin the rate limit's effect on the setting it left."""
        L, P = self.cfg.settle_ticks, len(self.lags)
        t0 = max(self._lag_seen, L + 1)
        if n <= t0:
            return
        width = 1 + P * (L + 1)
        if n == t0 + 1:
            # one new tick (every tick of a run): the row's sums without matrix products,
            # the same numbers (0/1 indicators times one value)
            y0 = abs(p[t0] - p[t0 - 1])
            if np.isfinite(y0):
                moved = values[t0 - L:t0 + 1] != values[t0 - L - 1:t0]   # (L+1, P) rows
                x = np.ones(width)
                x[1:] = moved[::-1].reshape(-1)            # lag 0 first, as below
                self.lag_xx += np.outer(x, x)
                self.lag_xy += x * y0
                self.lag_yy += float(y0 * y0)
                self.lag_n += 1
        else:
            ts = np.arange(t0, n)
            y = np.abs(p[ts] - p[ts - 1])
            x = np.ones((len(ts), width))
            for lag in range(L + 1):
                x[:, 1 + lag * P:1 + (lag + 1) * P] = values[ts - lag] != values[ts - lag - 1]
            ok = np.isfinite(y)                # x holds 0/1 indicators, always finite
            x, y = x[ok], y[ok]
            self.lag_xx += x.T @ x
            self.lag_xy += x.T @ y
            self.lag_yy += float(y @ y)
            self.lag_n += len(y)
        self._lag_unfit += n - t0
        self._lag_seen = n
        dof = self.lag_n - width
        if dof < 5 or self._lag_unfit < self.cfg.lag_fit_ticks:
            return                     # (lag_fit_ticks: the sums grow, the solve waits)
        self._lag_unfit = 0
        # a ridge (1 per coefficient, none on the constant): along a walk a knob moves
        # every tick and its lags cannot be told apart; those coefficients stay small
        # and uncertain instead of making the fit singular
        ridge, tiny = _lag_ridge(width)
        inv = np.linalg.inv(self.lag_xx + ridge + tiny)
        beta = inv @ self.lag_xy
        rss = self.lag_yy - 2.0 * beta @ self.lag_xy + beta @ self.lag_xx @ beta
        se = np.sqrt(np.maximum(inv.diagonal() * max(rss, 0.0) / dof, 1e-300))
        t = (beta / se)[1:].reshape(L + 1, P)                   # (lag, knob)
        best = beta[1:].reshape(L + 1, P).argmax(0)             # per knob, its largest
        found = t[best, np.arange(P)] >= self.LAG_T
        # kept once found: a knob whose moves stop showing (a cap no longer binding) has
        # not changed its delay
        self.lags[found] = best[found]

    def pooled_variance(self) -> float:
        """The objective's variance within settings, pooled over every setting credited
        more than once (0 while none is): the floor of each setting's variance in the
        best-known setting's bound (``lcb_pooled_noise``). A setting whose samples barely
        spread (a binding rate limit's level, or a few samples that happen to agree)
        would otherwise have a bound at its mean and beat better settings measured
        with the noise every setting has."""
        within = _within_variance(*self._cells()[1:])
        return 0.0 if within is None else within

    def forget(self, anchor: np.ndarray | None = None) -> None:
        """A new workload: the optimum may have moved. ``anchor``: the setting the
        trust region stays around until new statistics name a best (None: none, so
        the next probes are global)."""
        self.sums.clear()
        if self.dense:
            self.grid_stats[:] = 0.0
        self.known.take(anchor)
        self.probe = None
        self.drop_sweep()
        self.replan_uniform = False
        self.resets += 1

    def new_workload(self, context: bool = False) -> None:
        """A new workload context was entered (its statistics start empty): its first
        local probes go wide (``alarm_probes``), or sweep (``sweep_points``). Said by the
        engine at the switch, since a tick credited before the next probe already names
        a best, and :meth:`start_probe` would take the context for a known one.
        ``context``: said at a new context's switch, whose first global probes, drawn
        uniformly while the model has fewer than 3 settings, are then re-aimed by the
        model along their walk (``context_replan``, issue 25 round 8: a first probe drawn
        across the range walked on while the throughput fell to 0)."""
        if self.known.had_best:
            self.wide_left = self.cfg.alarm_probes
            self.sweep_due = self.cfg.sweep_points > 0
        self.replan_uniform = context and self.cfg.context_replan

    def drop_sweep(self) -> None:
        """Forget a coarse sweep begun or due: it belongs to the workload it began in."""
        self.sweep, self.sweep_due = [], False

    def _cells(self):
        """The visited cells: grid indices (V, P) and their sums, sums of squares and
        counts (unsmoothed)."""
        if self.dense:
            visited = self.grid_stats[2] > 0
            keys = np.argwhere(visited)
            s, sq, n = (self.grid_stats[i][visited] for i in range(3))
            return keys, s, sq, n
        if not self.sums:
            return np.zeros((0, len(self.shape)), np.int64), *(np.zeros(0),) * 3
        keys = np.array(list(self.sums), np.int64)
        stats = np.array(list(self.sums.values()), np.float64)
        return keys, stats[:, 0], stats[:, 1], stats[:, 2]

    def model_target(self, current: np.ndarray, box: np.ndarray | None = None,
                     safe_floor: float | None = None) -> np.ndarray | None:
        """The setting a Gaussian process over the credited objective rates highest by
        its upper confidence bound, less a cost per tick of walking there (None with
        fewer than 3 settings seen).

        The GP works on the standardised per-setting means: squared-exponential kernel
        with a length scale of ``model_length`` of each parameter's range, signal
        variance 1, and per-setting noise variance σ²/n (σ² pooled within settings).
        Candidates are ``box`` (given: the settings a local probe may go to), else every
        setting of small grids, else a random sample plus the neighbourhood of the
        current one. Beyond ``MODEL_MAX_CELLS`` settings the GP sees them merged into
        coarser cells, so a proposal costs the same after hours of data. ``safe_floor``:
        only candidates whose lower bound (mean − ``SAFE_Z`` sd, in the objective's
        units) reaches it (None when none does)."""
        keys, s, sq, n = self._cells()
        if len(keys) < 3:
            return None
        keys, s, sq, n = _coarsen(keys.astype(np.float64), s, sq, n, self.MODEL_MAX_CELLS)
        mean = s / n
        y0, ysd = mean.mean(), mean.std()
        within = _within_variance(s, sq, n)
        within = ysd * ysd if within is None else within
        ysd = ysd if ysd > 0 else (np.sqrt(within) or 1.0)
        scale = np.maximum(self.n_steps, 1) * self.cfg.model_length
        x = keys / scale
        noise = within / (ysd * ysd) / n
        k = _rbf(x, x) + np.diag(noise + 1e-6)
        chol_inv = np.linalg.inv(np.linalg.cholesky(k))                # L⁻¹, (V, V)
        alpha = chol_inv.T @ (chol_inv @ ((mean - y0) / ysd))           # K⁻¹ y
        cand = self._candidates(current) if box is None else box
        ks = _rbf(cand / scale, x)                                     # (C, V)
        mu = ks @ alpha
        v = chol_inv @ ks.T                                            # var = 1 − |L⁻¹k|²
        sd = np.sqrt(np.maximum(1.0 - (v * v).sum(0), 0.0))
        travel = np.abs(cand - current).sum(1)
        score = mu + self.cfg.model_beta * sd - self.cfg.model_travel * travel
        if safe_floor is not None:
            safe = y0 + ysd * (mu - self.SAFE_Z * sd) >= safe_floor
            if not safe.any():
                return None
            score = np.where(safe, score, -np.inf)
        return cand[int(np.argmax(score))]

    def _candidates(self, current: np.ndarray) -> np.ndarray:
        if self.dense and np.prod(self.shape) <= self.MODEL_MAX_CANDIDATES:
            return np.indices(self.shape).reshape(len(self.shape), -1).T
        rand = self.rng.integers(0, self.n_steps + 1,
                                 size=(self.MODEL_MAX_CANDIDATES, len(self.shape)))
        near = np.clip(current + self.rng.integers(-3, 4, size=(256, len(self.shape))),
                       0, self.n_steps)
        return np.concatenate([rand, near, current[None]])

    # -- actions ------------------------------------------------------------------------
    def start_probe(self, global_share: float, current: np.ndarray | None = None) -> None:
        """A new probe: global with probability ``global_share`` (to the model's
        proposal, or uniform over the range), else local (around the best, inside the
        guard band). With no best-known setting and ``first_probe = "local"`` the probe
        holds the current setting (where tuning starts, or where a new workload found
        it) until its level is known: the trust region's anchor, measured before any
        move, and the reference of ``probe_floor``."""
        best = self.known.best_idx
        replan = False
        if self.cfg.first_probe == "local" and current is not None:
            level = None if best is None else self._level(best)
            if best is None:                       # a new workload: re-explore wide
                self.new_workload()
            if level is None:                      # measure the anchor before moving
                anchor = current if best is None else best
                self.anchor = np.array(anchor, np.int64)
                self.probe = Probe(self.anchor.copy(), self.cfg.probe_dwell)
                return
            before, self.level_before = self.level_before, None
            ratio = self.WIDE_RATIO
            if before is not None and not before / ratio < level < before * ratio:
                self.wide_left = self.cfg.alarm_probes    # the alarm moved the level: a
                                                          # new workload, not noise
        if self.sweep_due and best is not None:  # instead of the wide draws
            self.sweep, self.sweep_due = self._sweep_plan(best), False
            if self.sweep:
                self.wide_left = 0
        if self.sweep:
            target = np.array(self.sweep.pop(0), np.int64)
            if current is not None:
                target = np.where(self.frozen, current, target)
            self.probe = Probe(target, self.cfg.probe_dwell)
            return
        if best is None or self.rng.random() < global_share:
            target = None
            if self.cfg.probe_model and current is not None:
                target = self.model_target(current)
                replan = target is not None
                if replan:
                    self.replan_uniform = False      # the model has its 3 settings now
            if target is None:
                target = self.rng.integers(0, self.n_steps + 1)
                replan = self.replan_uniform         # (context_replan: re-aimed as the
                                                     # walk's ticks give the model data)
        else:
            g = self._in_steps(self.cfg.guard_steps, whole=True)
            spread = self._in_steps(self.cfg.probe_local_steps)
            wide = self.wide_left > 0
            if wide:                          # after a change: a far optimum in few probes
                self.wide_left -= 1
                g = np.maximum(g, self._in_steps(self.cfg.alarm_guard_steps, whole=True))
                spread = np.maximum(spread, g.astype(float))
            near = local_draw(self.rng, np.broadcast_to(best, (self.LOCAL_CANDIDATES,
                                                              len(best))),
                              spread, self.n_steps, best=best, guard=g)
            if self.cfg.probe_avoid_bad:      # a setting seen below the floor: not again
                ok = [not self._known_bad(k) for k in near]
                near = near[ok] if any(ok) else best[None].astype(np.int64)
            if self.cfg.probe_move:
                # a probe at the best itself is a dwell that measures nothing new: with
                # one neighbour known bad, ~55 % of one-rung draws were (docs/journal.md, real devices,
                # session 6)
                moved = (near != best).any(1)
                if moved.any():
                    near = near[moved]
            target = None
            if not wide and current is not None:
                target = self._safe_target(best, current)
            if target is None and self.cfg.probe_model and current is not None:
                target = self.model_target(current, box=near)
            if target is None:
                target = near[0]
            replan = wide and self.cfg.wide_replan and self.cfg.probe_model
        if current is not None:
            target = np.where(self.frozen, current, target)
        self.probe = Probe(target, self.cfg.probe_dwell, replan)

    def _safe_target(self, best: np.ndarray, current: np.ndarray) -> np.ndarray | None:
        """With probability ``probe_safe``: the model's best upper bound among the
        settings anywhere in the range whose lower bound (mean − ``SAFE_Z`` sd) stays
        above ``probe_floor`` × the best-known level (safe Bayesian optimisation, after
        Sui et al.'s SafeOpt); None otherwise, or where the model has no such setting
        yet. A local probe climbs a tenth of the range at a time; where the model
        already knows a slope is safe, this one may go up it at once (measured on the
        recurring game: docs/engine.md, "One default for every target")."""
        share, floor = self.cfg.probe_safe, self.cfg.probe_floor
        if share <= 0 or floor <= 0 or not self.cfg.probe_model:
            return None
        level = self._level(best)
        if level is None or not self.rng.random() < share:
            return None
        return self.model_target(current, safe_floor=floor * level)

    def _in_steps(self, size: float, whole: bool = False) -> np.ndarray:
        """A probe size (``guard_steps``, ``probe_local_steps``, ``alarm_guard_steps``) in
        each knob's own steps. With ``probe_unit = N`` a size counts tenths (N = 10) of
        each knob's range, so that one setting means as much on a ladder of 11 rungs as on
        a range of 100 steps; 0: the knob's own steps. ``whole``: at least one step."""
        unit = self.cfg.probe_unit
        sizes = np.full(len(self.n_steps), float(size))
        if unit:
            sizes = sizes * self.n_steps / unit
        if whole:
            sizes = np.where(sizes > 0, np.maximum(1, np.rint(sizes)), 0).astype(np.int64)
        return sizes

    def _sweep_plan(self, best: np.ndarray) -> list[list[int]]:
        """The coarse sweep around ``best``: per knob (one at a time, the others held),
        ``sweep_points`` settings spread evenly over its range, the one at ``best`` left
        out (only for a new workload: after an alarm on a known one the wide draws stay,
        since a sweep's far end can cost far more than the floor allows there), those on the side of the nearer end first, then the other side, nearest
        first: one pass each way. A new workload's optimum may sit anywhere on the range
        (measured: a new mmap workload found at 2048 KiB walked down one rung per probe
        for 2 minutes, where a sweep reaches 4 KiB in its first probes). Only a knob given
        as a ladder of values (``values = [...]``) is swept: a ladder's optimum may sit
        anywhere on its log scale and ~10 rungs are crossed in a few ticks, while a sweep
        over a numeric range of 100 steps walks for ~50 ticks a point (measured on the
        recurring game: 0.0125 of the hour lost, 10 of 10 seeds; docs/engine.md); a
        numeric range keeps the wide draws and the GP's proposals."""
        plan: list[list[int]] = []
        for k, n in enumerate(self.n_steps):
            if self.frozen[k] or n == 0 or not self.step_grid.ladder[k]:
                continue
            for v in sweep_order(int(n), int(best[k]), self.cfg.sweep_points, with_at=False):
                t = [int(x) for x in best]
                t[k] = v
                plan.append(t)
        return plan

    def probe_action(self, current: np.ndarray) -> int | None:
        """The next action of the running probe (NULL while it dwells at its target);
        None when it has finished."""
        probe = self.probe
        if probe is None:
            return None
        if self._below_floor(probe):          # unsafe here: walk back to the best at once
            probe = self.probe = Probe(self.known.best_idx.copy(), 0, back=True)
        most = self._walk_steps(current, probe.target)
        action = walk_action(current, probe.target, self.n_steps, most, straight=True)
        if action != 0 and probe.replan:
            # every settle+1 moves of the walk the ticks it passed are credited: re-aim
            # (a far target chosen on little data is often passed by the peak)
            probe.walked += 1
            if probe.walked % (self.cfg.settle_ticks + 1) == 0:
                target = self.model_target(current)
                if target is not None:
                    probe.target = np.where(self.frozen, current, target)
                    action = walk_action(current, target, self.n_steps, most, straight=True)
        if action == 0:
            probe.dwell_left -= 1
            if probe.dwell_left < 0:
                self.probe = None
                return None
        return action

    def _walk_steps(self, current: np.ndarray, target: np.ndarray) -> int:
        """The most steps a probe walk moves its knob this tick: ``action_steps``, or with
        ``probe_walk_unit`` one ``probe_unit`` of the knob it moves (at most
        ``MAX_STEPS``): two steps a tick cross an 11-rung ladder in 5 ticks but a
        100-step range in 50, and a probe that walks that long measures the walk."""
        most, unit = self.cfg.action_steps, self.cfg.probe_unit
        if not (self.cfg.probe_walk_unit and unit):
            return most
        k = int(walk(current, target, self.n_steps, 1, straight=True)[0])
        return max(most, min(actions.MAX_STEPS, int(round(self.n_steps[k] / unit))))

    def _own(self, key: np.ndarray) -> tuple[float, float, float]:
        """One setting's own sum, sum of squares and count of credited values."""
        if self.dense:
            s, sq, n = self.grid_stats[(slice(None),) + tuple(key)]
        else:
            s, sq, n = self.sums.get(tuple(key), (0.0, 0.0, 0))
        return float(s), float(sq), float(n)

    def _level(self, key: np.ndarray) -> float | None:
        """The mean objective credited to one setting (None: no sample yet)."""
        s, _, n = self._own(key)
        return s / n if n > 0 else None

    def _below_floor(self, probe: Probe) -> bool:
        """Whether the newest objective value fell below ``probe_floor`` × the
        best-known setting's mean (its own samples; a positive objective) while a probe
        is away from it: the probe is then ended, not held for its dwell."""
        floor, best = self.cfg.probe_floor, self.known.best_idx
        if floor <= 0 or probe.back or best is None or self.last_p is None:
            return False
        if np.array_equal(probe.target, best):
            return False
        level = self._level(best)
        return (level is not None and level > 0
                and self.last_p < self._floor_line(best, level, floor * level))

    def _floor_line(self, best: np.ndarray, level: float, line: float) -> float:
        """``line`` (the probe floor under the best's ``level``), lowered to ``level`` − z
        of the best's own standard deviations (``probe_floor_noise`` = z) once the
        best's own values fall below the floor on more than ``NOISY_FLOOR`` of the ticks
        it held: one value is then no evidence that a probe is worse. Elsewhere the
        floor is as it was (the recorded real readahead traces replayed: at most 16 % on
        any trace once 100 ticks are counted, workload switches included; the game at
        50 % noise: ~31 %)."""
        z = self.cfg.probe_floor_noise
        if (z <= 0 or self.floor_held < self.NOISY_TESTS
                or self.floor_under <= self.NOISY_FLOOR * self.floor_held):
            return line
        s, sq, m = self._own(best)
        if m < 2:
            return line
        sd = math.sqrt(max(sq / m - level * level, 0.0) * m / (m - 1))
        return min(line, level - z * sd)

    def _known_bad(self, key: np.ndarray) -> bool:
        """Whether ``key``'s own mean is below ``probe_floor`` × the best-known setting's
        (``probe_avoid_bad``): a probe there already cost more than the floor allows, and
        another one costs as much again (measured live: the same rung probed 2-3 times in
        20 s put the worst 10 s at 0.80x the original)."""
        best, floor = self.known.best_idx, self.cfg.probe_floor
        if best is None or floor <= 0 or np.array_equal(key, best):
            return False
        level, ref = self._level(key), self._level(best)
        return level is not None and ref is not None and ref > 0 and level < floor * ref

    def guard(self, action: int, current: np.ndarray) -> int:
        """``action`` if it keeps every parameter within ``greedy_guard_steps`` of the
        best-known setting (or moves towards it), else a step back towards it. With no
        best known and ``first_probe = "local"``: of the anchor (where tuning started,
        or where a new workload found it): the anchor probe's rule, also for the
        network, which is untrained then."""
        best = self.known.best_idx if self.known.best_idx is not None else self.anchor
        if best is None or action == 0:
            return action
        k, steps = actions.decode(action, len(current))
        if self.cfg.probe_avoid_bad:          # never step onto a setting known below the floor
            to = np.asarray(current, np.int64).copy()
            to[k] = min(max(to[k] + steps, 0), int(self.n_steps[k]))
            if self._known_bad(to):
                return 0
        out, back = trust_region.outside(np.asarray(current)[None], np.array([k]),
                                         np.array([steps]), best[None], self.n_steps,
                                         self.cfg.greedy_guard_steps)
        return int(back[0]) if out[0] else action


def _coarsen(keys, s, sq, n, most: int):
    """Merge cells into blocks of 2, 4, 8 … steps per axis until at most ``most`` are
    left; a block sits at its cells' count-weighted mean position."""
    size = 1
    out = keys, s, sq, n
    while len(out[0]) > most:
        size *= 2
        block = np.floor_divide(keys, size).astype(np.int64)
        flat = np.ravel_multi_index(block.T, tuple(block.max(0) + 1))
        _, inv = np.unique(flat, return_inverse=True)
        m = inv.max() + 1
        agg = [np.bincount(inv, w, m) for w in (s, sq, n)]
        pos = np.stack([np.bincount(inv, keys[:, j] * n, m) for j in range(keys.shape[1])], 1)
        out = pos / agg[2][:, None], agg[0], agg[1], agg[2]
    return out


def _within_variance(s, sq, n) -> float | None:
    """The variance within cells, pooled (sums, sums of squares and counts per cell);
    None while no cell has two samples."""
    repeats = n.sum() - len(n)
    return max((sq - s * s / n).sum(), 0.0) / repeats if repeats > 0 else None


@functools.lru_cache(maxsize=8)
def _lag_ridge(width: int) -> tuple[np.ndarray, np.ndarray]:
    """The lag fit's ridge (1 on each coefficient, none on the constant) and its 1e-9
    jitter, built once per width (read only)."""
    ridge = np.eye(width)
    ridge[0, 0] = 0.0
    tiny = 1e-9 * np.eye(width)
    ridge.flags.writeable = tiny.flags.writeable = False
    return ridge, tiny


def _rbf(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    return np.exp(-0.5 * np.maximum(d2, 0.0))

