"""Replay DB: round trip, incremental refresh, Algorithm 2, session boundaries."""
import sqlite3

import numpy as np
import pytest

from capes.common.replay_db import Layout, ReplayDBError, ReplayReader, ReplayWriter, SessionInfo
from drl_engine.experience import Experience, n_step_returns
from drl_engine.config import RewardConfig
from conftest import two_params


def test_round_trip_keeps_values_metadata_and_wal(tmp_path, make_session):
    path = tmp_path / "r.db"
    w, info = make_session(path, ticks=20)
    w.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    r = ReplayReader(path)
    data = r.sessions[info.id]
    assert data.info.pi_names == ["tp", "x"] and data.info.node_names == ["n0", "n1"]
    assert [p.name for p in data.info.params] == ["a", "b"]
    assert data.first_tick == 0 and data.length == 20
    np.testing.assert_array_equal(data.pis[7], [[7, 14], [8, 15]])
    assert data.actions[7] == 7 % 5
    np.testing.assert_array_equal(data.after[7], [11, 4])
    # values in effect at tick 8 are those set by the action at tick 7
    np.testing.assert_array_equal(data.values_in_effect()[8], [11, 4])
    np.testing.assert_array_equal(data.values_in_effect()[0], [10, 4])   # defaults


def test_reader_refreshes_incrementally(tmp_path, make_session):
    path = tmp_path / "r.db"
    w, info = make_session(path, ticks=5)
    r = ReplayReader(path)
    assert r.sessions[info.id].length == 5
    w.add_pis(5, 0, [50, 100])
    w.commit()
    assert r.refresh() == 1
    assert r.sessions[info.id].length == 6
    assert np.isnan(r.sessions[info.id].pis[5, 1]).all()     # node 1 missing at tick 5
    assert r.refresh() == 0


def test_uncommitted_rows_are_invisible_and_committed_rows_survive_a_crash(tmp_path, make_session):
    path = tmp_path / "r.db"
    w, info = make_session(path, ticks=3)
    w.add_pis(3, 0, [1, 2])          # buffered, never committed: the "crash" loses only this
    w.conn.close()
    r = ReplayReader(path)
    assert r.sessions[info.id].length == 3


@pytest.mark.parametrize("n_pis", [2, 12])          # raw rows, and rows lz4 may shrink
def test_a_tick_of_rows_is_stored_as_row_by_row(tmp_path, n_pis):
    # the cluster harness writes a whole tick at once (add_pis_rows): the DB must hold
    # exactly what one add_pis per node would have stored, and refuse the same rows
    rows = np.arange(3 * n_pis, dtype=np.float32).reshape(3, n_pis) % 5
    stored = []
    for name, batched in (("one.db", False), ("batch.db", True)):
        w = ReplayWriter(tmp_path / name)
        w.begin_session(SessionInfo(pi_names=[f"p{j}" for j in range(n_pis)],
                                    node_names=["a", "b", "c", "d"], params=two_params()))
        if batched:
            w.add_pis_rows(7, [0, 2, 3], rows)
            with pytest.raises(ReplayDBError):
                w.add_pis_rows(8, [0, 4], rows[:2])            # node 4 is not in the layout
            with pytest.raises(ReplayDBError):
                w.add_pis_rows(8, [0], np.ones((1, n_pis + 1)))  # more PIs than the layout
        else:
            for node, row in zip([0, 2, 3], rows):
                w.add_pis(7, node, row)
        w.close()
        with sqlite3.connect(tmp_path / name) as conn:
            stored.append(conn.execute("SELECT tick, node, vec FROM pis ORDER BY rowid")
                          .fetchall())
    assert stored[0] == stored[1] and len(stored[0]) == 3


def test_a_full_buffer_drops_the_oldest_rows_of_a_batch_too(tmp_path):
    w = ReplayWriter(tmp_path / "r.db", max_pending=4)
    w.begin_session(SessionInfo(pi_names=["tp"], node_names=["a", "b", "c"],
                                params=two_params()))
    assert w.add_pis_rows(1, [0, 1, 2], [[1], [2], [3]]) == 0
    assert w.add_pis_rows(2, [0, 1, 2], [[4], [5], [6]]) == 2
    assert w.dropped == 2 and [(t, n) for _, t, n, _ in w._pis] == \
        [(1, 2), (2, 0), (2, 1), (2, 2)]


def test_bad_rows_are_refused(tmp_path, make_session):
    w, _ = make_session(tmp_path / "r.db", ticks=1)
    with pytest.raises(ReplayDBError):
        w.add_pis(1, 5, [1, 2])              # unknown node
    with pytest.raises(ReplayDBError):
        w.add_pis(1, 0, [1, 2, 3])           # more PIs than the layout
    with pytest.raises(ReplayDBError):
        w.add_action(1, 33, [1, 2])          # 2 params -> actions 0..32 (moves of 1..8 steps)


