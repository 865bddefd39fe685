"""The guide's model-proposed probes (drl_engine/guide.py) and knob cost categories."""
import numpy as np
import pytest

from capes.common import actions
from capes.common.params import ParameterSpec
from capes.common.step_grid import StepGrid
from capes.experiments.converge_test import load_config, run_one
from drl_engine.config import DQNConfig
from drl_engine.guide import Guide, Probe, _coarsen

# the game's knobs: rate limit 10..200 step 10, window 1..100 step 1
GAME_GRID = StepGrid(np.array([10.0, 1.0]), np.array([10.0, 1.0]), np.array([19, 99]))


def game_throughput(rate, window):
    """The default game's noise-free throughput (peak 100 at window 50, capped by rate)."""
    return min(100 * np.exp(-0.5 * ((window - 50) / 20) ** 2), rate)


def guide_with_samples(seed, cells, noise=0.1, frozen=None):
    """A guide over the game's grid (rate_limit 10..200 by 10, window 1..100 by 1) with
    ``cells`` random settings credited once each, noisy."""
    cfg = DQNConfig(guided=True, probe_model=True, model_length=0.25, model_beta=0.5)
    g = Guide(GAME_GRID, cfg,
              np.random.default_rng(seed), frozen=frozen)
    rng = np.random.default_rng(seed + 1000)
    for _ in range(cells):
        key = (int(rng.integers(0, 20)), int(rng.integers(0, 100)))
        rate, window = g.values(np.array(key))
        p = game_throughput(rate, window) * (1 + noise * rng.normal())
        g.grid_stats[(slice(None),) + key] += (p, p * p, 1.0)
    return g


@pytest.mark.parametrize("seed", range(5))
def test_the_model_proposes_a_setting_in_the_winning_band(seed):
    # 400 scattered noisy samples, almost none in the band (≥ 90 needs window 41..59 and
    # rate ≥ 90): the GP's proposal must land in it, where uniform search lands 8 % of
    # the time
    g = guide_with_samples(seed, 400)
    target = g.model_target(np.array([4, 9]))
    rate, window = g.values(target)
    assert game_throughput(rate, window) >= 90, (rate, window)


def test_the_model_needs_three_settings_before_it_proposes():
    g = guide_with_samples(0, 0)
    assert g.model_target(np.array([4, 9])) is None
    g.start_probe(1.0, np.array([4, 9]))          # falls back to a uniform target
    assert g.probe is not None and not g.probe.replan


def test_coarsening_keeps_every_sample_and_bounds_the_cells():
    g = guide_with_samples(3, 3000)
    keys, s, sq, n = g._cells()
    assert len(keys) > 1000
    ck, cs, csq, cn = _coarsen(keys.astype(float), s, sq, n, 100)
    assert len(ck) <= 100
    assert cn.sum() == pytest.approx(n.sum()) and cs.sum() == pytest.approx(s.sum())
    assert csq.sum() == pytest.approx(sq.sum())
    assert (ck >= 0).all() and (ck[:, 1] <= 99).all()


def test_a_frozen_parameter_keeps_its_value_in_every_probe():
    g = guide_with_samples(1, 300, frozen=np.array([True, False]))
    current = np.array([4, 9])
    for _ in range(50):
        g.known.setting(0)
        g.start_probe(0.5, current)
        assert g.probe.target[0] == 4
        g.probe = None


def test_an_unknown_cost_is_refused():
    with pytest.raises(ValueError, match="cost: must be one of dynamic, remount"):
        ParameterSpec(min=1, max=10, step=1, default=1, cost="sometimes").validate()


def test_the_engine_never_moves_a_knob_that_needs_a_reboot():
    cfg = load_config(None, ["game.time_limit_ticks=300", 'game.rate_limit.cost="reboot"',
                             "game.win_hold_ticks=100000"], "default")
    result = run_one(cfg, seed=0, keep_trace=True)
    rates, windows = result.trace["rate_limit"], result.trace["window"]
    assert set(rates) == {cfg.game.rate_limit.default}
    assert len(set(windows)) > 5                      # the dynamic knob is tuned


