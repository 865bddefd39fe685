"""The cluster engine (issue 11, items 1 and 5): a per-node shared-weight Q-network whose
size does not depend on the node count, its replay ring, exploration, trust region and
change detection, and the cluster converge harness. Small and seeded: 8 nodes, short
games; the long runs are in benchmarks/bench_cluster_engine.py."""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from capes.experiments.cluster_test import (aggregate, format_table, is_cluster_config,
                                            load_config, run_one, run_tuners)
from drl_engine.engine import Engine
from drl_engine.node_replay import NodeBatch, NodeReplay, RowData, pick_subsets
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from drl_engine.node_model import NodeDQN, NodeModelConfig, NodeQNetwork, pool_nodes
from storagegamesim.cluster import PI_NAMES, ClusterConfig

SHORT = ["cluster.nodes=8", "cluster.time_limit_ticks=240",
         'cluster.phases=[{at_tick=120, name="half idle", active_fraction=0.5}]']
# per node from the first tick: these tests are of the per-node engine; the shared cold
# start that precedes it by default has its own (tests/test_cold_start.py)
FAST_MODEL = NodeModelConfig(stats_ticks=40, learn_start=16, replay_mb=8,
                             cold_start="per_node")


def specs():
    return list(ClusterConfig().param_specs().values())


def default_dqn(**kw) -> DQNConfig:
    from capes.common.config import build
    return dataclasses.replace(build(DQNConfig, with_preset({"preset": "default"})), **kw)


def engine(nodes: int, model: NodeModelConfig | None = None, cold_start="per_node",
           **kw) -> Engine:
    model = dataclasses.replace(model or FAST_MODEL, cold_start=cold_start)
    return Engine.over_rows(default_dqn(**kw), RewardConfig(), list(PI_NAMES), specs(), nodes,
                         model=model, seed=0)


def cfg_short(extra=()):
    cfg = load_config(None, SHORT + list(extra))
    cfg.model = FAST_MODEL
    return cfg


# -- the model -----------------------------------------------------------------------------

def test_weight_count_does_not_depend_on_the_node_count():
    small, big = engine(8), engine(1000)
    assert small.weights == big.weights > 0
    # the change detector reads a fixed sample of 128 nodes at 1,000, every node at 8
    assert big.control.detector.streams == 128 and small.control.detector.streams == 8
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


@pytest.mark.parametrize("mean_field", [True, False])
def test_the_fast_arithmetic_computes_the_same_network(mean_field):
    """``summary_once`` (the head's c columns once per tick) and ``numpy_tanh`` change
    float rounding only: the same weights give the same Q-values and gradients as the
    concatenated rows and torch's tanh, to float32 precision; a checkpoint of one loads
    into the other."""
    torch.manual_seed(0)
    cfg = NodeModelConfig(mean_field=mean_field)
    fast = NodeQNetwork(12, 5, cfg)
    slow = NodeQNetwork(12, 5, dataclasses.replace(cfg, summary_once=False, numpy_tanh=False))
    slow.load_state_dict(fast.state_dict())
    x, abar = torch.randn(3, 40, 12), torch.rand(3, 40, 5) if mean_field else None
    mask = torch.rand(3, 40) > 0.2
    with torch.no_grad():
        torch.testing.assert_close(fast(x, mask, abar), slow(x, mask, abar))
    for net in (fast, slow):
        net(x, mask, abar).square().sum().backward()
    for a, b in zip(fast.parameters(), slow.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"mean_field": False}, {"dueling": False},
                                {"head_layers": 3, "encoder_layers": 3}, {"loss": "mse"}])