def test_not_a_replay_db_is_a_clear_error(tmp_path):
    bogus = tmp_path / "x.db"
    sqlite3.connect(bogus).execute("CREATE TABLE t (a)").connection.commit()
    with pytest.raises(ReplayDBError, match="not a CAPES replay DB"):
        ReplayReader(bogus)
    with pytest.raises(ReplayDBError, match="no such replay DB"):
        ReplayReader(tmp_path / "missing.db")


def test_reader_maps_sessions_onto_one_layout_by_name(tmp_path, make_session):
    path = tmp_path / "r.db"
    w, s1 = make_session(path, ticks=5, pi_names=("tp", "x"))
    w.begin_session(SessionInfo(pi_names=["x", "tp"], node_names=["n1"], params=s1.params))
    w.add_pis(0, 0, [7, 3])
    w.commit()
    r = ReplayReader(path, Layout(("n0", "n1"), ("tp", "x"), ("a", "b")))
    other = r.sessions[2]
    np.testing.assert_array_equal(other.pis[0, 1], [3, 7])     # reordered by name
    assert np.isnan(other.pis[0, 0]).all()                     # n0 absent in that session


def experience(path, **kw):
    return Experience(ReplayReader(path), RewardConfig(pis=["tp"]), stack=kw.pop("stack", 4),
                      missing_tolerance=kw.pop("tol", 0.2), **kw)


def test_algorithm2_minibatch_shapes_and_rewards(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=40)
    exp = experience(path)
    batch = exp.sample(32, np.random.default_rng(0))
    assert batch.obs.shape == (32, 4 * 2 * 2 + 2) == batch.next_obs.shape
    t = batch.ticks
    assert ((t >= 3) & (t <= 38)).all()          # a full stack at t, data at t + 1
    # objective: total tp = t + (t + 1); diff reward = p_{t+1} - p_t = 2
    np.testing.assert_allclose(batch.rewards, 2.0)
    np.testing.assert_array_equal(batch.actions, t % 5)
    # the newest tick of the stack is t; next_obs is shifted by one tick
    last_tp = batch.obs[:, (4 - 1) * 4]
    np.testing.assert_array_equal(last_tp, t)
    np.testing.assert_array_equal(batch.next_obs[:, (4 - 1) * 4], t + 1)


def test_algorithm2_tolerates_missing_entries_up_to_the_limit(tmp_path, make_session):
    path = tmp_path / "r.db"
    # node 1 missing at tick 20 (2 of 16 entries = 12.5 %: tolerated) and the objective
    # then lacks node 1, so transitions whose reward touches tick 20 must be skipped;
    # ticks 30-31 lack both nodes' rows for two ticks (8/16 = 50 %: not tolerated).
    missing = {(20, 1)} | {(t, n) for t in (30, 31) for n in (0, 1)}
    make_session(path, ticks=40, missing=missing)
    exp = experience(path)
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(40):
        seen |= set(exp.sample(32, rng).ticks.tolist())
    assert 21 in seen and 22 in seen              # stacks holding tick 20: tolerated
    assert 19 not in seen and 20 not in seen      # reward needs p_20, which is missing
    assert not seen & set(range(29, 35))          # too much missing at t or t + 1
    strict = experience(path, tol=0.0)
    ticks = set(strict.sample(32, rng).ticks.tolist())
    assert not ticks & set(range(19, 24))


def test_no_transition_spans_two_sessions(tmp_path, make_session):
    path = tmp_path / "r.db"
    w, s1 = make_session(path, ticks=10)
    w.begin_session(SessionInfo(pi_names=["tp", "x"], node_names=["n0", "n1"],
                                params=s1.params, label="second"))
    for t in range(10, 20):          # the next ticks, in a new session
        for n in range(2):
            w.add_pis(t, n, [1000 + t, 0])
        w.add_action(t, 0, [10, 4])
    w.commit()
    exp = experience(path)
    batch = exp.sample(256, np.random.default_rng(2))
    for sid, t, r in zip(batch.sessions, batch.ticks, batch.rewards):
        assert (sid == s1.id and 3 <= t <= 8) or (sid != s1.id and 13 <= t <= 18)
        assert r == pytest.approx(2.0)            # never the jump between sessions


def test_sampling_waits_for_enough_data(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=3)
    assert experience(path).sample(8, np.random.default_rng(0)) is None


