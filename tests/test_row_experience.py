"""The per-node engine's experience of earlier sessions (drl_engine/row_experience.py)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capes.experiments.cluster_test import load_config, run_one
from drl_engine.prior_experience import ExperienceError
from drl_engine.row_context import RowContexts
from drl_engine.row_experience import RowExperience

ROOT = Path(__file__).resolve().parents[1]
RECURRING = ROOT / "configs" / "recurring-workloads-cluster.toml"
PHASE = 200           # simulated s per phase
TINY = """
[cluster]
nodes = 8
time_limit_ticks = 60
signature_pis = true
best_static = "class"
[[cluster.workloads]]
name = "checkpoint"
write_fraction = 0.9
request_kb = 1024.0
sequential = 0.9
[engine]
context_pis = ["read_fraction", "request_kb", "sequential"]
[reward]
objective = "throughput"
pis = ["throughput"]
type = "diff"
"""


def played(names: list[str]):
    """The recurring cluster's classes ``names`` in turn, PHASE s each, on 16 nodes."""
    cfg = load_config(RECURRING, ["cluster.nodes=16"])
    c = cfg.cluster
    kind = {ph.name: ph for ph in c.phases}
    phases = [dataclasses.replace(kind[n], at_tick=PHASE * i) for i, n in enumerate(names)]
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        c, phases=phases[1:], time_limit_ticks=PHASE * len(names)))


def load(cfg, dbs):
    return RowExperience.load(dbs, cfg.engine, cfg.reward, cfg.model,
                              list(cfg.cluster.param_specs().values()))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One recorded session: checkpoint, then analysis (half the nodes idle)."""
    db = tmp_path_factory.mktemp("rowexp") / "recorded.db"
    run_one(played(["checkpoint", "analysis"]), seed=10_000, db_path=str(db))
    return db


@pytest.mark.slow
def test_recorded_workloads_are_pooled_by_signature_with_a_best_setting(recorded):
    cfg = played(["checkpoint", "analysis"])
    prior = load(cfg, [recorded])
    # checkpoint writers, analysis readers, idle nodes: one workload each, whatever
    # nodes ran them
    assert len(prior.workloads) == 3 and all(w.best is not None for w in prior.workloads)
    line = prior.summary()
    assert "3 workloads known (3 with a best setting) from 1 session, 400 ticks" in line
    with pytest.raises(ExperienceError, match="another target"):
        prior.check_layout(["throughput"], ["rate_limit", "window"])
    # the analysis readers' best window is larger than the checkpoint writers' (their
    # best static settings: window 50 and 22)
    read = np.array([np.exp(w.log_mean[0]) for w in prior.workloads])
    window = [w.best[1] for w in prior.workloads]
    assert window[int(np.argmax(read))] > window[int(np.argmin(read))]


@pytest.mark.slow
def test_any_row_recognises_a_workload_recorded_on_other_nodes(recorded):
    cfg = played(["checkpoint", "analysis"])
    prior = load(cfg, [recorded])
    ctx = RowContexts.build(cfg.engine, list(cfg.cluster.pi_names()), cfg.reward.pis,
                            list(cfg.cluster.param_specs().values()), 5)
    ctx.seed([(w.log_mean, w.log_m2, w.n, w.best) for w in prior.workloads], prior.offset)
    signatures = np.exp(np.stack([w.log_mean for w in prior.workloads])) - prior.offset
    rows = np.array([0, 1, 2, 0, 1]) % len(signatures)        # every row, any workload
    updates = ctx.signatures.update(signatures[rows])
    assert sorted((r, k, new) for r, _, k, new in updates) == \
        [(r, int(rows[r]), False) for r in range(5)]
    for r in range(5):
        assert np.array_equal(ctx.recalled(r, int(rows[r])), prior.workloads[rows[r]].best)


@pytest.mark.slow
def test_a_recorded_workload_reaches_its_band_sooner_than_fresh(recorded):
    cfg = played(["checkpoint", "analysis"])
    fresh = run_one(cfg, seed=3)
    known = run_one(cfg, seed=3, experience=load(cfg, [recorded]))
    ttb = [[p["recover_ticks"] if p["recover_ticks"] is not None else PHASE
            for p in r["per_phase"]] for r in (fresh, known)]
    # the analysis phase: recalled (rows return to its recorded setting), not searched
    assert known["context_returns"] > 0 and fresh["context_returns"] == 0
    assert ttb[1][1] < ttb[0][1] / 2, ttb
    assert known["mean_relative"] > fresh["mean_relative"]


def test_experience_of_another_layout_or_without_signatures_is_refused(tmp_path):
    cfg = load_config(RECURRING)
    with pytest.raises(ExperienceError, match="no such file"):
        load(cfg, [tmp_path / "missing.db"])
    plain = load_config()                     # cluster-sim.toml: no signature PIs
    db = tmp_path / "plain.db"
    run_one(dataclasses.replace(plain, cluster=dataclasses.replace(
        plain.cluster, nodes=4, time_limit_ticks=30, phases=[])), seed=0, db_path=str(db))
    with pytest.raises(ExperienceError, match="signature PIs"):
        load(plain, [db])                     # the engine names none
    with pytest.raises(ExperienceError, match="not among the replay DB's PIs"):
        load(dataclasses.replace(plain, engine=cfg.engine), [db])   # the DB has none


def test_converge_test_plays_the_cluster_game_with_experience(tmp_path):
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(TINY)
    db = tmp_path / "recorded.db"
    run_one(load_config(tiny), seed=1, db_path=str(db))
    base = [sys.executable, "-m", "capes", "converge-test", "--config", str(tiny),
            "--quiet", "--seeds", "1", "--experience", str(db)]
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("experience (per node")]
    assert len(lines) == 1 and "1 workload known" in lines[0], out.stderr
    out = subprocess.run(base + ["--experience-start", "gp"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--experience-start" in out.stderr


@pytest.mark.slow
def test_a_recorded_setting_that_falls_short_of_its_promise_is_forgotten(recorded, tmp_path):
    """A DB from another target (servers twice as fast: its nodes' levels are not
    reachable here): the recalled setting is checked against the level it promised,
    found short, forgotten, and its rows explore; the same target's DB keeps its promise."""
    cfg = played(["checkpoint", "analysis"])
    fast = dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, server_capacity=4000.0, thrash_rpcs=900.0))
    other = tmp_path / "other-target.db"
    run_one(fast, seed=10_001, db_path=str(other))
    seen = {}

    def keep(rec, sim, player):
        seen["promises"] = player.row_context.promises
    for name, db in (("same", recorded), ("other", other)):
        run_one(cfg, seed=3, experience=load(cfg, [db]), observers=[keep])
        seen[name] = seen.pop("promises")
    levels = sorted(w.level for w in load(cfg, [recorded]).workloads)
    assert levels[0] < 1 < levels[1] <= levels[2]    # idle nodes promise nothing checked
    assert seen["same"].broken == [] and seen["other"].broken, \
        (seen["same"].broken, seen["other"].broken)