def test_the_training_step_by_hand_is_bit_identical_to_autograd(kw):
    """NodeDQN's gradient written out (drl_engine/node_backward.py) gives the same bits
    as autograd: the same loss, optimiser state (the squared gradients' running means)
    and, after five steps, weights and target."""
    loss = kw.pop("loss", "huber")
    model = dataclasses.replace(FAST_MODEL, **kw)
    states = []
    for by_hand in (True, False):
        dqn = NodeDQN(12, 5, default_dqn(loss=loss), model, seed=0)
        dqn.q.by_hand = by_hand
        rng = np.random.default_rng(3)
        losses = []
        for _ in range(5):
            B, M = 8, 6
            x, nx = (rng.normal(0, 1, (B, M, 12)).astype(np.float32) for _ in range(2))
            abar, nabar = (rng.dirichlet(np.ones(5), (B, M)).astype(np.float32)
                           if model.mean_field else None for _ in range(2))
            every = np.ones((B, M), bool)            # every node present at t and t+n
            losses.append(dqn.learn(NodeBatch(
                obs=x, mask=every, actions=rng.integers(0, 5, (B, M)),
                returns=rng.normal(0, 3, B).astype(np.float32),
                discounts=np.full(B, 0.95, np.float32), next_obs=nx, next_mask=every,
                valid=rng.random((B, M)) > 0.2, abar=abar, next_abar=nabar)))
        states.append((losses, list(dqn.optimizer.square_avg),
                       list(dqn.q.parameters()) + list(dqn.target.parameters())))
    (l1, g1, w1), (l2, g2, w2) = states
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2)) and len(g1) == len(g2) > 0
    assert all(torch.equal(a, b) for a, b in zip(w1, w2))


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


@pytest.mark.parametrize("pick", ["partition", "redraw"])
def test_a_sample_needs_full_transitions_and_pools_few_nodes_at_1000(pick):
    eng = engine(1000, NodeModelConfig(stats_ticks=20, learn_start=5, loss_nodes=16,
                                       replay_mb=8, node_pick=pick))
    rng = np.random.default_rng(0)
    for t in range(40):
        x = rng.uniform(1, 100, (1000, len(PI_NAMES))).astype(np.float32)
        x[:, 4], x[:, 5] = 8 + (t % 2), 2000
        eng.ingest(t, x)
    b = eng.data.sample(8, eng.rng)
    assert b.obs.shape == (8, 16, eng.in_dim) and b.abar.shape == (8, 16, 5)
    assert b.valid.all() and np.isfinite(b.returns).all()
    assert eng.train(2) is not None and eng.train_steps == 2


def test_redraw_picks_uniform_subsets_of_distinct_nodes():
    """``node_pick = "redraw"``: each row is m distinct nodes, every m-subset as likely
    (all 20 subsets of 3 of 6 nodes ~ 300 times in 6,000 rows: a draw biased towards
    small or repeated indices would miss that band)."""
    rng = np.random.default_rng(1)
    s = pick_subsets(rng, 6000, 6, 3)
    assert s.shape == (6000, 3) and (np.diff(s, axis=1) > 0).all()
    _, counts = np.unique(s, axis=0, return_counts=True)
    assert len(counts) == 20 and counts.min() > 220 and counts.max() < 380
    big = pick_subsets(rng, 32, 1000, 16)
    assert big.min() >= 0 and big.max() < 1000 and (np.diff(big, axis=1) > 0).all()


def test_features_zero_missing_values_as_nan_to_num_does():
    x = np.array([[0.5, np.nan, np.inf, -np.inf, 2.0]], np.float32)
    mean, std = np.float32(0.5), np.float32(0.25)
    want = np.nan_to_num((x - mean) / std, nan=0.0)
    assert np.array_equal(RowData._z(x.copy(), mean, std), want)


def test_train_every_trains_every_kth_tick_on_k_times_as_many_ticks():
    """cluster_engine.train_every = k: a step on every k-th call only, its minibatch k ×
    batch_size ticks (the same nodes per tick), so a run samples as much per tick."""
    eng = engine(8, dataclasses.replace(FAST_MODEL, train_every=2, stats_ticks=20,
                                        learn_start=5), batch_size=4)
    rng = np.random.default_rng(0)
    for t in range(40):
        x = rng.uniform(1, 100, (8, len(PI_NAMES))).astype(np.float32)
        x[:, 4], x[:, 5] = 8 + (t % 2), 2000
        eng.ingest(t, x)
    sizes = []
    sample = eng.data.sample
    eng.data.sample = lambda n, r: sizes.append(n) or sample(n, r)
    losses = [eng.train() for _ in range(5)]
    assert [loss is not None for loss in losses] == [False, True, False, True, False]
    assert eng.train_steps == 2 and sizes == [8, 8]
    sizes.clear()                   # an explicit count (offline training): exactly that
    assert eng.train(1) is not None and sizes == [4]


