"""Workload-change detection: robust change-point tests on the engine's own streams.

The engine is told nothing when the workload changes; it has to notice. Two pieces:

:class:`ChangeDetector` — a two-sided CUSUM (default) or Page–Hinkley test on one stream of
scalars, or on k streams at once (e.g. the per-PI means). After every (re)start it skips
``cooldown`` samples (only after an alarm), then takes ``warmup`` samples as its reference
window: centre c = median, scale s = max(1.4826 · MAD, ``scale_floor``). From then on each
sample is standardised and winsorised, z = clip((x − c) / s, ±``clip``), and

    CUSUM:  S⁺ ← max(0, S⁺ + z − k),   S⁻ ← max(0, S⁻ − z − k),   alarm when max(S⁺, S⁻) > h
    PH:     m⁺ ← m⁺ + z − z̄ − k,  M⁺ = min m⁺;  m⁻ ← m⁻ − z + z̄ − k,  M⁻ = min m⁻;
            alarm when max(m⁺ − M⁺, m⁻ − M⁻) > h   (z̄: running mean since the reference)

with k = ``drift`` and h = ``threshold``, both in robust standard deviations. The test is
self-starting: after the reference, every in-control sample is folded into c and s
(running means of the winsorised sample and of its absolute deviation, weight 1/n up to
``refine`` samples), so the reference's own error (the median of 30 samples is off by
~0.23 σ, enough to triple the false alarms) fades. With k streams an alarm needs
``min_streams`` of them past h within ``vote_window`` updates (a stream past h restarts
its own statistic and casts a vote). An alarm restarts the test (cooldown, new
reference). Defaults k = 0.5, h = 10: measured 0.03 false alarms per hour of iid Gaussian
samples (0.4 with h = 8; 1.8 with h = 8 and no refinement) and 0.5 on Student-t(4)
samples; a 1 σ shift is found in ~25 samples, 2 σ in ~8; winsorising at ±5 keeps a
single outlier from ever alarming on its own.

:class:`SettingResidualDetector` — the throughput an agent sees changes with its own
actions, so a test on the raw throughput alarms whenever the agent explores (measured:
many alarms per simulated hour under a random policy). This detector keeps a table of
the expected level of every setting it has seen (a running mean, keyed by the knob
values, an EWMA once a setting has ``1/forget`` samples) and tests the *residual*
r = (x − μ[setting]) / |μ[setting]| (relative: multiplicative noise gives every setting
the same residual scale), deflated by √(1 + var factor of μ's estimate), so that a
residual has the same spread whether its setting was seen 3 or 300 times. A residual
counts only once its setting has ``min_samples`` samples; ``delay`` pairs each sample with
the setting applied ``delay`` updates earlier, and ``delays`` does so per element of a
tuple key when knobs act with different delays (StorageGameSim: the window acts
``delay_ticks`` late, the rate limit at once: ``delays = [3, 0]`` for the key
``(window, rate_limit)``; with one delay for both, every rate change would leave three
residuals keyed to the wrong setting). On one stream (the guide's) each residual is
also divided by its setting's own spread (``scale_prior``), and the CUSUM takes the
result as standardised, without a reference window of its own (levels and spreads learn
from winsorised samples, so a wild second or a new workload does not drag them): real
devices are
heteroscedastic (an IOPS-capped readahead of 4 KiB gives the same bytes every second, one
of 4 MiB swings ±30 %), and a reference estimated while the agent explores took minutes
and swallowed the first workload switch (measured on recorded real traces,
``tests/test_change_detection_real.py``). A workload change
moves the level of every setting at once, which the agent's own moves do not; on an
alarm the table is cleared (its levels belong to the old workload).

numpy only: the engine may run it per tick at 1,000 nodes (``update_many``: one table per
node, one vectorised test over the nodes, ``min_streams`` ≈ nodes/4 as the vote). One
stream costs ~10 µs per update (a plain-float path), 64 streams ~0.3 ms.

Limits, measured (benchmarks/bench_cluster_sim.py): when *every* node of a cluster
explores at random, each node's throughput also moves with its neighbours' windows
(contention), which its own setting does not explain; the vote keeps that to ~1 false
alarm per hour at 64 nodes, a single stream on the total throughput does not (≈ 12).
A change that the settings in use cannot see (the game's rate limit binding below both
the old and the new curve) is not detected until the agent moves somewhere it shows.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Literal, Sequence

import numpy as np

MAD_TO_SIGMA = 1.4826
SIGMA_TO_MEAN_ABS = math.sqrt(math.pi / 2)    # σ = E|x − μ| · √(π/2) for a Gaussian


@dataclass
class ChangeDetectorConfig:
    method: Literal["cusum", "page_hinkley"] = "cusum"
    threshold: float = 10.0       # h, robust standard deviations
    drift: float = 0.5            # k, allowance per sample, robust standard deviations
    warmup: int = 30              # samples in the reference window after a (re)start
    cooldown: int = 30            # samples ignored after an alarm
    clip: float = 5.0             # winsorise standardised samples at ±clip
    scale_floor: float = 1e-3     # lower bound of the robust scale, in the stream's units
    min_streams: int = 1          # streams past the threshold (within vote_window) to alarm
    vote_window: int = 10         # updates a stream's vote lasts
    refine: int = 600             # keep refining centre and scale over up to this many
    #                               in-control samples after the reference (0: never)
    standardised: bool = False    # the stream is already in units of its noise (centre
    #                               0, scale 1): no reference window, monitoring at once
    # SettingResidualDetector only
    min_samples: int = 3          # samples of a setting before its residuals count
    forget: float = 0.005         # EWMA weight floor of a setting's level (1/n until then)
    relative: bool = True         # residual relative to the setting's level
    level_floor: float = 1e-6     # |level| below this counts as this (relative residuals)
    delay: int = 0                # a sample reflects the setting of this many updates ago
    delays: list[int] = field(default_factory=list)   # or per element of a tuple key
    clear_on_alarm: bool = True   # forget every setting's level on an alarm
    scale_prior: float = 3.0      # per-setting spread (SettingResidualDetector, one
    #                               stream): each setting's residuals are divided by its
    #                               own mean |deviation|, shrunk towards the pooled one by
    #                               this many pseudo-samples, and the CUSUM then takes them
    #                               as standardised (0: one pooled scale for all settings
    #                               and a reference window, the earlier behaviour)

    def validate(self) -> None:
        if self.method not in ("cusum", "page_hinkley"):
            raise ValueError(f"method: must be 'cusum' or 'page_hinkley' (got {self.method!r})")
        if not self.threshold > 0:
            raise ValueError(f"threshold: must be > 0 (got {self.threshold})")
        if not self.drift >= 0:
            raise ValueError(f"drift: must be >= 0 (got {self.drift})")
        if self.warmup < 3:
            raise ValueError(f"warmup: must be >= 3 (got {self.warmup})")
        if self.cooldown < 0:
            raise ValueError(f"cooldown: must be >= 0 (got {self.cooldown})")
        if not self.clip > self.drift:
            raise ValueError(f"clip: must be > drift (got {self.clip})")
        if not self.scale_floor > 0:
            raise ValueError(f"scale_floor: must be > 0 (got {self.scale_floor})")
        if self.refine < 0:
            raise ValueError(f"refine: must be >= 0 (got {self.refine})")
        if self.vote_window < 1:
            raise ValueError(f"vote_window: must be >= 1 (got {self.vote_window})")
        if self.min_streams < 1:
            raise ValueError(f"min_streams: must be >= 1 (got {self.min_streams})")
        if self.min_samples < 1:
            raise ValueError(f"min_samples: must be >= 1 (got {self.min_samples})")
        if not 0 < self.forget <= 1:
            raise ValueError(f"forget: must lie in (0, 1] (got {self.forget})")
        if not self.level_floor > 0:
            raise ValueError(f"level_floor: must be > 0 (got {self.level_floor})")
        if self.delay < 0:
            raise ValueError(f"delay: must be >= 0 (got {self.delay})")
        if any(d < 0 for d in self.delays):
            raise ValueError(f"delays: must all be >= 0 (got {self.delays})")
        if not self.scale_prior >= 0:
            raise ValueError(f"scale_prior: must be >= 0 (got {self.scale_prior})")

    @property
    def history(self) -> int:
        """Settings to remember: the longest delay, plus the current one."""
        return max([self.delay, *self.delays]) + 1


class ChangeDetector:
    """Robust two-sided CUSUM / Page–Hinkley over ``streams`` parallel streams.

    ``update(x)`` takes a scalar (one stream) or an array of ``streams`` values (NaN: no
    sample for that stream this time) and returns True on an alarm."""

    def __init__(self, config: ChangeDetectorConfig | None = None, streams: int = 1):
        self.config = config or ChangeDetectorConfig()
        self.config.validate()
        if streams < 1:
            raise ValueError(f"streams: must be >= 1 (got {streams})")
        if self.config.min_streams > streams:
            raise ValueError(f"min_streams: must be <= streams ({streams}) "
                             f"(got {self.config.min_streams})")
        self._scalar = streams == 1        # plain-float fast path (same arithmetic)
        self.streams = streams
        self.alarms = 0                    # alarms raised
        self.alarms_up = 0                 # ... of them, level went up
        self.alarms_down = 0
        self.stream_alarms = np.zeros(streams, np.int64)   # per stream, voted or not
        self.samples = 0                   # updates seen
        self.last_alarm: int | None = None  # sample index (0-based) of the last alarm
        self.last_direction: str | None = None
        self._restart(cooldown=0)

    # ---- state
    def _restart(self, cooldown: int) -> None:
        k, w = self.streams, self.config.warmup
        self._cool = cooldown
        self._ref = np.full((w, k), np.nan)
        self._nref = np.zeros(k, np.int64)
        self.center = np.full(k, np.nan)
        self.scale = np.full(k, np.nan)
        self._absdev = np.full(k, np.nan)  # running mean |x − centre| (winsorised)
        self._nest = np.zeros(k)           # samples behind centre/scale
        self._pos = np.zeros(k)            # S⁺ / m⁺ − M⁺
        self._neg = np.zeros(k)
        self._mp = np.zeros(k)             # PH: m⁺, M⁺, m⁻, M⁻, running mean, count
        self._Mp = np.zeros(k)
        self._mn = np.zeros(k)
        self._Mn = np.zeros(k)
        self._zsum = np.zeros(k)
        self._zn = np.zeros(k)
        self._voted = np.full(k, -10 ** 18, np.int64)   # update index of each stream's vote
        if self.config.standardised:          # known reference: nothing to estimate
            self._nref[:] = self.config.warmup
            self.center[:] = 0.0
            self.scale[:] = 1.0
            self._absdev[:] = 1.0 / SIGMA_TO_MEAN_ABS
            self._nest[:] = self.config.refine

    def reset(self) -> None:
        """Forget the reference and the statistics (counters are kept)."""
        self._restart(cooldown=0)

    @property
    def state(self) -> str:
        if self._cool > 0:
            return "cooldown"
        return "monitoring" if np.all(self._nref >= self.config.warmup) else "warmup"

    @property
    def statistic(self) -> float:
        """The largest test statistic over streams and directions (alarm above h)."""
        return float(np.max(np.maximum(self._pos, self._neg)))

    # ---- the test
    def update(self, x) -> bool:
        """Feed one sample (per stream); True when this sample raises an alarm."""
        if self._scalar:
            if isinstance(x, (float, int)):
                return self._update_one(float(x))
            if np.size(x) == 1:
                return self._update_one(float(np.asarray(x, float).reshape(-1)[0]))
        cfg = self.config
        x = np.asarray(x, float).reshape(-1)
        if x.shape[0] != self.streams:
            raise ValueError(f"expected {self.streams} value(s), got {x.shape[0]}")
        idx = self.samples
        self.samples += 1
        if self._cool > 0:
            self._cool -= 1
            return False
        ok = np.isfinite(x)
        filling = ok & (self._nref < cfg.warmup)
        if filling.any():
            cols = np.flatnonzero(filling)
            self._ref[self._nref[cols], cols] = x[cols]
            self._nref[cols] += 1
            ready = cols[self._nref[cols] == cfg.warmup]
            if len(ready):
                ref = self._ref[:, ready]
                med = np.median(ref, axis=0)
                mad = np.median(np.abs(ref - med), axis=0)
                self.center[ready] = med
                self.scale[ready] = np.maximum(MAD_TO_SIGMA * mad, cfg.scale_floor)
                self._absdev[ready] = self.scale[ready] / SIGMA_TO_MEAN_ABS
                self._nest[ready] = cfg.warmup
        live = ok & ~filling & (self._nref >= cfg.warmup)
        if not live.any():
            return False
        z = np.clip((x - self.center) / self.scale, -cfg.clip, cfg.clip)
        z = np.where(live, z, 0.0)
        k = cfg.drift
        if cfg.method == "cusum":
            self._pos = np.where(live, np.maximum(0.0, self._pos + z - k), self._pos)
            self._neg = np.where(live, np.maximum(0.0, self._neg - z - k), self._neg)
        else:
            self._zsum += z
            self._zn += live
            zbar = np.where(self._zn > 0, self._zsum / np.maximum(self._zn, 1), 0.0)
            self._mp = np.where(live, self._mp + z - zbar - k, self._mp)
            self._mn = np.where(live, self._mn - z + zbar - k, self._mn)
            self._Mp, self._Mn = np.minimum(self._Mp, self._mp), np.minimum(self._Mn, self._mn)
            self._pos, self._neg = self._mp - self._Mp, self._mn - self._Mn
        over = np.maximum(self._pos, self._neg) > cfg.threshold
        if not over.any():
            if cfg.refine > cfg.warmup and not cfg.standardised:
                self._refine(z, live)
            return False
        self.stream_alarms += over
        self._voted[over] = idx
        if np.count_nonzero(self._voted > idx - cfg.vote_window) >= cfg.min_streams:
            return self._raise(idx, float(np.sum(self._pos[over])) >=
                               float(np.sum(self._neg[over])))
        # not enough votes yet: restart the voting streams' statistics only
        self._pos[over] = self._neg[over] = 0.0
        self._mp[over] = self._Mp[over] = self._mn[over] = self._Mn[over] = 0.0
        if cfg.refine > cfg.warmup and not cfg.standardised:
            self._refine(z, live & ~over)
        return False

    def _update_one(self, v: float) -> bool:
        """:meth:`update` for one stream, in plain floats (≈ 30× faster than the vector
        path for one value; the same arithmetic, which a test checks)."""
        cfg = self.config
        idx = self.samples
        self.samples += 1
        if self._cool > 0:
            self._cool -= 1
            return False
        if not math.isfinite(v):
            return False
        n_ref = int(self._nref[0])
        if n_ref < cfg.warmup:
            self._ref[n_ref, 0] = v
            self._nref[0] = n_ref + 1
            if n_ref + 1 == cfg.warmup:
                ref = self._ref[:, 0]
                med = float(np.median(ref))
                scale = max(MAD_TO_SIGMA * float(np.median(np.abs(ref - med))),
                            cfg.scale_floor)
                self.center[0], self.scale[0] = med, scale
                self._absdev[0] = scale / SIGMA_TO_MEAN_ABS
                self._nest[0] = cfg.warmup
            return False
        c, s, k = float(self.center[0]), float(self.scale[0]), cfg.drift
        z = min(cfg.clip, max(-cfg.clip, (v - c) / s))
        if cfg.method == "cusum":
            pos = max(0.0, float(self._pos[0]) + z - k)
            neg = max(0.0, float(self._neg[0]) - z - k)
        else:
            zsum, zn = float(self._zsum[0]) + z, float(self._zn[0]) + 1.0
            zbar = zsum / zn
            mp = float(self._mp[0]) + z - zbar - k
            mn = float(self._mn[0]) - z + zbar - k
            Mp, Mn = min(float(self._Mp[0]), mp), min(float(self._Mn[0]), mn)
            self._zsum[0], self._zn[0] = zsum, zn
            self._mp[0], self._mn[0], self._Mp[0], self._Mn[0] = mp, mn, Mp, Mn
            pos, neg = mp - Mp, mn - Mn
        self._pos[0], self._neg[0] = pos, neg
        if max(pos, neg) <= cfg.threshold:
            if cfg.refine > cfg.warmup and not cfg.standardised:
                n = min(float(self._nest[0]) + 1.0, float(cfg.refine))
                a = 1.0 / n
                xc = c + z * s
                absdev = float(self._absdev[0])
                absdev += a * (abs(xc - c) - absdev)
                self.center[0] = c + a * (xc - c)
                self._absdev[0] = absdev
                self.scale[0] = max(absdev * SIGMA_TO_MEAN_ABS, cfg.scale_floor)
                self._nest[0] = n
            return False
        self.stream_alarms[0] += 1
        self._voted[0] = idx
        # one stream: min_streams is 1 (checked at construction)
        return self._raise(idx, bool(pos >= neg))

    def _raise(self, idx: int, up: bool) -> bool:
        """Count an alarm at sample ``idx`` (its direction: the level went up or down) and
        restart every stream, cooling down; True, for the caller to return."""
        self.alarms += 1
        self.alarms_up += up
        self.alarms_down += not up
        self.last_alarm = idx
        self.last_direction = "up" if up else "down"
        self._restart(cooldown=self.config.cooldown)
        return True

    def _refine(self, z: np.ndarray, live: np.ndarray) -> None:
        """Self-starting: fold an in-control sample into centre and scale (running means
        of the winsorised sample and of its absolute deviation, weight 1/n up to
        ``refine`` samples, then an EWMA of that length), so that the reference's own
        estimation error (a median of 30 samples is off by ~0.23 σ) fades instead of
        biasing the test for good."""
        cfg = self.config
        n = np.minimum(self._nest + 1, cfg.refine)
        a = np.where(live, 1.0 / n, 0.0)
        xc = self.center + np.clip(z, -cfg.clip, cfg.clip) * self.scale
        xc = np.where(live, xc, self.center)
        dev = np.abs(xc - self.center)
        self.center = self.center + a * (xc - self.center)
        self._absdev = self._absdev + a * (dev - self._absdev)
        self.scale = np.where(live, np.maximum(self._absdev * SIGMA_TO_MEAN_ABS,
                                               cfg.scale_floor), self.scale)
        self._nest = np.where(live, n, self._nest)

    def counters(self) -> dict[str, Any]:
        return {"samples": self.samples, "alarms": self.alarms, "alarms_up": self.alarms_up,
                "alarms_down": self.alarms_down, "last_alarm": self.last_alarm,
                "state": self.state}


class SettingResidualDetector:
    """Change detection that is blind to the agent's own moves: residuals of each sample
    against the expected level of the setting that produced it, into a
    :class:`ChangeDetector`.

    ``update(x, key)``: one stream (or a vector of PIs sharing one setting) and the
    hashable setting in force (e.g. ``(window, rate_limit)``). ``update_many(xs, keys)``:
    one stream per node, each with its own setting (one table per node, one vectorised
    test; ``min_streams`` of the config is the vote). With ``pool="mean"`` the test runs
    on one stream instead, the mean residual over the streams that have one: √n less
    noise, for a change that moves most nodes the same way."""

    def __init__(self, config: ChangeDetectorConfig | None = None, streams: int = 1,
                 pool: Literal["none", "mean"] = "none"):
        self.config = config or ChangeDetectorConfig()
        if pool not in ("none", "mean"):
            raise ValueError(f"pool: must be 'none' or 'mean' (got {pool!r})")
        self.pool = pool
        # residuals divided by their setting's own spread are already standardised: the
        # CUSUM needs no reference window of its own (a reference estimated from them,
        # 30 held samples while an agent explores, took minutes and swallowed the
        # first switch: measured on the alternating readahead session)
        # One stream only (the guide's): the cluster engine's per-node vote keeps one
        # pooled scale with its floor (contention shifts of a few % are not a change).
        self._own_scale = self.config.scale_prior > 0 and streams == 1 and pool == "none"
        test_cfg = replace(self.config, standardised=True) if self._own_scale else self.config
        self.detector = ChangeDetector(test_cfg, 1 if pool == "mean" else streams)
        self.streams = streams
        self.residual = np.full(streams, np.nan)      # last residuals (NaN: none)
        # many streams, one delay, no own spread: update_many in numpy over the streams
        self._dense = (_DenseTables(streams, self.config.history)
                       if streams > 1 and not self._own_scale and not self.config.delays
                       else None)
        self.reset_tables()

    def reset_tables(self) -> None:
        self._tables: list[dict[Hashable, list]] = [{} for _ in range(self.streams)]
        self._pooled_dev, self._pooled_n = 0.0, 0    # all settings' mean |deviation|
        self._keys: list[deque] = [deque(maxlen=self.config.history)
                                   for _ in range(self.streams)]
        if self._dense is not None:
            self._dense.clear()

    @property
    def alarms(self) -> int:
        return self.detector.alarms

    @property
    def samples(self) -> int:
        return self.detector.samples

    def expected(self, key: Hashable, stream: int = 0) -> float | None:
        """The expected level of setting ``key`` (None when unseen)."""
        if self._dense is not None and self._dense.used:
            return self._dense.expected(key, stream)
        e = self._tables[stream].get(key)
        return None if e is None else float(np.asarray(e[0]).reshape(-1)[0])

    def settings_seen(self, stream: int = 0) -> int:
        if self._dense is not None and self._dense.used:
            return self._dense.seen(stream)
        return len(self._tables[stream])

    def update(self, x, key: Hashable) -> bool:
        """One sample (scalar, or a vector of ``streams`` PIs) produced under ``key``."""
        x = np.asarray(x, float).reshape(-1)
        if self.streams > 1 and x.shape[0] == self.streams:
            # several PIs of one node: one table of vectors
            keys = self._keys[0]
            keys.append(key)
            r = np.full(self.streams, np.nan)
            if len(keys) == keys.maxlen:
                r = self._residual(self._tables[0], self._effective(keys), x)
            return self._test(r)
        return self.update_many(x, [key])

    def update_many(self, xs: Sequence[float], keys: Sequence[Hashable]) -> bool:
        """One sample per stream, each produced under its own setting ``keys[i]``."""
        xs = np.asarray(xs, float).reshape(-1)
        if len(xs) != self.streams or len(keys) != self.streams:
            raise ValueError(f"expected {self.streams} values and keys")
        if self._dense is not None:
            return self._test(self._dense.update(xs, keys, self.config))
        r = [math.nan] * self.streams
        residual, effective = self._residual_scalar, self._effective
        for i, (q, table, x) in enumerate(zip(self._keys, self._tables, xs.tolist())):
            q.append(keys[i])
            if len(q) == q.maxlen and math.isfinite(x):
                r[i] = residual(table, effective(q), x)
        return self._test(np.array(r))

    def _residual_scalar(self, table: dict, key: Hashable, x: float) -> float:
        """:meth:`_residual` for one float (plain Python: no numpy per node).

        With ``scale_prior`` > 0 the residual is also divided by the setting's own
        spread (its mean |deviation| from its level, shrunk towards the pooled mean
        |deviation| of all settings by ``scale_prior`` pseudo-samples). Real devices are
        heteroscedastic: on an IOPS-capped loop device a small readahead gives the same
        bytes every second (±0.1 %) while a large one swings ±30 % with the bandwidth
        cap and the CPU; one pooled scale made every sample of a noisy setting an
        outlier (measured: 12 false alarms per hour on a stationary sequential reader;
        docs/journal.md (real devices))."""
        cfg = self.config
        e = table.get(key)
        if e is None:
            table[key] = [x, 1, 0.0, 0]      # level, samples, mean |dev|, deviations
            return math.nan
        mu, n, dev, m = e
        r = math.nan
        scale = max(abs(mu), cfg.level_floor) if cfg.relative else 1.0
        d = (x - mu) / scale
        armed = self._own_scale and self._pooled_n >= cfg.warmup
        spread = ((cfg.scale_prior * self._pooled_dev + m * dev) / (cfg.scale_prior + m)
                  if armed else math.nan)
        if n >= cfg.min_samples:
            var = 1.0 / n if n < 1.0 / cfg.forget else cfg.forget / (2.0 - cfg.forget)
            r = d / math.sqrt(1.0 + var)
            if self._own_scale and not armed:
                r = math.nan                  # the pooled spread is not known yet
            elif armed:
                r = r / max(spread * SIGMA_TO_MEAN_ABS, 1e-12)
        if armed:
            # level and spread learn from the winsorised sample: one wild second (or the
            # first seconds of a new workload) must not inflate the spread and drag the
            # level along, which would hide the change from the test
            lim = cfg.clip * max(spread * SIGMA_TO_MEAN_ABS, 1e-12)
            d = max(-lim, min(lim, d))
            x = mu + d * scale
        if n >= 2 or cfg.min_samples <= 1:  # the level's first sample deviates by 0
            a = max(1.0 / (m + 1), cfg.forget)
            e[2] = dev + a * (abs(d) - dev)
            e[3] = m + 1
            self._pooled_n += 1
            self._pooled_dev += max(1.0 / self._pooled_n, cfg.forget) * (
                abs(d) - self._pooled_dev)
        n += 1
        e[0] = mu + max(1.0 / n, cfg.forget) * (x - mu)
        e[1] = n
        return r

    def _effective(self, hist: deque) -> Hashable:
        """The setting behind the newest sample: the key given ``delay`` updates ago, or,
        with ``delays``, element j of the key given ``delays[j]`` updates ago."""
        d = self.config.delays
        if not d:
            return hist[-1 - self.config.delay]
        return tuple(hist[-1 - dj][j] for j, dj in enumerate(d))

    def _residual(self, table: dict, key: Hashable, x: np.ndarray) -> np.ndarray:
        cfg = self.config
        e = table.get(key)
        if e is None:
            table[key] = [x.copy(), 1]
            return np.full(len(x), np.nan)
        mu, n = e
        r = np.full(len(x), np.nan)
        if n >= cfg.min_samples:
            var = 1.0 / n if n < 1.0 / cfg.forget else cfg.forget / (2.0 - cfg.forget)
            d = x - mu
            if cfg.relative:
                d = d / np.maximum(np.abs(mu), cfg.level_floor)
            r = d / math.sqrt(1.0 + var)
        n += 1
        a = max(1.0 / n, cfg.forget)
        e[0] = mu + a * (x - mu)
        e[1] = n
        return r

    def _test(self, r: np.ndarray) -> bool:
        self.residual = r
        if self.pool == "mean":
            ok = np.isfinite(r)
            r = np.array([r[ok].mean() if ok.any() else np.nan])
        alarm = self.detector.update(r)          # NaN: no sample, but the clock runs
        if alarm and self.config.clear_on_alarm:
            keep = [list(q) for q in self._keys]
            pooled = self._pooled_dev, self._pooled_n     # the noise's spread stays
            self.reset_tables()
            self._pooled_dev, self._pooled_n = pooled
            for q, old in zip(self._keys, keep):
                q.extend(old)
        return alarm

    def counters(self) -> dict[str, Any]:
        out = self.detector.counters()
        out["settings_seen"] = sum(self.settings_seen(i) for i in range(self.streams))
        return out


class _DenseTables:
    """:meth:`SettingResidualDetector.update_many`'s per-stream tables as arrays, for
    many streams with one delay and the pooled scale (the per-node vote): every setting
    gets an id, a stream's level and count of setting j sit in ``mu[stream, j]`` and
    ``n[stream, j]`` (0: unseen), the key history is a ring of ids. The arithmetic of
    :meth:`SettingResidualDetector._residual_scalar`, elementwise in float64, so the
    residuals are the same to the bit; ~15 µs per stream and tick less at 128 streams.
    (The per-setting spreads are not kept: without ``scale_prior`` nothing reads them.)"""

    def __init__(self, streams: int, history: int):
        self.streams, self.history = streams, history
        self.ids: dict[Hashable, int] = {}
        self.ring = np.zeros((history, streams), np.int64)
        self.appended = 0               # updates seen (the ring is full from ``history``)
        self.used = False               # update() called: these tables are the live ones
        self.mu = np.zeros((streams, 16))
        self.n = np.zeros((streams, 16), np.int64)

    def clear(self) -> None:
        """Forget every level; the key history stays (as the deques do)."""
        self.mu[:] = 0.0
        self.n[:] = 0

    def _id(self, key: Hashable) -> int:
        j = self.ids.setdefault(key, len(self.ids))
        if j >= self.mu.shape[1]:
            grow = self.mu.shape[1]
            self.mu = np.concatenate([self.mu, np.zeros((self.streams, grow))], axis=1)
            self.n = np.concatenate([self.n, np.zeros((self.streams, grow), np.int64)], axis=1)
        return j

    def expected(self, key: Hashable, stream: int) -> float | None:
        j = self.ids.get(key)
        return None if j is None or self.n[stream, j] == 0 else float(self.mu[stream, j])

    def seen(self, stream: int) -> int:
        return int(np.count_nonzero(self.n[stream]))

    def update(self, xs: np.ndarray, keys: Sequence[Hashable],
               cfg: ChangeDetectorConfig) -> np.ndarray:
        self.used = True
        ids = self.ids
        kid = [ids.get(k) for k in keys]
        if None in kid:
            kid = [self._id(k) for k in keys]
        self.ring[self.appended % self.history] = kid
        self.appended += 1
        r = np.full(self.streams, np.nan)
        if self.appended < self.history:
            return r
        eff = self.ring[(self.appended - 1 - cfg.delay) % self.history]
        rows = np.flatnonzero(np.isfinite(xs))
        cols, x = eff[rows], xs[rows]
        n, mu = self.n[rows, cols], self.mu[rows, cols]
        new = n == 0
        self.mu[rows[new], cols[new]] = x[new]
        self.n[rows[new], cols[new]] = 1
        old = ~new
        rows, cols, x, n, mu = rows[old], cols[old], x[old], n[old], mu[old]
        nf = n.astype(float)
        d = x - mu
        if cfg.relative:
            d = d / np.maximum(np.abs(mu), cfg.level_floor)
        var = np.where(nf < 1.0 / cfg.forget, 1.0 / nf, cfg.forget / (2.0 - cfg.forget))
        counted = n >= cfg.min_samples
        r[rows[counted]] = (d / np.sqrt(1.0 + var))[counted]
        n1 = nf + 1.0
        self.mu[rows, cols] = mu + np.maximum(1.0 / n1, cfg.forget) * (x - mu)
        self.n[rows, cols] = n + 1
        return r


__all__ = ["ChangeDetectorConfig", "ChangeDetector", "SettingResidualDetector"]
