"""StorageGameSim (thesis §5.2.2): two knobs, one noisy, delayed throughput.

The knobs are the congestion window m and the I/O rate limit τ. Every simulated second
(tick) the noise-free throughput is

    tp(m, τ) = min(peak_throughput · exp(−½ · ((m_eff − peak_window) / curve_width)²), τ)

a bell-shaped (unimodal) function of the window that peaks at ``peak_window``, capped by
the rate limit. ``m_eff`` is the window ``delay_ticks`` ticks ago, so an action's effect
shows up late. The measured throughput adds Gaussian noise whose standard deviation is
``noise`` × tp. The game is won when the *noise-free* throughput stays within
``win_band`` × ideal of the ideal throughput for more than ``win_hold_ticks``
consecutive ticks; it is lost after ``time_limit_ticks``.

Every constant comes from :class:`GameConfig`; its defaults are the paper's.

Workload phases (optional, none by default): ``GameConfig.phases`` is a schedule of
:class:`~storagegamesim.phases.GamePhase` entries; from a phase's ``at_tick`` on, its
``peak_window`` / ``curve_width`` / ``peak_throughput`` / ``noise`` replace the game's
(``game.active`` is the config in force, ``game.phase`` its index). With phases, every
phase is judged on its own ideal and its own streak (``phase_won``); a win no longer ends
the game, which plays to its time limit, and ``won`` means every phase was won.

Workloads (optional, none by default): ``GameConfig.workloads`` names workloads, each with
its own optimum (``peak_window``, ``curve_width``, ``peak_throughput``) and a *signature*:
what a real monitor sees of it (read share, mean request size, sequential share, queue
depth). ``game.workload`` runs from tick 0, and a phase's ``workload`` switches to another
from its ``at_tick`` on, so a schedule of phases alternates and repeats them (A B A C B A
…; ``configs/recurring-workloads.toml``). With workloads the game reports the signature
as four more PIs (:data:`SIGNATURE_PI_NAMES`), each multiplied by a noise factor
``1 + signature_noise · N(0, 1)`` every tick; the signature does not depend on the knobs
(a real queue depth does: this game leaves that out). Without workloads the PIs, and the
random stream, are the paper game's.

A workload family (optional, ``[game.family]``, :mod:`storagegamesim.family`): members along
one continuous parameter, the write fraction; ``game.write_fraction`` names the member
this game plays (``configs/workload-family.toml``).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from capes.common.params import ParameterSpec
from storagegamesim.family import WorkloadFamily
from storagegamesim.phases import GamePhase, phase_starts, validate_schedule

PI_NAMES = ("throughput", "window", "rate_limit")
SIGNATURE_PI_NAMES = ("read_fraction", "request_kb", "sequential", "queue_depth")


@dataclass
class GameWorkload:
    """One workload of the game: where its optimum lies and what a monitor sees of it."""
    name: str = ""
    peak_window: float = 50.0
    curve_width: float = 20.0
    peak_throughput: float = 100.0
    read_fraction: float = 0.5     # share of requests that are reads
    request_kb: float = 64.0       # mean request size, KiB
    sequential: float = 0.5        # share of requests that continue the previous one
    queue_depth: float = 8.0       # requests outstanding at the device

    def validate(self) -> None:
        if not self.name:
            raise ValueError("name: every workload needs a name")
        for key in ("curve_width", "peak_throughput", "request_kb", "queue_depth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}: must be > 0 (got {getattr(self, key)})")
        for key in ("read_fraction", "sequential"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key}: must lie in [0, 1] (got {getattr(self, key)})")

    def signature(self) -> np.ndarray:
        return np.array([getattr(self, k) for k in SIGNATURE_PI_NAMES], float)


@dataclass
class GameConfig:
    peak_window: float = 50.0
    curve_width: float = 20.0
    peak_throughput: float = 100.0
    delay_ticks: int = 3
    noise: float = 0.01
    win_band: float = 0.10
    win_hold_ticks: int = 20
    time_limit_ticks: int = 3600
    window: ParameterSpec = field(default_factory=lambda: ParameterSpec(
        min=1, max=100, step=1, default=10))
    rate_limit: ParameterSpec = field(default_factory=lambda: ParameterSpec(
        min=10, max=200, step=10, default=50))
    phases: list[GamePhase] = field(default_factory=list)
    workloads: list[GameWorkload] = field(default_factory=list)
    workload: str = ""            # the workload of phase 0 (with workloads)
    signature_noise: float = 0.10  # relative noise of the signature PIs
    # a workload family (storagegamesim/family.py): the game plays its member at
    # ``write_fraction``, which replaces ``workloads`` and ``workload``
    family: WorkloadFamily | None = None
    write_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.family is not None and self.write_fraction is not None \
                and 0 <= self.write_fraction <= 1:
            member = self.family.workload(self.write_fraction)
            self.workloads, self.workload = [member], member.name

    def validate(self) -> None:
        if (self.family is None) != (self.write_fraction is None):
            raise ValueError("write_fraction: a workload family plays the member at "
                             "game.write_fraction; give both [game.family] and it, or neither")
        if self.family is not None:
            if not 0 <= self.write_fraction <= 1:
                raise ValueError(f"write_fraction: must lie in [0, 1] "
                                 f"(got {self.write_fraction})")
            if any(ph.workload is not None for ph in self.phases):
                raise ValueError("phases: a family's game plays one member; a phase "
                                 "cannot name a workload")
        if not self.curve_width > 0:
            raise ValueError(f"curve_width: must be > 0 (got {self.curve_width})")
        if not self.peak_throughput > 0:
            raise ValueError(f"peak_throughput: must be > 0 (got {self.peak_throughput})")
        if self.delay_ticks < 0:
            raise ValueError(f"delay_ticks: must be >= 0 (got {self.delay_ticks})")
        if self.noise < 0:
            raise ValueError(f"noise: must be >= 0 (got {self.noise})")
        if self.noise > 1:            # as converge-test --noise: 10 is not 1,000 %
            raise ValueError(f"noise: a fraction of the throughput, at most 1 (0.1 is 10 %); "
                             f"{self.noise:g} would be {self.noise * 100:g} %")
        if not 0 < self.win_band < 1:
            raise ValueError(f"win_band: must lie in (0, 1) (got {self.win_band})")
        if self.win_hold_ticks < 0:
            raise ValueError(f"win_hold_ticks: must be >= 0 (got {self.win_hold_ticks})")
        if not 1 <= self.time_limit_ticks <= 10**9:
            raise ValueError(f"time_limit_ticks: must lie in [1, 1e9] (got "
                             f"{self.time_limit_ticks})")
        if self.delay_ticks > 10**6:        # the game keeps that many past windows
            raise ValueError(f"delay_ticks: must be at most 1e6 (got {self.delay_ticks})")
        if not self.window.min <= self.peak_window <= self.window.max:
            raise ValueError(f"peak_window: must lie in the window's range "
                             f"[{self.window.min}, {self.window.max}]")
        validate_schedule(self.phases, self.time_limit_ticks)
        self._validate_workloads()
        for i, ph in enumerate(self.phases):
            ph.validate()
            if ph.workload is not None and ph.workload not in self._workload_names():
                raise ValueError(f"phases[{i}].workload: unknown workload {ph.workload!r} "
                                 f"(known: {', '.join(self._workload_names()) or 'none'})")
            if ph.peak_window is not None and not (
                    self.window.min <= ph.peak_window <= self.window.max):
                raise ValueError(f"phases[{i}].peak_window: must lie in the window's range "
                                 f"[{self.window.min}, {self.window.max}]")

    def _workload_names(self) -> list[str]:
        return [w.name for w in self.workloads]

    def _validate_workloads(self) -> None:
        names = self._workload_names()
        for i, w in enumerate(self.workloads):
            try:
                w.validate()
            except ValueError as exc:
                raise ValueError(f"workloads[{i}].{exc}") from None
            if not self.window.min <= w.peak_window <= self.window.max:
                raise ValueError(f"workloads[{i}].peak_window: must lie in the window's "
                                 f"range [{self.window.min}, {self.window.max}]")
        if len(set(names)) != len(names):
            raise ValueError(f"workloads: names must be unique (got {', '.join(names)})")
        if names and self.workload not in names:
            raise ValueError(f"workload: name the workload of phase 0, one of "
                             f"{', '.join(names)} (got {self.workload!r})")
        if not names and self.workload:
            raise ValueError(f"workload: {self.workload!r} names no entry of workloads")
        if not 0 <= self.signature_noise <= 10:
            raise ValueError(f"signature_noise: must lie in [0, 10] (got "
                             f"{self.signature_noise})")

    def _with_workload(self, name: str | None) -> "GameConfig":
        """This config running workload ``name``: its optimum replaces the curve's."""
        if not name:
            return self
        w = self.workloads[self._workload_names().index(name)]
        return dataclasses.replace(self, phases=[], workload=name, peak_window=w.peak_window,
                                   curve_width=w.curve_width,
                                   peak_throughput=w.peak_throughput)

    def phase_configs(self) -> list["GameConfig"]:
        """The config in force in each phase (phase 0: this one, running ``workload``);
        phases accumulate: a phase's own keys apply over the workload it names."""
        out = [self._with_workload(self.workload)]
        for ph in self.phases:
            cfg = dataclasses.replace(out[-1], phases=[])._with_workload(ph.workload)
            out.append(dataclasses.replace(cfg, phases=[], **ph.overrides()))
        return out

    def until(self, ticks: int) -> "GameConfig":
        """This game cut to ``ticks`` simulated seconds: the phases that start before."""
        return dataclasses.replace(self, time_limit_ticks=ticks,
                                   phases=[p for p in self.phases if p.at_tick < ticks])

    def pi_names(self) -> tuple[str, ...]:
        """The PIs the game reports: the paper's three, and the signature with workloads."""
        return PI_NAMES + SIGNATURE_PI_NAMES if self.workloads else PI_NAMES

    def active_workload(self) -> GameWorkload | None:
        names = self._workload_names()
        return self.workloads[names.index(self.workload)] if self.workload in names else None

    def param_specs(self) -> dict[str, ParameterSpec]:
        self.window.name, self.rate_limit.name = "window", "rate_limit"
        return {"rate_limit": self.rate_limit, "window": self.window}

    def curve(self, window: float) -> float:
        """Uncapped noise-free throughput at ``window``."""
        z = (window - self.peak_window) / self.curve_width
        return self.peak_throughput * math.exp(-0.5 * z * z)

    @property
    def ideal_throughput(self) -> float:
        """Best reachable noise-free throughput: the peak, unless τ can never reach it."""
        best_window = self.window.clamp(self.peak_window)
        return min(self.curve(best_window), self.rate_limit.max)


