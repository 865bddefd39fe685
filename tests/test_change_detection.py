"""Workload-change detection: delay and false alarms on seeded synthetic streams."""
import dataclasses

import numpy as np
import pytest

from capes.common.config import ConfigError, build
from drl_engine.change_detection import (ChangeDetector, ChangeDetectorConfig,
                                         SettingResidualDetector)
from storagegamesim.game import GameConfig, StorageGameSim
from storagegamesim.phases import GamePhase


def feed(det, xs, keys=None):
    if keys is None:
        return [i for i, x in enumerate(xs) if det.update(x)]
    return [i for i, (x, k) in enumerate(zip(xs, keys)) if det.update(x, k)]


@pytest.mark.parametrize("method", ["cusum", "page_hinkley"])
def test_few_false_alarms_on_stationary_noise(method):
    # 10 simulated hours of iid Gaussian noise around a level, and of heavy-tailed noise:
    # defaults give ≈ 0.03 alarms/hour on Gaussian, ≈ 0.5 on Student t(4)
    rng = np.random.default_rng(0)
    cfg = ChangeDetectorConfig(method=method)
    gauss = sum(len(feed(ChangeDetector(cfg), 50 + 5 * rng.standard_normal(3600)))
                for _ in range(10))
    heavy = sum(len(feed(ChangeDetector(cfg), 50 + 5 * rng.standard_t(4, 3600)))
                for _ in range(10))
    assert gauss <= 2
    assert heavy <= 12


@pytest.mark.parametrize("method", ["cusum", "page_hinkley"])
@pytest.mark.parametrize("shift, max_median", [(1.0, 40), (2.0, 12), (-3.0, 8), (20.0, 3)])
def test_a_mean_shift_is_found_quickly(method, shift, max_median):
    rng = np.random.default_rng(1)
    delays = []
    for _ in range(15):
        x = rng.standard_normal(1200)
        x[600:] += shift
        alarms = feed(ChangeDetector(ChangeDetectorConfig(method=method)), x)
        assert not [a for a in alarms if a < 600]
        after = [a for a in alarms if a >= 600]
        delays.append(after[0] - 600 + 1 if after else 10 ** 6)
    assert np.median(delays) <= max_median
    assert max(delays) < 600                    # never missed


def test_one_outlier_never_alarms_and_direction_is_reported():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(2000)
    x[500] = 1e6
    x[900] = -1e6
    det = ChangeDetector()
    assert feed(det, x) == []
    x = np.concatenate([rng.standard_normal(300), 5 + rng.standard_normal(100)])
    det = ChangeDetector()
    assert len(feed(det, x)) == 1 and det.last_direction == "up"
    assert det.counters()["alarms_up"] == 1 and det.state == "monitoring"


def test_warmup_cooldown_and_a_constant_stream():
    cfg = ChangeDetectorConfig(warmup=10, cooldown=5)
    det = ChangeDetector(cfg)
    x = np.concatenate([np.full(40, 3.0), np.full(40, 3.5)])  # noise-free: scale floor
    alarms = feed(det, x)
    assert alarms == [42]        # z is winsorised at 5: three samples of 4.5 pass h = 10
    assert feed(ChangeDetector(cfg), np.full(9, 3.0)) == []
    d = ChangeDetector(cfg)
    feed(d, np.full(9, 3.0))
    assert d.state == "warmup"
    d.update(3.0)
    assert d.state == "monitoring" and d.center[0] == 3.0
    assert not d.update(float("nan")) and d.samples == 11


def test_scalar_and_vector_paths_agree():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(6000)
    x[2500:] += 1.0
    x[4500:] -= 3.0
    for method in ("cusum", "page_hinkley"):
        a, b = ChangeDetector(ChangeDetectorConfig(method=method)), \
            ChangeDetector(ChangeDetectorConfig(method=method))
        b._scalar = False
        assert feed(a, x) == feed(b, x)
        np.testing.assert_allclose(a.center, b.center)
        np.testing.assert_allclose(a.scale, b.scale)


