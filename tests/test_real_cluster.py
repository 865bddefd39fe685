"""The real GlusterFS cluster bench (issue 40): phases across clients, fio's figures
summed, fairness, the static summary's gap, the per-node stack config; and (slow, root
with GlusterFS, FUSE and fio) the quick bench end to end: its JSON, the clients'
original readahead back, no replay row lost, nothing of the cluster left."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from capes.common.config import dump_toml, read_toml
from capes.experiments import real_cluster as rc
from capes.experiments import real_readahead as rr
from capes.experiments import gluster_volume as gv

REPO = Path(__file__).resolve().parents[1]
NODES = ["client1", "client2", "client3", "client4"]


def test_phases_give_every_client_its_job():
    assert rc.assignment("checkpoint", NODES) == dict.fromkeys(NODES, "seqwrite")
    assert rc.assignment("analysis", NODES) == {"client1": "seqread", "client2": "seqread",
                                                "client3": None, "client4": None}
    mixed = rc.assignment("mixed", NODES)
    assert [mixed[n] for n in NODES] == ["mmaprand", "mmaprand", "randwrite", "randwrite"]
    assert rc.assignment("analysis", ["client1"]) == {"client1": "seqread"}
    assert set(rc.DEFAULT_SCHEDULE) == set(rc.PHASES)      # every phase, each returning
    assert all(rc.DEFAULT_SCHEDULE.count(p) >= 2 for p in rc.PHASES)


def test_terse_lines_give_reads_and_writes():
    fields = ["0"] * 130
    fields[0], fields[5], fields[8], fields[46], fields[49] = "3", "1024", "1000", "512", "900"
    assert rc._terse(";".join(fields)) == (1024.0, 1000.0, 512.0, 900.0)
    assert rc._terse("2;x") is None and rc._terse("garbage") is None


def _runner_with(rows):
    r = rc.ClusterRunner.__new__(rc.ClusterRunner)
    r.nodes, r.rows = NODES, rows
    return r


def test_fairness_compares_clients_running_the_same_job_only():
    # mixed: client1-2 random readers (10, 10), client3-4 writers (100, 50)
    rows = [rc.ClusterRow(0, 170, {"client1": 10, "client2": 10, "client3": 100,
                                   "client4": 50}, 128, 0, "mixed", "x")]
    f = _runner_with(rows).fairness("x")
    assert f["0"] == pytest.approx(150 ** 2 / (2 * (100 ** 2 + 50 ** 2)))  # the writers'
    even = [rc.ClusterRow(0, 40, dict.fromkeys(NODES, 10), 128, 1, "checkpoint", "x")]
    assert _runner_with(even).fairness("x")["1"] == pytest.approx(1.0)


def _report(means: dict[int, float], original: int = 128) -> dict:
    cfgs = []
    for v, m in means.items():
        name = "original" if v == original else f"v{v}"
        cfgs.append({"name": name, "values": {} if v == original else
                     {f"{n}/read_ahead_kb": v for n in NODES},
                     "mean": m, "ci_high": m * 1.05, "n": 3})
    return {"configs": cfgs}


def test_static_summary_gives_the_gap_between_per_phase_best_and_best_static():
    grids = {"analysis": _report({16: 50.0, 128: 100.0, 8192: 80.0}),
             "mixed": _report({16: 100.0, 128: 80.0, 8192: 60.0})}
    sched = [rr.Phase("analysis", 60), rr.Phase("mixed", 60)]
    s = rc.static_summary(grids, 128, sched)
    assert s["per_workload_best_setting"] == {"analysis": 128, "mixed": 16}
    assert s["best_static"]["setting"] == 128
    assert s["best_static"]["relative"] == pytest.approx((1.0 + 0.8) / 2)
    assert s["original"]["relative"] == pytest.approx(0.9)


def test_gap_resampled_spans_what_the_repetitions_allow():
    sched = [rr.Phase("analysis", 60), rr.Phase("mixed", 60)]
    grids = {"analysis": _report({16: 50.0, 128: 100.0}),
             "mixed": _report({16: 100.0, 128: 80.0})}
    for rep in grids.values():                 # repetitions that agree: no spread
        for c in rep["configs"]:
            c["samples"] = [c["mean"]] * 3
    lo, mid, hi = rc.gap_interval(grids, 128, sched, n=200)
    assert lo == mid == hi == pytest.approx(0.1)   # 1 - (1 + 0.8) / 2
    grids["mixed"]["configs"][1]["samples"] = [60.0, 100.0, 140.0]   # 128 on mixed: noisy
    lo, mid, hi = rc.gap_interval(grids, 128, sched, n=400)
    assert lo < 0.1 < hi and 0 <= lo


def _arm(levels: list[float], noise: float, seed: int) -> list:
    """A tuner's series: 60 s a phase at ``levels[i]`` MB/s, ± ``noise`` uniform."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [[t, lv * (1 + rng.uniform(-noise, noise)), i]
            for i, lv in enumerate(levels) for t in range(60)]


