"""What the tick loop drives (``drl_engine.loop.run_ticks``): the engine of either mode
and every search baseline (``capes/experiments/baselines.py``) meet this protocol.

Per tick the loop calls ``update()`` (observe: pull the newest data), ``act()`` (a
:class:`~drl_engine.decision.Decision` or None), ``train()`` and, when the source says
the workload changed, ``workload_changed()``; observers read ``epsilon`` and
``train_steps``. A tuner that keeps what it learnt across restarts (the engine; the
daemon saves it) is also :class:`Checkpointed`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from drl_engine.decision import Decision


@runtime_checkable
class Tuner(Protocol):
    train_steps: int                       # minibatch updates so far (0: it learns none)

    @property
    def epsilon(self) -> float:
        """The exploration rate now (1: searching, 0: committed, for the baselines)."""

    def update(self) -> int:
        """Observe: pull the newest ticks from the replay DB (or the rows fed to it);
        the number of new rows."""

    def act(self, session: int | None = None, after_tick: int | None = None,
            current=None) -> Decision | None:
        """The decision for the newest tick of ``session`` newer than ``after_tick``
        (None: none yet); ``current``: the values in effect, when the caller knows
        them better than the DB."""

    def train(self, steps: int | None = None) -> float | None:
        """Learn from stored experience; the mean loss (None: nothing learnt)."""

    def workload_changed(self) -> None:
        """A new workload started (the source said so): explore again."""


@runtime_checkable
class Checkpointed(Tuner, Protocol):
    def save(self, path: str | Path) -> Path:
        """Write what was learnt, atomically."""

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        """Resume from :meth:`save`'s file (``weights_only``: the model alone)."""


__all__ = ["Checkpointed", "Tuner"]
