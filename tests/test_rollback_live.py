"""Rollback on a live cluster, where actions reach the nodes ticks late (the control
plane, the agents and the engine's own loop wait for CPU under load): the best-known
setting is measured only once the nodes report it, so a good best survives a rollback
whose action lands late, a best that is really gone is still dropped, and a setting
that never shows up ends the hold with no verdict. Seeded, engine-level, no processes."""
from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from capes.common.config import build
from capes.common.params import ParameterSpec
from interface_daemon.action_checker import ActionChecker, Verdict
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from drl_engine.engine import Engine

# the demo's layout: each node reports its throughput and its knobs' values
PIS = ["throughput", "window", "rate_limit"]
NODES = 3
SETTLE, WINDOW = 3, 4                  # the engine's settle_ticks; best_window


def specs() -> list[ParameterSpec]:
    return [ParameterSpec(min=1, max=100, step=1, default=10, name="window"),
            ParameterSpec(min=10, max=200, step=10, default=50, name="rate_limit")]


def engine(**model) -> Engine:
    dqn = dataclasses.replace(build(DQNConfig, with_preset({"preset": "default"})),
                              settle_ticks=SETTLE)
    cfg = NodeModelConfig(stats_ticks=20, replay_mb=8, detect=False, cold_start="per_node",
                          best_window=WINDOW, rollback_fraction=0.9, rollback_ticks=5,
                          **model)
    return Engine.over_rows(dqn, RewardConfig(), PIS, specs(), NODES, model=cfg, seed=0)


class LateNodes:
    """Nodes whose knobs take the engine's values ``lag`` ticks after it decided them
    (0: on the next tick, as in simulated time) and report them as PIs; a node's
    throughput is ``good`` at window ``peak`` (until ``gone_at``), ``bad`` elsewhere,
    read at the window in effect ``SETTLE`` ticks earlier. ``stuck``: nodes whose
    applier refuses every value."""

    def __init__(self, lag: int, peak=20, good=100.0, bad=60.0, gone_at=None, stuck=(),
                 step_rule=False):
        self.lag, self.peak, self.good, self.bad = lag, peak, good, bad
        self.gone_at, self.stuck = gone_at, set(stuck)
        # the interface daemon's per-node step rule: one knob of a row a tick, by at most
        # MAX_STEPS steps; an action that breaks it is refused whole
        self.checker = ActionChecker([dataclasses.replace(p, name=f"n{i}/{p.name}")
                                      for i in range(NODES) for p in specs()]) \
            if step_rule else None
        self.refused = 0
        self.knobs = np.tile([float(peak), 100.0], (NODES, 1))
        self.history = deque([self.knobs.copy()] * (SETTLE + 1), maxlen=SETTLE + 1)
        self.pending: deque = deque()       # (tick it lands, values)
        self.rng = np.random.default_rng(0)

    def set(self, values: np.ndarray) -> None:
        """An operator's (or an earlier action's) values, in effect at once."""
        self.knobs = np.asarray(values, float).copy()

    def send(self, tick: int, values: np.ndarray, accepted: np.ndarray) -> np.ndarray:
        """The control plane takes ``values`` (or refuses them: ``accepted`` stays);
        what it accepted reaches the nodes ``lag`` ticks later."""
        values = np.asarray(values, float).copy()
        if self.checker is not None:
            names = self.checker.order
            flat = lambda v: dict(zip(names, np.asarray(v, float).ravel().tolist()))  # noqa: E731
            if not self.checker.check_rows(Verdict(flat(values)), flat(accepted)).ok:
                self.refused += 1
                values = np.asarray(accepted, float).copy()
        self.pending.append((tick + 1 + self.lag, values))
        return values

    def pis(self, tick: int) -> np.ndarray:
        while self.pending and self.pending[0][0] <= tick:
            values = self.pending.popleft()[1]
            for i in set(range(NODES)) - self.stuck:
                self.knobs[i] = values[i]
        self.history.append(self.knobs.copy())
        w = self.history[0][:, 0]               # the window in effect SETTLE ticks ago
        good = self.gone_at is None or tick < self.gone_at
        tp = np.where((w == self.peak) & good, self.good, self.bad)
        x = np.empty((NODES, len(PIS)), np.float32)
        x[:, 0] = tp * self.rng.normal(1.0, 0.005, NODES)
        x[:, 1:] = self.knobs
        return x


def at_a_bad_setting_until_rollback(nodes: LateNodes, bad=(26.0, 100.0), **model):
    """The best (window 20, rate limit 100) set over 30 ticks, then the nodes at ``bad``
    until the level has stayed below 90 % of it for rollback_ticks: the rollback's tick."""
    eng = engine(**model)
    for t in range(30):
        eng.ingest(t, nodes.pis(t))
    assert eng.control.best.best_idx[:, 0].tolist() == [19] * NODES     # window 20
    best_tick = eng.control.best.best_tick
    nodes.set(np.tile(bad, (NODES, 1)))
    t = 30
    while not eng.control.rollback.due:
        eng.ingest(t, nodes.pis(t))
        t += 1
        assert t < 60, "no rollback"
    return eng, t - 1, best_tick


