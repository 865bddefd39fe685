"""Configuration: one clear error naming file, key and problem; overrides; presets."""
import pytest

from capes.common.config import ConfigError, apply_overrides, parse_override
from capes.experiments.converge_test import DEFAULT_CONFIG, load_config


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_shipped_config_loads_with_table_5_2_values():
    cfg = load_config(DEFAULT_CONFIG)
    e = cfg.engine
    assert (e.stack, e.hidden_layers, e.gamma, e.learning_rate, e.rmsprop_decay,
            e.batch_size, e.target_update_rate, e.epsilon_start, e.epsilon_final,
            e.missing_tolerance) == (10, 2, 0.99, 0.001, 0.9, 32, 0.01, 1.0, 0.05, 0.2)
    assert cfg.game.peak_window == 50 and cfg.game.delay_ticks == 3
    assert cfg.game.time_limit_ticks == 3600 and cfg.game.win_hold_ticks == 20


def test_presets_differ_only_in_their_improvements_and_the_file_wins(tmp_path):
    paper = load_config(DEFAULT_CONFIG, preset="paper").engine
    default = load_config(DEFAULT_CONFIG, preset="default").engine
    assert (paper.double_dqn, paper.loss, paper.normalise_inputs) == (False, "mse", False)
    assert (default.double_dqn, default.loss, default.normalise_inputs) == (True, "huber", True)
    explicit = load_config(write(tmp_path, '[engine]\npreset = "default"\nloss = "mse"\n'))
    assert explicit.engine.loss == "mse" and explicit.engine.double_dqn


@pytest.mark.parametrize("text, key, problem", [
    ("[game]\nnoise = -1\n", "game.noise", "must be >= 0"),
    ("[game]\nnoise = \"high\"\n", "game.noise", "expected a number"),
    ("[game]\nnoyse = 0.1\n", "game.noyse", "unknown key"),
    ("[engine]\ngamma = 1.5\n", "engine.gamma", "must lie in [0, 1]"),
    ("[engine]\nloss = \"l1\"\n", "engine.loss", "must be one of"),
    ("[engine]\npreset = \"fast\"\n", "engine.preset", "unknown preset"),
    ("[reward]\ntype = \"ratio\"\n", "reward.type", "unknown reward type"),
    ("[reward]\nobjective = \"latency\"\n", "reward.objective", "unknown objective"),
    ("[game.window]\nmin = 10\nmax = 5\n", "game.window.min", "must be <= max"),
    ("[game.window]\ndefault = 500\n", "game.window.default", "must lie in"),
    ("game = 3\n", "game", "expected a table"),
])
def test_bad_values_name_file_key_and_problem(tmp_path, text, key, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert problem in msg


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[game\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")


def test_set_overrides_are_typed_and_validated(tmp_path):
    cfg = load_config(DEFAULT_CONFIG, ["game.noise=0.5", "reward.type=diff_ewma",
                                       "game.window.default=20", "engine.double_dqn=false"])
    assert cfg.game.noise == 0.5 and cfg.reward.type == "diff_ewma"
    assert cfg.game.window.default == 20 and cfg.engine.double_dqn is False
    # an error caused by an override names the override, not the file
    with pytest.raises(ConfigError, match=r"^--set game.noise=-2: game.noise: must be >= 0"):
        load_config(DEFAULT_CONFIG, ["game.noise=0.5", "game.noise=-2"])
    with pytest.raises(ConfigError, match=r"^--set game.speed=2: game.speed: unknown key"):
        load_config(DEFAULT_CONFIG, ["game.speed=2"])
    with pytest.raises(ConfigError, match=r"^--set reward.options.window=0: reward.options"
                                          r".window: diff_avg: must be >= 1"):
        load_config(DEFAULT_CONFIG, ["reward.type=diff_avg", "reward.options.window=0"])


def test_parse_override():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=hello") == (["a"], "hello")
    with pytest.raises(ConfigError):
        parse_override("novalue")
    with pytest.raises(ConfigError):
        apply_overrides({"a": 1}, ["a.b=2"])
