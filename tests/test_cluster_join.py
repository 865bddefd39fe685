"""A cluster that changes (issue 11): a node joining and another leaving in the middle of
a running session, with the same engine object and weights going on (no retraining, no
new model). Small and seeded: 4 clients on one server, 300 simulated seconds; client c3
joins at tick 100 and c1 leaves at tick 200 (``absent`` in the phase schedule)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from capes.common.config import ConfigError, build
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
from capes.experiments.cluster_test import ClusterSource, load_config, run_one
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.engine import Engine
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from drl_engine.loop import run_ticks
from storagegamesim.cluster import PI_NAMES, ClusterConfig, ClusterSim
from storagegamesim.phases import ClusterPhase

JOIN, LEAVE, END = 100, 200, 300
JOINER, LEAVER = 3, 1
FAST_MODEL = NodeModelConfig(stats_ticks=40, learn_start=16, replay_mb=8)


def changing_cluster() -> ClusterConfig:
    return build(ClusterConfig, {
        "nodes": 4, "clients_per_server": 4, "time_limit_ticks": END, "absent": [JOINER],
        "phases": [{"at_tick": JOIN, "name": "c3 joins", "absent": []},
                   {"at_tick": LEAVE, "name": "c1 leaves", "absent": [LEAVER]}]})


def default_dqn() -> DQNConfig:
    return build(DQNConfig, with_preset({"preset": "default"}))


# -- the simulator: absent is not idle ---------------------------------------------------

def test_a_phase_makes_a_node_join_and_another_leave_and_absent_is_not_idle():
    sim = ClusterSim(changing_cluster(), seed=0, judge=False)
    seen = {}
    while sim.ticks < END - 1:
        seen[sim.ticks] = sim.present.copy()
        sim.tick()
    assert list(seen[JOIN - 1]) == [True, True, True, False]
    assert list(seen[JOIN]) == [True] * 4
    assert list(seen[LEAVE]) == [True, False, True, True]
    # an absent node does no I/O (nor does an idle one), but only the idle one is present
    assert sim.throughput[LEAVER] == 0 and not sim.state.active[LEAVER]
    idle = ClusterSim(dataclasses.replace(changing_cluster(), absent=[], phases=[
        ClusterPhase(at_tick=1, active_fraction=0.25)]), seed=0, judge=False)
    idle.tick()
    assert idle.present.all() and idle.state.active.sum() == 1


@pytest.mark.parametrize("table, match", [
    ({"nodes": 4, "absent": [4]}, r"absent: node indices must lie in \[0, 4\)"),
    ({"nodes": 2, "absent": [0, 1]}, r"absent: at least one node"),
    ({"nodes": 4, "phases": [{"at_tick": 5, "absent": [-1]}]}, r"phases\[0\]\.absent"),
])
def test_a_bad_absent_list_is_rejected_with_the_key(table, match):
    with pytest.raises(ConfigError, match=match):
        build(ClusterConfig, table, "cluster.toml")


# -- the replay DB: a node appended to a running session -----------------------------------

def test_a_growing_reader_keeps_the_rows_of_a_node_that_joined(tmp_path):
    specs = list(ClusterConfig().param_specs().values())
    w = ReplayWriter(tmp_path / "r.db")
    s = w.begin_session(SessionInfo(pi_names=list(PI_NAMES), node_names=["a", "b"],
                                    params=specs))
    fixed, growing = ReplayReader(tmp_path / "r.db"), ReplayReader(tmp_path / "r.db",
                                                                   grow_nodes=True)
    row = np.arange(len(PI_NAMES), dtype=np.float32)
    for t in range(3):
        if t == 2:
            w.update_layout(list(PI_NAMES), ["a", "b", "c"])
        for i in range(3 if t == 2 else 2):
            w.add_pis(t, i, row + i)
        w.commit()
        fixed.refresh(), growing.refresh()
    assert fixed.sessions[s.id].pis.shape[1] == 2            # the single-node engine's view
    data = growing.sessions[s.id]
    assert growing.layout.node_names == ("a", "b", "c")
    assert np.isnan(data.pis[:2, 2]).all() and list(data.pis[2, 2]) == list(row + 2)
    with pytest.raises(ValueError, match="grow_nodes"):
        Engine.over_rows(default_dqn(), RewardConfig(), list(PI_NAMES), specs, 2,
                      model=FAST_MODEL, reader=fixed)


# -- the engine: the same object and weights, through a join and a leave --------------------

def play(feed: str, tmp_path):
    """The converge harness's data path (simulator -> replay DB -> engine -> knobs), with
    every decision and every node's knob values kept."""
    ccfg = changing_cluster()
    sim = ClusterSim(ccfg, seed=1, judge=False)
    specs = list(ccfg.param_specs().values())
    w = ReplayWriter(tmp_path / f"{feed}.db")
    s = w.begin_session(SessionInfo(pi_names=list(PI_NAMES), params=specs,
                                    node_names=[sim.node_names[i] for i in range(3)]))
    reader = ReplayReader(tmp_path / f"{feed}.db", grow_nodes=True) if feed == "reader" \
        else None
    eng = Engine.over_rows(default_dqn(), RewardConfig(), list(PI_NAMES), specs, 3,
                        model=FAST_MODEL, reader=reader, seed=0)
    dqn, weights = eng.dqn, eng.weights
    src = ClusterSource(sim, w, s.id, feed=eng if feed == "rows" else None)
    log = []

    def record(rec):
        knobs = np.column_stack([sim.window, sim.rate_limit])     # after the decision
        log.append((sim.ticks, rec.decision, knobs.copy(), rec.loss))

    run_ticks(eng, src, observers=[record])
    w.close()
    return eng, dqn, weights, src, log


