"""The per-node recall of a known workload on a live cluster, where the interface daemon
refuses an action in which a node moves two knobs at once, or one by more than MAX_STEPS
steps (its per-node step rule, ``ActionChecker.check_rows``): the recalled setting is
walked to, reached and held; the simulated cluster harness counts the actions a live
daemon would refuse (``refused_live``). Seeded, no processes."""
from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import pytest

from capes.common.config import build
from capes.common.params import ParameterSpec
from interface_daemon.action_checker import ActionChecker, Verdict
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from drl_engine.engine import Engine

PIS = ["throughput", "read_fraction", "window", "rate_limit"]
NODES = 3
SETTLE, WINDOW, HOLD = 3, 4, 10        # settle_ticks, best_window, context_hold_ticks
GOOD = {0.1: (20.0, 100.0), 0.9: (26.0, 60.0)}   # each workload's (read fraction) best


def specs() -> list[ParameterSpec]:
    return [ParameterSpec(min=1, max=100, step=1, default=10, name="window"),
            ParameterSpec(min=10, max=200, step=10, default=50, name="rate_limit")]


def engine(**model) -> Engine:
    dqn = dataclasses.replace(build(DQNConfig, with_preset({"preset": "default"})),
                              settle_ticks=SETTLE, use_context=True,
                              context_pis=["read_fraction"], context_hold_ticks=HOLD)
    cfg = NodeModelConfig(stats_ticks=20, replay_mb=8, detect=False, cold_start="per_node",
                          best_window=WINDOW, **model)
    return Engine.over_rows(dqn, RewardConfig(), PIS, specs(), NODES, model=cfg, seed=0)


class Nodes:
    """Nodes behind a live daemon: an action that breaks the per-node step rule is
    refused whole (the daemon's own check); an accepted one is in effect on the next
    tick. A node's throughput is high at its workload's best setting (``GOOD``), read at
    the setting in effect ``SETTLE`` ticks earlier; its signature is the read fraction."""

    def __init__(self):
        self.checker = ActionChecker([dataclasses.replace(p, name=f"n{i}/{p.name}")
                                      for i in range(NODES) for p in specs()])
        self.refused = 0
        self.read = 0.1
        self.knobs = np.tile(GOOD[0.1], (NODES, 1))
        self.history = deque([self.knobs.copy()] * (SETTLE + 1), maxlen=SETTLE + 1)
        self.rng = np.random.default_rng(0)

    def send(self, values: np.ndarray) -> np.ndarray:
        flat = lambda v: dict(zip(self.checker.order, np.ravel(v).tolist()))  # noqa: E731
        if self.checker.check_rows(Verdict(flat(values)), flat(self.knobs)).ok:
            self.knobs = np.asarray(values, float).copy()
        else:
            self.refused += 1
        return self.knobs

    def pis(self) -> np.ndarray:
        self.history.append(self.knobs.copy())
        good = (self.history[0] == GOOD[self.read]).all(axis=1)
        x = np.empty((NODES, len(PIS)))
        x[:, 0] = np.where(good, 100.0, 60.0) * self.rng.normal(1.0, 0.005, NODES)
        x[:, 1] = self.read * self.rng.normal(1.0, 0.01, NODES)
        x[:, 2:] = self.knobs
        return x


def back_to_a_known_workload(**model):
    """Workload A at its best for 40 ticks, workload B at its own for 40 (the nodes set
    by hand, the engine watching), then A again until every node has recalled it: the
    engine, the nodes, the tick."""
    eng, nodes = engine(**model), Nodes()
    t = 0
    for read, until in ((0.1, 40), (0.9, 80)):
        nodes.read, nodes.knobs = read, np.tile(GOOD[read], (NODES, 1))
        while t < until:
            eng.ingest(t, nodes.pis())
            t += 1
    nodes.read = 0.1
    while eng.row_context.returns < NODES:
        eng.ingest(t, nodes.pis())
        t += 1
        assert t < 100, "no return recalled"
    return eng, nodes, t - 1


def live(eng: Engine, nodes: Nodes, start: int, ticks: int) -> list:
    decisions = []
    for t in range(start, start + ticks):
        if t > start:
            eng.ingest(t, nodes.pis())
        d = eng.act(current=nodes.knobs)
        nodes.send(d.values)
        decisions.append(d)
    return decisions


def test_a_recalled_setting_is_walked_to_within_the_step_rule_and_held():
    """Workload A's best (window 20, rate limit 100) recalled from B's (26, 60): both
    knobs of every node must move, which the daemon refuses in one action; the walk
    takes two ticks, is never refused, and the nodes then hold the setting for
    context_hold_ticks without a probe or a greedy move."""
    eng, nodes, tick = back_to_a_known_workload()
    decisions = live(eng, nodes, tick, HOLD + 4)
    assert nodes.refused == 0
    assert [d.values[0].tolist() for d in decisions[:2]] in ([[20, 60], [20, 100]],
                                                             [[26, 100], [20, 100]])
    held = decisions[1:2 + HOLD]                   # from arrival: the hold's ticks
    assert all((d.values == GOOD[0.1]).all() for d in held)
    assert all((d.row_actions == 0).all() and not d.row_explored.any() for d in held)
    assert eng.row_context.unreached == 0 and not eng.row_context.walking