def test_moves_of_a_knob_that_acts_at_once_raise_no_alarm():
    """The game's rate limit acts at once, its window ``settle`` ticks late; the guide
    credits both as if late. Residuals of the ticks right after a move would then be
    keyed to the wrong setting: the detector only hears ticks whose setting held."""
    g = guide_with_samples(0, 0)
    rng = np.random.default_rng(7)
    ticks = 3600
    values = np.empty((ticks, 2))
    p = np.empty(ticks)
    rate, window = 100.0, 50.0
    for t in range(ticks):
        if t % 15 == 0:                                # a stationary game, explored:
            rate = float(rng.choice([50.0, 70.0, 100.0, 150.0]))   # binding or not
            window = float(rng.integers(40, 61))
        values[t] = rate, window
        late = values[max(t - 3, 0), 1]                # the window acts 3 ticks late
        p[t] = game_throughput(rate, late) * (1 + 0.01 * rng.normal())
    assert not g.credit(p, values, ticks)
    assert g.alarms == []


@pytest.mark.parametrize("greedy_steps, allowed", [(1, False), (3, True)])
def test_greedy_actions_stay_within_their_own_guard_band(greedy_steps, allowed):
    # best known: rate index 5, window index 50; the agent sits one window step above it
    # and the Q-network asks for one more (+window = action 3)
    cfg = DQNConfig(guided=True, guard_steps=3, greedy_guard_steps=greedy_steps)
    g = Guide(GAME_GRID, cfg,
              np.random.default_rng(0))
    g.known.best_idx = np.array([5, 50])
    current = np.array([5, 51])
    out = g.guard(3, current)
    if allowed:
        assert out == 3
    else:
        k, sign = divmod(out - 1, 2)
        after = current.copy()
        after[k] += 1 if sign == 0 else -1
        assert np.abs(after - g.known.best_idx).max() < np.abs(current - g.known.best_idx).max()
    assert g.guard(4, current) == 4               # a step back towards the best always passes