@pytest.mark.parametrize("shift", [-1, 0])
def test_a_move_is_credited_with_its_own_delayed_effect_not_the_moves_before_it(shift):
    # issue 11, seed 2: every node moves together, alternating window +/- each tick, and
    # the throughput follows the window settle_ticks (3) late. A move's return must carry
    # its own effect: positive for the window+ that raises the throughput, negative for
    # the window-. (Credited with r_t ... r_{t+4}, each move got the effect of the moves
    # before it, the opposite sign, and the policy learned to reverse every move:
    # cluster_engine.return_shift = 0, the ablation.)
    eng = engine(2, dataclasses.replace(FAST_MODEL, return_shift=shift))
    assert eng.cfg.settle_ticks == 3 and eng.cfg.n_step == 5
    w = lambda u: 20.0 + (u % 2)                      # noqa: E731 -- the window at tick u
    for u in range(120):
        x = np.full((2, len(PI_NAMES)), 5.0, np.float32)
        x[:, 0] = 10.0 * w(u - 3)                     # throughput: the window 3 ticks ago
        x[:, 4], x[:, 5] = w(u), 2000                 # knob PIs: window, rate_limit
        eng.ingest(u, x)
    b = eng.data.sample(64, eng.rng)
    acts, ret = b.actions[:, 0], b.returns
    assert b.valid.all() and set(acts.tolist()) == {3, 4}   # window+ and window- only
    own = 1 if shift == -1 else -1                    # unshifted: the opposite sign
    assert (own * ret[acts == 3] > 0).all() and (own * ret[acts == 4] < 0).all()


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
    eng.control.probes.knob[:] = 1
    eng.control.probes.origin[:] = 10
    eng.control.probes.target[:] = 12
    eng.control.probes.dwell[:] = 2
    eng.control.probes.back[:] = False
    seen = []
    for _ in range(12):
        explore, a = eng.control.explore(idx, 0.0, eng.rng)
        seen.append(int(a[0]))
        idx = idx + np.array([[0, {3: 1, 4: -1}.get(int(a[0]), 0)]])
        if not explore[0]:
            break
    assert seen == [3, 3, 0, 0, 4, 4, 0] and idx[0, 1] == 10


def test_a_probe_that_named_the_best_stays_where_it_went_with_return_best():
    # two rows probe window 10 -> 12; the best-known setting has row 0 at 12 (its probe
    # raised the objective's peak) and row 1 at 10: row 0 stays, row 1 comes back
    eng = engine(2, NodeModelConfig(probe_steps=3.0, probe_dwell=2, detect=False,
                                    probe_return="best"), guard_steps=0)
    eng.control.best.best_idx = np.array([[30, 12], [30, 10]])
    idx = np.array([[30, 10], [30, 10]])
    p = eng.control.probes
    p.knob[:], p.origin[:], p.target[:], p.dwell[:], p.back[:] = 1, 10, 12, 2, False
    for _ in range(12):
        explore, a = eng.control.explore(idx, 0.0, eng.rng)
        idx = idx + np.stack([np.zeros(2, np.int64),
                              np.vectorize({3: 1, 4: -1}.get)(a, 0)], axis=1)
        if not explore.any():
            break
    assert idx[:, 1].tolist() == [12, 10] and (p.knob == -1).all()


def test_probe_return_is_checked_on_load():
    with pytest.raises(ValueError, match="probe_return"):
        NodeModelConfig(probe_return="origin").validate()


def test_the_trust_region_turns_a_move_away_from_the_best_back():
    eng = engine(2, guard_steps=3)
    eng.control.best.best_idx = np.array([[39, 10], [39, 10]])
    idx = np.array([[39, 13], [39, 12]])
    # node 0 would go to 14 (4 from the best): turned back; node 1 to 13: allowed (a
    # greedy move too: the knobs are ranges, not ladders)
    out = eng.control.guard(idx, np.array([3, 3]), np.zeros(2, bool))
    assert out.tolist() == [4, 3] and eng.control.guarded == 1


