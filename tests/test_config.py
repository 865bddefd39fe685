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
    ("[engine]\nreturn_shift = -1\n", "engine.return_shift", "must be >= 0"),
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
                                          r".window: diff_avg: must lie in \[1, "):
        load_config(DEFAULT_CONFIG, ["reward.type=diff_avg", "reward.options.window=0"])


def test_parse_override():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a=hello") == (["a"], "hello")
    with pytest.raises(ConfigError):
        parse_override("novalue")
    with pytest.raises(ConfigError):
        apply_overrides({"a": 1}, ["a.b=2"])


# ----------------------------------------------------------------------- issue 12
# Every bad value found by the red team: one line naming file, key and problem, exit
# status 2, within seconds, never a traceback and never silent acceptance.
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOOD = """tick_seconds = 1.0
[keys]
enabled = false
[daemon]
ingest = "tcp://127.0.0.1:0"
control = "tcp://127.0.0.1:0"
grpc = "127.0.0.1:0"
db = "{tmp}/replay.db"
[parameters.window]
min = 1
max = 100
step = 1
default = 10
"""

BAD_VALUES = {   # name -> (text added, or a callable(tmp) giving it; key; problem)
    "unknown forbidden parameter": ("[daemon.forbidden]\nwindoww = [13]\n",
                                    "daemon.forbidden.windoww", "unknown parameter"),
    "empty parameter name": ('[parameters.""]\nmin = 1\nmax = 2\nstep = 1\ndefault = 1\n',
                             "parameters", "must not be empty"),
    "DB path is a directory": ("DB:{tmp}", "daemon.db", "is a directory"),
    "huge max_message_bytes": ("[daemon]\nmax_message_bytes = 9223372036854775807\n",
                               "daemon.max_message_bytes", "must lie in [1, 16777216]"),
    "max_message_bytes beyond 64 bits": ("[daemon]\nmax_message_bytes = 99999999999999999999\n",
                                         "daemon.max_message_bytes", "out of range"),
    "negative restore_after_s": ("[control]\nrestore_after_s = -1\n",
                                 "control.restore_after_s", "must lie in [0, "),
    "NaN restore_after_s": ("[control]\nrestore_after_s = nan\n",
                            "control.restore_after_s", "finite"),
    "commit_every_s = inf": ("[daemon]\ncommit_every_s = inf\n", "daemon.commit_every_s",
                             "finite"),
    "max_clock_skew_s = nan": ("[daemon]\nmax_clock_skew_s = nan\n",
                               "daemon.max_clock_skew_s", "finite"),
    "parameter step = inf": ("[parameters.rate]\nmin = 1\nmax = 10\nstep = inf\ndefault = 1\n",
                             "parameters.rate.step", "finite"),
    "parameter step too fine": ("[parameters.rate]\nmin = 0\nmax = 1e12\nstep = 1e-3\n"
                                "default = 0\n", "parameters.rate.step", "too fine"),
    "parameter max beyond 2**53": ("[parameters.rate]\nmin = -1.7e308\nmax = 1.7e308\n"
                                   "step = 1\ndefault = 0\n", "parameters.rate.min",
                                   "within ±2**53"),
    "tick_seconds = inf": ("TOP:tick_seconds = inf\n", "tick_seconds", "finite"),
    "tick_seconds = 1e-300": ("TOP:tick_seconds = 1e-300\n", "tick_seconds", "must lie in"),
    "engine NaN": ("[engine]\nlearning_rate = nan\n", "engine.learning_rate", "finite"),
    "engine stack huge": ("[engine]\nstack = 1000000000\n", "engine.stack", "at most"),
    "engine preset a table": ("[engine.preset]\nx = 1\n", "engine.preset",
                              "expected a preset name"),
    "EWMA weight 1e-17": ('[reward]\ntype = "diff_ewma"\noptions = { weight = 1e-17 }\n',
                          "reward.options.weight", "must lie in [0.001, 1]"),
    "applier option inf": ('[control.appliers.window]\nname = "file"\n'
                           'options = { path = "w", scale = inf }\n',
                           "control.appliers.window.options.scale", "finite"),
    "NUL in a string": ('[daemon]\nlabel = "a\\u0000b"\n', "daemon.label", "NUL"),
    "empty monitor node": ('[monitor]\nnode = ""\n', "monitor.node", "must not be empty"),
}


