"""ClusterSim: N storage clients sharing S servers, each client with its own knobs.

The multi-node sibling of :class:`~storagegamesim.game.StorageGameSim` (issue 11). It
models a Lustre-like cluster: every client node has a congestion window ``w`` (RPCs in
flight, like ``osc.*.max_rpcs_in_flight``) and an I/O rate limit ``τ`` (MB/s, the game's
rate limit; a stand-in for ``max_dirty_mb``/NRS-TBF throttling), and runs a workload with
a demand ``d`` (MB/s, ``inf``: as much as it gets) and a write fraction ``f``. Clients are
attached to servers in contiguous blocks (client i to server ⌊i·S/N⌋); a server is shared
by its clients, so one client's large window costs the others.

Model, per simulated second (tick), for every server s and its clients i (all in seconds,
MB and MB/s; b = RPC size, τ0 = base round trip, C_s = server capacity in read-MB/s,
κ_w = write cost, K = thrashing point in RPCs, p = thrashing power)::

    cap_i  = min(τ_i, d_i)                       rate limit and demand (0 when idle)
    q_i(R) = min(w_i, cap_i · R / b)             RPCs in flight: Little's law, ≤ window
    x_i(R) = q_i(R) · b / R                      = min(w_i · b / R, cap_i)  (throughput)
    h_i    = b · (1 + f_i (κ_w − 1)) / C_s       server time of one of i's RPCs
    Q_s    = Σ_i q_i,    W_s = Σ_i q_i h_i       RPCs and work outstanding at the server
    g(Q)   = 1 + (Q / K)^p                       thrashing (seeks, locks, cache misses)
    R_s    = τ0 + (b / C_s + W_s) · g(Q_s)       the round trip (RTT) of every RPC

The last line is a processor-sharing server: an RPC completes once the work queued with
it, its own included, has been served, at a capacity that degrades as the queue grows.
R_s is its fixed point, found per server by Illinois regula falsi between
R = τ0 + b/C_s (idle) and Ψ(∞) (every client window-limited); Ψ(R) is non-decreasing and
bounded, so a root exists in that bracket. With n window-limited clients of window w on
a server (Q = n·w) the server's throughput is
``X(Q) = Q·b / (τ0 + (b/C + Q·h)·(1 + (Q/K)^p))``: it rises like Michaelis–Menten
(half-way near the bandwidth-delay product Q ≈ τ0/h), peaks near
``Q* ≈ (τ0·K^p / (p·h))^(1/(p+1))`` and falls beyond (congestion collapse). So the best
window per client is ≈ Q*/n: it moves when clients go idle, when the read/write mix
changes (h), when a server slows down (C) or when the thrashing point moves (K), and a
demand-limited client leaves room for the others' windows.

Per-node PIs (:data:`PI_NAMES`), as real collectors report them: ``throughput`` x_i,
``latency_ms`` (1000·R_s, the OSC's RPC round trip), ``rpcs_in_flight`` q_i, ``dirty_mb``
(f_i·q_i·b: written data not yet acknowledged) and the knob values. The four measured PIs
carry Gaussian noise with a standard deviation of ``noise`` × their noise-free value
(clipped at 0); knob changes take effect ``delay_ticks`` ticks late, workload changes at
once. The objective is the total throughput Σ x_i, minus ``fairness_alpha`` × the
standard deviation of the active clients' throughputs (thesis Eq. 3.1) when set.

Workload phases (:class:`~storagegamesim.phases.ClusterPhase`) change the workload mix,
the demand, the share of active clients, the noise, the servers' capacity or thrashing
point, or which clients are in the cluster at all (``absent``: a node joins or leaves)
at a given tick. :func:`best_static` finds the best static setting of a phase by
search (one setting shared by all nodes, or one per workload class), which is what
:func:`~storagegamesim.phases.score_phases` compares a run against.

Everything is numpy, vectorised over nodes (and over candidate settings in the search):
no Python loop over nodes anywhere.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from capes.common.config import to_table
from capes.common.params import ParameterSpec
from capes.common.step_grid import StepGrid
from storagegamesim.phases import (ClusterPhase, Workload, phase_starts,
                                   validate_schedule)

PI_NAMES = ("throughput", "latency_ms", "rpcs_in_flight", "dirty_mb", "window", "rate_limit")
KNOBS = ("window", "rate_limit")
_MEASURED = ("throughput", "latency_ms", "rpcs_in_flight", "dirty_mb")
# the workload's signature (``signature_pis``, issue 25): per node, its class's read
# share, request size and sequential share (0 when idle), each with relative noise
# ``signature_noise``; they do not change the model, they let a tuner tell classes apart
SIGNATURE_PI_NAMES = ("read_fraction", "request_kb", "sequential")


@dataclass
class ClusterConfig:
    nodes: int = 8
    servers: int = 0                  # 0: one per ``clients_per_server`` clients
    clients_per_server: int = 8
    server_capacity: float = 2000.0   # MB/s of reads a server moves at best
    write_cost: float = 1.5           # a written MB costs this many read MB of capacity
    rpc_size_mb: float = 1.0
    base_rtt_ms: float = 40.0         # round trip of an RPC on an idle server
    thrash_rpcs: float = 450.0        # K: RPCs outstanding at which g(Q) = 2
    thrash_power: float = 2.0         # p
    noise: float = 0.01               # Gaussian noise std-dev as a fraction of each PI
    delay_ticks: int = 3              # knob changes show up this many ticks late
    fairness_alpha: float = 0.0       # objective = Σ x − α · stdev(x of active clients)
    win_band: float = 0.10            # in band: objective >= (1 − band) × best static
    win_hold_ticks: int = 20          # a phase is won after more ticks than this in band
    time_limit_ticks: int = 3600
    layout_seed: int = 0              # which nodes run which class / are active
    best_static: Literal["shared", "class"] = "shared"   # the ideal the sim judges by
    window: ParameterSpec = field(default_factory=lambda: ParameterSpec(
        min=1, max=256, step=1, default=8))
    rate_limit: ParameterSpec = field(default_factory=lambda: ParameterSpec(
        min=50, max=2000, step=50, default=2000))
    workloads: list[Workload] = field(default_factory=lambda: [Workload()])
    absent: list[int] = field(default_factory=list)   # nodes not in the cluster (yet)
    phases: list[ClusterPhase] = field(default_factory=list)
    signature_pis: bool = False       # report SIGNATURE_PI_NAMES too
    signature_noise: float = 0.10

    def pi_names(self) -> tuple[str, ...]:
        return PI_NAMES + SIGNATURE_PI_NAMES if self.signature_pis else PI_NAMES

    def validate(self) -> None:
        if not 0 <= self.signature_noise <= 10:
            raise ValueError(f"signature_noise: must lie in [0, 10] (got {self.signature_noise})")
        if self.nodes < 1:
            raise ValueError(f"nodes: must be >= 1 (got {self.nodes})")
        if self.servers < 0:
            raise ValueError(f"servers: must be >= 0 (got {self.servers})")
        if self.clients_per_server < 1:
            raise ValueError(f"clients_per_server: must be >= 1 (got {self.clients_per_server})")
        if self.n_servers > self.nodes:
            raise ValueError(f"servers: must be <= nodes ({self.nodes}), every server "
                             f"needs a client (got {self.n_servers})")
        for key in ("server_capacity", "rpc_size_mb", "base_rtt_ms", "thrash_rpcs"):
            v = getattr(self, key)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{key}: must be a finite number > 0 (got {v})")
        if not 1 <= self.write_cost <= 100:
            raise ValueError(f"write_cost: must lie in [1, 100] (got {self.write_cost})")
        if not 1 <= self.thrash_power <= 8:
            raise ValueError(f"thrash_power: must lie in [1, 8] (got {self.thrash_power})")
        if self.noise < 0:
            raise ValueError(f"noise: must be >= 0 (got {self.noise})")
        if self.noise > 1:            # as converge-test --noise: 10 is not 1,000 %
            raise ValueError(f"noise: a fraction of the throughput, at most 1 (0.1 is 10 %); "
                             f"{self.noise:g} would be {self.noise * 100:g} %")
        if self.delay_ticks < 0:
            raise ValueError(f"delay_ticks: must be >= 0 (got {self.delay_ticks})")
        if self.fairness_alpha < 0:
            raise ValueError(f"fairness_alpha: must be >= 0 (got {self.fairness_alpha})")
        if not 0 < self.win_band < 1:
            raise ValueError(f"win_band: must lie in (0, 1) (got {self.win_band})")
        if self.win_hold_ticks < 0:
            raise ValueError(f"win_hold_ticks: must be >= 0 (got {self.win_hold_ticks})")
        if self.time_limit_ticks < 1:
            raise ValueError(f"time_limit_ticks: must be >= 1 (got {self.time_limit_ticks})")
        if not self.workloads:
            raise ValueError("workloads: must name at least one workload class")
        for spec, key in ((self.window, "window"), (self.rate_limit, "rate_limit")):
            if spec.min <= 0:
                raise ValueError(f"{key}.min: must be > 0 (got {spec.min})")
        validate_schedule(self.phases, self.time_limit_ticks)
        for i, ph in enumerate(self.phases):
            try:
                ph.validate()
            except ValueError as exc:
                raise ValueError(f"phases[{i}].{exc}") from None
        for key, absent in [("absent", self.absent)] + [
                (f"phases[{i}].absent", ph.absent) for i, ph in enumerate(self.phases)
                if ph.absent is not None]:
            if not all(0 <= i < self.nodes for i in absent):
                raise ValueError(f"{key}: node indices must lie in [0, {self.nodes}) "
                                 f"(got {absent})")
            if len(set(absent)) == self.nodes:
                raise ValueError(f"{key}: at least one node must be in the cluster")

    @property
    def n_servers(self) -> int:
        return self.servers or math.ceil(self.nodes / self.clients_per_server)

    def param_specs(self) -> dict[str, ParameterSpec]:
        """The per-node knobs, as the engine and the action checker see them."""
        self.window.name, self.rate_limit.name = "window", "rate_limit"
        return {"rate_limit": self.rate_limit, "window": self.window}

    def node_names(self) -> list[str]:
        width = max(4, len(str(self.nodes - 1)))
        return [f"c{i:0{width}d}" for i in range(self.nodes)]


# --------------------------------------------------------------------------- phase state
@dataclass
class PhaseState:
    """Everything the model needs in one phase, as per-node / per-server arrays."""
    index: int
    name: str
    workloads: list[Workload]
    klass: np.ndarray          # (N,) workload class of every node
    present: np.ndarray        # (N,) bool: in the cluster (an absent node sends no PIs)
    active: np.ndarray         # (N,) bool: present and doing I/O
    demand: np.ndarray         # (N,) MB/s, 0 when idle
    write_fraction: np.ndarray  # (N,)
    h: np.ndarray              # (N,) server seconds per RPC of the node
    h0: np.ndarray             # (S,) server seconds per read RPC
    noise: float
    thrash_rpcs: float
    signature: np.ndarray | None = None   # (3, N): read share, request KiB, sequential


class _Layout:
    """Which server each node uses, and the fixed random draws of ``layout_seed``."""

    def __init__(self, cfg: ClusterConfig):
        n, s = cfg.nodes, cfg.n_servers
        self.n, self.s = n, s
        self.server = (np.arange(n) * s) // n                     # contiguous blocks
        self.starts = np.searchsorted(self.server, np.arange(s))  # first node per server
        rng = np.random.default_rng(cfg.layout_seed)
        self.class_order = rng.permutation(n)
        self.active_order = rng.permutation(n)
        self.z = rng.standard_normal(n)


def _phase_states(cfg: ClusterConfig, layout: _Layout) -> list[PhaseState]:
    cur = {"workloads": list(cfg.workloads), "demand_scale": 1.0, "active_fraction": 1.0,
           "noise": cfg.noise, "capacity_scale": 1.0, "thrash_rpcs": cfg.thrash_rpcs,
           "absent": list(cfg.absent)}
    out = []
    for k, ph in enumerate([None] + list(cfg.phases)):
        if ph is not None:
            for key in cur:
                v = getattr(ph, key)
                if v is not None:
                    cur[key] = list(v) if key == "workloads" else v
        out.append(_state(cfg, layout, k, ph.name if ph is not None else "", cur))
    return out


def _state(cfg: ClusterConfig, layout: _Layout, k: int, name: str, cur: dict) -> PhaseState:
    n = layout.n
    wls: list[Workload] = cur["workloads"]
    shares = np.array([w.share for w in wls], float)
    counts = _largest_remainder(shares / shares.sum() * n)
    labels = np.repeat(np.arange(len(wls)), counts)
    klass = np.empty(n, np.int64)
    klass[layout.class_order] = labels
    present = np.ones(n, bool)
    present[cur["absent"]] = False
    active = np.zeros(n, bool)
    n_active = max(1, int(round(cur["active_fraction"] * n)))
    active[layout.active_order[:n_active]] = True
    active &= present
    base = np.array([w.demand for w in wls], float)[klass]
    sigma = np.array([w.demand_spread for w in wls], float)[klass]
    scale = cur["demand_scale"]
    with np.errstate(invalid="ignore"):
        demand = np.where(np.isinf(base), math.inf if scale > 0 else 0.0,
                          base * scale * np.exp(sigma * layout.z - 0.5 * sigma ** 2))
    demand = np.where(active, demand, 0.0)
    wf = np.array([w.write_fraction for w in wls], float)[klass]
    cap = np.full(layout.s, cfg.server_capacity * cur["capacity_scale"])
    b = cfg.rpc_size_mb
    h = b * (1.0 + wf * (cfg.write_cost - 1.0)) / cap[layout.server]
    sig = np.array([[1.0 - w.write_fraction, w.request_kb, w.sequential] for w in wls],
                   float)[klass].T * active
    return PhaseState(k, name, wls, klass, present, active, demand, wf, h, b / cap,
                      float(cur["noise"]), float(cur["thrash_rpcs"]), sig)


def _largest_remainder(quotas: np.ndarray) -> np.ndarray:
    counts = np.floor(quotas).astype(np.int64)
    short = int(round(quotas.sum())) - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(quotas - counts), kind="stable")[:short]] += 1
    return counts


# --------------------------------------------------------------------------- the model
def _solve(cfg: ClusterConfig, layout: _Layout, st: PhaseState, w: np.ndarray,
           cap: np.ndarray, tol: float = 1e-10, max_iter: int = 100):
    """Steady state for windows ``w`` and caps ``cap`` of shape (..., N).

    Returns (R (..., S) in seconds, q (..., N), x (..., N))."""
    b, tau0 = cfg.rpc_size_mb, cfg.base_rtt_ms / 1000.0
    K, p = st.thrash_rpcs, cfg.thrash_power
    srv, starts, h, h0 = layout.server, layout.starts, st.h, st.h0
    cap_b = cap / b

    def psi(R):
        q = np.minimum(w, cap_b * R[..., srv])
        Q = np.add.reduceat(q, starts, axis=-1)
        W = np.add.reduceat(q * h, starts, axis=-1)
        return tau0 + (h0 + W) * (1.0 + (Q / K) ** p)

    wa = np.where(cap > 0, w, 0.0)
    Qmax = np.add.reduceat(wa, starts, axis=-1)
    Wmax = np.add.reduceat(wa * h, starts, axis=-1)
    lo = np.broadcast_to(tau0 + h0, Qmax.shape).copy()
    hi = tau0 + (h0 + Wmax) * (1.0 + (Qmax / K) ** p)
    flo = psi(lo) - lo
    fhi = psi(hi) - hi
    R = hi.copy()
    done = (flo <= tol * lo) | (fhi >= -tol * hi)
    R = np.where(flo <= tol * lo, lo, R)
    side = np.zeros(lo.shape, np.int8)
    for _ in range(max_iter):
        if done.all():
            break
        denom = flo - fhi
        c = np.where(denom > 0, (lo * fhi - hi * flo) / np.where(denom > 0, -denom, 1.0), lo)
        c = np.where(done, R, c)
        fc = psi(c) - c
        conv = done | (np.abs(fc) <= tol * c) | ((hi - lo) <= tol * c)
        R = np.where(done, R, c)
        pos = fc > 0                       # root above c
        lo, flo = np.where(pos, c, lo), np.where(pos, fc, flo)
        hi, fhi = np.where(pos, hi, c), np.where(pos, fhi, fc)
        fhi = np.where(pos & (side == 1), fhi * 0.5, fhi)      # Illinois
        flo = np.where(~pos & (side == -1), flo * 0.5, flo)
        side = np.where(pos, 1, -1).astype(np.int8)
        done = conv
    q = np.minimum(w, cap_b * R[..., srv])
    x = q * b / R[..., srv]
    return R, q, x


def objective(x: np.ndarray, active: np.ndarray, alpha: float) -> np.ndarray:
    """Σ x − α · stdev(x over the active nodes), over the last axis."""
    total = x.sum(axis=-1)
    if alpha:
        total = total - alpha * x[..., active].std(axis=-1)
    return total


# --------------------------------------------------------------------------- the sim
class ClusterSim:
    """One cluster game. ``set_params`` changes knobs (all nodes or some); ``tick``
    advances one simulated second; ``pis`` returns per-node PI arrays.

    ``judge`` (default True) keeps the game's win rule per phase (``streak``, ``won``,
    ``phase_won``) against the best static setting of each phase; it needs
    :func:`phase_optima`, searched on the first tick unless ``optima`` are given (they are
    cached per config, so many seeds of one config pay once). With ``judge=False`` no
    search runs and ``won`` stays False; score the trace with
    :func:`~storagegamesim.phases.score_phases` instead."""

    def __init__(self, config: ClusterConfig | None = None, seed: int | None = None,
                 optima: Sequence["StaticOptimum"] | None = None, judge: bool = True):
        self.config = config or ClusterConfig()
        self.judge = judge
        self._layout = _Layout(self.config)
        self._states = _phase_states(self.config, self._layout)
        self._optima = list(optima) if optima is not None else None
        self.node_names = self.config.node_names()
        self.reset(seed)

    # ---- state
    def reset(self, seed: int | None = None) -> None:
        cfg, n = self.config, self.config.nodes
        self.rng = np.random.default_rng(seed)
        self.window = np.full(n, float(cfg.window.default))
        self.rate_limit = np.full(n, float(cfg.rate_limit.default))
        d = cfg.delay_ticks + 1
        self._hist_w = np.tile(self.window, (d, 1))
        self._hist_r = np.tile(self.rate_limit, (d, 1))
        self._pos = 0
        self.ticks = 0
        self.phase = 0
        self.phase_starts = phase_starts(cfg.phases)
        self.streak = 0
        self.won = False
        self.phase_won = [False] * len(self._states)
        self._cache_key = None
        self.solves = 0
        self._evaluate(self.window, self.rate_limit)
        self.throughput = self.true_throughput.copy()
        self.latency_ms = self.true_latency_ms.copy()
        self.rpcs_in_flight = self.true_rpcs_in_flight.copy()
        self.dirty_mb = self.true_dirty_mb.copy()
        self.objective = self.true_objective

    @property
    def nodes(self) -> int:
        return self.config.nodes

    @property
    def state(self) -> PhaseState:
        """The workload in force (phase state)."""
        return self._states[self.phase]

    @property
    def present(self) -> np.ndarray:
        """(N,) bool: the nodes in the cluster now (:attr:`ClusterConfig.absent`, a
        phase's ``absent``); an absent node does no I/O and its agent sends no PIs."""
        return self.state.present

    @property
    def phase_names(self) -> list[str]:
        """A name per phase (the schedule's, or "phase k")."""
        return [st.name or f"phase {st.index}" for st in self._states]

    @property
    def over(self) -> bool:
        if self.config.phases:
            return self.ticks >= self.config.time_limit_ticks
        return self.won or self.ticks >= self.config.time_limit_ticks

    # ---- knobs
    def set_params(self, window=None, rate_limit=None, nodes=None) -> None:
        """Apply knob values to ``nodes`` (index array, slice or mask; None: all),
        clamped to their ranges. Values are a scalar or one per selected node."""
        cfg = self.config
        sel = slice(None) if nodes is None else nodes
        if window is not None:
            self.window[sel] = np.clip(np.asarray(window, float), cfg.window.min, cfg.window.max)
        if rate_limit is not None:
            self.rate_limit[sel] = np.clip(np.asarray(rate_limit, float),
                                           cfg.rate_limit.min, cfg.rate_limit.max)

    # ---- time
    def tick(self) -> np.ndarray:
        """Advance one simulated second; return the measured per-node throughput."""
        cfg = self.config
        d = cfg.delay_ticks + 1
        self._pos = (self._pos + 1) % d
        self._hist_w[self._pos] = self.window
        self._hist_r[self._pos] = self.rate_limit
        oldest = (self._pos + 1) % d
        self.ticks += 1
        nxt = self.phase + 1
        if nxt < len(self.phase_starts) and self.ticks >= self.phase_starts[nxt]:
            self.phase = nxt
            self.streak = 0
        self._evaluate(self._hist_w[oldest], self._hist_r[oldest])
        st = self.state
        true = (self.true_throughput, self.true_latency_ms, self.true_rpcs_in_flight,
                self.true_dirty_mb)
        if st.noise:
            z = self.rng.standard_normal((len(true), cfg.nodes))
            meas = [np.maximum(0.0, v * (1.0 + st.noise * z[i])) for i, v in enumerate(true)]
        else:
            meas = [v.copy() for v in true]
        self.throughput, self.latency_ms, self.rpcs_in_flight, self.dirty_mb = meas
        if cfg.signature_pis:           # drawn last: without it the stream is unchanged
            z = self.rng.standard_normal(st.signature.shape)
            sig = st.signature * np.maximum(0.0, 1.0 + cfg.signature_noise * z)
            sig[[0, 2]] = np.minimum(sig[[0, 2]], 1.0)
            self.signature = sig
        self.objective = float(objective(self.throughput, st.active, cfg.fairness_alpha))
        if self.judge:
            self._judge()
        return self.throughput

    def _judge(self) -> None:
        cfg = self.config
        ideal = self.ideal_objective
        if self.true_objective >= (1.0 - cfg.win_band) * ideal:
            self.streak += 1
        else:
            self.streak = 0
        if self.streak > cfg.win_hold_ticks:
            if cfg.phases:
                self.phase_won[self.phase] = True
                self.won = all(self.phase_won)
            else:
                self.won = True

    def _evaluate(self, w: np.ndarray, r: np.ndarray) -> None:
        key = (self.phase, w.tobytes(), r.tobytes())
        if key == self._cache_key:
            return
        st, cfg = self.state, self.config
        cap = np.minimum(r, st.demand)
        R, q, x = _solve(cfg, self._layout, st, w, cap)
        self.solves += 1
        self._cache_key = key
        self.server_rtt_ms = R * 1000.0
        self.true_throughput = x
        self.true_latency_ms = self.server_rtt_ms[self._layout.server]
        self.true_rpcs_in_flight = q
        self.true_dirty_mb = st.write_fraction * q * cfg.rpc_size_mb
        self.true_objective = float(objective(x, st.active, cfg.fairness_alpha))

    # ---- what a monitoring agent reads
    def pis(self) -> dict[str, np.ndarray]:
        """Per-node PIs (arrays of length ``nodes``), measured (noisy) values."""
        out = {"throughput": self.throughput, "latency_ms": self.latency_ms,
               "rpcs_in_flight": self.rpcs_in_flight, "dirty_mb": self.dirty_mb,
               "window": self.window.copy(), "rate_limit": self.rate_limit.copy()}
        if self.config.signature_pis:
            out.update(zip(SIGNATURE_PI_NAMES, getattr(self, "signature", self.state.signature)))
        return out

    def node_pis(self, i: int) -> dict[str, float]:
        return {k: float(v[i]) for k, v in self.pis().items()}

    @property
    def total_throughput(self) -> float:
        return float(self.throughput.sum())

    @property
    def true_total_throughput(self) -> float:
        return float(self.true_throughput.sum())

    # ---- the ideal
    def optima(self) -> list["StaticOptimum"]:
        """Best static setting of every phase (``config.best_static`` mode), cached."""
        if self._optima is None:
            self._optima = phase_optima(self.config, self.config.best_static)
        return self._optima

    @property
    def ideal_objective(self) -> float:
        """Noise-free objective of the best static setting of the phase in force."""
        return self.optima()[self.phase].objective

    def class_nodes(self, phase: int) -> list[tuple[str, np.ndarray]]:
        """Per workload class of ``phase``: its name and its active nodes (scoring per
        node class: ``capes/experiments/recall_scoring.py``)."""
        st = self._states[phase]
        out = [(w.name, np.flatnonzero(st.active & (st.klass == k)))
               for k, w in enumerate(st.workloads)]
        return [(name, nodes) for name, nodes in out if len(nodes)]

    def evaluate(self, window, rate_limit, phase: int | None = None) -> dict:
        """Noise-free steady state of a static setting (scalar or per node), in ``phase``
        (default: the one in force); does not touch the game."""
        return evaluate(self.config, window, rate_limit,
                        self.phase if phase is None else phase,
                        _layout=self._layout, _states=self._states)


# --------------------------------------------------------------------------- search
@dataclass
class StaticOptimum:
    phase: int
    mode: str
    window: np.ndarray          # (N,) per node
    rate_limit: np.ndarray      # (N,)
    objective: float
    total_throughput: float
    evaluations: int

    def to_dict(self) -> dict:
        w, r = self.window, self.rate_limit
        out = {"phase": self.phase, "mode": self.mode, "objective": self.objective,
               "total_throughput": self.total_throughput, "evaluations": self.evaluations}
        if np.all(w == w[0]) and np.all(r == r[0]):
            out.update(window=float(w[0]), rate_limit=float(r[0]))
        else:
            out.update(window=w.tolist(), rate_limit=r.tolist())
        return out


def evaluate(cfg: ClusterConfig, window, rate_limit, phase: int = 0, *,
             _layout=None, _states=None) -> dict:
    """Noise-free steady state of a static setting in ``phase``: per-node arrays and the
    objective."""
    layout = _layout or _Layout(cfg)
    st = (_states or _phase_states(cfg, layout))[phase]
    n = cfg.nodes
    w = np.broadcast_to(np.clip(np.asarray(window, float), cfg.window.min, cfg.window.max),
                        (n,)).copy()
    r = np.broadcast_to(np.clip(np.asarray(rate_limit, float), cfg.rate_limit.min,
                                cfg.rate_limit.max), (n,)).copy()
    R, q, x = _solve(cfg, layout, st, w, np.minimum(r, st.demand))
    return {"throughput": x, "rpcs_in_flight": q, "latency_ms": 1000.0 * R[layout.server],
            "server_rtt_ms": 1000.0 * R, "total_throughput": float(x.sum()),
            "objective": float(objective(x, st.active, cfg.fairness_alpha))}


def _grid(spec: ParameterSpec, descending: bool = False) -> np.ndarray:
    """Every value of a knob on its step grid (ascending, or descending so that a tie
    goes to the larger value), forbidden values left out."""
    g = StepGrid.of([spec]).knob_values(0)
    g = g[~np.isin(g, spec.forbidden)] if spec.forbidden else g
    return g[::-1].copy() if descending else g


class _Scorer:
    """Objective of a batch of candidate settings, chunked to bound memory."""

    def __init__(self, cfg, layout, st, budget: int = 1 << 18):
        self.cfg, self.layout, self.st = cfg, layout, st
        self.chunk = max(1, budget // cfg.nodes)
        self.evaluations = 0

    def __call__(self, W: np.ndarray, R: np.ndarray) -> np.ndarray:
        out = np.empty(len(W))
        for i in range(0, len(W), self.chunk):
            w, r = W[i:i + self.chunk], R[i:i + self.chunk]
            _, _, x = _solve(self.cfg, self.layout, self.st, w, np.minimum(r, self.st.demand))
            out[i:i + self.chunk] = objective(x, self.st.active, self.cfg.fairness_alpha)
        self.evaluations += len(W)
        return out


def best_static(cfg: ClusterConfig, phase: int = 0, mode: str = "shared",
                exhaustive: bool = False, *, _layout=None, _states=None) -> StaticOptimum:
    """The best static setting of ``phase`` by search on the noise-free objective.

    ``mode="shared"``: one (window, rate limit) for every node. A coarse 2-D grid (about
    32 × 10 points) seeds a coordinate ascent of full 1-D scans over every value of each
    knob on its step grid, until a round changes nothing; ``exhaustive=True`` scans the
    full 2-D grid instead (the test checks the two agree on small cases).
    ``mode="class"``: one setting per workload class (nodes of a class share it; idle
    nodes keep the shared optimum), by coordinate ascent from the shared optimum: full
    1-D scans of each knob of each class in turn, until a round improves nothing."""
    layout = _layout or _Layout(cfg)
    st = (_states or _phase_states(cfg, layout))[phase]
    n = cfg.nodes
    wg, rg = _grid(cfg.window), _grid(cfg.rate_limit, descending=True)   # ties: larger τ
    score = _Scorer(cfg, layout, st)
    if exhaustive:
        W, Rr = np.meshgrid(wg, rg, indexing="ij")
        W, Rr = W.ravel(), Rr.ravel()
        vals = score(np.repeat(W[:, None], n, 1), np.repeat(Rr[:, None], n, 1))
        i = int(np.argmax(vals))
        w_best, r_best = np.full(n, W[i]), np.full(n, Rr[i])
    else:
        cw = wg[np.unique(np.linspace(0, len(wg) - 1, min(len(wg), 32)).round().astype(int))]
        cr = rg[np.unique(np.linspace(0, len(rg) - 1, min(len(rg), 10)).round().astype(int))]
        W, Rr = (a.ravel() for a in np.meshgrid(cw, cr, indexing="ij"))
        vals = score(np.repeat(W[:, None], n, 1), np.repeat(Rr[:, None], n, 1))
        i = int(np.argmax(vals))
        w0, r0, best = float(W[i]), float(Rr[i]), float(vals[i])
        for _ in range(20):
            v = score(np.repeat(wg[:, None], n, 1), np.full((len(wg), n), r0))
            w1 = float(wg[int(np.argmax(v))])
            v2 = score(np.full((len(rg), n), w1), np.repeat(rg[:, None], n, 1))
            r1 = float(rg[int(np.argmax(v2))])
            new = float(v2.max())
            if (w1, r1) == (w0, r0) or new <= best * (1 + 1e-12):
                if new > best:
                    w0, r0, best = w1, r1, new
                break
            w0, r0, best = w1, r1, new
        w_best, r_best = np.full(n, w0), np.full(n, r0)
    if mode == "class":
        w_best, r_best = _class_ascent(cfg, st, score, w_best, r_best, wg, rg)
    elif mode != "shared":
        raise ValueError(f"mode: must be 'shared' or 'class' (got {mode!r})")
    res = evaluate(cfg, w_best, r_best, phase, _layout=layout,
                   _states=_states or _phase_states(cfg, layout))
    return StaticOptimum(phase, mode, w_best, r_best, res["objective"],
                         res["total_throughput"], score.evaluations)


def _class_ascent(cfg, st, score, w, r, wg, rg):
    w, r = w.copy(), r.copy()
    groups = [np.flatnonzero(st.active & (st.klass == k)) for k in range(len(st.workloads))]
    groups = [g for g in groups if len(g)]
    best = float(score(w[None], r[None])[0])
    for _ in range(20):
        improved = False
        for g in groups:
            for grid, which in ((wg, 0), (rg, 1)):
                W = np.repeat(w[None], len(grid), 0)
                Rr = np.repeat(r[None], len(grid), 0)
                (W if which == 0 else Rr)[:, g] = grid[:, None]
                v = score(W, Rr)
                j = int(np.argmax(v))
                if v[j] > best * (1 + 1e-9):
                    best = float(v[j])
                    (w if which == 0 else r)[g] = grid[j]
                    improved = True
        if not improved:
            break
    return w, r


_OPTIMA_CACHE: dict[tuple[str, str], list[StaticOptimum]] = {}


def phase_optima(cfg: ClusterConfig, mode: str = "shared") -> list[StaticOptimum]:
    """:func:`best_static` of every phase, cached per (config, mode): the search is
    deterministic and does not depend on noise or seeds."""
    table = to_table(dataclasses.replace(cfg, noise=0.0, time_limit_ticks=1, phases=[
        dataclasses.replace(p, noise=None) for p in cfg.phases]))
    key = (repr(table), mode)
    if key not in _OPTIMA_CACHE:
        layout = _Layout(cfg)
        states = _phase_states(cfg, layout)
        _OPTIMA_CACHE[key] = [best_static(cfg, k, mode, _layout=layout, _states=states)
                              for k in range(len(states))]
    return _OPTIMA_CACHE[key]


__all__ = ["ClusterConfig", "ClusterSim", "ClusterPhase", "Workload", "PhaseState",
           "StaticOptimum", "PI_NAMES", "KNOBS", "best_static", "phase_optima", "evaluate",
           "objective"]
