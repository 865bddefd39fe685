"""ClusterSim, workload phases and the per-phase scorer (issue 11)."""
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from capes.common.config import ConfigError, build, read_toml
from storagegamesim.cluster import (ClusterConfig, ClusterSim, _Layout, _phase_states,
                                    _solve, best_static, evaluate, phase_optima)
from storagegamesim.game import GameConfig, StorageGameSim
from storagegamesim.phases import (ClusterPhase, GamePhase, Workload, phase_at,
                                   phase_starts, relative_trace, score_phases, summarise)

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cluster-sim.toml"


def example(nodes=None, **changes) -> ClusterConfig:
    table = read_toml(CONFIG)["cluster"]
    if nodes is not None:
        table = {**table, "nodes": nodes}
    cfg = build(ClusterConfig, table, str(CONFIG), "cluster")
    return dataclasses.replace(cfg, **changes) if changes else cfg


def settle(sim, ticks=None, **knobs):
    sim.set_params(**knobs)
    for _ in range(sim.config.delay_ticks + 1 if ticks is None else ticks):
        sim.tick()


# --------------------------------------------------------------------------- model
def test_the_fixed_point_is_solved_for_mixed_window_rate_and_demand_limits():
    cfg = ClusterConfig(nodes=40, clients_per_server=8, workloads=[
        Workload("a", 1, math.inf, 0.9), Workload("b", 1, 80.0, 0.1, 0.8),
        Workload("c", 1, 5.0, 0.5)])
    layout = _Layout(cfg)
    st = _phase_states(cfg, layout)[0]
    rng = np.random.default_rng(3)
    w = rng.integers(1, 200, (6, cfg.nodes)).astype(float)
    r = rng.choice([50.0, 300.0, 2000.0], (6, cfg.nodes))
    cap = np.minimum(r, st.demand)
    R, q, x = _solve(cfg, layout, st, w, cap)
    # every server's RTT is a fixed point of the model's equation
    b, tau0 = cfg.rpc_size_mb, cfg.base_rtt_ms / 1000
    Q = np.add.reduceat(q, layout.starts, axis=-1)
    W = np.add.reduceat(q * st.h, layout.starts, axis=-1)
    psi = tau0 + (st.h0 + W) * (1 + (Q / st.thrash_rpcs) ** cfg.thrash_power)
    np.testing.assert_allclose(psi, R, rtol=1e-8)
    # and the per-node quantities follow from it
    np.testing.assert_allclose(x, np.minimum(w * b / R[:, layout.server], cap), rtol=1e-9)
    assert np.all(q <= w + 1e-9) and np.all(x <= cap + 1e-9)
    # batched and one-at-a-time solutions agree
    R1, _, x1 = _solve(cfg, layout, st, w[2], cap[2])
    np.testing.assert_allclose(R1, R[2], rtol=1e-9)
    np.testing.assert_allclose(x1, x[2], rtol=1e-9)


def test_total_throughput_is_unimodal_in_a_shared_window():
    cfg = ClusterConfig(nodes=8, noise=0.0)
    tp = [evaluate(cfg, w, cfg.rate_limit.max)["total_throughput"] for w in range(1, 257)]
    peak = int(np.argmax(tp))
    assert 5 < peak < 100                        # an interior optimum, not a knob end
    assert np.all(np.diff(tp[:peak + 1]) > 0) and np.all(np.diff(tp[peak:]) < 0)
    assert tp[-1] < 0.2 * tp[peak]               # a huge window collapses the server


def test_one_nodes_larger_window_costs_the_others_on_its_server_only():
    cfg = ClusterConfig(nodes=16, clients_per_server=8, noise=0.0)   # 2 servers
    base = evaluate(cfg, 22, cfg.rate_limit.max)
    w = np.full(16, 22.0)
    w[0] = 120.0
    greedy = evaluate(cfg, w, cfg.rate_limit.max)
    same_server, other_server = slice(1, 8), slice(8, 16)
    assert greedy["throughput"][0] > base["throughput"][0]
    assert np.all(greedy["throughput"][same_server] < 0.9 * base["throughput"][same_server])
    np.testing.assert_allclose(greedy["throughput"][other_server],
                               base["throughput"][other_server])
    assert greedy["latency_ms"][1] > base["latency_ms"][1]
    assert greedy["total_throughput"] < base["total_throughput"]     # saturated: net loss