def bad_config(tmp_path, name) -> tuple[Path, str, str]:
    text, key, problem = BAD_VALUES[name]
    good = GOOD.replace("{tmp}", str(tmp_path))
    text = text.replace("{tmp}", str(tmp_path))
    if text.startswith("DB:"):                      # replaces the DB path
        good = good.replace(f"{tmp_path}/replay.db", text[3:])
        text = ""
    if text.startswith("TOP:"):                     # a top-level key goes first
        good = good.replace("tick_seconds = 1.0\n", text[4:])
        text = ""
    for section in ("[daemon]\n", "[control]\n", "[monitor]\n"):
        if text.startswith(section) and section in good:   # merge into the section
            good = good.replace(section, text, 1)
            text = ""
    path = tmp_path / "bad.toml"
    path.write_text(good + text)
    return path, key, problem


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_each_bad_value_is_one_config_error(tmp_path, name):
    from capes.settings import load_settings
    path, key, problem = bad_config(tmp_path, name)
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    assert str(err.value).startswith(f"{path}: {key}"), str(err.value)
    assert problem in err.value.problem, str(err.value)


def run_capes(*args, timeout=20):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "capes", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("name", ["unknown forbidden parameter", "commit_every_s = inf",
                                  "DB path is a directory", "NaN restore_after_s"])
def test_the_daemon_exits_2_with_one_line_for_a_bad_value(tmp_path, name):
    path, key, problem = bad_config(tmp_path, name)
    out, took = run_capes("interface-daemon", "--config", str(path))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and took < 15, (out.returncode, took, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"capes: configuration error: {path}: {key}"), lines[0]
    assert problem in lines[0], lines[0]


def test_the_control_agent_exits_2_for_a_negative_restore_after_s(tmp_path):
    path, key, problem = bad_config(tmp_path, "negative restore_after_s")
    out, took = run_capes("control-agent", "--config", str(path))
    assert out.returncode == 2 and took < 5, (out.returncode, took, out.stderr)
    assert out.stderr.strip().splitlines() == [
        f"capes: configuration error: {path}: control.restore_after_s: must lie in "
        f"[0, 604800] seconds, 0 meaning never (got -1.0)"]


def test_a_binary_config_file_is_one_line(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"tick_seconds = 1.0\n# \xff\xfe\x00\x9c\n")
    out, took = run_capes("interface-daemon", "--config", str(path))
    assert out.returncode == 2 and took < 5, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"capes: configuration error: {path}: not valid TOML: not UTF-8 text "
        f"(byte 0xff at offset 21)"]
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_a_non_sqlite_db_is_one_line_from_the_daemon(tmp_path):
    """Not a config-level check (the file may appear later): the daemon's own error."""
    (tmp_path / "notes.db").write_text("not a database\n" * 100)
    path = tmp_path / "c.toml"
    path.write_text(GOOD.replace("{tmp}", str(tmp_path)).replace("replay.db", "notes.db"))
    out, took = run_capes("interface-daemon", "--config", str(path))
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and took < 10 and "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and "notes.db" in lines[0], lines


def test_infinity_only_where_a_field_allows_it():
    from capes.common.config import build
    from storagegamesim.phases import Workload
    assert build(Workload, {"demand": float("inf")}).demand == float("inf")
    with pytest.raises(ConfigError, match="share: expected a finite number"):
        build(Workload, {"share": float("inf")})
    with pytest.raises(ConfigError, match="demand: expected a finite number, got nan"):
        build(Workload, {"demand": float("nan")})


def test_a_true_false_or_auto_key_names_its_three_values():
    """``cluster_engine.device_sampling`` (true, false or "auto"): each is accepted from
    --set, and anything else is refused with the values it may take."""
    from capes.experiments.cluster_test import load_config as load_cluster
    for text, want in (("true", True), ("false", False), ("auto", "auto")):
        cfg = load_cluster(None, [f"cluster_engine.device_sampling={text}"])
        assert cfg.model.device_sampling == want
    with pytest.raises(ConfigError, match=r"must be true, false or 'auto' \(got 'gpu'\)"):
        load_cluster(None, ["cluster_engine.device_sampling=gpu"])