def run_live(eng: Engine, nodes: LateNodes, start: int, ticks: int) -> list:
    """The live loop: act on the newest tick with the values the control plane accepted
    (``current``, as the engine daemon passes them), the nodes apply them late."""
    accepted = nodes.knobs.copy()
    decisions = []
    for t in range(start, start + ticks):
        if t > start:
            eng.ingest(t, nodes.pis(t))
        d = eng.act(current=accepted)
        accepted = nodes.send(t, d.values, accepted)
        decisions.append(d)
    return decisions


def test_a_good_best_survives_a_rollback_whose_action_lands_late():
    nodes = LateNodes(lag=4)
    eng, tick, best_tick = at_a_bad_setting_until_rollback(nodes)
    decisions = run_live(eng, nodes, tick, 3 * (SETTLE + WINDOW) + nodes.lag)
    assert decisions[0].rolled_back and (decisions[0].values[:, 0] == 20).all()
    rb = eng.control.rollback
    # measured at the rolled-back setting (window 20 again, as good as before): kept
    assert rb.stale_bests == 0 and rb.rollback_ticks == [tick]
    assert rb.unconfirmed == 0
    assert eng.control.best.best_idx[:, 0].tolist() == [19] * NODES
    assert eng.control.best.best_tick >= best_tick
    # held, no moves, until the verdict: measured over the best_window ticks that start
    # settle_ticks after the nodes reported the setting (tick + 1 + lag)
    seen = tick + 1 + nodes.lag
    held = [d for d in decisions[1:] if d.tick < seen + SETTLE + WINDOW]
    assert len(held) == SETTLE + WINDOW + nodes.lag
    assert all((d.row_actions == 0).all() and not d.row_explored.any() for d in held)


def test_in_simulated_time_the_hold_is_the_fixed_one():
    """No lag (the setting shows up on the next tick): the verdict falls on the tick it
    always did, settle_ticks + best_window + 1 after the rollback."""
    nodes = LateNodes(lag=0)
    eng, tick, _ = at_a_bad_setting_until_rollback(nodes)
    run_live(eng, nodes, tick, 2)
    assert eng.control.rollback.hold_until == tick + SETTLE + WINDOW + 1


def test_a_best_that_is_gone_is_still_dropped_when_the_action_lands_late():
    nodes = LateNodes(lag=4, gone_at=30)            # window 20 is no longer good either
    eng, tick, _ = at_a_bad_setting_until_rollback(nodes)
    run_live(eng, nodes, tick, SETTLE + WINDOW + nodes.lag + 2)
    rb = eng.control.rollback
    assert rb.stale_bests == 1
    assert rb.unconfirmed == 0


def test_a_setting_that_never_shows_up_ends_the_hold_with_no_verdict():
    nodes = LateNodes(lag=2, stuck={1})             # node 1's applier refuses every value
    eng, tick, best_tick = at_a_bad_setting_until_rollback(nodes)
    decisions = run_live(eng, nodes, tick, eng.mcfg.rollback_ticks + 3)
    rb = eng.control.rollback
    assert rb.unconfirmed == 1 and rb.stale_bests == 0 and not rb.holding(decisions[-1].tick)
    assert eng.control.best.best_idx is not None      # never measured: kept
    # waited rollback_ticks ticks without a move, then acts again
    waited = [d for d in decisions[1:] if d.tick < tick + eng.mcfg.rollback_ticks]
    assert all((d.row_actions == 0).all() for d in waited)


def test_the_rollback_walks_back_within_the_daemons_step_rule():
    """Both knobs of every row off the best (window 26, rate limit 60: 60 % of it): the
    interface daemon refuses a jump of two knobs of a row, so the rollback walks back a
    knob a tick, is never refused, and the best, measured there, is kept."""
    nodes = LateNodes(lag=1, step_rule=True)
    eng, tick, _ = at_a_bad_setting_until_rollback(nodes, bad=(26.0, 60.0))
    decisions = run_live(eng, nodes, tick, 3 * (SETTLE + WINDOW) + 4)
    rb = eng.control.rollback
    assert nodes.refused == 0 and decisions[0].rolled_back
    assert rb.stale_bests == 0 and rb.unconfirmed == 0
    assert eng.control.best.best_idx[:, 0].tolist() == [19] * NODES
    # window 26 -> 20 (6 steps) and rate limit 60 -> 100 (4 steps): two ticks, then held
    assert [d.values[0].tolist() for d in decisions[:2]] in ([[20, 60], [20, 100]],
                                                             [[26, 100], [20, 100]])
    assert (nodes.knobs == [20, 100]).all()


def test_the_jump_a_daemon_refuses_measures_nothing_and_keeps_the_best():
    """The ablation (``rollback_walk = false``) jumps both knobs of each row at once: the
    daemon refuses it, the setting never shows up, and the hold ends with no verdict
    instead of dropping the best on a measure of the setting it failed to leave."""
    nodes = LateNodes(lag=1, step_rule=True)
    eng, tick, _ = at_a_bad_setting_until_rollback(nodes, bad=(26.0, 60.0),
                                                   rollback_walk=False)
    run_live(eng, nodes, tick, eng.mcfg.rollback_ticks + 2)
    rb = eng.control.rollback
    assert nodes.refused >= 1 and (nodes.knobs == [26, 60]).all()
    assert rb.stale_bests == 0 and rb.unconfirmed == 1
    assert eng.control.best.best_idx is not None
