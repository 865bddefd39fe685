"""The simulator as a node: a real process whose knobs and PIs are files."""
from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capes.common.config import ConfigError
from capes.settings import load_settings
from monitor_agent.collectors import build_collector
from storagegamesim.game import GameConfig
from storagegamesim.node import KNOBS, PI_FILES, SimNode

REPO = Path(__file__).resolve().parent.parent


def start_node(dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "capes", "sim-node", "--dir", str(dir),
                             *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def read_number(path: Path) -> float:
    try:
        text = path.read_text().strip()
        return float(text) if text else math.nan
    except FileNotFoundError:
        return math.nan


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=10)


def test_knob_files_drive_throughput_to_the_peak(tmp_path):
    """Set the knobs as the file applier would; the node's PIs climb to the peak, the
    game is won and the node stops by itself."""
    proc = start_node(tmp_path, "--tick-seconds", "0.02", "--seed", "1",
                      "--set", "game.noise=0.01")
    try:
        wait_for(lambda: read_number(tmp_path / "ticks") >= 3, 20, "the first ticks")
        col = build_collector("simulator", {"dir": str(tmp_path)})
        before = col.collect()
        assert before["window"] == 10 and before["rate_limit"] == 50   # the defaults
        assert before["throughput"] < 50
        (tmp_path / "window").write_text("50\n")
        (tmp_path / "rate_limit").write_text("200\n")
        wait_for(lambda: col.collect()["throughput"] > 90, 10, "throughput near the peak")
        after = col.collect()
        assert after["window"] == 50 and after["rate_limit"] == 200
        assert proc.wait(timeout=10) == 0               # won: stops by itself
        assert read_number(tmp_path / "won") == 1
        assert abs(read_number(tmp_path / "true_throughput") - 100.0) < 1e-6
        assert "won after" in proc.stderr.read()
    finally:
        stop(proc)


def test_sigterm_stops_the_node_at_once(tmp_path):
    proc = start_node(tmp_path, "--tick-seconds", "0.05", "--keep-running")
    try:
        wait_for(lambda: read_number(tmp_path / "ticks") >= 2, 20, "the first ticks")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 2
        assert "stopped after" in proc.stderr.read()
        assert all((tmp_path / f).exists() for f in PI_FILES + KNOBS)
    finally:
        stop(proc)


def test_keep_running_holds_after_a_win(tmp_path):
    cfg = GameConfig(noise=0.0, win_hold_ticks=2, time_limit_ticks=30)
    node = SimNode(tmp_path, cfg, seed=0, keep_running=True)
    (tmp_path / "window").write_text("50")
    (tmp_path / "rate_limit").write_text("200")
    while not node.game.won:
        node.step()
    assert not node.over                      # keeps playing to show the hold
    while not node.over:
        node.step()
    assert node.game.ticks == 30 and read_number(tmp_path / "won") == 1


def test_bad_knob_values_are_ignored_and_counted(tmp_path):
    node = SimNode(tmp_path, GameConfig(noise=0.0), seed=0)
    (tmp_path / "window").write_text("lots\n")
    (tmp_path / "rate_limit").write_text("")      # caught mid-write: unchanged
    node.step()
    assert node.game.window == 10 and node.game.rate_limit == 50
    assert node.bad_knob_values == 1
    (tmp_path / "window").write_text("1000\n")    # out of range: clamped like a real knob
    node.step()
    assert node.game.window == 100
    assert read_number(tmp_path / "ticks") == 2


def test_game_config_comes_from_the_game_table_and_the_whole_file_is_checked(tmp_path):
    toml = tmp_path / "game.toml"
    toml.write_text("[game]\nnoise = 0.1\n[engine]\nstack = 4\n")
    cfg = load_settings(str(toml), ["game.window.default=20"]).game
    assert cfg.noise == 0.1 and cfg.window.default == 20
    with pytest.raises(ConfigError, match="--set noise=0.5: noise: unknown key"):
        load_settings(str(toml), ["noise=0.5"])
    with pytest.raises(ConfigError, match="--set game.nosie=0.5: game.nosie: unknown key"):
        load_settings(None, ["game.nosie=0.5"])
    toml.write_text("[game]\nnoise = 0.1\n[engine]\nstak = 4\n")
    with pytest.raises(ConfigError, match=f"{toml}: engine.stak: unknown key"):
        load_settings(str(toml))
