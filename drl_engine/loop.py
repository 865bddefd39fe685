"""One tick loop for every way the engine runs: live against the interface daemon
(``drl_engine.daemon``), in the converge test against the simulator, and offline on
stored experience. The loop is the algorithm's outer step; what differs between those
uses is only where a tick's data comes from (the *source*) and how time passes (the
*clock*):

    state = source.observe()          # new PIs are in the DB; switches, current values
    engine.update()                   # refresh the replay cache
    decision = engine.act(...)        # ε-greedy on the newest observation (when tuning)
    source.apply(decision)            # record and apply the action
    loss = engine.train()             # Algorithm-2 minibatches (when training)
    observers(record)                 # logs, traces, status files, checkpoints
    clock.wait()                      # until the next tick (no wait in simulated time)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from drl_engine.decision import Decision
from drl_engine.tuner import Tuner


@dataclass
class TickState:
    """What the source reports at the start of a tick."""
    session: int | None                   # the replay DB session to act on (None: none)
    tuning: bool = True                   # act this tick
    training: bool = True                 # train this tick ...
    train_steps: int | None = None        # ... this many minibatches (None: the engine's
                                          # train_steps_per_tick)
    workload_epoch: int = 0               # a change bumps ε (thesis §5.1.6)
    current: list[float] | None = None    # values in effect, if known better than the DB


@dataclass
class TickRecord:
    """What happened in one tick, for observers."""
    index: int
    state: TickState
    decision: Decision | None
    loss: float | None


class Source(Protocol):
    def observe(self) -> TickState | None:
        """Bring this tick's data into the replay DB; None when the source is done."""

    def apply(self, decision: Decision) -> None:
        """Record and apply an action."""


class SimulatedClock:
    """Simulated time: the next tick starts at once."""

    def stopped(self) -> bool:
        return False

    def wait(self) -> None:
        pass


class WallClock:
    """Real time: one tick every ``tick_s`` seconds; ``stop`` (a StopSignal) ends it.
    A loop that falls more than ten ticks behind starts counting afresh instead of
    rushing through the backlog."""

    def __init__(self, tick_s: float, stop):
        self.tick_s, self.stop = tick_s, stop
        self.next = time.monotonic()

    def stopped(self) -> bool:
        return self.stop.is_set()

    def wait(self) -> None:
        self.next += self.tick_s
        self.stop.wait(max(0.0, self.next - time.monotonic()))
        if time.monotonic() - self.next > 10 * self.tick_s:
            self.next = time.monotonic()


class PollingClock(WallClock):
    """Real time aligned with the data: the next tick starts as soon as ``fresh()``
    (polled every ``poll_s``) says a new tick was committed, and at the latest ``tick_s``
    after the last one. A fixed tick at an arbitrary phase to the monitor's waits up to a
    whole tick after the data lands; a bad probe's walk back waits with it."""

    def __init__(self, tick_s: float, stop, poll_s: float, fresh: Callable[[], bool]):
        super().__init__(tick_s, stop)
        self.poll_s, self.fresh = poll_s, fresh

    def wait(self) -> None:
        deadline = self.next + self.tick_s
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= deadline:
                break
            self.stop.wait(min(self.poll_s, deadline - now))
            if self.fresh():
                break
        self.next = time.monotonic()


def run_ticks(engine: Tuner, source: Source, clock=None,
              observers: Iterable[Callable[[TickRecord], None]] = (),
              max_ticks: int = 0) -> int:
    """Run ticks of ``engine`` (the engine or a baseline: ``drl_engine.tuner.Tuner``)
    until the source is done, the clock is stopped, or ``max_ticks`` (0: no limit).
    Returns the number of ticks run."""
    clock = clock or SimulatedClock()
    observers = list(observers)
    epoch = last_tick = None
    ticks = 0
    while not clock.stopped():
        state = source.observe()
        if state is None:
            break
        if epoch is not None and state.workload_epoch != epoch:
            engine.workload_changed()
        epoch = state.workload_epoch
        engine.update()
        decision = None
        if state.tuning and state.session is not None:
            decision = engine.act(state.session, after_tick=last_tick, current=state.current)
        if decision is not None:
            source.apply(decision)
            last_tick = decision.tick
        loss = engine.train(state.train_steps) if state.training else None
        record = TickRecord(ticks, state, decision, loss)
        for observe in observers:
            observe(record)
        ticks += 1
        if max_ticks and ticks >= max_ticks:
            break
        clock.wait()
    return ticks
