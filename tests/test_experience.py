"""Experience across sessions (issue 37): a workload family, ``--experience`` and what it
brings along, its errors, and a recorded workload's return without a search."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capes.common.config import ConfigError
from capes.experiments.converge_test import load_config, run_one
from drl_engine.prior_experience import ExperienceError, PriorExperience, interpolated_best
from storagegamesim.family import WorkloadFamily
from storagegamesim.game import StorageGameSim

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "workload-family.toml"


def member(x: float, ticks: int):
    cfg = load_config(CONFIG)
    return dataclasses.replace(cfg, game=dataclasses.replace(
        cfg.game, write_fraction=x, time_limit_ticks=ticks))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One fresh 600-s session at write fraction 0.3, its replay DB kept."""
    db = tmp_path_factory.mktemp("exp") / "recorded.db"
    run_one(member(0.3, 600), seed=101, db_path=db)
    return db


# ------------------------------------------------------------------ the family
def test_a_members_optimum_and_signature_move_smoothly_with_the_write_fraction():
    fam = WorkloadFamily()
    xs = np.linspace(0, 1, 11)
    members = [fam.workload(x) for x in xs]
    windows = np.array([m.peak_window for m in members])
    assert windows[0] == fam.reader_window and windows[-1] == fam.writer_window
    assert np.allclose(np.diff(windows), np.diff(windows)[0])        # linear: no jumps
    assert [m.read_fraction for m in members] == pytest.approx(1 - xs)
    assert np.all(np.diff([m.request_kb for m in members]) < 0)
    # the game plays the member it is given, and shows its signature in the PIs
    game = StorageGameSim(member(0.6, 100).game, seed=0)
    assert game.active.peak_window == pytest.approx(fam.workload(0.6).peak_window)
    assert game.pis()["read_fraction"] == pytest.approx(0.4)


def test_a_family_without_its_member_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.read_text().replace("write_fraction = 0.35", "write_fraction = 1.5"))
    with pytest.raises(ConfigError, match="write_fraction"):
        load_config(bad)


# ------------------------------------------------------------------ --experience
def test_experience_says_what_it_brought(recorded):
    cfg = member(0.3, 600)
    prior = PriorExperience.load([recorded], cfg.engine, cfg.reward)
    line = prior.summary()
    assert "1 workload known (1 with a best setting) from 1 session, 600 ticks" in line, line
    assert str(recorded) in line and "old" in line
    # its best-known setting is the member's optimum (window 58.5; 123 MB/s, so a rate limit >= 130)
    window = prior.specs[1].min + prior.workloads[0].best[1] * prior.specs[1].step
    assert prior.param_names == ["rate_limit", "window"]
    assert abs(window - 58.5) <= 6