@pytest.mark.parametrize("most", [1, 2, 3])
def test_a_probe_walks_up_to_action_steps_per_tick_and_stops_on_its_target(most):
    cfg = DQNConfig(guided=True, action_steps=most, probe_dwell=2)
    g = Guide(GAME_GRID, cfg,
              np.random.default_rng(0))
    g.start_probe(1.0, np.array([4, 9]))
    g.probe.target = np.array([5, 20])              # 1 rate step and 11 window steps
    current, moves = np.array([4, 9]), 0
    while (action := g.probe_action(current)) is not None:
        move = actions.decode(action, 2)
        if move is not None:
            k, steps = move
            assert 1 <= abs(steps) <= most
            current[k] += steps
            moves += 1
    assert current.tolist() == [5, 20]
    assert moves == 1 + -(-11 // most)              # the window walked ⌈11 / most⌉ ticks


def test_the_guard_counts_every_step_of_a_larger_move():
    cfg = DQNConfig(guided=True, greedy_guard_steps=1, action_steps=2)
    g = Guide(GAME_GRID, cfg,
              np.random.default_rng(0))
    g.known.best_idx = np.array([5, 50])
    window_up_2 = actions.encode(1, 2, 2)
    assert g.guard(window_up_2, np.array([5, 49])) == window_up_2   # lands at 51: inside
    back = g.guard(window_up_2, np.array([5, 50]))                  # 52: outside
    assert back == 0                                # already at the best: stay


def test_greedy_guard_steps_is_validated():
    with pytest.raises(ValueError, match="greedy_guard_steps"):
        DQNConfig(greedy_guard_steps=-1).validate()


def knob_series(seed, n=400, noise=0.1, delays=(0, 3)):
    """Two knobs on 0..19 moved at random (one per tick, or none) and an objective that
    follows knob 0 at once and knob 1 ``delays[1]`` ticks late (slopes 10 and 5)."""
    rng = np.random.default_rng(seed)
    values = np.zeros((n, 2))
    values[0] = (10, 10)
    for t in range(1, n):
        values[t] = values[t - 1]
        if rng.random() < 0.6:
            k = rng.integers(2)
            values[t, k] = np.clip(values[t, k] + rng.choice((-1, 1)), 0, 19)
    a = values[np.maximum(np.arange(n) - delays[0], 0), 0]
    b = values[np.maximum(np.arange(n) - delays[1], 0), 1]
    p = 10 * a + 5 * b + noise * rng.normal(size=n)
    return p, values


def lag_guide(seed=0, **cfg):
    cfg = DQNConfig(guided=True, settle_ticks=3, **{"learn_lags": True, **cfg})
    return Guide(StepGrid(np.zeros(2), np.ones(2), np.array([19, 19])), cfg,
                 np.random.default_rng(seed))


@pytest.mark.parametrize("seed", range(3))
def test_each_knob_s_reaction_delay_is_learned(seed):
    p, values = knob_series(seed)
    g = lag_guide(seed)
    for n in range(10, len(p) + 1, 7):          # ticks arrive a few at a time
        g.credit(p, values, n)
    assert g.lags.tolist() == [0, 3]


def test_the_lag_fit_solved_every_k_ticks_learns_the_same_delays(monkeypatch):
    # engine.lag_fit_ticks (default preset: 10): the sums take every tick, the solve
    # (a matrix inverse) runs once per k new ticks, and still finds each knob's delay
    p, values = knob_series(0)
    solves = []
    inv = np.linalg.inv
    monkeypatch.setattr(np.linalg, "inv", lambda a: solves.append(1) or inv(a))
    found = {}
    for k in (1, 10):
        g = lag_guide(lag_fit_ticks=k)
        solves.clear()
        for n in range(10, len(p) + 1):          # one tick at a time, as a run
            g.credit(p, values, n)
        found[k] = (g.lags.tolist(), len(solves))
    assert found[1][0] == found[10][0] == [0, 3]
    assert found[10][1] <= found[1][1] / 10 + 1


def test_credit_goes_to_the_setting_each_knob_had_when_it_acted():
    p, values = knob_series(0)
    g = lag_guide()
    g.credit(p, values, 200)                   # learns the lags
    before = g.grid_stats.copy()
    g.credit(p, values, 201)
    t = 200
    key = (int(values[t, 0]), int(values[t - 3, 1]))
    assert g.grid_stats[2][key] == before[2][key] + 1
    assert g.grid_stats[0][key] - before[0][key] == pytest.approx(p[t])


def test_without_evidence_every_knob_keeps_the_settle_time():
    # noise far above the knobs' effects: nothing is learned, settle_ticks stands
    p, values = knob_series(0, noise=500.0)
    g = lag_guide()
    g.credit(p, values, len(p))
    assert g.lags.tolist() == [3, 3]
    # and with learning off, not even a clear effect moves them
    p, values = knob_series(0)
    g = lag_guide(learn_lags=False)
    g.credit(p, values, len(p))
    assert g.lags.tolist() == [3, 3]


def ladder_guide(**cfg):
    """A guide over one knob of 11 rungs (read_ahead_kb 4 … 4096 as ladder indices)."""
    return Guide(StepGrid(np.array([0.0]), np.array([1.0]), np.array([10]),
                          ladder=np.array([True])),
                 DQNConfig(guided=True, **cfg), np.random.default_rng(0))


def credit_level(g, setting: int, level: float, ticks: int = 3):
    """``ticks`` samples of ``level`` credited to ``setting``, and the newest value seen."""
    g.grid_stats[:, setting] += (level * ticks, level * level * ticks, ticks)
    g.last_p = level


def test_a_local_first_probe_holds_where_tuning_starts_until_its_level_is_known():
    g = ladder_guide(first_probe="local", guard_steps=1)
    for _ in range(5):                  # no best known: every first probe stays at 5
        g.start_probe(1.0, np.array([5]))
        assert list(g.probe.target) == [5]
    credit_level(g, 5, 26.0)
    assert list(g.known.setting(0)) == [5]
    targets = set()
    for _ in range(40):                 # then local probes, one rung around it
        g.start_probe(0.0, np.array([5]))
        targets.add(int(g.probe.target[0]))
    assert targets <= {4, 5, 6} and len(targets) > 1
    # "global": the first probe may go anywhere on the ladder
    far = set()
    for seed in range(20):
        h = ladder_guide(first_probe="global")
        h.rng = np.random.default_rng(seed)
        h.start_probe(1.0, np.array([5]))
        far.add(int(h.probe.target[0]))
    assert max(abs(t - 5) for t in far) >= 3



@pytest.mark.parametrize("seed", [0, 7])
def test_an_engine_starting_away_from_the_default_holds_where_the_knob_is(tmp_path, seed):
    """The shipped readahead config (default "128", ladder index 5) on a host found at
    512 (index 7), as the engine daemon runs it: ``current`` from the daemon, the
    replay DB assuming the default before the session's first action. The ticks before
    that action are not the default's: the engine holds 512 while its level is measured
    and then moves one rung at a time (it walked straight to 128, found live)."""
    from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
    from capes.experiments import real_readahead as rr
    from capes.settings import load_settings
    from drl_engine.engine import Engine
    s = load_settings(rr.APP_CONFIG)
    spec = s.parameters["read_ahead_kb"]
    assert spec.default == 5 and spec.values[7] == "512"
    w = ReplayWriter(tmp_path / "r.db")
    w.begin_session(SessionInfo(pi_names=[rr.PI_NAME, rr.SIGNATURE_PI], node_names=["h"],
                                params=[spec], label="s"))

    def app(t: int, knob: float) -> None:   # sequential reads: 512 and up at the cap
        w.add_pis(t, 0, np.array([min(60e6, 20e6 * 2.0 ** (knob - 5)), 4.0], np.float32))
    for t in range(4):                      # the ticks before the engine's first action
        app(t, 7)
    w.commit()
    reader = ReplayReader(tmp_path / "r.db")
    engine = Engine(s.engine, s.reward, reader, device="cpu", seed=seed)
    knob, held = 7.0, []
    for t in range(4, 16):
        engine.update()
        d = engine.act(max(reader.sessions), current=[knob])
        if d is not None:
            w.add_action(d.tick, d.action, d.values)
            knob = float(d.values[0])
            held.append(knob)
        app(t, knob)
        w.commit()
    assert len(held) >= 10 and held[:4] == [7.0] * 4, held    # the anchor, measured
    assert all(6.0 <= v <= 8.0 for v in held), held           # then one rung around it
    engine.close()
    reader.close()


def test_before_any_level_is_known_a_greedy_move_stays_near_the_local_anchor():
    down_2 = actions.encode(0, -2, 1)
    g = ladder_guide(first_probe="local", guard_steps=1, greedy_guard_steps=1,
                     action_steps=2)
    assert g.guard(down_2, np.array([5])) == down_2       # no anchor yet: unguarded
    g.start_probe(1.0, np.array([5]))                     # the anchor probe: 128 KiB
    assert g.known.best_idx is None
    assert g.guard(down_2, np.array([5])) == 0            # two rungs away: refused
    assert g.guard(down_2, np.array([6])) == down_2       # ends one rung from it: allowed
    assert g.guard(actions.encode(0, -1, 1), np.array([4])) == actions.encode(0, 1, 1)
    h = ladder_guide(first_probe="global", greedy_guard_steps=1, action_steps=2)
    h.start_probe(1.0, np.array([5]))
    assert h.guard(down_2, np.array([5])) == down_2       # the presets' path: unchanged


def test_a_probe_below_the_floor_walks_back_at_once():
    g = ladder_guide(first_probe="local", guard_steps=1, probe_floor=0.75, probe_dwell=4)
    credit_level(g, 5, 26.0)
    g.known.setting(0)
    g.probe = Probe(np.array([4]), 4)
    assert g.probe_action(np.array([5])) != 0        # walks down to 4
    g.last_p = 13.0                                 # half the best's level: unsafe
    action = g.probe_action(np.array([4]))
    assert actions.decode(action, 1) == (0, 1)       # straight back up, not a dwell
    assert g.probe.back and list(g.probe.target) == [5]
    assert g.probe_action(np.array([5])) is None    # there: the probe is over
    # above the floor the probe dwells its whole time
    g.probe = Probe(np.array([6]), 4)
    g.last_p = 24.0
    moves = [g.probe_action(np.array([6])) for _ in range(5)]
    assert moves == [0, 0, 0, 0, None]


def test_under_noise_a_value_the_best_itself_often_measures_does_not_end_a_probe():
    """probe_floor_noise: at 50 % noise the best's own values fall below 3/4 of its level
    a third of the time; judged on one value each, half the probes walked back from
    settings better than the best (Table 5.1, seed 22, diff_avg: stuck at 0.78)."""
    def guide(z, spread, under=40, held=120):
        g = ladder_guide(first_probe="local", guard_steps=1, probe_floor=0.75, probe_dwell=4,
                         probe_floor_noise=z)
        for level in (100.0 - spread, 100.0 + spread):   # the best: mean 100, sd ~spread
            credit_level(g, 5, level, ticks=2)
        g.known.setting(0)
        g.floor_held, g.floor_under = held, under        # its values below the floor
        g.probe = Probe(np.array([6]), 4)
        return g
    def walks_back(g, value):
        g.last_p = value
        return g.probe_action(np.array([6])) != 0 and g.probe.back
    assert walks_back(guide(0.0, 50.0), 60.0)        # off: any value below 75 ends it
    assert not walks_back(guide(2.0, 50.0), 60.0)    # a value the best often measures
    assert walks_back(guide(1.0, 50.0), 30.0)        # far below even the noisy best
    assert walks_back(guide(2.0, 50.0, under=20), 60.0)   # the best rarely below the
    assert walks_back(guide(2.0, 50.0, under=30, held=90), 60.0)   # floor, or not yet
    #                                                        counted enough: as it was
    assert walks_back(guide(2.0, 5.0), 70.0)         # quiet best: the floor as it was
    assert not walks_back(guide(2.0, 5.0), 80.0)


def test_the_floor_counts_how_often_the_best_itself_falls_below_it():
    g = ladder_guide(first_probe="local", guard_steps=1, probe_floor=0.75,
                     probe_floor_noise=2.0, settle_ticks=0)
    credit_level(g, 5, 100.0)
    g.known.setting(0)
    values = np.full((40, 1), g.values(np.array([5]))[0])
    p = np.where(np.arange(40) % 3 == 0, 50.0, 120.0)    # a third of them below 75
    for n in range(1, 41):
        g.credit(p, values, n)
    assert g.floor_held == 40 and 12 <= g.floor_under <= 14


def test_a_setting_known_below_the_floor_is_not_probed_or_stepped_onto_again():
    def guide(avoid):
        g = ladder_guide(first_probe="local", guard_steps=1, probe_local_steps=1.0,
                         probe_floor=0.75, probe_avoid_bad=avoid)
        credit_level(g, 5, 26.0)          # the anchor, 128 KiB
        credit_level(g, 4, 13.0, ticks=2)  # one rung down: half of it (a probe walked back)
        g.known.setting(0)
        return g
    for seed in range(20):
        g = guide(True)
        g.rng = np.random.default_rng(seed)
        g.start_probe(0.0, np.array([5]))
        assert int(g.probe.target[0]) in (5, 6)          # never 4 again
    down, up = actions.encode(0, -1, 1), actions.encode(0, 1, 1)
    g = guide(True)
    assert g.guard(down, np.array([5])) == 0 and g.guard(up, np.array([5])) == up
    # off (the presets): the same data still sends probes and greedy moves to 4
    h = guide(False)
    assert h.guard(down, np.array([5])) == down
    targets = set()
    for seed in range(20):
        h.rng = np.random.default_rng(seed)
        h.start_probe(0.0, np.array([5]))
        targets.add(int(h.probe.target[0]))
    assert 4 in targets


def test_probe_move_never_probes_the_best_itself():
    def targets(move, bad_below):
        g = ladder_guide(first_probe="local", guard_steps=1, probe_local_steps=1.0,
                         probe_floor=0.75, probe_avoid_bad=True, probe_move=move)
        credit_level(g, 5, 35.0)                   # 128 KiB, above the floor
        credit_level(g, 6, 40.0)                   # 256 KiB, the best
        if bad_below:
            credit_level(g, 5, 5.0, ticks=9)       # 128 now known below the floor
        g.known.setting(0)
        out = []
        for seed in range(40):
            g.rng = np.random.default_rng(seed)
            g.start_probe(0.0, np.array([6]))
            out.append(int(g.probe.target[0]))
        return out
    # off (the presets): one-rung draws stay at the best about as often as they move up
    assert targets(False, True).count(6) >= 10
    assert set(targets(True, True)) == {7}          # on: the one rung not known bad
    assert set(targets(True, False)) == {5, 7}      # both neighbours, never the best
    # nowhere to go (every neighbour known bad): the probe holds the best
    g = ladder_guide(first_probe="local", guard_steps=1, probe_local_steps=1.0,
                     probe_floor=0.75, probe_avoid_bad=True, probe_move=True)
    for k, level in ((4, 10.0), (5, 40.0), (6, 10.0)):
        credit_level(g, k, level)
    g.known.best_idx = np.array([5])
    g.start_probe(0.0, np.array([5]))
    assert int(g.probe.target[0]) == 5


def test_a_new_workload_is_swept_coarsely_before_the_local_search():
    g = ladder_guide(first_probe="local", guard_steps=1, alarm_guard_steps=10,
                     alarm_probes=3, sweep_points=4)
    credit_level(g, 9, 50.0)                  # the workload before, best at 2048 KiB
    g.known.setting(0)
    g.forget()                                # a new workload: best unknown
    g.start_probe(0.0, np.array([9]))         # the anchor is measured first
    assert list(g.probe.target) == [9] and not g.sweep
    credit_level(g, 9, 0.1)
    g.known.setting(0)
    targets = []
    for _ in range(4):
        g.start_probe(0.0, np.array([9]))
        targets.append(int(g.probe.target[0]))
    # 4 points over 0..10 (0, 3, 7, 10): the nearer end first, then down, nearest first
    assert targets == [10, 7, 3, 0] and not g.sweep and g.wide_left == 0
    g.forget()
    assert not g.sweep                        # an alarm or a new workload drops the rest
    # a new context (the engine says so at the switch): one tick already names a best,
    # and still the sweep comes first
    g.grid_stats[:] = 0.0
    credit_level(g, 9, 0.1, ticks=1)
    g.known.setting(0)
    g.new_workload()
    g.start_probe(0.0, np.array([9]))
    assert list(g.probe.target) == [10] and [t[0] for t in g.sweep] == [7, 3, 0]
    g.drop_sweep()
    # an alarm whose level moved 2x on a known workload: the wide draws, no sweep
    credit_level(g, 9, 50.0)
    g.known.setting(0)
    g.level_before = 50.0
    g.forget(anchor=np.array([9]))
    g.start_probe(0.0, np.array([9]))
    credit_level(g, 9, 5.0)
    g.start_probe(0.0, np.array([9]))
    assert not g.sweep and g.wide_left == 2
    # off (sweep_points = 0): the wide random draws, as before
    h = ladder_guide(first_probe="local", guard_steps=1, alarm_guard_steps=10,
                     alarm_probes=3)
    credit_level(h, 9, 50.0)
    h.known.setting(0)
    h.forget()
    h.start_probe(0.0, np.array([9]))
    credit_level(h, 9, 0.1)
    h.known.setting(0)
    h.start_probe(0.0, np.array([9]))
    assert not h.sweep and h.wide_left == 2


@pytest.mark.parametrize("fresh_only", [False, True])
def test_the_detector_hears_a_re_read_figure_once_with_detect_fresh_only(fresh_only):
    g = ladder_guide(detect_fresh_only=fresh_only, settle_ticks=1)
    heard = []
    g.detector.update = lambda p, key: heard.append(p) or False
    p = np.array([5.0, 5.0, 6.0, 6.0, 6.0, 4.0, 5.0, 5.0])   # a figure renewed every other tick
    values = np.full((len(p), 1), 5.0)
    g.credit(p, values, len(p), first_action=None)
    assert heard == ([6.0, 4.0, 5.0] if fresh_only else list(p[1:]))


def test_after_a_change_the_first_probes_may_go_further():
    g = ladder_guide(guard_steps=1, probe_local_steps=1.0, alarm_guard_steps=4,
                     alarm_probes=2)
    credit_level(g, 0, 1.0)
    g.known.setting(0)
    g.forget(anchor=np.array([0]))
    g.wide_left = g.cfg.alarm_probes            # as an alarm in credit() sets it
    reach = []
    for _ in range(2):
        g.start_probe(0.0, np.array([0]))
        reach.append(int(g.probe.target[0]))
    g.start_probe(0.0, np.array([0]))
    assert g.wide_left == 0 and int(g.probe.target[0]) <= 1
    assert all(t <= 4 for t in reach)
    # over many seeds the wide probes reach rungs the one-rung band cannot
    far = 0
    for seed in range(20):
        h = ladder_guide(guard_steps=1, probe_local_steps=1.0, alarm_guard_steps=4,
                         alarm_probes=1)
        h.rng = np.random.default_rng(seed)
        h.known.best_idx, h.wide_left = np.array([0]), 1
        h.start_probe(0.0, np.array([0]))
        far += int(h.probe.target[0]) >= 2
    assert far >= 5


def test_a_new_workload_after_a_known_best_re_explores_wide():
    g = ladder_guide(first_probe="local", guard_steps=1, alarm_guard_steps=4, alarm_probes=3)
    g.start_probe(1.0, np.array([7]))                 # the very start: narrow
    assert g.wide_left == 0
    credit_level(g, 7, 50.0)
    g.known.setting(0)
    g.forget()                                        # a new workload: best unknown
    g.start_probe(1.0, np.array([7]))
    assert list(g.probe.target) == [7] and g.wide_left == 3


@pytest.mark.parametrize("after, wide", [(5.0, True), (40.0, True), (11.0, False)])
def test_after_an_alarm_the_anchor_is_measured_and_only_a_moved_level_goes_wide(after, wide):
    g = ladder_guide(first_probe="local", guard_steps=1, alarm_guard_steps=4, alarm_probes=3)
    credit_level(g, 7, 10.0)
    g.known.setting(0)
    g.level_before = g._level(np.array([7]))        # as credit() does on an alarm
    g.forget(anchor=np.array([7]))
    g.start_probe(0.0, np.array([6]))               # the anchor's level is unknown: hold it
    assert list(g.probe.target) == [7] and g.wide_left == 0
    credit_level(g, 7, after)
    g.start_probe(0.0, np.array([7]))
    assert (g.wide_left > 0) == wide                # 2x or more: a new workload; else noise


@pytest.mark.parametrize("key, value", [("first_probe", "near"), ("probe_floor", 1.0),
                                        ("probe_floor", -0.1), ("alarm_guard_steps", -1),
                                        ("probe_floor_noise", -1.0)])
def test_probe_safety_settings_are_validated(key, value):
    with pytest.raises(ValueError, match=key):
        DQNConfig(**{key: value}).validate()


def _credit_walk(g, windows, rate=19):
    """Credit the game's throughput at each window (rate index ``rate``) once."""
    for w in windows:
        key = (rate, w)
        p = game_throughput(*g.values(np.array(key)))
        g.grid_stats[(slice(None),) + key] += (p, p * p, 1.0)


def test_a_new_contexts_uniform_first_probe_is_re_aimed_once_the_model_has_data():
    # context_replan (issue 25 round 8): at a new workload context the first global probe
    # is drawn uniformly (the model has no settings yet) and is re-aimed by the model
    # every settle+1 moves of its walk; at a session's start, or with the switch off, it
    # keeps its target (the behaviour the stationary figures were measured with)
    def first_probe(replan: bool, context: bool):
        cfg = DQNConfig(guided=True, probe_model=True, action_steps=2, context_replan=replan)
        g = Guide(GAME_GRID, cfg, np.random.default_rng(0))
        g.new_workload(context=context)
        g.start_probe(1.0, np.array([19, 45]))
        return g

    for replan, context in ((False, True), (True, False)):
        assert not first_probe(replan, context).probe.replan
    g = first_probe(True, True)
    assert g.probe.replan and g.replan_uniform
    # walking up from window 45 the throughput falls: once three settings are credited
    # the model turns the walk back towards the windows below (the peak is at 50 - 20)
    g.probe.target = np.array([19, 95])
    _credit_walk(g, [45, 60, 75])
    cur = np.array([19, 75])
    for _ in range(DQNConfig().settle_ticks + 1):
        action = g.probe_action(cur)
    k, steps = actions.decode(action, 2)
    assert g.probe.target[1] < 75 and (k, np.sign(steps)) == (1, -1)
    g.start_probe(1.0, cur)                # the model proposes from now on: flag spent
    assert not g.replan_uniform
    g.new_workload(context=True)
    g.forget()                             # an alarm's re-exploration is not a new context's
    assert not g.replan_uniform


def test_a_numeric_range_is_not_swept_but_searched_with_wide_draws():
    # a sweep over a range of 100 steps walks ~50 ticks a point (measured on the
    # recurring game: 0.0125 of the hour lost); a range keeps the wide draws instead
    g = Guide(StepGrid(np.array([1.0]), np.array([1.0]), np.array([99])),
              DQNConfig(guided=True, first_probe="local", probe_unit=10, guard_steps=1,
                        alarm_guard_steps=10, alarm_probes=3, sweep_points=4),
              np.random.default_rng(0))
    credit_level(g, 40, 0.1, ticks=1)
    g.known.setting(0)
    g.new_workload()
    g.start_probe(0.0, np.array([40]))
    assert not g.sweep and g.wide_left > 0


def test_probe_unit_sizes_the_search_by_each_knobs_range():
    # probe_unit = 10: guard_steps = 1 is a rung of an 11-rung ladder and ten steps of a
    # 100-step range; without it, one step of each
    def guide(n, **cfg):
        g = Guide(StepGrid(np.array([0.0]), np.array([1.0]), np.array([n])),
                  DQNConfig(guided=True, guard_steps=1, probe_local_steps=1.0, **cfg),
                  np.random.default_rng(0))
        credit_level(g, n // 2, 10.0)
        g.known.setting(0)
        return g
    for n, unit, most in ((10, 10, 1), (100, 10, 10), (100, 0, 1)):
        g = guide(n, probe_unit=unit)
        assert g._in_steps(1, whole=True).tolist() == [most]
        reach = 0
        for _ in range(300):
            g.start_probe(0.0)
            reach = max(reach, abs(int(g.probe.target[0]) - n // 2))
        assert reach == most                  # local probes reach the guard, never beyond


def _walk_moves(g, start, target):
    """The signed steps of each move a probe to ``target`` makes from ``start``."""
    g.probe, current, moves = Probe(np.array(target), 0), np.array(start), []
    while (action := g.probe_action(current)) is not None:
        move = actions.decode(action, len(current))
        if move is not None:
            current[move[0]] += move[1]
            moves.append(move)
    assert current.tolist() == list(target)
    return moves


@pytest.mark.parametrize("on", [True, False])
def test_a_probe_walk_crosses_a_probe_unit_of_a_long_range_a_tick(on):
    # probe_walk_unit: a tenth of the window's 99 steps a tick (at most MAX_STEPS), the
    # rate limit's 19 steps two at a time as before; off, two steps a tick everywhere
    cfg = DQNConfig(guided=True, action_steps=2, probe_unit=10, probe_walk_unit=on)
    moves = _walk_moves(Guide(GAME_GRID, cfg, np.random.default_rng(0)), [4, 9], [8, 49])
    window = [abs(s) for k, s in moves if k == 1]
    rate = [abs(s) for k, s in moves if k == 0]
    assert sum(rate) == 4 and max(rate) <= 2
    assert sum(window) == 40 and max(window) == (8 if on else 2)
    assert len(moves) == (11 if on else 26)        # the walk's ticks
    # an 11-rung ladder (the readahead knob) walks as it did: two rungs a tick
    ladder = ladder_guide(action_steps=2, probe_unit=10, probe_walk_unit=True)
    assert [abs(s) for _, s in _walk_moves(ladder, [0], [9])] == [2, 2, 2, 2, 1]


def _sloped_guide(seed=0, **cfg):
    """A guide over the game's grid that has seen windows 10–40 at the top rate limit
    (the game's slope up to its peak at 50), each 6 times with 10 % noise."""
    cfg = {"probe_model": True, **cfg}
    g = Guide(GAME_GRID, DQNConfig(guided=True, probe_unit=10, guard_steps=1,
                                   probe_local_steps=1.0, **cfg),
              np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for w in (9, 19, 29, 39):
        for _ in range(6):
            p = game_throughput(200, w + 1) * (1 + 0.1 * rng.normal())
            g.grid_stats[:, 19, w] += (p, p * p, 1.0)
    g.known.setting(0)
    return g


@pytest.mark.parametrize("seed", range(4))
def test_a_safe_probe_goes_only_where_the_model_clears_the_floor(seed):
    g = _sloped_guide(seed, probe_safe=1.0, probe_floor=0.75)
    assert list(g.known.best_idx) == [19, 39]
    level = g._level(g.known.best_idx)
    target = g._safe_target(g.known.best_idx, g.known.best_idx.copy())
    assert target is not None
    rate, window = g.values(target)
    # never where the floor is known to be crossed (windows 30 and below: <= 0.64 x)
    assert game_throughput(rate, window) >= 0.75 * level * 0.9
    assert window > 30
    # without a floor, a share or a model, no safe probe: local probes stay local
    for off in ({"probe_safe": 0.0, "probe_floor": 0.75}, {"probe_safe": 1.0},
                {"probe_safe": 1.0, "probe_floor": 0.75, "probe_model": False}):
        h = _sloped_guide(seed, **off)
        assert h._safe_target(h.known.best_idx, h.known.best_idx.copy()) is None


def test_a_wide_probe_is_re_aimed_as_it_walks_with_wide_replan():
    for on in (True, False):
        g = _sloped_guide(wide_replan=on, alarm_guard_steps=10, alarm_probes=1)
        g.wide_left = 1
        g.start_probe(0.0, g.known.best_idx.copy())
        assert g.probe.replan == on and g.wide_left == 0
        g.start_probe(0.0, g.known.best_idx.copy())          # the next, local one: not re-aimed
        assert not g.probe.replan


def test_probe_safe_is_a_share():
    for value in (-0.1, 1.5):
        with pytest.raises(ValueError, match="probe_safe"):
            DQNConfig(probe_safe=value).validate()