def test_transitions_without_an_action_are_not_sampled(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=40, action_every=2)
    batch = experience(path).sample(64, np.random.default_rng(0))
    assert (batch.ticks % 2 == 0).all()


def test_a_move_of_several_steps_is_learned_as_its_direction(tmp_path):
    """Probe walks move two steps a tick (actions 5..8 of 2 parameters): the replay DB
    keeps the move made, the Q-network (2P + 1 outputs) learns it as its direction."""
    path = tmp_path / "r.db"
    w = ReplayWriter(path)
    info = w.begin_session(SessionInfo(pi_names=["tp", "x"], node_names=["n0"],
                                       params=two_params()))
    for t in range(60):
        w.add_pis(t, 0, [t, 2 * t])
        w.add_action(t, t % 9, [10, 4])          # 0..8: NULL, one-step, two-step moves
    w.commit()
    assert ReplayReader(path).sessions[info.id].actions[:9].tolist() == list(range(9))
    batch = experience(path).sample(256, np.random.default_rng(0))
    learned_as = np.array([0, 1, 2, 3, 4, 1, 2, 3, 4])       # a + 2 steps -> a+, ...
    np.testing.assert_array_equal(batch.actions, learned_as[batch.ticks % 9])
    with pytest.raises(ReplayDBError, match="outside"):
        w.add_action(60, 33, [10, 4])            # 2 parameters: 0..32 exist


def test_n_step_returns_discount_n_rewards_and_look_n_ticks_ahead(tmp_path, make_session):
    path = tmp_path / "r.db"
    make_session(path, ticks=40)
    exp = Experience(ReplayReader(path), RewardConfig(pis=["tp"]), stack=4, n_step=3, gamma=0.5)
    batch = exp.sample(32, np.random.default_rng(0))
    assert (batch.ticks <= 36).all()                    # s_{t+3} must exist
    np.testing.assert_allclose(batch.rewards, 2 * (1 + 0.5 + 0.25))
    np.testing.assert_allclose(batch.discounts, 0.5 ** 3)    # the bootstrap's γⁿ
    np.testing.assert_array_equal(batch.next_obs[:, 12], batch.ticks + 3)


def test_a_shifted_return_starts_later_and_every_engine_computes_it_alike(tmp_path,
                                                                          make_session):
    """``engine.return_shift`` (the cluster engine: ``settle_ticks``): an action's
    n-step return starts that many ticks after it, and the tick it needs must exist."""
    r = np.arange(20.0)
    np.testing.assert_array_equal(n_step_returns(r, np.array([0, 5]), 2, 0.5), [0.5, 8.0])
    np.testing.assert_array_equal(n_step_returns(r, np.array([0, 5]), 2, 0.5, shift=3),
                                  [3 + 2.0, 8 + 4.5])
    np.testing.assert_array_equal(n_step_returns(r, np.array([18]), 3, 1.0, ring=True),
                                  [18 + 19 + 0.0])                 # a ring wraps
    path = tmp_path / "r.db"
    make_session(path, ticks=40)
    exp = Experience(ReplayReader(path), RewardConfig(pis=["tp"]), stack=4, n_step=3,
                     gamma=0.5, return_shift=2)
    rng = np.random.default_rng(0)
    ticks = np.concatenate([exp.sample(32, rng).ticks for _ in range(20)])
    assert ticks.min() == 3 and ticks.max() == 34       # r_{t+2+2} needs tick 39


def test_refresh_reads_only_new_rows_never_a_whole_index(tmp_path, make_session):
    """Every query a refresh runs is a rowid range search (or a lookup), never a scan of
    a table or index: its cost must not grow with the rows already stored. (More new
    rows than ``RESERVE_ROWS``, so that the sizing query runs and is checked too.)"""
    path = tmp_path / "r.db"
    w, _ = make_session(path, ticks=2000)
    r = ReplayReader(path)
    new = ReplayReader.RESERVE_ROWS + 1
    for t in range(2000, 2000 + new):
        w.add_pis(t, 0, [1, 2])
    w.add_action(2000, 1, [10, 4])
    w.commit()
    statements: list[str] = []
    r.conn.set_trace_callback(statements.append)
    assert r.refresh() == new + 1
    r.conn.set_trace_callback(None)
    grouped = [s for s in statements if "GROUP BY session" in s]
    assert grouped, statements
    for sql in statements:
        if not sql.lstrip().upper().startswith("SELECT") or "FROM pis" not in sql and \
                "FROM actions" not in sql:
            continue
        plan = " | ".join(row[-1] for row in r.conn.execute("EXPLAIN QUERY PLAN " + sql))
        assert "SCAN pis" not in plan and "SCAN actions" not in plan, (sql, plan)