def test_rate_limit_and_demand_cap_a_node():
    cfg = ClusterConfig(nodes=8, noise=0.0, delay_ticks=0,
                        workloads=[Workload("light", 0.5, 30.0, 0.0),
                                   Workload("heavy", 0.5, math.inf, 0.5)])
    sim = ClusterSim(cfg, seed=0, judge=False)
    light = sim.state.demand == 30.0
    settle(sim, window=64, rate_limit=cfg.rate_limit.max)
    np.testing.assert_allclose(sim.true_throughput[light], 30.0)
    r = np.full(8, cfg.rate_limit.max)
    r[~light] = 100.0
    settle(sim, rate_limit=r)
    np.testing.assert_allclose(sim.true_throughput[~light], 100.0)
    # a demand-limited node's window does not matter while it is not the bottleneck
    before = sim.true_throughput.copy()
    w = np.full(8, 64.0)
    w[light] = 200.0
    settle(sim, window=w)
    np.testing.assert_allclose(sim.true_throughput, before)


def test_knob_changes_are_delayed_workload_changes_are_not():
    cfg = ClusterConfig(nodes=8, noise=0.0, delay_ticks=3, phases=[
        ClusterPhase(at_tick=10, active_fraction=0.5)])
    sim = ClusterSim(cfg, seed=0, judge=False)
    sim.tick()
    before = sim.true_total_throughput
    sim.set_params(window=22)
    seen = [sim.tick().sum() for _ in range(4)]
    assert seen[:3] == [pytest.approx(before)] * 3
    assert seen[3] > before * 1.1
    while sim.ticks < 9:
        sim.tick()
    full = sim.true_throughput.copy()
    sim.tick()                                    # tick 10: half the clients are idle
    assert sim.phase == 1 and sim.ticks == 10
    idle = ~sim.state.active
    assert idle.sum() == 4 and np.all(sim.true_throughput[idle] == 0)
    assert np.all(sim.true_throughput[~idle] > full[~idle])   # the others gain


def test_set_params_per_node_and_clamping():
    cfg = ClusterConfig(nodes=8)
    sim = ClusterSim(cfg, seed=0, judge=False)
    sim.set_params(window=500, nodes=[1, 2])
    sim.set_params(rate_limit=[1, 10 ** 6], nodes=np.array([3, 4]))
    assert list(sim.window[:4]) == [8, 256, 256, 8]
    assert sim.rate_limit[3] == cfg.rate_limit.min and sim.rate_limit[4] == cfg.rate_limit.max
    pis = sim.pis()
    assert set(pis) == {"throughput", "latency_ms", "rpcs_in_flight", "dirty_mb", "window",
                        "rate_limit"}
    assert all(len(v) == 8 for v in pis.values())
    assert sim.node_names[0] == "c0000" and len(set(sim.node_names)) == 8


def test_noise_is_the_configured_fraction_of_each_pi():
    cfg = ClusterConfig(nodes=64, noise=0.1, time_limit_ticks=10 ** 6)
    sim = ClusterSim(cfg, seed=1, judge=False)
    settle(sim, window=22)
    rel = np.array([sim.tick() / sim.true_throughput - 1 for _ in range(300)])
    assert rel.mean() == pytest.approx(0, abs=0.005)
    assert rel.std() == pytest.approx(0.1, rel=0.03)
    lat = np.array([(sim.tick(), sim.latency_ms / sim.true_latency_ms - 1)[1]
                    for _ in range(300)])
    assert lat.std() == pytest.approx(0.1, rel=0.03)


