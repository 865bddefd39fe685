"""Offline training on recorded StorageGameSim experience: the loss falls, and the
checkpoint starts a fresh engine and a converge run."""
import json
import sys

import numpy as np
import pytest
import torch

from capes.cli import main as capes_main
from capes.common.config import ConfigError
from capes.experiments.converge_test import load_config, run_one
from capes.experiments.offline_training import (DEFAULT_CONFIG, NotEnoughExperience, load_training_config,
                                    train_offline)
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
from drl_engine.engine import Engine
from recorded_game import record_and_merge


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two seeded converge runs of the default game (at most 400 ticks each), merged."""
    d = tmp_path_factory.mktemp("recorded")
    record_and_merge(d, 400)
    return d


def test_loss_falls_on_recorded_experience(recorded, tmp_path):
    torch.set_num_threads(1)
    # 1-step targets: n-step returns add n rewards' noise to every target, so within
    # 800 steps their loss falls less (about 0.45-0.67 for n = 5); this test is about
    # the offline loop, not about n
    cfg = load_training_config(DEFAULT_CONFIG, ["engine.n_step=1"])
    report = train_offline(recorded / "merged.db", tmp_path / "m.pt", steps=800,
                           cfg=cfg, chunk=50, device="cpu")
    losses = [p["loss"] for p in report.curve]
    assert report.steps == 800 and len(losses) == 16 and report.sessions == 2
    # TD loss is noisy (the reward is a difference of noisy throughputs), but the last
    # 200 steps lie well below the first 50: about 0.17-0.26 of it over training seeds
    assert np.mean(losses[-4:]) < 0.5 * losses[0]
    assert (tmp_path / "m.pt").exists()


def fresh_engine(db, cfg, seed=7):
    return Engine(cfg.engine, cfg.reward, ReplayReader(db), device="cpu", seed=seed)


def test_checkpoint_loads_into_a_fresh_engine_and_a_converge_run(recorded, tmp_path):
    torch.set_num_threads(1)
    cfg = load_training_config(DEFAULT_CONFIG)
    ckpt = tmp_path / "m.pt"
    train_offline(recorded / "merged.db", ckpt, steps=100, cfg=cfg, device="cpu")
    saved = torch.load(ckpt, weights_only=True)["dqn"]["q"]

    engine = fresh_engine(recorded / "run1.db", cfg)
    untrained = {k: v.clone() for k, v in engine.dqn.learner.q.state_dict().items()}
    engine.load(ckpt, weights_only=True)
    for name, tensor in engine.dqn.learner.q.state_dict().items():
        torch.testing.assert_close(tensor, saved[name])
        assert not torch.equal(tensor, untrained[name])
    assert engine.train_steps == 0          # weights only: counters start afresh

    game = load_config(DEFAULT_CONFIG, ["game.time_limit_ticks=40"])
    result = run_one(game, seed=5, init_model=str(ckpt))
    assert result.ticks == 40 and result.train_steps > 0


def test_checkpoint_of_another_layout_is_refused(recorded, tmp_path):
    cfg = load_training_config(DEFAULT_CONFIG)
    ckpt = tmp_path / "m.pt"
    train_offline(recorded / "run0.db", ckpt, steps=10, cfg=cfg, device="cpu")
    other = tmp_path / "other.db"
    game = load_config(DEFAULT_CONFIG).game
    with ReplayWriter(other) as w:
        w.begin_session(SessionInfo(pi_names=["throughput", "window"], node_names=["sim0"],
                                    params=list(game.param_specs().values())))
        w.add_pis(0, 0, [1.0, 2.0])
    with pytest.raises(ValueError, match="another layout"):
        fresh_engine(other, cfg).load(ckpt, weights_only=True)


def test_too_little_experience_is_a_clear_error(tmp_path):
    db = tmp_path / "short.db"
    game = load_config(DEFAULT_CONFIG, ["game.time_limit_ticks=5"])
    run_one(game, seed=0, db_path=db)
    with pytest.raises(NotEnoughExperience, match="too few usable transitions"):
        train_offline(db, tmp_path / "m.pt", steps=10, device="cpu")
    assert not (tmp_path / "m.pt").exists()


def test_config_takes_engine_and_reward_and_checks_the_whole_file():
    cfg = load_training_config(DEFAULT_CONFIG, ["engine.gamma=0.5", 'reward.type="diff_avg"'],
                               preset="paper")
    assert (cfg.engine.gamma, cfg.reward.type, cfg.engine.preset) == (0.5, "diff_avg", "paper")
    assert cfg.engine.double_dqn is False                   # the paper preset's value
    with pytest.raises(ConfigError, match="game.noise: must be >= 0"):
        load_training_config(DEFAULT_CONFIG, ["game.noise=-0.5"])
    with pytest.raises(ConfigError, match="engine.gamma"):
        load_training_config(DEFAULT_CONFIG, ["engine.gamma=2"])


def test_train_cli_writes_checkpoint_plot_and_json(recorded, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    torch.set_num_threads(1)
    out = tmp_path / "m.pt"
    rc = capes_main(["train", "--replay", str(recorded / "run0.db"), "--steps", "60",
                     "--chunk", "20", "--out", str(out), "--device", "cpu",
                     "--plot", str(tmp_path / "loss.png"), "--json", str(tmp_path / "t.json")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "step 60/60" in err and "steps/s" in err
    assert out.exists() and (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [p["step"] for p in doc["curve"]] == [20, 40, 60]
    assert capes_main(["train", "--replay", str(tmp_path / "none.db"), "--steps", "5",
                       "--out", str(tmp_path / "x.pt")]) == 1
    assert "no such replay DB" in capsys.readouterr().err
