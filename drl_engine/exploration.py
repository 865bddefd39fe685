"""ε-greedy exploration (thesis §5.1.6): ε falls linearly from ``epsilon_start`` to
``epsilon_final`` over the exploration period and is bumped to ``workload_epsilon`` when a
new workload starts, then falls back over ``workload_ticks``.

:func:`epsilon` is the one formula; :class:`Exploration` the one state it reads (where
the bump was raised, by whom, a pretrained start), which each engine mode holds and
which changes only through its methods."""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Exploration:
    """The engine's exploration state (``Engine.exploration``, both modes): the last
    bump of ε (a new workload, an alarm, a context switch restoring a context's own
    bump), whether the guide's change detector raised it (``local``: its probes stay
    local then), and whether the model came pretrained (ε starts from
    ``pretrained_epsilon_start``)."""
    cfg: DQNConfig
    bumped_at: int | None = None          # the action tick ε was raised at (None: never)
    local: bool = False                   # ... by the guide's change detector
    pretrained: bool = False              # started from another run's model

    def epsilon(self, ticks: int, origin: int | None = None, start: float | None = None,
                bump_ticks: int | None = None) -> float:
        """ε at action tick ``ticks``. ``origin``: the current workload context's first
        tick (ε then runs on the context's own clock, the bump counted from there too);
        ``start``, ``bump_ticks``: the mode's own ``epsilon_start`` and ``workload_ticks``
        (None: the engine's)."""
        bumped = self.bumped_at
        if origin is not None:
            ticks = max(0, ticks - origin)
            bumped = bumped - origin if bumped is not None and bumped > origin else None
        return epsilon(ticks, self.cfg, bumped, self.pretrained, start=start,
                       bump_ticks=bump_ticks)

    def bump(self, at: int | None, local: bool = False) -> None:
        """The one place the bump changes: raised at action tick ``at`` (None: not
        raised), ``local`` when by the guide's change detector."""
        self.bumped_at, self.local = at, local

    def reset(self) -> None:
        """As built: never bumped, not pretrained (a checkpoint that failed to load)."""
        self.bumped_at, self.local, self.pretrained = None, False, False


__all__ = ["Exploration", "epsilon"]