def test_several_streams_vote():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1000, 4))
    one = x.copy()
    one[500:, 0] += 4                            # one stream moves
    two = one.copy()
    two[500:, 1] += 4                            # two streams move
    cfg = ChangeDetectorConfig(min_streams=2)
    d1 = ChangeDetector(cfg, streams=4)
    assert [i for i, v in enumerate(one) if d1.update(v)] == []
    assert d1.stream_alarms[0] >= 1              # it voted, alone
    d2 = ChangeDetector(cfg, streams=4)
    hits = [i for i, v in enumerate(two) if d2.update(v)]
    assert len(hits) == 1 and 500 <= hits[0] < 510
    with pytest.raises(ValueError, match="min_streams"):
        ChangeDetector(cfg, streams=1)


def level_of(setting):                           # the agent's own moves change the level
    return {0: 100.0, 1: 60.0, 2: 20.0}[setting]


def agent_stream(rng, n, noise, change_at=None, factor=0.7):
    keys = rng.integers(0, 3, n // 10).repeat(10)          # a new setting every 10 ticks
    x = np.array([level_of(k) for k in keys]) * (1 + noise * rng.standard_normal(n))
    if change_at is not None:
        x[change_at:] *= factor                             # the workload changes
    return x, keys.tolist()


def test_residuals_ignore_the_agents_own_moves_but_not_a_workload_change():
    rng = np.random.default_rng(5)
    x, keys = agent_stream(rng, 3600, 0.1)
    assert len(feed(ChangeDetector(), x)) > 10              # the raw level: fooled
    assert feed(SettingResidualDetector(), x, keys) == []   # residuals: quiet
    delays = []
    for _ in range(10):
        x, keys = agent_stream(rng, 3600, 0.1, change_at=1500)
        det = SettingResidualDetector()
        alarms = feed(det, x, keys)
        assert not [a for a in alarms if a < 1500]
        delays.append([a for a in alarms if a >= 1500][0] - 1500 + 1)
    assert np.median(delays) <= 10 and max(delays) <= 30
    assert det.expected(0) is not None and det.settings_seen() >= 1


def test_residual_keys_follow_each_knobs_delay():
    cfg = ChangeDetectorConfig(delays=[3, 0], min_samples=1)
    det = SettingResidualDetector(cfg)
    assert det.config.history == 4
    for key in [(10, 1), (20, 1), (30, 2), (40, 2)]:
        det.update(1.0, key)
    # the 4th sample is charged to window 10 (3 updates ago) and rate 2 (now)
    assert det.expected((10, 2)) == 1.0 and det.expected((40, 2)) is None
    det2 = SettingResidualDetector(ChangeDetectorConfig(delay=2, min_samples=1))
    for key in "abcd":
        det2.update(1.0, key)
    assert det2.expected("a") == det2.expected("b") == 1.0 and det2.expected("c") is None


def test_per_node_streams_with_their_own_settings():
    rng = np.random.default_rng(6)
    n, T = 32, 1200
    cfg = ChangeDetectorConfig(min_streams=4)
    det = SettingResidualDetector(cfg, streams=n)
    pooled = SettingResidualDetector(ChangeDetectorConfig(), streams=n, pool="mean")
    hits, hits_pooled = [], []
    for t in range(T):
        keys = rng.integers(0, 3, n)                         # every node explores
        x = np.array([level_of(k) for k in keys]) * (1 + 0.2 * rng.standard_normal(n))
        if t >= 800:
            x[: n // 2] *= 0.8                               # half the nodes slow down
        if det.update_many(x, keys.tolist()):
            hits.append(t)
        if pooled.update_many(x, keys.tolist()):
            hits_pooled.append(t)
    assert hits and all(800 <= h < 830 for h in hits[:1]) and not [h for h in hits if h < 800]
    assert hits_pooled and 800 <= hits_pooled[0] < 830
    assert not [h for h in hits_pooled if h < 800]


@pytest.mark.parametrize("relative", [True, False])
def test_per_node_tables_in_numpy_give_the_plain_loops_residuals(relative):
    """Many streams keep their settings' levels in arrays (update_many in numpy); the
    residuals, alarms and levels are those of the per-stream Python tables, to the bit,
    across missing samples, settings seen for the first time and an alarm's reset."""
    rng = np.random.default_rng(8)
    n = 48
    cfg = ChangeDetectorConfig(delay=3, min_streams=8, relative=relative)
    fast, plain = SettingResidualDetector(cfg, streams=n), SettingResidualDetector(cfg, streams=n)
    plain._dense = None
    knobs, alarms = rng.integers(10, 14, (n, 2)), []
    for t in range(1500):
        knobs = np.clip(knobs + rng.integers(-1, 2, (n, 2)) * (rng.random((n, 1)) < 0.2), 1, 40)
        x = (1 + 0.1 * knobs[:, 0] + 0.5 * (t >= 700)) * (1 + 0.05 * rng.standard_normal(n))
        x[rng.random(n) < 0.05] = np.nan
        keys = list(map(tuple, knobs.tolist()))
        alarm = fast.update_many(x, keys)
        assert alarm == plain.update_many(x, keys)
        alarms += [t] * alarm
        np.testing.assert_array_equal(fast.residual, plain.residual)
    assert alarms and alarms[0] >= 700
    assert fast.counters() == plain.counters()
    for s in range(n):
        assert fast.settings_seen(s) == plain.settings_seen(s)
        assert [fast.expected(k, s) for k in keys] == [plain.expected(k, s) for k in keys]


def test_config_is_validated_with_the_key():
    with pytest.raises(ConfigError, match="detector.threshold"):
        build(ChangeDetectorConfig, {"threshold": 0}, "x.toml", "detector")
    with pytest.raises(ConfigError, match="method"):
        build(ChangeDetectorConfig, {"method": "magic"}, "x.toml")
    with pytest.raises(ValueError, match="clip"):
        ChangeDetector(ChangeDetectorConfig(clip=0.1))
    with pytest.raises(ValueError, match="pool"):
        SettingResidualDetector(pool="max")


def game_alarms(noise, seed, change, policy):
    phases = [GamePhase(at_tick=1500, peak_window=75.0)] if change else []
    cfg = GameConfig(noise=noise, win_hold_ticks=10 ** 6, phases=phases)
    cfg.window.default, cfg.rate_limit.default = 50, 200
    game = StorageGameSim(cfg, seed=seed)
    rng = np.random.default_rng(seed + 100)
    det = SettingResidualDetector(ChangeDetectorConfig(delays=[cfg.delay_ticks, 0]))
    alarms = []
    while game.ticks < 3600:
        if policy == "greedy" and rng.random() < 0.1:       # a converged ε = 0.1 agent
            dw, dr = [(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)][rng.integers(5)]
        else:                                               # greedy: back to (50, 200)
            dw = np.sign(50 - game.window)
            dr = np.sign(200 - game.rate_limit) if dw == 0 else 0
        game.set_params(window=game.window + dw, rate_limit=game.rate_limit + 10 * dr)
        key = (game.window, game.rate_limit)
        if det.update(game.tick(), key):
            alarms.append(game.ticks)
    return alarms


@pytest.mark.parametrize("noise", [0.01, 0.5])
def test_on_the_game_a_moved_peak_is_found_within_a_minute(noise):
    # 3 runs with the peak moving 50 -> 75 at tick 1,500 and 2 stationary hours: the
    # goal is a median delay <= 60 s and <= 1 false alarm per hour (here 3.25 h: <= 2;
    # the raw throughput under an exploring agent gives dozens)
    delays, false = [], 0
    for seed in range(3):
        alarms = game_alarms(noise, seed, True, "greedy")
        false += len([a for a in alarms if a < 1500])
        delays.append([a for a in alarms if a >= 1500][0] - 1500 + 1)
    false += sum(len(game_alarms(noise, 10 + s, False, "greedy")) for s in range(2))
    assert np.median(delays) <= 60
    assert false <= 2


def test_dataclass_replace_keeps_validation_reachable():
    cfg = dataclasses.replace(ChangeDetectorConfig(), warmup=2)
    with pytest.raises(ValueError, match="warmup"):
        ChangeDetector(cfg)
