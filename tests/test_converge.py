"""The converge test, small and seeded: the engine must win the game."""
import json
import subprocess
import sys

import pytest

from capes.experiments.converge_test import load_config, run_grid, run_one

FAST = ["game.noise=0.01"]


@pytest.mark.slow
def test_seeded_run_wins_the_default_game():
    """The paper's test: play to the win, and stop there."""
    result = run_one(load_config(None, FAST), seed=0, play_on=False)
    assert result.won
    assert result.ticks == result.first_win_s < 3600
    assert 40 <= result.final_window <= 60 and result.final_rate_limit >= 90


@pytest.mark.slow
def test_played_on_the_engine_holds_the_optimum_and_the_metrics_say_so():
    """Played to the hour, the default preset stays in the band late in the run, and the
    metrics agree with the trace they summarise."""
    result = run_one(load_config(None, FAST), seed=0, keep_trace=True)
    assert result.ticks == 3600 and result.won and result.first_win_s < 3600
    tp = result.trace["true_throughput"]
    late = [abs(x - 100) <= 10 for x in tp[1800:3600]]
    assert abs(result.in_band_late - sum(late) / len(late)) < 0.01
    assert result.in_band_late >= 0.9
    assert result.tp_frac_hour < result.tp_frac_late <= 1.0


def test_same_seed_same_result():
    cfg = load_config(None, FAST + ["game.time_limit_ticks=300"])
    a, b = run_one(cfg, seed=5, keep_trace=True), run_one(cfg, seed=5, keep_trace=True)
    assert (a.won, a.ticks, a.train_steps) == (b.won, b.ticks, b.train_steps)
    assert a.trace["window"] == b.trace["window"]
    assert a.trace["loss"] == b.trace["loss"]


def test_a_game_with_other_constants_converges_without_code_changes():
    other = ["game.peak_window=30", "game.delay_ticks=1", "game.curve_width=12",
             "game.window.max=60", "game.window.default=55", "game.rate_limit.max=300",
             "game.rate_limit.default=150", "game.peak_throughput=250"]
    result = run_one(load_config(None, FAST + other), seed=1)
    assert result.won
    assert 20 <= result.final_window <= 40


def test_grid_report_summarises_every_cell():
    cfg = load_config(None, ["game.time_limit_ticks=200"])
    report = run_grid(cfg, [0.01, 0.5], ["diff"], seeds=2, progress=None)
    assert len(report["cells"]) == 2 and len(report["runs"]) == 4
    for cell in report["cells"]:
        assert cell["runs"] == 2 and 0 <= cell["wins"] <= 2
        assert cell["success_rate"] == cell["wins"] / 2
        assert len(cell["converge_times"]) == cell["wins"]


@pytest.mark.slow
def test_cli_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, "-m", "capes", "converge-test", "--seeds", "1", "--noise", "1%",
         "--reward", "diff", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[1/1] noise=0.01 reward=diff seed=0: won" in proc.stderr   # progress
    report = json.loads(out.read_text())
    assert report["cells"][0]["wins"] == 1 and report["runs"][0]["won"]
    assert png.stat().st_size > 10_000


@pytest.mark.slow
def test_cli_reports_bad_config_clearly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "capes", "converge-test", "--set",
                           "game.noise=-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr and "game.noise" in proc.stderr


def test_tensorboard_scalars_of_a_run(tmp_path):
    """With tensorboard installed, each run writes its per-tick scalars; without, the
    command says what to install (one line, exit 2) before it plays anything."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        proc = subprocess.run([sys.executable, "-m", "capes", "converge-test", "--tensorboard",
                               str(tmp_path / "tb")], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and "tensorboard" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        pytest.skip("tensorboard is not installed (the optional extra)")
    res = run_one(load_config(None, ["game.time_limit_ticks=60"]), seed=0,
                  tensorboard=str(tmp_path / "tb"))
    assert res.ticks == 60
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