def test_a_tuner_against_the_best_static_held_live_in_the_same_run():
    # two phases whose levels differ 4x: the stratified error counts only the noise
    # within each phase, so a tuner 10 % above static in both is told apart from it,
    # and one that is static again is not
    result = {"schedule": [["a", 60], ["b", 60]], "static": {"best": {"a": 100, "b": 100}},
              "tuners": {"static": {"series": _arm([80, 20], 0.1, 1)},
                         "better": {"series": _arm([88, 22], 0.1, 2)},
                         "same": {"series": _arm([80, 20], 0.1, 3)}}}
    rc.against_static_live(result)
    better, same = (result["tuners"][n]["vs_static_live"] for n in ("better", "same"))
    assert better["diff"] == pytest.approx(0.05, abs=0.01)       # (0.08 + 0.02) / 2
    assert better["ci95"][0] > 0 and same["ci95"][0] < 0 < same["ci95"][1]
    assert "vs_static_live" not in result["tuners"]["static"]
    # without a static arm in the run there is nothing to compare with
    del result["tuners"]["static"], result["tuners"]["better"]["vs_static_live"]
    rc.against_static_live(result)
    assert "vs_static_live" not in result["tuners"]["better"]


def test_worst_10s_against_the_untuned_cluster_held_live_in_the_same_run():
    # the original arm at 80 then 20; a tuner whose worst 10 s in phase b sink to 12
    # (0.6 of the original there) is judged on that phase, not on a's higher level
    result = {"schedule": [["a", 60], ["b", 60]],
              "tuners": {"original": {"series": _arm([80, 20], 0.0, 1)},
                         "dip": {"series": [[t, 12.0 if (i == 1 and 30 <= t < 40) else
                                             [88, 22][i], i]
                                            for i in (0, 1) for t in range(60)]}}}
    rc.against_original_live(result)
    assert result["tuners"]["dip"]["worst_10s_vs_original_live"] == pytest.approx(0.6)
    assert result["tuners"]["original"]["worst_10s_vs_original_live"] == pytest.approx(1.0)
    # against the original's own worst 10 s of the phase: its level held flat there,
    # so the same 0.6; a dip of its own in phase b (to 15) makes the tuner's 12 read 0.8
    assert result["tuners"]["dip"]["worst_10s_vs_original_worst"] == pytest.approx(0.6)
    result["tuners"]["original"]["series"] = [
        [t, 15.0 if (i == 1 and t < 10) else v, i]
        for t, v, i in result["tuners"]["original"]["series"]]
    rc.against_original_live(result)
    assert result["tuners"]["dip"]["worst_10s_vs_original_worst"] == pytest.approx(0.8)
    assert result["tuners"]["original"]["worst_10s_vs_original_worst"] == pytest.approx(1.0)
    # without an original arm in the run there is nothing to compare with
    del result["tuners"]["original"], result["tuners"]["dip"]["worst_10s_vs_original_live"]
    rc.against_original_live(result)
    assert "worst_10s_vs_original_live" not in result["tuners"]["dip"]


def test_stack_config_has_a_row_per_client_on_its_own_bdi(tmp_path):
    runner = SimpleNamespace(nodes=NODES[:2], ra_paths={
        "client1": "/sys/class/bdi/0:61/read_ahead_kb",
        "client2": "/sys/class/bdi/0:62/read_ahead_kb"})
    table = rc.stack_table(rc.CLUSTER_CONFIG, runner, tmp_path, [16, 128, 8192], 128)
    assert set(table["parameters"]) == {"client1/read_ahead_kb", "client2/read_ahead_kb"}
    assert table["parameters"]["client2/read_ahead_kb"] == {
        "values": ["16", "128", "8192"], "default": "128", "nodes": ["client2"]}
    assert table["control"]["appliers"]["client1/read_ahead_kb"]["options"]["path"] == \
        "/sys/class/bdi/0:61/read_ahead_kb"
    (tmp_path / "s.toml").write_text(dump_toml(table))
    from capes.settings import load_settings
    s = load_settings(tmp_path / "s.toml", [rc.node_collectors(tmp_path / "pi")])
    assert s.reward.pis == ["app_bytes_s"]


