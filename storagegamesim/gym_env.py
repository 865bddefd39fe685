"""A Gymnasium face for StorageGameSim, so RL users can drive it with their own tools.

    env = StorageGameEnv(GameConfig(noise=0.1))
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())

Observation: [measured throughput, window m, rate limit τ]. Actions, as in CAPES:
0 = NULL, 1/2 = window ± step, 3/4 = rate limit ± step. Reward: the change of measured
throughput (the paper's ``diff``). ``terminated`` at the win, ``truncated`` at the time
limit. With the ``gymnasium`` extra installed it is a real ``gymnasium.Env`` with
spaces; without it, the same class works with duck-typed spaces.
"""
from __future__ import annotations

import numpy as np

from storagegamesim.game import GameConfig, StorageGameSim

try:                                    # optional extra: pip install capes[gymnasium]
    import gymnasium as gym
    from gymnasium import spaces
    _Base = gym.Env
except ImportError:                     # pragma: no cover - exercised without the extra
    gym = spaces = None
    _Base = object


class _Discrete:
    def __init__(self, n: int):
        self.n = n
        self._rng = np.random.default_rng()

    def sample(self) -> int:
        return int(self._rng.integers(self.n))

    def contains(self, x) -> bool:
        return isinstance(x, (int, np.integer)) and 0 <= x < self.n


class StorageGameEnv(_Base):
    metadata = {"render_modes": []}

    def __init__(self, config: GameConfig | None = None):
        self.config = config or GameConfig()
        self.game = StorageGameSim(self.config)
        cfg = self.config
        high = np.array([np.inf, cfg.window.max, cfg.rate_limit.max], np.float32)
        low = np.array([0.0, cfg.window.min, cfg.rate_limit.min], np.float32)
        if spaces is not None:
            self.action_space = spaces.Discrete(5)
            self.observation_space = spaces.Box(low, high, dtype=np.float32)
        else:
            self.action_space = _Discrete(5)
            self.observation_space = None

    def _obs(self) -> np.ndarray:
        g = self.game
        return np.array([g.throughput, g.window, g.rate_limit], np.float32)

    def reset(self, *, seed: int | None = None, options=None):
        if spaces is not None:
            super().reset(seed=seed)
        self.game.reset(seed)
        return self._obs(), {"true_throughput": self.game.true_throughput}

    def step(self, action: int):
        if not 0 <= int(action) < 5:
            raise ValueError(f"action must be in 0..4, got {action}")
        g, cfg = self.game, self.config
        if action == 1:
            g.set_params(window=g.window + cfg.window.step)
        elif action == 2:
            g.set_params(window=g.window - cfg.window.step)
        elif action == 3:
            g.set_params(rate_limit=g.rate_limit + cfg.rate_limit.step)
        elif action == 4:
            g.set_params(rate_limit=g.rate_limit - cfg.rate_limit.step)
        before = g.throughput
        g.tick()
        reward = g.throughput - before
        truncated = not g.won and g.ticks >= cfg.time_limit_ticks
        info = {"true_throughput": g.true_throughput, "streak": g.streak}
        return self._obs(), float(reward), g.won, truncated, info