@pytest.mark.slow
def test_the_engine_daemon_seeds_a_per_node_engine_with_the_recorded_workloads(
        recorded, tmp_path, caplog):
    """``capes drl-engine --experience`` on a deployment of <node>/<knob> parameters: the
    per-node engine the daemon starts knows the recorded workloads on every row."""
    import logging
    from types import SimpleNamespace

    from drl_engine.daemon import EngineDaemonOptions, _start_engine
    cfg = played(["checkpoint", "analysis"])
    specs = list(cfg.cluster.param_specs().values())
    nodes = cfg.cluster.node_names()
    deploy = SimpleNamespace(cluster_engine=cfg.model, param_specs=lambda: [
        dataclasses.replace(s, name=f"{n}/{s.name}") for n in nodes for s in specs])
    prior = load(cfg, [recorded])
    with caplog.at_level(logging.INFO, logger="capes.engine"):
        engine = _start_engine(recorded, cfg.engine, cfg.reward, EngineDaemonOptions(
            device="cpu", experience=prior), tmp_path / "none.pt", deploy)
    try:
        assert engine is not None and engine.per_node and engine.row_context is not None
        assert [c.count for c in engine.row_context.signatures.rows] == [3] * len(nodes)
        assert engine.row_context.promises is not None
        assert any(r.getMessage().startswith("experience (per node") for r in caplog.records)
    finally:
        engine.close()
