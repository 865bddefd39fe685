"""Recall on the cluster variant (issue 25): per-node workload contexts in the per-node
mode (drl_engine/row_context.py) and the cluster harness's scores of returns."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from capes.experiments.cluster_test import aggregate, format_table, load_config, run_one
from drl_engine.engine import Engine
from storagegamesim.cluster import ClusterSim, phase_optima

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "recurring-workloads-cluster.toml"
CHECKPOINT = '{name="checkpoint", write_fraction=0.9, request_kb=1024.0, sequential=0.9}'
ANALYSIS = '{name="analysis", write_fraction=0.1, request_kb=256.0, sequential=0.6}'
# checkpoint, analysis on half the nodes, checkpoint again: every node returns
SHORT = ["cluster.nodes=8", "cluster.time_limit_ticks=420",
         f'cluster.phases=[{{at_tick=200, name="analysis", active_fraction=0.5, '
         f'workloads=[{ANALYSIS}]}}, {{at_tick=320, name="checkpoint", '
         f'active_fraction=1.0, workloads=[{CHECKPOINT}]}}]']


def short_cfg(extra=()):
    cfg = load_config(CONFIG, SHORT + ["engine.use_context=true"] + list(extra))
    cfg.model = dataclasses.replace(cfg.model, stats_ticks=40, learn_start=16, replay_mb=8,
                                    cold_start_ticks=60)
    return cfg


def play(cfg, seed=0):
    """The cluster variant, tick by tick, with the engine fed each tick's rows; yields
    (tick, engine, its best-known setting before the tick was folded in, decision)."""
    ccfg = cfg.cluster
    sim = ClusterSim(ccfg, seed=seed, optima=phase_optima(ccfg, ccfg.best_static),
                     judge=False)
    knobs = list(ccfg.param_specs())
    eng = Engine.over_rows(cfg.engine, cfg.reward, list(ccfg.pi_names()),
                           list(ccfg.param_specs().values()), ccfg.nodes, model=cfg.model,
                           seed=seed)
    for _ in range(ccfg.time_limit_ticks - 1):
        sim.tick()
        pis = sim.pis()
        best = eng.control.best.best_idx
        best = None if best is None else best.copy()
        eng.ingest(sim.ticks, np.column_stack([pis[n] for n in ccfg.pi_names()]))
        d = eng.act()
        if d is not None:
            sim.set_params(**{n: d.values[:, k] for k, n in enumerate(knobs)})
        eng.train()
        yield sim.ticks, eng, best, d


def returned(cfg):
    """Play the short game: the first visit's best-known setting as values (the nodes'
    setting when they left it), the values each decision set from the return on, the
    engine."""
    last_best = left_with = None
    after = []
    for tick, eng, best, d in play(cfg):
        rc = eng.row_context
        if left_with is None:
            if best is not None:                   # the first visit's best-known setting
                last_best = best
            if rc.switch_ticks:                    # left the first checkpoint
                assert 200 <= tick < 210 and last_best is not None
                left_with = eng.control.grid.values(last_best)
        if tick > 320 and d is not None and rc.returns >= 8:
            after.append((d.values, dict(rc.walking)))
    assert left_with is not None and after
    assert rc.returns >= 8 and rc.switch_ticks[-1] < 330    # every node, within 10 ticks
    return left_with, after, eng


def test_a_return_walks_every_node_back_to_its_setting_of_the_last_visit():
    """Each node walks to the setting it had in the first visit's best-known setting, a
    knob of a row by at most MAX_STEPS steps a tick (the interface daemon's per-node step
    rule), and holds it there."""
    from capes.common import actions
    left_with, after, eng = returned(short_cfg())
    grid = eng.control.grid
    steps = [np.abs(grid.index(b) - grid.index(a)) for (a, _), (b, _) in
             zip(after, after[1:])]
    walked = next(i for i, (_, walking) in enumerate(after) if not walking)
    assert 0 < walked < 20                         # the far knobs took several ticks
    for s in steps[:walked]:
        assert ((s > 0).sum(axis=1) <= 1).all() and (s <= actions.MAX_STEPS).all()
    assert np.array_equal(after[walked][0], left_with)
    assert eng.row_context.unreached == 0


def test_the_ablation_sets_every_node_back_at_once():
    left_with, after, _ = returned(short_cfg(["cluster_engine.rollback_walk=false"]))
    assert np.array_equal(after[0][0], left_with)   # the first decision after the return


def test_without_named_signature_pis_or_with_the_switch_off_it_plays_as_before():
    a = run_one(short_cfg(['engine.context_pis=[]']), seed=2, keep_trace=True)
    b = run_one(short_cfg(['engine.use_context=false']), seed=2, keep_trace=True)
    assert a["trace"]["true_objective"] == b["trace"]["true_objective"]
    assert "context_returns" not in a and "context_returns" not in b
    default = load_config(None)           # the default cluster game names none
    assert default.engine.use_context and not default.engine.context_pis


def test_the_harness_scores_each_occurrence_as_a_first_visit_or_a_return_per_class():
    r = run_one(short_cfg(), seed=1)
    assert [(p["workload"], p["visit"]) for p in r["occurrences"]] == \
        [("checkpoint", 1), ("analysis", 1), ("checkpoint", 2)]
    classes = [(c["phase"], c["workload"], c["visit"], c["nodes"]) for c in r["classes"]]
    assert classes == [(0, "checkpoint", 1, 8), (1, "analysis", 1, 4),
                       (2, "checkpoint", 2, 8)]
    assert r["context_returns"] >= 8
    a = aggregate([r])
    assert a["class_recall"]["checkpoint"]["return_phases"] == 1
    assert a["recall"]["runs"] == 1
    assert "checkpoint" in format_table({"nodes": 8, "seeds": 1, "phase_starts": [0],
                                         "tuners": {"capes": a}})


def test_the_rows_at_once_cluster_as_one_clustering_per_row_would():
    from drl_engine.context import SignatureClusters
    from drl_engine.row_context import RowSignatures
    cfg = short_cfg().engine
    rows, rng = 6, np.random.default_rng(4)
    sigs = np.array([[0.1, 1024.0, 0.9], [0.9, 256.0, 0.6], [0.0, 0.0, 0.0]])
    which = rng.integers(0, 3, (rows, 8)).repeat(250, axis=1)    # 2,000 ticks, 8 phases
    fast, slow = RowSignatures(cfg, 3), [SignatureClusters(
        cfg.context_window, cfg.context_threshold, cfg.context_floor, cfg.context_confirm,
        cfg.context_floor_strict) for _ in range(rows)]
    fast.grow(rows)
    got, want = [], []
    for t in range(which.shape[1]):
        x = sigs[which[:, t]] * np.maximum(0, 1 + 0.3 * rng.standard_normal((rows, 3)))
        x[t % rows] = np.nan if t % 97 == 0 else x[t % rows]       # a row absent now and then
        got += [(t, *c) for c in fast.update(x)]
        for r, cl in enumerate(slow):
            if np.isfinite(x[r]).any():
                before = cl.current
                ch = cl.update(x[r])
                if ch is not None:
                    want.append((t, r, before, *ch))
    assert got == want and len(got) > 3 * rows
    assert list(fast.counts()) == [c.count for c in slow]
    assert max(max(c.n) for c in slow) == SignatureClusters.MOST_SAMPLES   # running averages
    for r, cl in enumerate(slow):
        assert np.array_equal(fast.mean[r], cl.mean[cl.current])
        assert np.array_equal(fast.m2[r], cl.m2[cl.current])


def test_two_arms_are_compared_seed_by_seed():
    from capes.experiments.recall_scoring import cluster_pairs

    def run(seed, hour, ret):
        ph = lambda visit, rel, rec: {"visit": visit, "ticks": 100, "mean_relative": rel,  # noqa: E731
                                      "recover_ticks": rec, "workload": "w"}
        return {"seed": seed, "tp_frac_hour": hour,
                "occurrences": [ph(1, 0.9, 50), ph(2, ret, 3)],
                "classes": [ph(1, 0.9, 50), ph(2, ret, None)]}
    a = [run(1, 0.97, 0.99), run(0, 0.95, 0.98), run(2, 0.5, 0.5)]   # seed 2: no pair
    b = [run(0, 0.94, 0.96), run(1, 0.95, 0.96)]
    rows = {r["row"]: r for r in cluster_pairs(a, b)}
    assert rows["hour"]["seeds"] == [0, 1]
    assert np.isclose(rows["hour"]["a_minus_b"][0], 0.015)
    assert np.isclose(rows["returns"]["a_minus_b"][0], 0.025)
    assert rows["returns"]["band_a"] == 3 and rows["w returns"]["band_a"] == 100  # censored


def test_a_restarted_engine_recalls_what_its_nodes_saw_before_the_restart(tmp_path):
    cfg = short_cfg()
    ccfg = cfg.cluster
    sim = ClusterSim(ccfg, seed=0, optima=phase_optima(ccfg, ccfg.best_static), judge=False)
    knobs = list(ccfg.param_specs())

    def engine():
        return Engine.over_rows(cfg.engine, cfg.reward, list(ccfg.pi_names()),
                                list(ccfg.param_specs().values()), ccfg.nodes,
                                model=cfg.model, seed=0)
    eng, others, first, original = engine(), [], {}, {}
    while sim.ticks < 340:
        sim.tick()
        pis = sim.pis()
        rows = np.column_stack([pis[n] for n in ccfg.pi_names()])
        for e in [eng] + others:
            e.ingest(sim.ticks, rows)
        if sim.ticks == 260:          # in the analysis phase, every node switched: restart
            assert eng.row_context.news >= 8 and eng.row_context.returns == 0
            path = eng.save(tmp_path / "rows.ckpt")
            others = [engine(), engine()]          # restarted from the checkpoint, fresh
            others[0].load(path)
        if others and not first and others[0].row_context.target:
            first = dict(others[0].row_context.target)   # the return, recalled
            original = dict(eng.row_context.target)      # ... by the original
        d = eng.act()
        if d is not None:
            sim.set_params(**{n: d.values[:, k] for k, n in enumerate(knobs)})
        eng.train()
    restarted, fresh = others
    assert restarted.row_context.returns == eng.row_context.returns >= 8
    assert fresh.row_context.returns == 0 and not fresh.row_context.target   # no recall
    assert len(first) >= 8 and first.keys() == original.keys()
    for r, idx in first.items():     # each returning node recalled as without the restart
        assert np.array_equal(idx, original[r])


def test_the_group_search_moves_each_signature_group_as_one_to_its_optimum():
    from drl_engine.context_search import GroupSearch, signature_groups
    rng = np.random.default_rng(0)
    # 8 rows, two workload classes told by their signatures (6 readers, 2 writers)
    sig = np.array([[1.0, 512.0]] * 6 + [[0.0, 64.0]] * 2) * \
        (1 + 0.05 * rng.standard_normal((8, 2)))
    groups = signature_groups(np.abs(sig), np.arange(8))
    assert [g.tolist() for g in groups] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    # one knob (0..100 steps): the readers' best is 70, the writers' 0; a row's own move
    # is worth little, a class moving together much (0.3 % noise on the total)
    best = np.array([70] * 6 + [0] * 2)
    f = lambda idx: 1000.0 - 0.02 * ((idx[:, 0] - best) ** 2).sum()   # noqa: E731

    class Ring:                                     # the objective per tick, 3 ticks late
        def __init__(self):
            self.p: dict[int, float] = {}

        def comparable(self, ticks, tick):
            return np.array([self.p.get(int(t), np.nan) for t in ticks])
    ring, applied = Ring(), [np.full((8, 2), 40)]
    search = GroupSearch(groups, applied[0], np.array([100, 100]), np.array([True, False]),
                         0.1, 8, 3, tick=0, until=600)
    for t in range(1, 700):
        ring.p[t] = f(applied[max(0, t - 3)]) * (1 + 0.003 * rng.standard_normal())
        search.observe(ring, t)
        new = search.take()
        applied.append(applied[-1] if new is None else new)
        if search.done:
            break
    assert search.done and t < 600                          # done before its time ran out
    assert np.abs(search.best[:, 0] - best).max() <= 2      # every row near its class's best
    assert (search.best[:, 1] == 40).all()                  # a knob not dynamic never moves