def test_the_jump_is_refused_and_the_nodes_keep_the_setting_they_had():
    """The ablation (``rollback_walk = false``) sets both knobs of each node at once:
    the daemon refuses it, and the nodes hold workload B's setting under workload A."""
    eng, nodes, tick = back_to_a_known_workload(rollback_walk=False)
    decisions = live(eng, nodes, tick, 3)
    assert (decisions[0].values == GOOD[0.1]).all()    # asked for at once ...
    assert nodes.refused >= 1 and (nodes.knobs == GOOD[0.9]).all()   # ... refused


# -- the simulated cluster harness ---------------------------------------------------------

@pytest.mark.parametrize("walk", [True, False])
def test_the_cluster_harness_counts_what_a_live_daemon_would_refuse(walk):
    """A short seeded run of the recurring-workloads cluster game (8 nodes, every node
    returns to the checkpoint workload at tick 320; the group search on): with the walk
    no action breaks the daemon's per-node step rule; the jump's recall (and the group
    search's far moves) would be refused."""
    from test_recall_cluster import short_cfg
    from capes.experiments.cluster_test import run_one
    r = run_one(short_cfg(["cluster.time_limit_ticks=340",
                           f"cluster_engine.rollback_walk={str(walk).lower()}"]), seed=0)
    assert r["context_returns"] >= 8 and r["context_searches"] >= 1
    if walk:
        assert r["refused_live"] == 0, r["refused_live_examples"]
    else:
        assert r["refused_live"] >= 1 and r["refused_live_rows"] >= r["refused_live"]
        assert "per-node action" in r["refused_live_examples"][0]


@pytest.mark.parametrize("refuse", [True, False])
def test_the_harness_leaves_a_refused_action_unapplied_when_asked(tmp_path, refuse):
    """``refuse_live``: an action moving both knobs of a node is counted and, as a live
    daemon would, not applied; a legal one (one knob, <= MAX_STEPS steps) is applied."""
    from capes.common import actions
    from capes.common.replay_db import ReplayWriter, SessionInfo
    from capes.experiments.cluster_test import ClusterSource, load_config
    from drl_engine.decision import Decision
    from storagegamesim.cluster import ClusterSim
    ccfg = load_config(None, ["cluster.nodes=2"]).cluster
    sim = ClusterSim(ccfg, seed=0, judge=False)
    writer = ReplayWriter(tmp_path / "replay.db")
    session = writer.begin_session(SessionInfo(
        pi_names=list(ccfg.pi_names()), node_names=list(sim.node_names),
        params=list(ccfg.param_specs().values())))
    source = ClusterSource(sim, writer, session.id, refuse_live=refuse)
    names = source.knob_names
    knobs = lambda: np.column_stack([getattr(sim, n) for n in names]).astype(float)  # noqa: E731
    step = np.array([ccfg.param_specs()[n].step for n in names])
    w = names.index("window")
    start = knobs()
    one, two = np.eye(2)[w], np.ones(2)              # window alone; both knobs
    both = start + step * np.stack([actions.MAX_STEPS * one, -two])   # node 1: refused
    source.apply(Decision(1, actions.ROWS, both, 0.0, False, None, row_actions=np.zeros(2)))
    assert source.step_rule.refused == 1 and source.step_rule.rows == 1, source.step_rule.examples
    assert np.array_equal(knobs(), start if refuse else both)
    legal = knobs() + step * np.stack([0 * one, actions.MAX_STEPS * one])
    source.apply(Decision(2, actions.ROWS, legal, 0.0, False, None, row_actions=np.zeros(2)))
    assert source.step_rule.refused == 1 and np.array_equal(knobs(), legal)
    writer.close()


def test_an_engine_restarted_mid_walk_finishes_the_walk_and_holds(tmp_path):
    """A kill and restart between the walk's two ticks: the restarted engine knows the
    rows are walking (kept in its checkpoint), takes the second step and holds the
    recalled setting for context_hold_ticks."""
    eng, nodes, tick = back_to_a_known_workload()
    live(eng, nodes, tick, 1)                          # the walk's first step
    assert eng.row_context.walking
    path = eng.save(tmp_path / "engine.pt")
    again = engine()
    again.load(path)
    assert set(again.row_context.walking) == set(eng.row_context.walking)
    decisions = []
    for t in range(tick + 1, tick + 2 + HOLD):
        again.ingest(t, nodes.pis())
        d = again.act(current=nodes.knobs)
        nodes.send(d.values)
        decisions.append(d)
    assert nodes.refused == 0 and (decisions[0].values == GOOD[0.1]).all()
    assert all((d.values == GOOD[0.1]).all() and (d.row_actions == 0).all()
               for d in decisions)
    assert not again.row_context.walking and again.row_context.unreached == 0
