"""Replay DBs as an asset: info, merge (identical, partial, refused, repeated,
interrupted), export, and the compact vector encoding they rely on."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from capes.cli import main as capes_main
from capes.common.params import ParameterSpec
from capes.common.replay_db import (ReplayDBError, ReplayReader, ReplayWriter, SessionInfo,
                             decode_vec, encode_vec)
from capes.experiments.replay_export import export_csv, export_npz
from capes.experiments.replay_info import describe
from capes.experiments.replay_merge import MergeError, differences, merge
from drl_engine.experience import Experience
from drl_engine.config import RewardConfig


def specs(order=("a", "b"), b_step=2.0):
    all_ = {"a": ParameterSpec(min=1, max=100, step=1, default=10, name="a"),
            "b": ParameterSpec(min=0, max=10, step=b_step, default=4, name="b")}
    return [all_[n] for n in order]


def value(session_seed, tick, node, pi):
    """A distinct, reproducible value for every entry."""
    return session_seed * 1000 + tick + 0.25 * node + 0.01 * (pi + 1)


def write_session(path, seed, pi_names=("tp", "x", "y", "z", "w"), nodes=("n0", "n1"),
                  params=None, ticks=40, label=None, skip=()):
    """One session whose PI j of node n at tick t is value(seed, t, n, j) and whose
    action at tick t is t % (2k + 1); returns its SessionInfo."""
    params = params or specs()
    with ReplayWriter(path) as w:
        info = w.begin_session(SessionInfo(pi_names=list(pi_names), node_names=list(nodes),
                                           params=params, label=label or f"seed {seed}"))
        vals = np.array([p.default for p in params], np.float32)
        for t in range(ticks):
            for n in range(len(nodes)):
                if (t, n) not in skip:
                    w.add_pis(t, n, [value(seed, t, n, j) for j in range(len(pi_names))])
            action = t % (2 * len(params) + 1)
            if action:
                k, down = divmod(action - 1, 2)
                vals[k] = params[k].clamp(vals[k] + (-1 if down else 1) * params[k].step)
            w.add_action(t, action, vals)
    return info


def files_in(directory):
    """Files but the -wal / -shm files SQLite keeps beside a DB read read-only."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(("-wal", "-shm")))


# -- the compact encoding -----------------------------------------------------------------

def test_encoding_round_trips_exactly_and_shrinks_repetitive_vectors():
    rng = np.random.default_rng(0)
    repetitive = np.zeros(44, np.float32)
    repetitive[:4] = [3, 2, 14, 37]
    noisy = rng.normal(size=44).astype(np.float32)
    noisy[5] = np.nan
    for vec in (repetitive, noisy, np.float32([1.5, np.nan, 3])):
        blob = encode_vec(vec)
        np.testing.assert_array_equal(decode_vec(blob), vec)     # NaN == NaN here
    assert len(encode_vec(repetitive)) < 0.5 * repetitive.nbytes
    assert len(encode_vec(noisy)) == noisy.nbytes                # raw when lz4 cannot help
    assert len(encode_vec(repetitive, compress=False)) == repetitive.nbytes


def test_reader_reads_compact_and_raw_rows_alike(tmp_path):
    pis = [f"p{j}" for j in range(44)]
    vec = np.zeros(44, np.float32)
    vec[3] = 7.5
    for compress in (True, False):
        path = tmp_path / f"{compress}.db"
        with ReplayWriter(path, compress=compress) as w:
            w.begin_session(SessionInfo(pi_names=pis, node_names=["n"], params=specs()))
            w.add_pis(0, 0, vec)
        blob = sqlite3.connect(path).execute("SELECT vec FROM pis").fetchone()[0]
        assert (len(blob) % 4 != 0) == compress
        np.testing.assert_array_equal(ReplayReader(path).sessions[1].pis[0, 0], vec)


# -- info ---------------------------------------------------------------------------------

