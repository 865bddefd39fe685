"""StorageGameSim: the rules the converge test relies on."""
import numpy as np
import pytest

from capes.common.config import ConfigError, build
from storagegamesim.game import GameConfig, StorageGameSim


def settle(game, window, rate_limit, ticks):
    game.set_params(window=window, rate_limit=rate_limit)
    for _ in range(ticks):
        game.tick()


def test_throughput_peaks_at_the_configured_window():
    cfg = GameConfig(noise=0.0)
    readings = {}
    for m in (10, 30, 45, 50, 55, 70, 90):
        game = StorageGameSim(cfg, seed=0)
        settle(game, m, cfg.rate_limit.max, cfg.delay_ticks + 1)
        readings[m] = game.throughput
    assert max(readings, key=readings.get) == 50
    assert readings[50] == pytest.approx(cfg.peak_throughput)
    # unimodal: falls off monotonically on both sides
    assert readings[10] < readings[30] < readings[45] < readings[50]
    assert readings[90] < readings[70] < readings[55] < readings[50]


def test_rate_limit_caps_throughput():
    game = StorageGameSim(GameConfig(noise=0.0), seed=0)
    settle(game, 50, 40, 5)
    assert game.throughput == pytest.approx(40)


def test_window_change_takes_effect_after_the_delay():
    cfg = GameConfig(noise=0.0, delay_ticks=3)
    game = StorageGameSim(cfg, seed=0)
    game.set_params(rate_limit=200)
    game.tick()
    before = game.throughput
    game.set_params(window=50)
    seen = [game.tick() for _ in range(4)]
    assert seen[:3] == [pytest.approx(before)] * 3      # still the old window
    assert seen[3] == pytest.approx(cfg.peak_throughput)


def test_noise_standard_deviation_is_the_configured_fraction():
    game = StorageGameSim(GameConfig(noise=0.1, time_limit_ticks=10**6), seed=1)
    settle(game, 50, 200, 5)
    samples = np.array([game.tick() for _ in range(5000)])
    assert samples.mean() == pytest.approx(100, rel=0.01)
    assert samples.std() == pytest.approx(10, rel=0.05)


def test_win_needs_more_than_hold_ticks_inside_the_band():
    cfg = GameConfig(noise=0.5, win_hold_ticks=20, delay_ticks=0)
    game = StorageGameSim(cfg, seed=0)
    game.set_params(window=50, rate_limit=200)
    for _ in range(20):
        game.tick()
        assert not game.won
    game.tick()
    assert game.won and game.over


def test_win_is_judged_on_noise_free_throughput_and_resets_outside_the_band():
    cfg = GameConfig(noise=0.0, delay_ticks=0)
    game = StorageGameSim(cfg, seed=0)
    game.set_params(window=50, rate_limit=200)
    for _ in range(15):
        game.tick()
    game.set_params(window=20)       # far outside ±10 %
    game.tick()
    assert game.streak == 0
    game.set_params(window=52)       # 52 is inside the band
    for _ in range(21):
        game.tick()
    assert game.won


def test_time_limit_ends_the_game():
    game = StorageGameSim(GameConfig(time_limit_ticks=30), seed=0)
    while not game.over:
        game.tick()
    assert game.ticks == 30 and not game.won


def test_same_seed_same_noise():
    a, b = StorageGameSim(GameConfig(noise=0.5), seed=7), StorageGameSim(GameConfig(noise=0.5), seed=7)
    assert [a.tick() for _ in range(50)] == [b.tick() for _ in range(50)]


def test_bad_game_constants_are_rejected_with_the_key():
    with pytest.raises(ConfigError, match=r"game.toml: noise: must be >= 0"):
        build(GameConfig, {"noise": -0.1}, "game.toml")
    with pytest.raises(ConfigError, match=r"peak_window"):
        build(GameConfig, {"peak_window": 500}, "game.toml")
    with pytest.raises(ConfigError, match=r"window.step: must be > 0"):
        build(GameConfig, {"window": {"step": 0}}, "game.toml")


def test_gym_face_plays_by_the_same_rules():
    from storagegamesim.gym_env import StorageGameEnv
    env = StorageGameEnv(GameConfig(noise=0.0, delay_ticks=0, win_hold_ticks=2))
    obs, info = env.reset(seed=0)
    assert list(obs) == [pytest.approx(info["true_throughput"]), 10, 50]
    obs, reward, terminated, truncated, _ = env.step(1)        # window + 1
    assert obs[1] == 11 and reward > 0 and not terminated
    with pytest.raises(ValueError):
        env.step(7)
    # walk to the peak and hold: the episode terminates with a win
    for _ in range(39):
        env.step(1)
    for _ in range(10):
        env.step(3)
    done = False
    for _ in range(5):
        *_, done, truncated, _ = env.step(0)
        if done:
            break
    assert done and not truncated
