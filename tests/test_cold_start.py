"""The cluster engine's cold start (issue 23, item 4; drl_engine/cold_start.py): every
node moves together while the guide searches one shared setting, then the per-node
engine takes over from the best it found. Small and seeded: 8 nodes, the first phase of
the cluster game; the 64-node figures are in docs/engine.md."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from capes.experiments.cluster_test import load_config, run_one
from drl_engine import checkpoint
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.engine import Engine

MODEL = NodeModelConfig(stats_ticks=40, learn_start=16, replay_mb=8, cold_start_ticks=60)


def first_phase(ticks: int, cold_start: str):
    """8 nodes, the cluster game's first workload only (no phase change)."""
    cfg = load_config(None, ["cluster.nodes=8", f"cluster.time_limit_ticks={ticks}",
                             "cluster.phases=[]"])
    cfg.model = dataclasses.replace(MODEL, cold_start=cold_start)
    return cfg


def test_every_node_moves_together_until_the_hand_over_and_then_holds_its_best():
    r = run_one(first_phase(150, "shared"), seed=0, keep_trace=True)
    t = r["handed_over_at"]
    assert t is not None and 60 < t < 150       # the budget, a walk to the best, a hold
    std = np.array(r["trace"]["window_std"])
    window = np.array(r["trace"]["window_mean"])
    assert (std[:t - 1] == 0).all()             # one shared setting while it searches ...
    assert (np.diff(window[:t - 1]) != 0).sum() > 10   # ... which it moves
    # the per-node engine then starts from the shared best: its trust region and rollback
    # anchor, and its probes move single nodes
    assert std[t:].max() > 0


@pytest.mark.slow
def test_the_shared_cold_start_reaches_the_band_where_per_node_does_not_yet():
    # 8 nodes, seed 0: the shared search reaches the first phase's band (within 10 % of
    # the best shared setting, held 21 s) in 15 s, node-by-node probing in 102 s
    shared = run_one(first_phase(150, "shared"), seed=0)["per_phase"][0]["recover_ticks"]
    per_node = run_one(first_phase(150, "per_node"), seed=0)["per_phase"][0]["recover_ticks"]
    assert shared is not None and shared <= 90
    assert per_node is None or per_node > shared


def small_engine(cold_start="shared") -> Engine:
    """4 nodes of the cluster game, fed its PIs by hand (window 20, rate limit 2000)."""
    cfg = first_phase(10, cold_start)
    c = cfg.cluster
    return Engine.over_rows(cfg.engine, cfg.reward, list(c.pi_names()),
                         list(c.param_specs().values()), 4, model=cfg.model, seed=0)


def feed(eng, ticks, values=None):
    """Ticks of made-up PIs: every node moving 80 MB/s, with the knob values given."""
    names = eng.pi_names
    for t in ticks:
        x = np.full((eng.nodes, len(names)), 80.0, np.float32)
        x[:, [names.index(s.name) for s in eng.params]] = \
            [2000, 20] if values is None else values
        eng.ingest(t, x)


def test_a_restart_resumes_the_search_and_never_starts_it_over(tmp_path):
    eng = small_engine()
    feed(eng, range(10))
    for t in range(10, 30):
        d = eng.act()
        assert (d.values == d.values[0]).all()           # every node alike
        feed(eng, [t], d.values)
    eng.save(tmp_path / "c.pt")
    again = small_engine()
    again.load(tmp_path / "c.pt")
    assert again.control.cold.ticks == eng.control.cold.ticks == 20 and again.control.cold.active
    assert np.array_equal(again.control.cold.p, eng.control.cold.p)
    # a checkpoint of an engine that acted before the cold start existed: no search
    state = eng.state_dict()
    state.pop("cold_start")
    checkpoint.write(state, tmp_path / "old.pt")
    old = small_engine()
    old.load(tmp_path / "old.pt")
    assert not old.control.cold.active


def test_per_node_is_the_ablation_and_a_pretrained_model_skips_the_search(tmp_path):
    assert small_engine("per_node").control.cold is None
    eng = small_engine()
    eng.save(tmp_path / "m.pt")
    warm = small_engine()
    warm.load(tmp_path / "m.pt", weights_only=True)
    feed(warm, range(20))
    warm.act()
    assert warm.control.cold.ticks == 0                      # the model's own probes, per node
