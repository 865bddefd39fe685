"""Workloads that come back (issue 25): the game's schedule and signatures, the engine's
contexts, and recall in a short seeded converge run."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from capes.common.config import ConfigError, build
from storagegamesim.game import (PI_NAMES, SIGNATURE_PI_NAMES, GameConfig, GameWorkload,
                                 StorageGameSim)
from storagegamesim.phases import GamePhase

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def two_workloads(**game) -> GameConfig:
    a = GameWorkload("a", peak_window=50, read_fraction=0.9, request_kb=1024,
                     sequential=0.9, queue_depth=4)
    b = GameWorkload("b", peak_window=20, curve_width=10, peak_throughput=80,
                     read_fraction=0.2, request_kb=16, sequential=0.1, queue_depth=32)
    return GameConfig(workloads=[a, b], workload="a",
                      phases=[GamePhase(100, workload="b"), GamePhase(200, workload="a")],
                      **game)


def test_schedule_switches_optimum_and_signature_and_comes_back():
    cfg = two_workloads(noise=0.0, signature_noise=0.0, delay_ticks=0)
    game = StorageGameSim(cfg, seed=0)
    assert tuple(game.pis()) == PI_NAMES + SIGNATURE_PI_NAMES
    seen = {}
    for t in range(1, 300):
        game.set_params(window=50 if t < 100 or t >= 200 else 20, rate_limit=200)
        game.tick()
        seen[t] = (game.active.workload, game.ideal_throughput, game.true_throughput,
                   game.pis()["request_kb"])
    assert seen[99][0] == "a" and seen[100][0] == "b" and seen[200][0] == "a"
    assert seen[150][1] == 80 and seen[150][2] == pytest.approx(80)     # b's own peak
    assert seen[50][3] == 1024 and seen[150][3] == 16 and seen[250][3] == 1024
    # a's best setting is far from b's optimum: each workload has its own
    assert cfg.phase_configs()[1].curve(50) < 0.5 * 80


def test_signature_is_noisy_but_centred_and_shares_stay_in_range():
    game = StorageGameSim(two_workloads(signature_noise=0.5), seed=1)
    rows = []
    for _ in range(2000):
        game.tick()
        rows.append([game.pis()[k] for k in SIGNATURE_PI_NAMES])
    rows = np.array(rows[:99])
    assert rows[:, 0].max() <= 1.0 and rows[:, 2].max() <= 1.0 and rows.min() >= 0.0
    assert np.median(rows[:, 1]) == pytest.approx(1024, rel=0.1)
    assert rows[:, 1].std() > 100                                  # noisy, as configured


def test_paper_game_pis_and_random_stream_are_unchanged_without_workloads():
    plain = StorageGameSim(GameConfig(noise=0.1), seed=3)
    assert tuple(plain.pis()) == PI_NAMES
    a = [plain.tick() for _ in range(20)]
    # the same draws with workloads configured but signature noise off come first
    cfg = dataclasses.replace(two_workloads(noise=0.1, signature_noise=0.0), phases=[],
                              workloads=[GameWorkload("a", peak_window=50)])
    assert [StorageGameSim(cfg, seed=3).tick() for _ in range(1)] == a[:1]


def test_bad_workload_schedule_is_rejected_with_the_key():
    with pytest.raises(ConfigError, match=r"phases\[0\].workload: unknown workload 'c'"):
        build(GameConfig, {"workloads": [{"name": "a"}], "workload": "a",
                           "phases": [{"at_tick": 10, "workload": "c"}]}, "g.toml")
    with pytest.raises(ConfigError, match=r"workload: name the workload of phase 0"):
        build(GameConfig, {"workloads": [{"name": "a"}]}, "g.toml")
    with pytest.raises(ConfigError, match=r"workloads\[0\].read_fraction"):
        build(GameConfig, {"workloads": [{"name": "a", "read_fraction": 2}],
                           "workload": "a"}, "g.toml")


def test_recurring_config_repeats_workloads_in_phases_of_varying_length():
    from capes.experiments.converge_test import load_config
    game = load_config(CONFIGS / "recurring-workloads.toml").game
    names = [c.workload for c in game.phase_configs()]
    assert len(set(names)) == 3 and len(names) > 2 * 3        # each comes back
    starts = [0] + [p.at_tick for p in game.phases] + [game.time_limit_ticks]
    lengths = np.diff(starts)
    assert lengths.min() <= 150 and lengths.max() >= 500
    assert len({c.peak_window for c in game.phase_configs()}) == 3


# -- contexts (drl_engine/context.py) ---------------------------------------------------
def signatures(centre, ticks, noise, rng):
    centre = np.asarray(centre, float)
    return centre * np.maximum(0.0, 1.0 + rng.normal(0.0, noise, (ticks, len(centre))))


A_SIG, B_SIG = [0.9, 1024, 0.95, 4], [0.2, 16, 0.05, 32]


def play(clusters, rows):
    return [c for c in (clusters.update(x) for x in rows) if c is not None]


@pytest.mark.parametrize("noise", [0.1, 0.3])
def test_noise_does_not_split_a_context(noise):
    from drl_engine.context import SignatureClusters
    clusters = SignatureClusters()
    changes = play(clusters, signatures(A_SIG, 1500, noise, np.random.default_rng(0)))
    assert changes == [(0, True)] and clusters.count == 1


def test_a_new_signature_makes_a_new_context_and_a_seen_one_is_recalled():
    from drl_engine.context import SignatureClusters
    rng = np.random.default_rng(1)
    clusters = SignatureClusters()
    rows = np.concatenate([signatures(A_SIG, 200, 0.1, rng), signatures(B_SIG, 100, 0.1, rng),
                           signatures(A_SIG, 50, 0.1, rng), signatures(B_SIG, 50, 0.1, rng)])
    switched_at = []
    for i, x in enumerate(rows):
        if clusters.update(x) is not None:
            switched_at.append((i, clusters.current))
    # new A, new B, A recalled, B recalled: each within two ticks of the change
    assert [c for _, c in switched_at] == [0, 1, 0, 1] and clusters.count == 2
    assert [i for i, _ in switched_at][1:] == [203, 301, 351]


def test_clusters_seeded_with_earlier_workloads_recall_one_on_the_first_tick():
    """Experience of earlier sessions (both modes seed through ``SignatureClusters.seed``):
    a signature that fits a seeded workload is that context, not a new one; another is
    new."""
    from drl_engine.context import SignatureClusters
    rng = np.random.default_rng(2)
    earlier = SignatureClusters()
    play(earlier, np.concatenate([signatures(A_SIG, 200, 0.1, rng),
                                  signatures(B_SIG, 200, 0.1, rng)]))
    known = [(earlier.mean[k], earlier.m2[k], earlier.n[k]) for k in range(2)]
    for sig, k in ((B_SIG, 1), (A_SIG, 0)):
        clusters = SignatureClusters()
        clusters.seed(earlier.offset, known)
        assert play(clusters, signatures(sig, 50, 0.1, rng)) == [(k, False)]
        assert clusters.count == 2 and clusters.n[k] == min(earlier.n[k] + 50, 500)
    fresh = SignatureClusters()
    fresh.seed(earlier.offset, known[:1])
    assert play(fresh, signatures(B_SIG, 50, 0.1, rng)) == [(1, True)]


def test_context_columns_default_to_pis_that_are_neither_objective_nor_knob():
    from drl_engine.config import DQNConfig
    from drl_engine.context import context_columns
    names = list(PI_NAMES + SIGNATURE_PI_NAMES)
    assert context_columns(DQNConfig(), names, ["throughput"], ["rate_limit", "window"]) \
        == [3, 4, 5, 6]
    assert context_columns(DQNConfig(), PI_NAMES, ["throughput"], ["rate_limit", "window"]) == []
    with pytest.raises(ValueError, match="context_pis: iops"):
        context_columns(DQNConfig(context_pis=["iops"]), names, ["throughput"], [])


def short_recurring(**engine_sets):
    from capes.experiments.converge_test import load_config
    sets = [f"engine.{k}={v}" for k, v in engine_sets.items()]
    cfg = load_config(CONFIGS / "recurring-workloads.toml", sets)
    cfg.game = cfg.game.until(1100)                  # seqread, randwrite, seqread again
    return cfg


def test_paper_game_builds_no_context_so_the_default_plays_as_before():
    from capes.experiments.converge_test import load_config, run_one
    cfg = load_config(CONFIGS / "storagegamesim.toml", ["game.time_limit_ticks=60"])
    off = load_config(CONFIGS / "storagegamesim.toml",
                      ["game.time_limit_ticks=60", "engine.use_context=false"])
    a, b = run_one(cfg, 3, keep_trace=True), run_one(off, 3, keep_trace=True)
    assert cfg.engine.use_context and a.trace["window"] == b.trace["window"]


@pytest.mark.slow
def test_a_return_reaches_its_band_faster_than_its_first_visit():
    from capes.experiments.converge_test import run_one
    r = run_one(short_recurring(), seed=0)
    first, ret = r.phases[0], r.phases[2]
    assert (first["workload"], first["visit"]) == ("seqread", 1)
    assert (ret["workload"], ret["visit"]) == ("seqread", 2) and ret["recover_ticks"] is not None
    assert first["recover_ticks"] is None or ret["recover_ticks"] < first["recover_ticks"]
    assert ret["recover_ticks"] <= 15


def test_cluster_recurring_config_gives_each_class_its_signature():
    from capes.experiments.cluster_test import load_config
    from storagegamesim.cluster import PI_NAMES as CLUSTER_PIS, SIGNATURE_PI_NAMES as SIG
    from storagegamesim.cluster import ClusterSim
    ccfg = load_config(CONFIGS / "recurring-workloads-cluster.toml").cluster
    assert ccfg.nodes == 64 and ccfg.pi_names() == CLUSTER_PIS + SIG
    names = [p.name for p in ccfg.phases]
    assert len(set(names)) == 3 and len(names) >= 9
    sim = ClusterSim(dataclasses.replace(ccfg, nodes=16, time_limit_ticks=2000), seed=0)
    for _ in range(1000):                                  # into phase 2 ("checkpoint")
        sim.tick()
    req = sim.pis()["request_kb"]
    assert np.median(req) == pytest.approx(1024, rel=0.1)
    for _ in range(400):                                   # "mixed": two classes
        sim.tick()
    req = sim.pis()["request_kb"]
    assert (req < 150).sum() == 4 and (req > 300).sum() == 12


def test_the_recall_walk_moves_the_farthest_knob_by_full_moves():
    from capes.common.step_grid import walk_action
    n_steps = np.array([19, 99])                       # rate_limit, window (the game's grid)

    def ticks(rule, cur, target):
        cur, k = np.array(cur), 0
        while (a := rule(cur, target)) != 0:
            from capes.common.actions import decode
            p, s = decode(a, 2)
            cur[p] += s
            k += 1
        assert (cur == target).all()
        return k
    target = np.array([11, 22])
    fast = ticks(lambda c, t: walk_action(c, t, n_steps, 8), [13, 78], target)
    assert fast == 7 + 1 and fast < ticks(lambda c, t: walk_action(c, t, n_steps, 8,
                                                                   straight=True),
                                          [13, 78], target)


def test_a_restarted_engine_keeps_its_workload_contexts(tmp_path):
    from capes.common.replay_db import ReplayReader
    from capes.experiments.converge_test import run_one
    from drl_engine.engine import Engine
    cfg = short_recurring()
    cfg.game = dataclasses.replace(cfg.game, time_limit_ticks=400,   # seqread, then
                                   phases=[GamePhase(300, workload="randwrite")])  # randwrite
    db = tmp_path / "replay.db"
    run_one(cfg, seed=0, db_path=db)

    def engine():
        e = Engine(cfg.engine, cfg.reward, ReplayReader(db), seed=0)
        return e, next(iter(e.experience.reader.sessions))
    a, session = engine()
    assert a.act(session) is not None and a.context.counters()["contexts"] == 2
    a.save(tmp_path / "engine.pt")
    b, _ = engine()
    b.load(tmp_path / "engine.pt")
    assert b.context.counters() == a.context.counters() and b.context.current == 1
    assert np.allclose(b.context.clusters.mean, a.context.clusters.mean)
    assert [m.created_at for m in b.context.memory] == [m.created_at for m in a.context.memory]
    # seqread's signature again: the restarted engine recognises it (context 0, a
    # return; a fresh engine would make it a new context 0) and recalls its setting
    assert b.context.clusters.update(np.array([0.9, 1024.0, 0.95, 4.0])) == (0, False)


@pytest.mark.parametrize("strict", [False, True])
def test_a_strict_floor_keeps_a_tight_workload_whole_through_a_moderate_wobble(strict):
    """engine.context_floor_strict (measured live, docs/journal.md (real devices) session 5): a
    sequential reader's request size sat at 15.6 KiB for a minute, then read ~11.4 KiB
    on two ticks of three at a large readahead; with the floor as a 5-sample prior the
    tight context's spread had shrunk to ~3 %, and the wobble made a second context
    (with its own sweep). A strict floor keeps one context, and a real switch (4 KiB
    page faults) still makes a new one at once."""
    from drl_engine.context import SignatureClusters
    rng = np.random.default_rng(2)
    tight = 15.6 * np.exp(rng.normal(0.0, 0.01, 60))
    wobble = np.tile([11.4, 11.4, 16.0], 10)
    other = 4.0 * np.exp(rng.normal(0.0, 0.01, 20))
    rows = np.concatenate([tight, wobble, other])[:, None]
    clusters = SignatureClusters(strict_floor=strict)
    changes = [(i, c) for i, c in ((i, clusters.update(x)) for i, x in enumerate(rows))
               if c is not None]
    if strict:
        assert [c for _, c in changes] == [(0, True), (1, True)]
        assert 90 < changes[1][0] <= 93          # the page faults: within 3 ticks
    else:
        assert (1, True) in [c for _, c in changes] and changes[1][0] < 90


def test_a_share_that_starts_at_zero_is_one_workload_with_its_noise_and_another_at_one():
    """A signature PI whose first value is 0 (a writer's share of reads, an idle node's
    open files): a little noise above 0 is the same workload, a share of 1 another."""
    from drl_engine.context import SignatureClusters
    rng = np.random.default_rng(3)
    writer = np.where(rng.random(120) < 0.3, rng.uniform(0.0, 0.02, 120), 0.0)
    reader = 1.0 - rng.uniform(0.0, 0.02, 60)
    clusters = SignatureClusters()
    changes = [(i, c) for i, c in ((i, clusters.update(np.array([x]))) for i, x in
                                   enumerate(np.concatenate([writer, reader])))
               if c is not None]
    assert [c for _, c in changes] == [(0, True), (1, True)] and clusters.count == 2
    assert 120 <= changes[1][0] <= 124