@pytest.mark.parametrize("feed", ["reader", "rows"])
def test_a_node_joins_and_another_leaves_mid_session_without_a_new_model(feed, tmp_path):
    eng, dqn, weights, src, log = play(feed, tmp_path)
    assert len(log) == END                            # every tick, no exception
    assert eng.dqn is dqn and eng.weights == weights  # the same model, never retrained
    assert eng.nodes == 4 and list(src.order) == [0, 1, 2, JOINER]   # c3 appended
    decisions = {t: d for t, d, _, _ in log if d is not None and d.rows}
    assert all(d.tick == t for t, d in decisions.items())           # acting on each tick
    assert all(len(d.row_actions) == 3 for t, d in decisions.items() if t < JOIN)
    knobs = {t: k for t, _, k, _ in log}
    default = [ClusterConfig().window.default, ClusterConfig().rate_limit.default]
    # the node that joined: untouched while absent, then moved by the engine
    assert all(list(knobs[t][JOINER]) == default for t in range(JOIN))
    moved = [t for t, d in decisions.items() if t >= JOIN and d.row_actions[JOINER] != 0]
    assert moved and any(list(knobs[t][JOINER]) != default for t in moved)
    # the node that left: no action from its first absent tick on, its knobs left alone
    assert all(d.row_actions[LEAVER] == 0 and not d.row_explored[LEAVER]
               for t, d in decisions.items() if t >= LEAVE)
    assert all((knobs[t][LEAVER] == knobs[LEAVE - 1][LEAVER]).all()
               for t in range(LEAVE, END))
    # the best-known setting is the three nodes' (the four's is forgotten, not rolled back to)
    best = eng.control.best
    assert best.best_tick is None or (best.best_tick > LEAVE and not best.best_nodes[LEAVER])
    # ... and the others keep learning: rewards (over the same nodes) after both changes
    rep = eng.replay
    for lo, hi in ((JOIN + 5, LEAVE), (LEAVE + 5, END - 2)):
        assert np.isfinite(rep.r[np.arange(lo, hi) % rep.capacity]).mean() > 0.9
    assert all(loss is not None for t, _, _, loss in log if t > LEAVE)


def test_the_converge_harness_plays_a_join_and_a_leave(tmp_path):
    cfg = load_config(None, [])
    cfg.cluster, cfg.model = changing_cluster(), FAST_MODEL
    out = run_one(cfg, seed=0)
    assert out["ticks"] == END and out["feed"] == "reader"
    assert [p["name"] for p in out["per_phase"]] == ["phase 0", "c3 joins", "c1 leaves"]
    assert out["weights"] > 0 and all(p["ticks"] > 0 for p in out["per_phase"])


@pytest.mark.parametrize("walk", [True, False])
def test_a_node_joining_during_the_cold_start_walks_to_the_shared_setting(walk):
    """The cold start sets every node to one shared setting; a node that joins off it
    must walk there within the interface daemon's per-node step rule (one knob of a
    row, <= MAX_STEPS steps a tick), or a live daemon refuses the cold start's every
    action whole (``refused_live`` counts them; ``rollback_walk = false``: the jump)."""
    cfg = load_config(None, ["cluster.nodes=8",                  # cluster-sim.toml
                             f"cluster_engine.rollback_walk={str(walk).lower()}"])
    joins = build(ClusterConfig, {"nodes": 8, "time_limit_ticks": 120, "absent": [7],
                                  "phases": [{"at_tick": 60, "name": "c7 joins",
                                              "absent": []}]})
    cfg.cluster = dataclasses.replace(cfg.cluster, absent=[7], phases=joins.phases,
                                      time_limit_ticks=120)
    out = run_one(cfg, seed=0)
    assert out["handed_over_at"] is None or out["handed_over_at"] > 60   # joined in it
    if walk:
        assert out["refused_live"] == 0, out["refused_live_examples"]
    else:
        assert out["refused_live"] >= 1
        assert "moves with" in out["refused_live_examples"][0]
