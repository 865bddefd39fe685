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
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from capes.common.params import ParameterSpec
from storagegamesim.phases import GamePhase, phase_starts, validate_schedule

PI_NAMES = ("throughput", "window", "rate_limit")


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

    def validate(self) -> None:
        if not self.curve_width > 0:
            raise ValueError(f"curve_width: must be > 0 (got {self.curve_width})")
        if not self.peak_throughput > 0:
            raise ValueError(f"peak_throughput: must be > 0 (got {self.peak_throughput})")
        if self.delay_ticks < 0:
            raise ValueError(f"delay_ticks: must be >= 0 (got {self.delay_ticks})")
        if self.noise < 0:
            raise ValueError(f"noise: must be >= 0 (got {self.noise})")
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
        for i, ph in enumerate(self.phases):
            ph.validate()
            if ph.peak_window is not None and not (
                    self.window.min <= ph.peak_window <= self.window.max):
                raise ValueError(f"phases[{i}].peak_window: must lie in the window's range "
                                 f"[{self.window.min}, {self.window.max}]")

    def phase_configs(self) -> list["GameConfig"]:
        """The config in force in each phase (phase 0: this one); phases accumulate."""
        out = [self]
        for ph in self.phases:
            out.append(dataclasses.replace(out[-1], phases=[], **ph.overrides()))
        return out

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
        self.active = cfg
        self._phase_cfgs = cfg.phase_configs() if cfg.phases else [cfg]
        self.phase_starts = phase_starts(cfg.phases)
        self.phase_won = [False] * len(self._phase_cfgs)
        self.true_throughput = self._noise_free()
        self.throughput = self.true_throughput

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
        return {"throughput": self.throughput, "window": self.window,
                "rate_limit": self.rate_limit}

    def _noise_free(self) -> float:
        return min(self.active.curve(self._windows[0]), self.rate_limit)