def test_greedy_moves_of_a_ladder_knob_stay_a_rung_from_the_best():
    # as the one-row mode's (engine.greedy_guard_steps, 1 in the default preset); probes
    # keep guard_steps. Without it (the ablation) every client of the real cluster took
    # greedy moves 3 rungs (8x) off its recalled window
    import test_row_sweep
    eng = test_row_sweep.ladder_engine(3, guard_steps=3)
    assert eng.cfg.greedy_guard_steps == 1 and eng.mcfg.greedy_guard
    eng.control.best.best_idx = np.array([[4]] * 3)           # 64 KiB
    idx = np.array([[3], [3], [4]])
    # down a rung: greedy from 32 KiB (2 from the best: back up), probing from 32 KiB
    # (allowed), greedy from the best itself (1 rung: allowed)
    down, up = 2, 1
    out = eng.control.guard(idx, np.array([down] * 3), np.array([False, True, False]))
    assert out.tolist() == [up, down, down]
    eng.control.mcfg = dataclasses.replace(eng.control.mcfg, greedy_guard=False)
    assert eng.control.guard(idx, np.array([down] * 3), np.zeros(3, bool)).tolist() == \
        [down] * 3


def test_idle_nodes_keep_their_knobs():
    eng = engine(4)
    rng = np.random.default_rng(0)
    x = np.full((4, len(PI_NAMES)), 50.0, np.float32)
    x[2:, :4] = 0.0                                   # nodes 2 and 3 move no data
    x[:, 4], x[:, 5] = 8, 2000
    feed_ticks(eng, 30, rng, x)
    for _ in range(20):
        d = eng.act()
        assert (d.row_actions[2:] == 0).all() and not d.row_explored[2:].any()


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
    assert any(200 <= a <= 230 for a in eng.control.alarm_ticks), eng.control.alarm_ticks
    assert not [a for a in eng.control.alarm_ticks if a < 200]
    assert eng.exploration.bumped_at is not None and eng.epsilon > eng.cfg.epsilon_final
    assert eng.counters()["alarms"] == len(eng.control.alarm_ticks)


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
    assert big.weights == state["weights"] and big.data.mean is not None and big.exploration.pretrained
    rng = np.random.default_rng(1)
    x = np.full((64, len(PI_NAMES)), 80.0, np.float32)
    x[:, 4], x[:, 5] = 20, 2000
    feed_ticks(big, 15, rng, x)
    d = big.act()
    assert d.row_actions.shape == (64,) and d.values.shape == (64, 2)
    assert big.epsilon == pytest.approx(big.cfg.pretrained_epsilon_start, abs=0.01)
    r64 = run_one(cfg_short(["cluster.nodes=64", "cluster.time_limit_ticks=30",
                             "cluster.phases=[]"]), seed=0, init_model=str(ckpt))
    assert r64["nodes"] == 64 and r64["weights"] == r8["weights"]


