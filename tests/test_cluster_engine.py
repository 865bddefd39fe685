"""The cluster engine (issue 11, items 1 and 5): a per-node shared-weight Q-network whose
size does not depend on the node count, its replay ring, exploration, trust region and
change detection, and the cluster converge harness. Small and seeded: 8 nodes, short
games; the long runs are in benchmarks/bench_cluster_engine.py."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from capes.common.params import ParameterSpec
from capes.experiments.cluster_test import (aggregate, format_table, is_cluster_config,
                                            load_config, run_one, run_tuners)
from drl_engine.cluster_engine import ClusterEngine, NodeReplay
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from drl_engine.node_model import NodeModelConfig, NodeQNetwork, pool_nodes
from storagegamesim.cluster import PI_NAMES, ClusterConfig

SHORT = ["cluster.nodes=8", "cluster.time_limit_ticks=240",
         'cluster.phases=[{at_tick=120, name="half idle", active_fraction=0.5}]']
FAST_MODEL = NodeModelConfig(stats_ticks=40, learn_start=16, replay_mb=8)


def specs():
    return list(ClusterConfig().param_specs().values())


def default_dqn(**kw) -> DQNConfig:
    from capes.common.config import build
    return dataclasses.replace(build(DQNConfig, with_preset({"preset": "default"})), **kw)


def engine(nodes: int, model: NodeModelConfig | None = None, **kw) -> ClusterEngine:
    return ClusterEngine(default_dqn(**kw), RewardConfig(), list(PI_NAMES), specs(), nodes,
                         model=model or FAST_MODEL, seed=0)


def cfg_short(extra=()):
    cfg = load_config(None, SHORT + list(extra))
    cfg.model = FAST_MODEL
    return cfg


# -- the model -----------------------------------------------------------------------------

def test_weight_count_does_not_depend_on_the_node_count():
    small, big = engine(8), engine(1000)
    assert small.weights == big.weights > 0
    # the change detector reads a fixed sample of 128 nodes at 1,000, every node at 8
    assert big.detector.streams == 128 and small.detector.streams == 8
    x = torch.zeros(2, 1000, small.in_dim)
    assert big.dqn.q(x, None, torch.zeros(2, 1000, 5)).shape == (2, 1000, 5)


def test_the_network_is_permutation_equivariant_and_ignores_masked_nodes():
    torch.manual_seed(0)
    net = NodeQNetwork(12, 5, NodeModelConfig(mean_field=False))
    x = torch.randn(1, 6, 12)
    perm = torch.randperm(6)
    q = net(x)
    assert torch.allclose(net(x[:, perm]), q[:, perm], atol=1e-6)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    y = x.clone()
    y[:, 4:] = 100.0                                   # what masked nodes hold is ignored
    assert torch.allclose(net(x, mask)[:, :4], net(y, mask)[:, :4], atol=1e-6)
    assert torch.allclose(net(x[:, :4])[:, :4], net(x, mask)[:, :4], atol=1e-5)


def test_mean_std_pool_of_a_subset_estimates_the_whole():
    torch.manual_seed(1)
    e = torch.randn(1, 4000, 3) * 2 + 1
    whole = pool_nodes(e, None, "mean_std")
    sub = pool_nodes(e[:, torch.randperm(4000)[:400]], None, "mean_std")
    assert torch.allclose(whole, sub, atol=0.25)


# -- the replay ring -------------------------------------------------------------------------

def test_each_nodes_action_is_read_back_from_its_knob_pis():
    rep = NodeReplay(4, list(PI_NAMES), specs(), 64, RewardConfig())
    # knobs in action order: rate_limit (step 50), window (step 1)
    before = np.array([[2000, 8], [2000, 8], [1000, 8], [np.nan, 8]], np.float32)
    after = np.array([[2000, 9], [1950, 8], [1050, 7], [2000, 8]], np.float32)
    # node 0: window+ (action 3); node 1: rate- (2); node 2: both moved (-1); 3: unknown
    assert rep._read_actions(before, after).tolist() == [3, 2, -1, -1]
    assert rep._read_actions(before[:2], before[:2]).tolist() == [0, 0]


def test_ring_rewards_and_mean_field():
    rep = NodeReplay(3, list(PI_NAMES), specs(), 32, RewardConfig())
    x = np.zeros((3, len(PI_NAMES)), np.float32)
    x[:, 0] = [10, 20, 30]
    x[:, 4], x[:, 5] = 8, 2000                        # window, rate_limit
    rep.ingest(0, x)
    y = x.copy()
    y[:, 0] = [11, 22, 33]
    y[0, 4] = 9                                       # node 0: window+, others NULL
    rep.ingest(1, y)
    assert rep.r[0] == pytest.approx(6.0)             # diff of the total
    assert rep.actions[0].tolist() == [3, 0, 0]
    mf = rep.mean_field(0)
    assert mf[0].tolist() == [1.0, 0, 0, 0, 0]        # node 0 sees two NULLs
    assert mf[1].tolist() == [0.5, 0, 0, 0.5, 0]      # node 1 sees NULL and window+
    rep.ingest(5, y)                                  # a gap: ticks 2-4 are missing
    assert np.isnan(rep.pobj[3]) and rep.actions[1].tolist() == [-1, -1, -1]


def test_a_sample_needs_full_transitions_and_pools_few_nodes_at_1000():
    eng = engine(1000, NodeModelConfig(stats_ticks=20, learn_start=5, loss_nodes=16,
                                       replay_mb=8))
    rng = np.random.default_rng(0)
    for t in range(40):
        x = rng.uniform(1, 100, (1000, len(PI_NAMES))).astype(np.float32)
        x[:, 4], x[:, 5] = 8 + (t % 2), 2000
        eng.ingest(t, x)
    b = eng.sample(8)
    assert b.obs.shape == (8, 16, eng.in_dim) and b.abar.shape == (8, 16, 5)
    assert b.valid.all() and np.isfinite(b.returns).all()
    assert eng.train(2) is not None and eng.train_steps == 2


# -- acting ----------------------------------------------------------------------------------

def feed_ticks(eng, n, rng, base=None, start=0):
    x = base if base is not None else np.full((eng.nodes, len(PI_NAMES)), 50.0, np.float32)
    for t in range(start, start + n):
        y = x.copy()
        y[:, :4] *= rng.uniform(0.99, 1.01, (eng.nodes, 4))
        eng.ingest(t, y)
    return x


def test_probes_are_excursions_that_come_back():
    eng = engine(1, NodeModelConfig(probe_steps=3.0, probe_dwell=2, detect=False),
                 guard_steps=0)
    idx = np.array([[30, 10]])
    eng.probe_knob[:] = 1
    eng.probe_origin[:] = 10
    eng.probe_target[:] = 12
    eng.probe_dwell[:] = 2
    eng.probe_back[:] = False
    seen = []
    for _ in range(12):
        explore, a = eng._explore(idx, 0.0)
        seen.append(int(a[0]))
        idx = idx + np.array([[0, {3: 1, 4: -1}.get(int(a[0]), 0)]])
        if not explore[0]:
            break
    assert seen == [3, 3, 0, 0, 4, 4, 0] and idx[0, 1] == 10


def test_the_trust_region_turns_a_move_away_from_the_best_back():
    eng = engine(2, guard_steps=3)
    eng.best_idx = np.array([[39, 10], [39, 10]])
    idx = np.array([[39, 13], [39, 12]])
    # node 0 would go to 14 (4 from the best): turned back; node 1 to 13: allowed
    out = eng._guard(idx, np.array([3, 3]), np.zeros(2, bool))
    assert out.tolist() == [4, 3] and eng.guarded == 1


def test_idle_nodes_keep_their_knobs():
    eng = engine(4)
    rng = np.random.default_rng(0)
    x = np.full((4, len(PI_NAMES)), 50.0, np.float32)
    x[2:, :4] = 0.0                                   # nodes 2 and 3 move no data
    x[:, 4], x[:, 5] = 8, 2000
    feed_ticks(eng, 30, rng, x)
    for _ in range(20):
        d = eng.act()
        assert (d.actions[2:] == 0).all() and not d.explored[2:].any()


@pytest.mark.parametrize("signal,change", [
    ("share", [0.4] * 4 + [1.3] * 4),       # the mix changes: half slow down, half speed up
    ("throughput", [0.7] * 8),              # every node's level drops 30 %
])
def test_a_workload_change_is_detected_counted_and_raises_exploration(signal, change):
    eng = engine(8, NodeModelConfig(stats_ticks=40, replay_mb=8, detect_signal=signal),
                 exploration_ticks=100)
    rng = np.random.default_rng(3)
    x = np.full((8, len(PI_NAMES)), 100.0, np.float32)
    x[:, 4], x[:, 5] = 20, 2000
    for t in range(300):
        y = x.copy()
        if t >= 200:
            y[:, 0] *= np.array(change, np.float32)
        y[:, :4] *= rng.normal(1.0, 0.01, (8, 4))
        eng.ingest(t, y)
    assert any(200 <= a <= 230 for a in eng.alarm_ticks), eng.alarm_ticks
    assert not [a for a in eng.alarm_ticks if a < 200]
    assert eng.bumped_at is not None and eng.epsilon > eng.cfg.epsilon_final
    assert eng.counters()["alarms"] == len(eng.alarm_ticks)


# -- checkpoints -----------------------------------------------------------------------------

def test_a_checkpoint_trained_on_8_nodes_runs_on_64(tmp_path):
    ckpt = tmp_path / "n8.pt"
    r8 = run_one(cfg_short(["cluster.time_limit_ticks=120", "cluster.phases=[]"]), seed=0,
                 save_model=str(ckpt))
    assert r8["train_steps"] > 0
    state = torch.load(ckpt, weights_only=True)
    assert state["nodes_trained"] == 8
    big = engine(64)
    big.load(ckpt, weights_only=True)
    assert big.weights == state["weights"] and big.mean is not None and big.pretrained
    rng = np.random.default_rng(1)
    x = np.full((64, len(PI_NAMES)), 80.0, np.float32)
    x[:, 4], x[:, 5] = 20, 2000
    feed_ticks(big, 15, rng, x)
    d = big.act()
    assert d.actions.shape == (64,) and d.values.shape == (64, 2)
    assert big.epsilon == pytest.approx(big.cfg.pretrained_epsilon_start, abs=0.01)
    r64 = run_one(cfg_short(["cluster.nodes=64", "cluster.time_limit_ticks=30",
                             "cluster.phases=[]"]), seed=0, init_model=str(ckpt))
    assert r64["nodes"] == 64 and r64["weights"] == r8["weights"]


def test_a_checkpoint_for_other_pis_is_refused(tmp_path):
    eng = engine(8)
    path = eng.save(tmp_path / "c.pt")
    other = ClusterEngine(default_dqn(), RewardConfig(), list(PI_NAMES)[::-1], specs(), 8,
                          model=FAST_MODEL)
    with pytest.raises(ValueError, match="trained on PIs"):
        other.load(path)


def test_resume_restores_counters(tmp_path):
    eng = engine(8)
    feed_ticks(eng, 30, np.random.default_rng(0))
    for _ in range(5):
        eng.act()
    path = eng.save(tmp_path / "c.pt")
    again = engine(8)
    again.load(path)
    assert again.action_ticks == 5 and not again.pretrained


# -- the harness -----------------------------------------------------------------------------

def test_same_seed_same_result_and_reader_feed_equals_rows_feed():
    cfg = cfg_short(["cluster.time_limit_ticks=100", "cluster.phases=[]"])
    a = run_one(cfg, seed=3, keep_trace=True, feed="reader")
    b = run_one(cfg, seed=3, keep_trace=True, feed="rows")
    c = run_one(cfg, seed=3, keep_trace=True, feed="reader")
    assert a["trace"]["true_objective"] == c["trace"]["true_objective"]
    assert a["trace"]["true_objective"] == b["trace"]["true_objective"]
    assert a["trace"]["loss"] == b["trace"]["loss"]
    assert (a["feed"], b["feed"]) == ("reader", "rows")


def test_harness_scores_every_phase_and_reports_the_model():
    cfg = cfg_short()
    r = run_one(cfg, seed=0)
    assert r["ticks"] == 240 and len(r["per_phase"]) == 2
    assert [p["name"] for p in r["per_phase"]] == ["phase 0", "half idle"]
    for key in ("median_relative", "mean_relative", "in_band_share", "weights",
                "detection_delays", "false_alarms_per_hour", "alarm_ticks"):
        assert key in r
    assert 0.3 < r["mean_relative"] < 1.2


def test_baselines_run_in_the_same_harness_and_search_again_at_each_phase():
    cfg = cfg_short()
    report = run_tuners(cfg, ["random", "hill"], seeds=1, progress=None)
    for name in ("random", "hill"):
        a = report["tuners"][name]
        assert a["runs"] == 1 and len(a["per_phase"]) == 2 and "weights" not in a
    text = format_table(report)
    assert "hill" in text and "half idle" in text
    json.dumps(report)


def test_the_converge_command_routes_a_cluster_config(tmp_path, capsys):
    from capes.cli import main
    from capes.experiments.cluster_test import DEFAULT_CONFIG
    assert is_cluster_config(DEFAULT_CONFIG) and not is_cluster_config(None)
    out = tmp_path / "r.json"
    sets = []
    for s in ["cluster.nodes=8", "cluster.time_limit_ticks=120",
              'cluster.phases=[{at_tick=60, active_fraction=0.5}]']:
        sets += ["--set", s]
    rc = main(["converge-test", "--config", str(DEFAULT_CONFIG), *sets, "--seeds", "1",
               "--quiet", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["nodes"] == 8 and report["tuners"]["capes"]["weights"] > 0
    assert "cluster converge test" in capsys.readouterr().out


def test_aggregate_takes_medians_over_seeds():
    runs = [{"median_relative": v, "mean_relative": v, "in_band_share": v, "phases_won": 1,
             "phases": 2, "wall_s": 1.0,
             "per_phase": [{"name": "a", "recover_ticks": r, "in_band_share": v,
                            "mean_relative": v, "median_relative": v}]}
            for v, r in ((0.8, None), (0.9, 10), (1.0, 30))]
    a = aggregate(runs)
    assert a["median_relative"] == 0.9 and a["per_phase"][0]["recovered"] == 2
    assert a["per_phase"][0]["median_recover_ticks"] == 20
