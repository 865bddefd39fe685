"""ε-greedy exploration (thesis §5.1.6): ε falls linearly from ``epsilon_start`` to
``epsilon_final`` over the exploration period and is bumped to ``workload_epsilon`` when a
new workload starts, then falls back over ``workload_ticks``."""
from __future__ import annotations

from drl_engine.config import DQNConfig


def epsilon(action_ticks: int, cfg: DQNConfig, bumped_at: int | None = None,
            pretrained: bool = False, start: float | None = None,
            bump_ticks: int | None = None) -> float:
    """ε after ``action_ticks`` actions; a workload change at ``bumped_at`` lifts it.
    A pretrained model starts from ``pretrained_epsilon_start``: it already knows
    something, and exploring as if it knew nothing throws that away. ``start`` and
    ``bump_ticks``: a mode's own ``epsilon_start`` and ``workload_ticks`` (per node)."""
    start = cfg.pretrained_epsilon_start if pretrained else \
        (cfg.epsilon_start if start is None else start)
    workload_ticks = cfg.workload_ticks if bump_ticks is None else bump_ticks
    frac = min(1.0, action_ticks / cfg.exploration_ticks)
    eps = start + frac * (cfg.epsilon_final - start)
    if bumped_at is not None and action_ticks >= bumped_at:
        since = action_ticks - bumped_at
        frac = min(1.0, since / workload_ticks) if workload_ticks else 1.0
        bump = cfg.workload_epsilon + frac * (cfg.epsilon_final - cfg.workload_epsilon)
        eps = max(eps, bump)
    return eps


__all__ = ["epsilon"]