def test_a_checkpoint_for_other_pis_is_refused(tmp_path):
    eng = engine(8)
    path = eng.save(tmp_path / "c.pt")
    other = Engine.over_rows(default_dqn(), RewardConfig(), list(PI_NAMES)[::-1], specs(), 8,
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
    assert again.action_ticks == 5 and not again.exploration.pretrained


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


def test_writes_in_their_own_process_store_the_same_db_and_raise_their_errors(
        tmp_path):
    import sqlite3
    from capes.experiments.cluster_test import WriteProcess
    from capes.common.replay_db import ReplayDBError
    cfg = cfg_short(["cluster.time_limit_ticks=60", "cluster.phases=[]"])
    dbs = []
    for behind in (True, False):
        path = tmp_path / f"{behind}.db"
        out = run_one(cfg, seed=1, feed="rows", write_behind=behind, db_path=str(path))
        with sqlite3.connect(path) as conn:
            dbs.append((conn.execute("SELECT rowid, * FROM pis ORDER BY rowid").fetchall(),
                        conn.execute("SELECT node_names FROM sessions").fetchall(),
                        out["mean_relative"]))
        assert ("writer_cpu_s" in out) == behind
    assert len(dbs[0][0]) == 60 * 8 and dbs[0] == dbs[1]
    # the process's writer refuses a node outside the session's layout: the error
    # reaches the caller (at a later submit or at close)
    p = WriteProcess(tmp_path / "True.db", _session_of(tmp_path / "True.db"))
    bad = np.zeros((1, len(PI_NAMES)), np.float32)
    with pytest.raises(ReplayDBError, match="not in session layout"):
        try:
            for tick in range(1000, 1020):
                p.submit(_rows_call, tick, np.array([10_000]), bad)
                time.sleep(0.01)
        finally:
            p.close()


def _rows_call(*args):                 # sent by name, as ClusterSource._write_rows is
    raise AssertionError("runs in the writer process, by name")


_rows_call.__name__ = "_write_rows"


def _session_of(path):
    from capes.common.replay_db import ReplayReader
    reader = ReplayReader(path)
    reader.refresh()
    info = next(iter(reader.sessions.values())).info
    reader.close()
    return info


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


# -- [cluster_engine] in a config file ------------------------------------------------------

def test_the_cluster_engine_section_is_typed_and_reaches_the_engine(tmp_path):
    from capes.experiments.cluster_test import DEFAULT_CONFIG
    cfg = load_config(DEFAULT_CONFIG, ["cluster_engine.loss_nodes=32",
                                       'cluster_engine.detect_signal="throughput"',
                                       "cluster_engine.rollback_ticks=30"])
    assert (cfg.model.loss_nodes, cfg.model.detect_signal, cfg.model.rollback_ticks) == \
        (32, "throughput", 30)
    assert cfg.model.embed == NodeModelConfig().embed            # the others: defaults
    assert load_config(DEFAULT_CONFIG).model.rollback_ticks == 60    # the file's section
    f = tmp_path / "c.toml"
    f.write_text("[cluster]\nnodes = 8\n\n[cluster_engine]\nhidden = 32\n")
    assert load_config(f).model.hidden == 32


@pytest.mark.parametrize("text, key, problem", [
    ("embeded = 64", "cluster_engine.embeded", "unknown key"),
    ("hidden = 0", "cluster_engine.hidden", "must be > 0"),
    ('detect_signal = "mine"', "cluster_engine.detect_signal", "must be one of"),
    ("rollback_fraction = 1.5", "cluster_engine.rollback_fraction", "[0, 1)"),
    ("sweep_abort = 1.0", "cluster_engine.sweep_abort", "[0, 1)"),
    ("loss_nodes = 1.5", "cluster_engine.loss_nodes", "integer"),
    ("replay_mb = 1e12", "cluster_engine.replay_mb", ""),
    ('cold_start = "both"', "cluster_engine.cold_start", "must be one of"),
    ("return_shift = -2", "cluster_engine.return_shift", "-1 for settle_ticks"),
])
def test_a_bad_cluster_engine_key_is_one_clear_error_line(tmp_path, text, key, problem):
    from capes.common.config import ConfigError
    f = tmp_path / "bad.toml"
    f.write_text(f"[cluster]\nnodes = 8\n\n[cluster_engine]\n{text}\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    msg = str(err.value)
    assert "\n" not in msg and str(f) in msg and key in msg and problem in msg, msg


def test_a_bad_cluster_engine_key_stops_the_command_with_one_line(tmp_path, capsys):
    from capes.cli import main
    from capes.experiments.cluster_test import DEFAULT_CONFIG
    f = tmp_path / "bad.toml"
    f.write_text(DEFAULT_CONFIG.read_text().replace("[cluster_engine]\n",
                                                    "[cluster_engine]\nprobe_dwel = 3\n"))
    rc = main(["converge-test", "--config", str(f), "--seeds", "1", "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc != 0 and len(err) == 1 and "cluster_engine.probe_dwel" in err[0], err


# -- change detection: contention is not a workload change ----------------------------------

def contention_ticks(eng, ticks, rng, start=0):
    """A stationary cluster on one server: node i moves w_i·c / Σw (its share of the
    server moves with its neighbours' windows), windows random-walking slowly."""
    n = eng.nodes
    w = np.full(n, 20.0)
    for t in range(start, start + ticks):
        if t % 10 == 0:
            w = np.clip(w + rng.integers(-1, 2, n), 15, 25)
        x = np.zeros((n, len(PI_NAMES)), np.float32)
        x[:, 0] = 1600.0 * w / w.sum() * rng.normal(1.0, 0.01, n)
        x[:, 1:4] = 50.0 * rng.normal(1.0, 0.01, (n, 3))
        x[:, 4], x[:, 5] = w, 2000
        eng.ingest(t, x)


def test_neighbours_moves_are_not_an_alarm_a_workload_change_is():
    rng = np.random.default_rng(5)
    quiet = engine(8, NodeModelConfig(stats_ticks=40, replay_mb=8))
    contention_ticks(quiet, 1500, rng)
    assert quiet.control.alarm_ticks == []
    # the same stream with the former floor (1e-3): shifts of a few % of a node's share
    # hit the winsorising like a workload change
    touchy = engine(8, NodeModelConfig(stats_ticks=40, replay_mb=8,
                                       detect_scale_floor=0.001))
    contention_ticks(touchy, 1500, np.random.default_rng(5))
    assert len(touchy.control.alarm_ticks) >= 2


# -- rollback and cost categories ------------------------------------------------------------

def level_ticks(eng, start, ticks, tp, window, rng):
    for t in range(start, start + ticks):
        x = np.full((eng.nodes, len(PI_NAMES)), 50.0, np.float32)
        x[:, 0] = tp * rng.normal(1.0, 0.005, eng.nodes)
        x[:, 4], x[:, 5] = window, 2000
        eng.ingest(t, x)


def test_a_lasting_drop_below_the_best_rolls_back_and_is_counted():
    eng = engine(4, NodeModelConfig(stats_ticks=20, replay_mb=8, detect=False,
                                    best_window=4, rollback_fraction=0.9, rollback_ticks=5))
    rng = np.random.default_rng(0)
    level_ticks(eng, 0, 30, 100.0, 20, rng)                 # the best: window 20
    assert eng.control.best.best_idx[:, 1].tolist() == [19] * 4
    level_ticks(eng, 30, 6, 95.0, 26, rng)                  # moved: 95 %, not a drop
    assert eng.act().rolled_back is False
    level_ticks(eng, 36, 12, 70.0, 26, rng)                 # 70 % of the best, lasting
    d = eng.act()
    assert d.rolled_back and d.values[:, 1].tolist() == [20.0] * 4
    assert (d.values[:, 0] == 2000).all() and (d.row_actions == 0).all()
    assert eng.control.rollback.rollback_ticks == [47] and eng.counters()["rollbacks"] == 1
    # back at the best and as good again: no second rollback
    level_ticks(eng, 48, 20, 100.0, 20, rng)
    assert not eng.act().rolled_back and len(eng.control.rollback.rollback_ticks) == 1


def test_a_best_that_a_rollback_cannot_bring_back_is_dropped():
    eng = engine(4, NodeModelConfig(stats_ticks=20, replay_mb=8, detect=False,
                                    best_window=4, rollback_ticks=5))
    rng = np.random.default_rng(0)
    level_ticks(eng, 0, 30, 100.0, 20, rng)
    level_ticks(eng, 30, 12, 60.0, 26, rng)
    assert eng.act().rolled_back
    for t in range(42, 41 + 3 + 4 + 1):             # held at the best while measured
        level_ticks(eng, t, 1, 60.0, 20, rng)
        d = eng.act()
        assert not d.rolled_back and (d.row_actions == 0).all() and not d.row_explored.any()
        assert eng.control.rollback.stale_bests == 0
    level_ticks(eng, 49, 1, 60.0, 20, rng)          # measured: still 60 %
    assert eng.control.rollback.stale_bests == 1 and eng.control.best.best_tick is None
    level_ticks(eng, 50, 12, 60.0, 20, rng)         # the new best is today's level
    assert not eng.act().rolled_back and len(eng.control.rollback.rollback_ticks) == 1
    assert eng.control.rollback.stale_bests == 1


def test_an_alarm_forgets_the_best_so_no_rollback_to_another_workloads_setting():
    eng = engine(4, NodeModelConfig(stats_ticks=20, replay_mb=8, detect=False,
                                    best_window=4, rollback_ticks=5))
    rng = np.random.default_rng(0)
    level_ticks(eng, 0, 30, 100.0, 20, rng)
    eng._alarm(30)
    level_ticks(eng, 30, 20, 50.0, 26, rng)
    assert not eng.act().rolled_back and eng.control.rollback.rollback_ticks == []
    assert eng.control.best.best_idx[:, 1].tolist() == [25] * 4


def remount_specs():
    out = specs()
    out[0] = dataclasses.replace(out[0])
    out[0].cost = "remount"          # until ParameterSpec has the field: read by getattr
    return out


@pytest.mark.parametrize("explore", ["probe", "random"])
def test_only_dynamic_knobs_are_tuned_online(explore):
    eng = Engine.over_rows(default_dqn(exploration_ticks=10**6), RewardConfig(), list(PI_NAMES),
                        remount_specs(), 8, seed=0,
                        model=dataclasses.replace(FAST_MODEL, explore=explore))
    assert eng.control.costs == ["remount", "dynamic"] and eng.control.allowed.tolist() == [1, 0, 0, 1, 1]
    rng = np.random.default_rng(0)
    x = np.full((8, len(PI_NAMES)), 50.0, np.float32)
    x[:, 4], x[:, 5] = 20, 1000
    moved_window = False
    for t in range(300):
        y = x.copy()
        y[:, :4] *= rng.normal(1.0, 0.01, (8, 4))
        eng.ingest(t, y)
        d = eng.act()
        assert (d.values[:, 0] == 1000).all() and not np.isin(d.row_actions, [1, 2]).any()
        moved_window |= bool((d.values[:, 1] != x[:, 4]).any())
        x[:, 4] = d.values[:, 1]
    assert moved_window and eng.train(1) is not None
    # greedy too: the Q-values of the remount knob's actions are never picked
    eng.action_ticks, eng.cfg = 0, dataclasses.replace(eng.cfg, epsilon_start=0.0,
                                                       epsilon_final=0.0)
    with torch.no_grad():
        for p in eng.dqn.q.head[-1].parameters():
            p.zero_()
        eng.dqn.q.head[-1].bias[1 + 1] = 100.0            # advantage of "rate_limit +"
    assert not np.isin(eng.act().row_actions, [1, 2]).any()


def forbidding_specs():
    """The cluster's knobs with forbidden values around where the nodes start."""
    out = specs()
    out[0].forbidden = [950.0, 1050.0]               # rate_limit (starts at 1000)
    out[1].forbidden = [19.0, 21.0, 22.0]            # window (starts at 20)
    return out


def test_a_per_node_move_steps_over_forbidden_values_as_the_one_row_move():
    from drl_engine.engine import apply_action
    sp = forbidding_specs()
    eng = Engine.over_rows(default_dqn(), RewardConfig(), list(PI_NAMES), sp, 4, seed=0,
                           model=FAST_MODEL)
    cur = np.array([[1000.0, 20.0]] * 4)
    out = eng.control.apply(cur, np.array([0, 1, 3, 4]))   # NULL, rate +, window +, window -
    assert out.tolist() == [[1000, 20], [1100, 20], [1000, 23], [1000, 18]]
    for a in range(5):        # the flat mode's move of one row: the same values
        assert apply_action(a, cur[0], sp) == eng.control.apply(cur[:1], np.array([a]))[0].tolist()
    # the trust region judges a move where it lands: window 20 -> 23 is 3 steps from a
    # best at 20 (turned back: NULL, the row is at its best), rate 1000 -> 1100 is 2
    eng.control.best.best_idx = eng.control.grid.index(np.array([[1000.0, 20.0]] * 4))
    idx = eng.control.grid.index(cur)
    guarded = dataclasses.replace(eng.cfg, guard_steps=2)
    eng.control.cfg = guarded
    assert eng.control.guard(idx, np.array([3, 3, 1, 0]), np.zeros(4, bool)).tolist() == \
        [0, 0, 1, 0]


@pytest.mark.parametrize("cold_start,explore", [("shared", "probe"), ("per_node", "probe"),
                                                ("per_node", "random")])
def test_a_per_node_engine_never_proposes_a_forbidden_value(cold_start, explore):
    """Issue 39: the per-node engine once moved by clipping, onto forbidden values the
    daemon then refused; it now crosses them (cold start, probes, greedy moves, trust
    region, walks)."""
    sp = forbidding_specs()
    bad = {k: set(s.forbidden) for k, s in enumerate(sp)}
    eng = Engine.over_rows(default_dqn(exploration_ticks=10**6), RewardConfig(),
                           list(PI_NAMES), sp, 8, seed=0,
                           model=dataclasses.replace(FAST_MODEL, explore=explore,
                                                     cold_start=cold_start))
    rng = np.random.default_rng(0)
    x = np.full((8, len(PI_NAMES)), 50.0, np.float32)
    x[:, 4], x[:, 5] = 20, 1000
    crossed = set()
    for t in range(300):
        y = x.copy()
        y[:, :4] *= rng.normal(1.0, 0.01, (8, 4))
        eng.ingest(t, y)
        d = eng.act()
        for k in bad:
            assert not bad[k] & set(d.values[:, k].tolist()), (t, k, d.values[:, k])
        crossed |= {k for k in bad if (d.values[:, k] < min(bad[k])).any()
                    or (d.values[:, k] > max(bad[k])).any()}
        x[:, 4], x[:, 5] = d.values[:, 1], d.values[:, 0]
    assert crossed == {0, 1}          # both knobs moved past their forbidden values


def test_a_knob_that_is_not_dynamic_is_reported_as_a_recommendation():
    eng = Engine.over_rows(default_dqn(), RewardConfig(), list(PI_NAMES), remount_specs(), 4,
                        model=dataclasses.replace(FAST_MODEL, best_window=5), seed=0)
    rng = np.random.default_rng(0)
    for t, (rate, tp) in enumerate([(1000, 50.0)] * 40):
        x = np.full((4, len(PI_NAMES)), tp, np.float32)
        x[:, 0] *= rng.normal(1.0, 0.01, 4)
        x[:, 4], x[:, 5] = 20, rate
        eng.ingest(t, x)
    (rec,) = eng.recommendations()
    assert rec["name"] == "rate_limit" and rec["cost"] == "remount"
    assert rec["current"] == 1000 and rec["suggest"] is None and rec["evidence"] == "not varied"
    for t in range(40, 80):                              # an operator remounted with 1500
        x = np.full((4, len(PI_NAMES)), 80.0, np.float32)
        x[:, 4], x[:, 5] = 20, 1500
        eng.ingest(t, x)
    (rec,) = eng.recommendations()
    assert rec["suggest"] == 1500 and set(rec["levels"]) == {1000.0, 1500.0}


def test_an_unknown_cost_category_is_refused():
    bad = remount_specs()
    bad[0].cost = "sometimes"
    with pytest.raises(ValueError, match="cost must be one of"):
        Engine.over_rows(default_dqn(), RewardConfig(), list(PI_NAMES), bad, 4, model=FAST_MODEL)


def test_the_greedy_margin_shrinks_like_one_over_n_above_margin_nodes():
    assert engine(8).control.act_margin == engine(64).control.act_margin == FAST_MODEL.act_margin
    assert engine(1000).control.act_margin == pytest.approx(FAST_MODEL.act_margin * 64 / 1000)
    flat = dataclasses.replace(FAST_MODEL, margin_nodes=0)
    assert engine(1000, flat).control.act_margin == FAST_MODEL.act_margin


def test_the_harness_reports_rollbacks_and_recommendations(tmp_path):
    cfg = cfg_short(["cluster.time_limit_ticks=120", "cluster.phases=[]"])
    cfg.cluster.rate_limit.cost = "remount"      # until ParameterSpec has the field
    report = run_tuners(cfg, ["capes"], seeds=1, progress=None)
    r = report["runs"][0]
    assert r["rollbacks"] == len(r["rollback_ticks"]) and "stale_bests" in r
    (rec,) = r["recommendations"]
    assert rec["name"] == "rate_limit" and rec["cost"] == "remount"
    assert r["final_rate_limit_mean"] == 2000.0           # never tuned online
    text = format_table(report)
    assert "RB/h" in text and "recommendation (remount, not tuned online): rate_limit" in text
    from capes.experiments.cluster_test import _clean, write_json
    write_json(_clean(report), tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["tuners"]["capes"]["recommendations"]


def test_a_restarted_cluster_engine_keeps_its_best_known_setting_and_probes(tmp_path):
    """The checkpoint keeps the controller (issue 23): best-known setting and level,
    running probes, the reward scale; a restart on the same cluster resumes them."""
    rng = np.random.default_rng(0)
    eng = engine(4)
    x = np.full((4, len(PI_NAMES)), 80.0, np.float32)
    x[:, 4], x[:, 5] = 20, 2000
    feed_ticks(eng, 40, rng, x)
    for t in range(40, 80):
        d = eng.act()
        y = x.copy()
        y[:, 4:6] = d.values
        feed_ticks(eng, 1, rng, y, start=t)
    eng.control.best.best_idx = np.array([[5, 3]] * 4)
    eng.control.best.best_level = 123.0
    eng.save(tmp_path / "c.pt")
    again = engine(4)
    again.load(tmp_path / "c.pt")
    assert again.control.best.best_idx.tolist() == eng.control.best.best_idx.tolist()
    assert again.control.best.best_level == 123.0
    assert again.control.probes.knob.tolist() == eng.control.probes.knob.tolist()
    assert again.epsilon == eng.epsilon < 1.0
    other = engine(8)                       # another cluster size: the model only
    other.load(tmp_path / "c.pt")
    assert other.control.best.best_idx is None