def test_converge_test_logs_its_experience_line(recorded):
    out = subprocess.run(
        [sys.executable, "-m", "capes", "converge-test", "--config", str(CONFIG),
         "--experience", str(recorded), "--quiet", "--set", "game.time_limit_ticks=60"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("experience: ")]
    assert len(lines) == 1 and "1 workload known" in lines[0], out.stderr


@pytest.mark.parametrize("command", ["converge-test", "drl-engine"])
def test_a_bad_experience_db_is_one_clear_error(tmp_path, command):
    not_db = tmp_path / "notes.txt"
    not_db.write_text("not a replay DB\n")
    for path, said in ((tmp_path / "missing.db", "no such file"),
                       (not_db, "not a usable replay DB")):
        out = subprocess.run([sys.executable, "-m", "capes", command, "--experience",
                              str(path)], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and said in lines[0], out.stderr


def test_experience_from_another_target_is_refused(recorded, tmp_path):
    paper = load_config()                       # the paper game: no signature PIs
    prior = PriorExperience.load([recorded], paper.engine, paper.reward)
    with pytest.raises(ExperienceError, match="another target"):
        prior.check_layout(paper.game.pi_names(), list(paper.game.param_specs()))
    out = subprocess.run([sys.executable, "-m", "capes", "converge-test", "--experience",
                          str(recorded)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "another target" in out.stderr, out.stderr


def test_a_network_start_needs_a_trained_network(recorded, tmp_path):
    out = subprocess.run([sys.executable, "-m", "capes", "converge-test", "--config",
                          str(CONFIG), "--experience", str(recorded),
                          "--experience-start", "qnet"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--init-model" in out.stderr, out.stderr


# ------------------------------------------------------------------ the interpolated start
def test_the_interpolated_start_lies_between_enclosing_workloads_and_only_there():
    sd = [np.array([0.1, 0.1])] * 3
    sigs = [np.array([0.0, 1.0]), np.array([3.0, 1.0]), np.array([6.0, 1.0])]
    bests = [np.array([0, 10]), np.array([6, 10]), np.array([9, 4])]
    n_steps = np.array([12, 12])
    # 2/3 of the way from the workload at 3 to the one at 6: per knob 2/3 of the way
    idx, how = interpolated_best(np.array([5.0, 1.0]), sigs, sd, bests, n_steps)
    assert idx.tolist() == [8, 6]
    assert "interpolated between known workloads 2 (nearest) and 1" in how
    # beyond the known ones, or off their line on another signature PI: the nearest's
    for u in (np.array([7.0, 1.0]), np.array([5.0, 2.0])):
        idx, how = interpolated_best(u, sigs, sd, bests, n_steps)
        assert idx.tolist() == [9, 4] and "outside the known ones" in how, (u, how)
    idx, how = interpolated_best(np.array([5.0, 1.0]), sigs[:1], sd[:1], bests[:1], n_steps)
    assert idx.tolist() == [0, 10] and "only known workload" in how


def test_a_new_member_between_two_recorded_starts_near_its_own_optimum(recorded, tmp_path,
                                                                       caplog):
    """Members 0.3 (recorded above) and 0.8 recorded: member 0.55, never seen, walks with
    ``interpolate`` to a window between theirs, near its own optimum (with ``memory``: to
    the nearest's); member 1.0, beyond them, plays exactly as with ``memory``. The log
    says which start it took."""
    caplog.set_level("INFO", logger="capes.engine")
    db8 = tmp_path / "x08.db"
    run_one(member(0.8, 600), seed=102, db_path=db8)
    fam = WorkloadFamily()
    for x, said in ((0.55, "interpolated"), (1.0, "outside the known ones")):
        cfg = member(x, 40)
        runs = {}
        for start in ("interpolate", "memory"):
            prior = PriorExperience.load([recorded, db8], cfg.engine, cfg.reward,
                                         start=start)
            runs[start] = run_one(cfg, seed=3, experience=prior, keep_trace=True)
            if start == "interpolate":
                assert prior.last_start is not None and said in prior.last_start, \
                    prior.last_start
                logged = [r.getMessage() for r in caplog.records
                          if "experience start for a new workload" in r.getMessage()]
                assert logged and said in logged[-1] and "window=" in logged[-1], logged
                spec = prior.specs[1]
                windows = sorted(spec.min + w.best[1] * spec.step for w in prior.workloads
                                 if w.best is not None)
        walked = {k: max(r.trace["window"][:8]) for k, r in runs.items()}  # the walk's end
        if x == 0.55:
            assert windows[0] < walked["interpolate"] < windows[-1], (windows, walked)
            assert abs(walked["interpolate"] - fam.workload(x).peak_window) <= 4, walked
            assert abs(walked["memory"] - fam.workload(x).peak_window) > 8, walked
        else:
            assert list(runs["interpolate"].trace["window"]) == \
                list(runs["memory"].trace["window"])


# ------------------------------------------------------------------ a return
def test_a_recorded_workload_comes_back_to_its_best_setting_without_a_search(recorded):
    """The member recorded earlier runs again: with the experience the engine walks to
    the recorded best setting and is in band within its first minute (the walk, the
    knob delay and the 21-s hold); a fresh engine on the same seed searches first."""
    cfg = member(0.3, 240)
    prior = PriorExperience.load([recorded], cfg.engine, cfg.reward)
    best_window = prior.specs[1].min + prior.workloads[0].best[1] * prior.specs[1].step
    with_exp = run_one(cfg, seed=7, experience=prior, keep_trace=True)
    fresh = run_one(cfg, seed=7, keep_trace=True)
    assert with_exp.first_win_s is not None and with_exp.first_win_s <= 60, with_exp
    # it went straight there: the walk reaches the recorded best within 10 ticks and
    # stays near it (the guarded greedy moves keep within a step of a best-known setting
    # that new ticks may move by a step: 56-59 around 58 here, 58-60 around 59 before
    # the safe probes joined the default)
    window = list(with_exp.trace["window"])
    reached = window.index(best_window) if best_window in window[:10] else None
    assert reached is not None, window[:10]
    assert max(abs(w - best_window) for w in window[reached:40]) <= 2, window[:40]
    assert fresh.first_win_s is None or fresh.first_win_s > with_exp.first_win_s


def test_the_paired_bootstrap_interval_covers_a_shift_and_only_it():
    from capes.common.stats import paired_bootstrap_ci
    rng = np.random.default_rng(0)
    a = rng.exponential(80, 30)                  # skewed, as times to a band are
    med, lo, hi = paired_bootstrap_ci(a, a - 40 + rng.normal(0, 5, 30))
    assert lo < med < hi and lo < -40 < hi and hi < 0
    assert paired_bootstrap_ci(a, a) == (0.0, 0.0, 0.0)
    assert paired_bootstrap_ci([1.0], [2.0]) is None


def test_an_init_model_that_is_no_checkpoint_is_one_line_not_a_traceback(tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_text("not a checkpoint\n")
    out = subprocess.run([sys.executable, "-m", "capes", "converge-test", "--config",
                          str(CONFIG), "--seeds", "1", "--init-model", str(bad)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "not a readable checkpoint" in out.stderr and "Traceback" not in out.stderr