def test_one_row_layout_gives_each_client_a_global_knob_applied_on_its_node(tmp_path):
    """``--one-row``: the engine's one-row mode over every client's knob (names without
    ``/``), each still applied by its own node's control agent only; with the processes
    collector the node's signature PIs load."""
    runner = SimpleNamespace(nodes=NODES[:2], ra_paths={
        "client1": "/sys/class/bdi/0:61/read_ahead_kb",
        "client2": "/sys/class/bdi/0:62/read_ahead_kb"})
    table = rc.stack_table(rc.CLUSTER_CONFIG, runner, tmp_path, [4, 128], 128, one_row=True)
    assert set(table["parameters"]) == {"client1_read_ahead_kb", "client2_read_ahead_kb"}
    assert table["parameters"]["client2_read_ahead_kb"]["nodes"] == ["client2"]
    (tmp_path / "s.toml").write_text(dump_toml(table))
    from capes.settings import load_settings
    from drl_engine.per_node import rows_of
    s = load_settings(tmp_path / "s.toml", [rc.node_collectors(
        tmp_path / "pi", "/sys/fs/cgroup/memory/x", tmp_path / "mnt1")])
    assert rows_of(s.param_specs()) is None                  # the one-row mode
    names = [c.name for c in s.monitor.collectors]
    assert names == ["command", "processes"]


def test_the_shipped_cluster_config_says_only_what_the_target_is():
    """Issue 40: [engine] holds at most the preset, the exploration horizon and what is
    the target's own (<= 4 keys); a row per client node."""
    t = read_toml(rc.CLUSTER_CONFIG)
    assert t["engine"]["preset"] == "default" and len(t["engine"]) <= 4
    assert "exploration_ticks" in t["engine"]
    assert all(p.endswith("/read_ahead_kb") and spec["nodes"] == [p.split("/")[0]]
               for p, spec in t["parameters"].items())


# ------------------------------------------------------------------ real (root, slow)

@pytest.mark.slow
def test_quick_cluster_bench_restores_every_client_and_leaves_nothing(tmp_path):
    why = rc.missing_requirements()
    if why:
        pytest.skip(why)
    before_loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    before_trees = gv.snapshot()
    out = tmp_path / "q.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_real_cluster.py"),
                           "--quick", "--tuners", "static,capes", "--seed", "2",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["cluster"]["throttle"] == gv.throttle_mechanism()
    assert res["cluster"]["nodes"] == ["client1", "client2"]
    bs = res["best_static"]
    assert bs["setting"] in res["grid"] + [res["original"]["setting"]]
    assert 0 < bs["relative"] <= 1 and res["per_phase_best_gap"] == pytest.approx(
        1 - bs["relative"])
    t = res["tuners"]["capes"]
    assert {"relative", "diff_vs_best_static", "ci95", "worst_10s_vs_original",
            "restored", "fairness"} <= set(t)
    assert t["ci95"][0] <= t["diff_vs_best_static"] <= t["ci95"][1]
    assert t["restored"] is True and t["rows_lost"] == 0
    assert set(t["restored_values"].values()) == {res["original"]["setting"]}
    assert len(t["phases"]) == 2 and all(0 < f <= 1 for f in t["fairness"].values())
    held = res["tuners"]["static"]              # the stack without a tuner, held still
    assert held["restored"] is True and held["rows_lost"] == 0
    assert held["applied_min"] == held["applied_max"] == bs["setting"]
    assert res["teardown"]["problems"] == []
    after = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert after == before_loops
    assert "capes-cluster-" not in Path("/proc/mounts").read_text()
    assert not [p for p, a in gv.gluster_processes().items()
                if "capes-cluster-" in " ".join(a)]
    assert gv.snapshot() == before_trees


def test_a_clients_window_is_published_as_its_rung_on_the_ladder():
    # the per-node engine reads a knob of named values as its index: 128 KiB is rung 5
    assert rc.rung(rc.LADDER, 128) == 5 and rc.rung(rc.LADDER, 4) == 0
    assert rc.rung(rc.LADDER, 8192) == len(rc.LADDER) - 1
    assert rc.rung(rc.LADDER, 100) == 5 and rc.rung(rc.LADDER, 20000) == 11   # nearest
