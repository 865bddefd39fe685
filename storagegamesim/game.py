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
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from capes.common.params import ParameterSpec

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
        if self.time_limit_ticks < 1:
            raise ValueError(f"time_limit_ticks: must be >= 1 (got {self.time_limit_ticks})")
        if not self.window.min <= self.peak_window <= self.window.max:
            raise ValueError(f"peak_window: must lie in the window's range "
                             f"[{self.window.min}, {self.window.max}]")

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
        self.true_throughput = self._noise_free()
        self.throughput = self.true_throughput

    @property
    def over(self) -> bool:
        return self.won or self.ticks >= self.config.time_limit_ticks

    def set_params(self, window: float | None = None, rate_limit: float | None = None) -> None:
        """Apply new knob values (clamped to their ranges, as a real knob would be)."""
        if window is not None:
            self.window = self.config.window.clamp(float(window))
        if rate_limit is not None:
            self.rate_limit = self.config.rate_limit.clamp(float(rate_limit))

    def tick(self) -> float:
        """Advance one simulated second; return the measured (noisy) throughput."""
        cfg = self.config
        self._windows.append(self.window)
        self.ticks += 1
        self.true_throughput = self._noise_free()
        noise = self.rng.normal(0.0, cfg.noise * self.true_throughput) if cfg.noise else 0.0
        self.throughput = max(0.0, self.true_throughput + noise)
        ideal = cfg.ideal_throughput
        if abs(self.true_throughput - ideal) <= cfg.win_band * ideal:
            self.streak += 1
        else:
            self.streak = 0
        if self.streak > cfg.win_hold_ticks:
            self.won = True
        return self.throughput

    def pis(self) -> dict[str, float]:
        """The node's performance indicators, as a monitoring agent would read them."""
        return {"throughput": self.throughput, "window": self.window,
                "rate_limit": self.rate_limit}

    def _noise_free(self) -> float:
        return min(self.config.curve(self._windows[0]), self.rate_limit)