def test_info_reports_ranges_gaps_and_missing_entries(tmp_path):
    path = tmp_path / "known.db"
    with ReplayWriter(path) as w:
        w.begin_session(SessionInfo(pi_names=["tp", "x", "y"], node_names=["n0", "n1"],
                                    params=specs(), label="known"))
        for t in range(5, 15):
            for n in range(2):
                if t in (8, 9) or (t, n) == (11, 1):
                    continue                               # 2 ticks gone, 1 row gone
                vec = [1.0, 2.0, 3.0]
                if (t, n) == (12, 0):
                    vec[1] = np.nan                        # one NaN entry
                if (t, n) == (13, 1):
                    vec = vec[:2]                          # one PI not known yet
                w.add_pis(t, n, vec)
            w.add_action(t, 0, [10, 4])
    s = describe(path)
    assert s.schema_version == 1 and len(s.sessions) == 1
    ss = s.sessions[0]
    assert (ss.first_tick, ss.last_tick, ss.ticks, ss.rows, ss.actions) == (5, 14, 8, 15, 10)
    assert ss.gaps == [[8, 9]]
    assert ss.absent_rows == 5 and ss.nan_entries == 2
    assert ss.missing_share == pytest.approx((2 + 5 * 3) / (10 * 2 * 3))
    assert ss.node_names == ["n0", "n1"] and ss.pi_names == ["tp", "x", "y"]
    assert [p["name"] for p in ss.params] == ["a", "b"] and ss.params[1]["step"] == 2
    assert s.size_bytes == sum(p.stat().st_size for p in tmp_path.iterdir()
                               if p.name.startswith("known.db"))