def test_same_seed_same_run_and_seeds_differ():
    cfg = example(64, noise=0.5)

    def play(seed):
        sim = ClusterSim(cfg, seed=seed, judge=False)
        rng = np.random.default_rng(0)
        out = []
        for _ in range(50):
            sim.set_params(window=sim.window + rng.integers(-1, 2, 64))
            out.append(np.concatenate([sim.tick(), sim.latency_ms, sim.dirty_mb]))
        return np.array(out)

    a, b, c = play(7), play(7), play(8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_the_layout_does_not_depend_on_the_run_seed():
    cfg = example(64)
    a, b = ClusterSim(cfg, seed=1, judge=False), ClusterSim(cfg, seed=2, judge=False)
    for k in range(3):
        assert np.array_equal(a._states[k].klass, b._states[k].klass)
        assert np.array_equal(a._states[k].active, b._states[k].active)


# --------------------------------------------------------------------------- search
def test_best_static_search_matches_the_exhaustive_grid():
    for cfg in (ClusterConfig(nodes=8), example(8),
                ClusterConfig(nodes=16, workloads=[Workload("w", 1, 150.0, 1.0)])):
        for k in range(len(cfg.phases) + 1):
            fast, full = best_static(cfg, k), best_static(cfg, k, exhaustive=True)
            assert fast.objective == pytest.approx(full.objective, rel=1e-9)
            assert fast.evaluations < full.evaluations / 4


def test_best_static_finds_the_known_optimum_of_one_server():
    # one server, 4 identical window-limited clients: the optimum is where the closed
    # form X(Q) = Q·b / (τ0 + (b/C + Q·h)(1 + (Q/K)^p)) peaks, Q = 4·w
    cfg = ClusterConfig(nodes=4, servers=1, workloads=[Workload("r", 1, math.inf, 0.0)])
    b, tau0, C, K = cfg.rpc_size_mb, cfg.base_rtt_ms / 1000, cfg.server_capacity, cfg.thrash_rpcs
    w = np.arange(1, 257)
    Q = 4 * w
    X = Q * b / (tau0 + (b / C + Q * b / C) * (1 + (Q / K) ** 2))
    opt = best_static(cfg)
    assert opt.window[0] == w[np.argmax(X)]
    assert opt.total_throughput == pytest.approx(X.max(), rel=1e-9)
    # the docstring's approximation of the optimum is close
    q_star = (tau0 * K ** 2 / (2 * b / C)) ** (1 / 3)
    assert abs(4 * opt.window[0] - q_star) / q_star < 0.1


def test_phases_move_the_optimum():
    cfg = example(64)
    optima = phase_optima(cfg)
    windows = [o.window[0] for o in optima]
    assert windows[1] > 1.8 * windows[0]           # half the clients idle: window doubles
    # each phase's best setting is out of the next phase's band
    for k in range(len(optima) - 1):
        stale = evaluate(cfg, optima[k].window, optima[k].rate_limit, k + 1)["objective"]
        assert stale < (1 - cfg.win_band) * optima[k + 1].objective
    # a setting per workload class beats the best shared one in the mixed phase
    per_class = phase_optima(cfg, "class")
    assert per_class[2].objective > 1.05 * optima[2].objective
    assert all(c.objective >= s.objective * (1 - 1e-12) for c, s in zip(per_class, optima))


def test_the_sim_judges_each_phase_against_its_best_static_setting():
    cfg = example(8, time_limit_ticks=300, phases=[ClusterPhase(at_tick=150,
                                                                active_fraction=0.5)])
    optima = phase_optima(cfg)
    sim = ClusterSim(cfg, seed=0)
    while sim.ticks < 149:
        sim.set_params(window=optima[0].window, rate_limit=optima[0].rate_limit)
        sim.tick()
    assert sim.phase_won == [True, False] and not sim.won and not sim.over
    while not sim.over:
        sim.set_params(window=optima[1].window, rate_limit=optima[1].rate_limit)
        sim.tick()
    assert sim.ticks == 300 and sim.phase_won == [True, True] and sim.won
    assert sim.ideal_objective == pytest.approx(optima[1].objective)


def test_thousand_nodes_run_and_scale():
    cfg = example(1000)
    assert cfg.n_servers == 125
    sim = ClusterSim(cfg, seed=0, judge=False)
    for _ in range(20):
        sim.set_params(window=sim.window + 1)
        sim.tick()
    assert sim.throughput.shape == (1000,) and np.all(np.isfinite(sim.throughput))
    # servers scale with the nodes: the per-node optimum does not depend on the size
    assert phase_optima(cfg)[0].window[0] == phase_optima(example(8))[0].window[0]


# --------------------------------------------------------------------------- config
def test_the_example_config_builds_with_its_phases():
    cfg = example()
    assert cfg.nodes == 64 and len(cfg.phases) >= 2
    assert cfg.workloads[0].demand == math.inf
    assert cfg.phases[1].workloads[1].name == "readers"
    assert phase_starts(cfg.phases) == [0, 1200, 2400]


@pytest.mark.parametrize("table, match", [
    ({"nodes": 0}, r"nodes: must be >= 1"),
    ({"nodes": 4, "servers": 5}, r"servers: must be <= nodes"),
    ({"phases": [{"at_tick": 10, "active_fraction": 0}]},
     r"phases\[0\]\.active_fraction"),
    ({"phases": [{"at_tick": 10}, {"at_tick": 5}]}, r"phases\[1\]\.at_tick"),
    ({"phases": [{"at_tick": 5000}]}, r"phases\[0\]\.at_tick: must be < time_limit"),
    ({"workloads": [{"write_fraction": 2}]}, r"workloads\[0\]\.write_fraction"),
    ({"best_static": "per-node"}, r"best_static"),
])
def test_bad_cluster_config_is_rejected_with_the_key(table, match):
    with pytest.raises(ConfigError, match=match):
        build(ClusterConfig, table, "cluster.toml")


# --------------------------------------------------------------------------- game phases
def test_single_node_game_phase_moves_the_peak_and_plays_on():
    cfg = build(GameConfig, {"noise": 0.0, "phases": [{"at_tick": 100, "peak_window": 75.0}]})
    game = StorageGameSim(cfg, seed=0)
    game.set_params(window=50, rate_limit=200)
    while game.ticks < 99:
        game.tick()
    assert game.phase_won == [True, False] and not game.won and not game.over
    game.tick()
    assert game.phase == 1 and game.true_throughput < 50 and game.streak == 0
    game.set_params(window=75)
    while not game.over:
        game.tick()
    assert game.ticks == cfg.time_limit_ticks and game.won
    assert game.ideal_throughput == pytest.approx(100)


def test_game_phases_accumulate_and_are_validated():
    cfg = build(GameConfig, {"phases": [{"at_tick": 10, "noise": 0.5},
                                        {"at_tick": 20, "peak_window": 70.0}]})
    act = cfg.phase_configs()
    assert [c.noise for c in act] == [0.01, 0.5, 0.5]
    assert [c.peak_window for c in act] == [50, 50, 70]
    with pytest.raises(ConfigError, match=r"phases\[0\]\.peak_window"):
        build(GameConfig, {"phases": [{"at_tick": 10, "peak_window": 500.0}]})
    with pytest.raises(ConfigError, match=r"phases\[1\]\.at_tick"):
        build(GameConfig, {"phases": [{"at_tick": 10}, {"at_tick": 10}]})


def test_a_game_without_phases_draws_the_same_noise_as_before():
    a = StorageGameSim(GameConfig(noise=0.5), seed=3)
    b = StorageGameSim(GameConfig(noise=0.5, phases=[GamePhase(at_tick=3000)]), seed=3)
    assert [a.tick() for _ in range(100)] == [b.tick() for _ in range(100)]


# --------------------------------------------------------------------------- scorer
def test_scorer_on_a_synthetic_trace():
    # phase 0: ticks 0-99, ideal 100; phase 1: ticks 100-199, ideal 50
    tp = np.concatenate([np.linspace(0, 100, 50), np.full(50, 100.0),   # in band from 45
                         np.full(30, 100.0),        # phase 1 starts way above: in band
                         np.full(10, 30.0),         # a dip below 45 breaks the hold
                         np.full(60, 50.0)])        # back in band at 140
    s = score_phases(tp, [0, 100], [100.0, 50.0], hold=21, band=0.1)
    assert [x.won for x in s] == [True, True]
    first_in = int(np.argmax(tp >= 90))
    assert s[0].recover_ticks == first_in
    assert s[0].in_band_share == pytest.approx((100 - first_in) / 100)
    assert s[1].recover_ticks == 0          # 30 ticks above the band: one-sided rule
    assert s[1].in_band_share == pytest.approx(0.9)
    assert s[1].mean_relative == pytest.approx((30 * 2 + 10 * 0.6 + 60 * 1) / 100)
    # two-sided (the game's literal rule): above the band is out, recovery at 140
    s2 = score_phases(tp, [0, 100], [100.0, 50.0], hold=21, two_sided=True)
    assert s2[1].recover_ticks == 40 and s2[1].in_band_share == pytest.approx(0.6)
    # a hold that does not fit before the phase ends is no recovery
    short = score_phases(np.concatenate([np.zeros(90), np.full(20, 100.0)]), [0, 100],
                         [100.0, 100.0], hold=21)
    assert not short[0].won and short[1].recover_ticks is None and short[1].ticks == 10
    # relative to a best static setting other than the ideal
    rel = score_phases(tp, [0, 100], [100.0, 50.0], best_static=[200.0, 100.0])
    assert rel[1].median_relative == pytest.approx(0.5)


def test_scorer_edges_and_summary():
    tp = np.full(150, 95.0)
    s = score_phases(tp, [0, 100, 200], [100.0, 100.0, 100.0], names=["a", "b", "c"])
    assert [x.ticks for x in s] == [100, 50, 0]
    assert s[2].won is False and math.isnan(s[2].in_band_share)
    summary = summarise(s, tp, [0, 100, 200], [100.0, 100.0, 100.0])
    assert summary["phases_won"] == 2 and not summary["all_won"]
    assert summary["median_relative"] == pytest.approx(0.95)
    assert summary["in_band_share"] == 1.0 and summary["max_recover_ticks"] == 0
    assert s[1].to_dict()["name"] == "b"
    np.testing.assert_allclose(relative_trace([10, 10, 10], [0, 2], [10.0, 5.0]), [1, 1, 2])
    assert phase_at([0, 100, 200], 99) == 0 and phase_at([0, 100, 200], 100) == 1
    with pytest.raises(ValueError, match="hold"):
        score_phases(tp, [0], [1.0], hold=0)


def test_scorer_on_a_cluster_run_that_holds_each_phase_optimum():
    cfg = example(8)
    optima = phase_optima(cfg)
    sim = ClusterSim(cfg, seed=0, optima=optima)
    trace = []
    while not sim.over:
        k = phase_at(sim.phase_starts, sim.ticks + 1)
        sim.set_params(window=optima[k].window, rate_limit=optima[k].rate_limit)
        sim.tick()
        trace.append(sim.true_objective)
    scores = score_phases(trace, sim.phase_starts, [o.objective for o in optima], first_tick=1)
    assert all(s.won for s in scores) and sim.won
    assert sim.phase_names == ["phase 0", "analysis", "mixed"]
    # the knobs act delay_ticks late, so each change costs that many ticks out of band
    # (phase 0 counts from tick 0; its first tick is 1)
    assert [s.recover_ticks for s in scores] == [cfg.delay_ticks + 1] + [cfg.delay_ticks] * 2
    assert all(s.median_relative == pytest.approx(1.0) for s in scores)