class StorageGameSim:
    """One game. ``set_params`` changes the knobs; ``tick`` advances one second."""

    def __init__(self, config: GameConfig | None = None, seed: int | None = None):
        self.config = config or GameConfig()
        self.reset(seed)

    def reset(self, seed: int | None = None) -> None:
        cfg = self.config
        self.rng = np.random.default_rng(seed)
        self.window = float(cfg.window.default)
        self.rate_limit = float(cfg.rate_limit.default)
        # windows of the last delay_ticks+1 ticks; the oldest one is in effect now
        self._windows = deque([self.window] * (cfg.delay_ticks + 1), maxlen=cfg.delay_ticks + 1)
        self.ticks = 0
        self.streak = 0
        self.won = False
        self.phase = 0
        self._phase_cfgs = cfg.phase_configs()
        self.active = self._phase_cfgs[0]
        self.phase_starts = phase_starts(cfg.phases)
        self.phase_won = [False] * len(self._phase_cfgs)
        self.true_throughput = self._noise_free()
        self.throughput = self.true_throughput
        self.signature = self._true_signature()

    @property
    def over(self) -> bool:
        if self.config.phases:
            return self.ticks >= self.config.time_limit_ticks
        return self.won or self.ticks >= self.config.time_limit_ticks

    @property
    def ideal_throughput(self) -> float:
        """The ideal throughput of the phase in force."""
        return self.active.ideal_throughput

    def set_params(self, window: float | None = None, rate_limit: float | None = None) -> None:
        """Apply new knob values (clamped to their ranges, as a real knob would be)."""
        if window is not None:
            self.window = self.config.window.clamp(float(window))
        if rate_limit is not None:
            self.rate_limit = self.config.rate_limit.clamp(float(rate_limit))

    def tick(self) -> float:
        """Advance one simulated second; return the measured (noisy) throughput."""
        self._windows.append(self.window)
        self.ticks += 1
        nxt = self.phase + 1
        if nxt < len(self.phase_starts) and self.ticks >= self.phase_starts[nxt]:
            self.phase = nxt
            self.active = self._phase_cfgs[self.phase]
            self.streak = 0
        cfg = self.active
        self.true_throughput = self._noise_free()
        noise = self.rng.normal(0.0, cfg.noise * self.true_throughput) if cfg.noise else 0.0
        self.throughput = max(0.0, self.true_throughput + noise)
        if self.config.workloads:            # drawn after the throughput's noise: the
            self.signature = self._noisy_signature()   # paper game's stream is unchanged
        ideal = cfg.ideal_throughput
        if abs(self.true_throughput - ideal) <= cfg.win_band * ideal:
            self.streak += 1
        else:
            self.streak = 0
        if self.streak > cfg.win_hold_ticks:
            if self.config.phases:
                self.phase_won[self.phase] = True
                self.won = all(self.phase_won)
            else:
                self.won = True
        return self.throughput

    def pis(self) -> dict[str, float]:
        """The node's performance indicators, as a monitoring agent would read them."""
        out = {"throughput": self.throughput, "window": self.window,
               "rate_limit": self.rate_limit}
        if self.config.workloads:
            out.update(zip(SIGNATURE_PI_NAMES, (float(v) for v in self.signature)))
        return out

    def _true_signature(self) -> np.ndarray:
        w = self.active.active_workload()
        return w.signature() if w is not None else np.zeros(0)

    def _noisy_signature(self) -> np.ndarray:
        """The workload's signature times 1 + σ·N(0, 1) per PI; shares stay in [0, 1]."""
        sig = self._true_signature()
        sigma = self.config.signature_noise
        if sigma:
            sig = sig * np.maximum(0.0, 1.0 + self.rng.normal(0.0, sigma, len(sig)))
        sig[[0, 2]] = np.minimum(sig[[0, 2]], 1.0)
        return sig

    def _noise_free(self) -> float:
        return min(self.active.curve(self._windows[0]), self.rate_limit)