def test_info_cli_prints_json_and_text(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    path = tmp_path / "r.db"
    info = write_session(path, 1, ticks=12, skip={(3, 0), (3, 1)})
    assert capes_main(["replay", "info", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sessions"][0]["uuid"] == info.uuid
    assert doc["sessions"][0]["gaps"] == [[3, 3]]
    assert capes_main(["replay", "info", str(path)]) == 0
    text = capsys.readouterr().out
    assert info.uuid in text and "gaps: 3" in text and "parameter b: [0, 10] step 2" in text
    assert capes_main(["replay", "info", str(tmp_path / "none.db")]) == 1
    assert "no such replay DB" in capsys.readouterr().err


# -- merge --------------------------------------------------------------------------------

def test_merge_keeps_sessions_distinct_with_provenance(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    ia, ib = write_session(a, 1), write_session(b, 2, ticks=30)
    report = merge([a, b], out)
    assert report.count("added") == 2 and report.total_sessions == 2
    merged = ReplayReader(out)
    src = {1: ReplayReader(a).sessions[1], 2: ReplayReader(b).sessions[1]}
    for s in merged.sessions.values():
        seed = 1 if s.info.uuid == ia.uuid else 2
        assert s.info.provenance["source_file"] == str((a if seed == 1 else b).resolve())
        assert s.info.provenance["source_session"] == 1 and "merged_at" in s.info.provenance
        np.testing.assert_array_equal(s.pis[:s.length], src[seed].pis[:src[seed].length])
        np.testing.assert_array_equal(s.actions[:s.length], src[seed].actions[:s.length])
    assert {s.info.uuid for s in merged.sessions.values()} == {ia.uuid, ib.uuid}
    # transitions come from one session each: both sessions start at tick 0, and no
    # sampled transition of one is at a tick the other alone has
    exp = Experience(merged, RewardConfig(pis=["tp"]), stack=4)
    batch = exp.sample(256, np.random.default_rng(0))
    lengths = {sid: d.length for sid, d in merged.sessions.items()}
    assert set(batch.sessions) == set(lengths)
    assert all(t + 1 < lengths[s] for s, t in zip(batch.sessions, batch.ticks))


def test_merging_the_same_sources_again_adds_nothing(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    write_session(a, 1)
    write_session(b, 2)
    first = merge([a, a], out)                      # the same source twice in one go
    assert [s.status for s in first.sessions] == ["added", "present"]
    rows = sqlite3.connect(out).execute("SELECT COUNT(*) FROM pis").fetchone()[0]
    again = merge([b, a, b], out)                   # into the existing OUT: accumulates
    assert [s.status for s in again.sessions] == ["added", "present", "present"]
    assert again.total_sessions == 2
    con = sqlite3.connect(out)
    assert con.execute("SELECT COUNT(*) FROM pis").fetchone()[0] == rows + 40 * 2
    assert con.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 2
    assert merge([a, b], out).count("present") == 2


def test_a_session_that_grew_since_its_merge_is_extended(tmp_path):
    a, out = tmp_path / "a.db", tmp_path / "out.db"
    info = write_session(a, 1, ticks=10)
    merge([a], out)
    with ReplayWriter(a) as w:                      # the live DB went on recording
        w.session = ReplayReader(a).sessions[info.id].info
        w.add_pis(10, 0, [1, 2, 3, 4, 5])
        w.add_action(10, 0, [10, 4])
    report = merge([a], out)
    assert report.sessions[0].status == "extended"
    assert (report.sessions[0].pis_rows, report.sessions[0].action_rows) == (1, 1)
    assert ReplayReader(out).sessions[1].length == 11


def test_incompatible_sessions_are_refused_with_every_difference_listed(tmp_path):
    a, b, c, out = (tmp_path / f"{n}.db" for n in ("a", "b", "c", "out"))
    write_session(a, 1)
    write_session(b, 2, pi_names=("tp", "x", "y", "z", "v"))
    write_session(c, 3, params=specs(b_step=5.0), nodes=("n0", "n9"))
    with pytest.raises(MergeError) as err:
        merge([a, b, c], out)
    text = str(err.value)
    for expected in ("PIs missing: w", "PIs extra: v", "parameter b: step 5.0 (expected 2.0)",
                     "nodes missing: n1", "nodes extra: n9", "--allow-partial"):
        assert expected in text
    assert "c.db session 1" in text and "b.db session 1" in text
    assert files_in(tmp_path) == ["a.db", "b.db", "c.db"]        # nothing written


def test_merge_cli_refuses_partial_without_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    write_session(a, 1)
    write_session(b, 2, pi_names=("tp", "x", "y", "z"))
    assert capes_main(["replay", "merge", str(a), str(b), "-o", str(out)]) == 1
    assert "PIs missing: w" in capsys.readouterr().err and not out.exists()
    assert capes_main(["replay", "merge", str(a), str(b), "-o", str(out),
                       "--allow-partial"]) == 0
    assert "2 session(s) added" in capsys.readouterr().out


def test_partial_merge_maps_by_name_and_algorithm2_tolerance_applies(tmp_path):
    a, b, c, out = (tmp_path / f"{n}.db" for n in ("a", "b", "c", "out"))
    write_session(a, 1)                                          # tp x y z w
    write_session(b, 2, pi_names=("w", "tp", "x", "y"))          # 1 of 5 missing: 20 %
    write_session(c, 3, pi_names=("tp", "x", "y"))               # 2 of 5 missing: 40 %
    report = merge([a, b, c], out, allow_partial=True)
    assert [s.differences for s in report.sessions] == [[], ["PIs missing: z"],
                                                        ["PIs missing: z, w"]]
    reader = ReplayReader(out)
    assert reader.layout.pi_names == ("tp", "x", "y", "z", "w")
    sb = reader.sessions[2]
    np.testing.assert_array_equal(sb.pis[7, 1, [0, 1, 2, 4]],         # mapped by name
                                  np.float32([value(2, 7, 1, j) for j in (1, 2, 3, 0)]))
    assert np.isnan(sb.pis[:sb.length, :, 3]).all()                  # z marked missing
    exp = Experience(reader, RewardConfig(pis=["tp"]), stack=4, missing_tolerance=0.2)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(20):
        seen |= set(exp.sample(64, rng).sessions.tolist())
    assert seen == {1, 2}                 # 20 % missing tolerated, 40 % never sampled


def test_same_parameters_in_another_order_are_stored_in_the_reference_order(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    write_session(a, 1)
    write_session(b, 2, params=specs(order=("b", "a")))
    merge([a, b], out)                                # not a difference: no flag needed
    src = ReplayReader(b).sessions[1]
    merged = ReplayReader(out).sessions[2]
    assert merged.info.param_names == ["a", "b"]
    # source action 1 = "increase b" is "increase b" = action 3 in (a, b) order
    np.testing.assert_array_equal(merged.actions[:40], [
        {0: 0, 1: 3, 2: 4, 3: 1, 4: 2}[int(x)] for x in src.actions[:40]])
    np.testing.assert_array_equal(merged.after[:40], src.after[:40][:, ::-1])
    assert (merged.actions[:40] >= 0).all()          # usable for training


def test_an_interrupted_merge_leaves_no_output_and_no_temp_file(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    write_session(a, 1)
    write_session(b, 2)

    def crash(msg):
        raise KeyboardInterrupt       # as Ctrl-C or SIGTERM would, mid-way

    with pytest.raises(KeyboardInterrupt):
        merge([a, b], out, progress=crash)
    assert files_in(tmp_path) == ["a.db", "b.db"]
    merge([a], out)
    before = out.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        merge([b], out, progress=crash)
    assert out.read_bytes() == before                # the old OUT, untouched
    assert files_in(tmp_path) == ["a.db", "b.db", "out.db"]


def test_a_killed_merge_leaves_no_output_and_the_next_merge_cleans_up(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    write_session(a, 1)
    write_session(b, 2)
    script = textwrap.dedent(f"""
        import os, signal
        from capes.experiments.replay_merge import merge
        merge([{str(a)!r}, {str(b)!r}], {str(out)!r},
              progress=lambda msg: os.kill(os.getpid(), signal.SIGKILL))
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert any(".merge-" in n for n in files_in(tmp_path))        # the dead temp file
    assert merge([a, b], out).total_sessions == 2
    assert files_in(tmp_path) == ["a.db", "b.db", "out.db"]


def test_merge_output_is_a_normal_wal_replay_db(tmp_path):
    a, out = tmp_path / "a.db", tmp_path / "out.db"
    write_session(a, 1)
    merge([a], out)
    with sqlite3.connect(out) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ReplayWriter(out) as w:                      # a daemon can go on writing to it
        w.begin_session(SessionInfo(pi_names=["tp"], node_names=["n0"], params=specs()))
    assert len(describe(out).sessions) == 2


def test_not_a_replay_db_is_a_clear_error(tmp_path):
    bogus = tmp_path / "x.db"
    sqlite3.connect(bogus).execute("CREATE TABLE t (a)").connection.commit()
    with pytest.raises(ReplayDBError, match="not a CAPES replay DB"):
        merge([bogus], tmp_path / "out.db")
    assert not (tmp_path / "out.db").exists()


def test_differences_ignore_order():
    a = SessionInfo(pi_names=["x", "y"], node_names=["n"], params=specs())
    b = SessionInfo(pi_names=["y", "x"], node_names=["n"], params=specs(order=("b", "a")))
    assert differences(a, b) == []


# -- export -------------------------------------------------------------------------------

def test_export_csv_has_one_row_per_session_tick_and_node(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    write_session(a, 1, ticks=5)
    write_session(b, 2, ticks=4, pi_names=("x", "tp"), skip={(2, 1)})
    merge([a, b], out, allow_partial=True)
    n = export_csv(out, tmp_path / "x.csv")
    lines = (tmp_path / "x.csv").read_text().splitlines()
    assert n == 5 * 2 + 4 * 2 - 1 == len(lines) - 1
    assert lines[0] == "session,tick,node,tp,x,y,z,w,action,param.a,param.b"
    rows = [line.split(",") for line in lines[1:]]
    row = next(r for r in rows if r[:3] == ["2", "3", "n1"])
    assert float(row[3]) == pytest.approx(value(2, 3, 1, 1))          # tp by name
    assert float(row[4]) == pytest.approx(value(2, 3, 1, 0))
    assert row[5:8] == ["", "", ""]                                   # PIs it lacks
    # action at tick 3 is 3 % 5 = 3 ("b+"); values in effect come from ticks 0..2:
    # a+ at tick 1, a- at tick 2 -> a back to 10; b untouched at 4
    assert row[8] == "b+" and row[9:] == ["10", "4"]


def test_export_npz_loads_without_pickle(tmp_path):
    a = tmp_path / "a.db"
    write_session(a, 1, ticks=6, skip={(4, 0)})
    export_npz(a, tmp_path / "a.npz")
    z = np.load(tmp_path / "a.npz", allow_pickle=False)
    assert list(z["sessions"]) == [1]
    assert list(z["s1_pi_names"]) == ["tp", "x", "y", "z", "w"]
    np.testing.assert_array_equal(z["s1_ticks"], np.arange(6))
    assert z["s1_pis"].shape == (6, 2, 5)
    assert np.isnan(z["s1_pis"][4, 0]).all()
    np.testing.assert_allclose(z["s1_pis"][5, 1, 2], value(1, 5, 1, 2), rtol=1e-6)
    np.testing.assert_array_equal(z["s1_actions"], [0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(z["s1_values"][:3], [[10, 4], [10, 4], [11, 4]])
    assert json.loads(str(z["info"]))["sessions"][0]["gaps"] == []


def test_export_cli_writes_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    a = tmp_path / "a.db"
    write_session(a, 1, ticks=3)
    assert capes_main(["replay", "export", str(a), "--format", "csv", "-o",
                       str(tmp_path / "a.csv")]) == 0
    assert len((tmp_path / "a.csv").read_text().splitlines()) == 1 + 3 * 2
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
