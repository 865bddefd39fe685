"""Engine checkpoints (issue 12, item 4): a save is fsynced (file and directory), a save
killed mid-write leaves the previous checkpoint loadable, and its temp file is removed
by the next start instead of accumulating (17.8 MB each in the red team's run)."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from capes.common import atomic
from capes.common.replay_db import ReplayReader
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine import checkpoint
from drl_engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def make_engine(db: Path, seed: int = 0) -> Engine:
    eng = Engine(DQNConfig(stack=4, exploration_ticks=100), RewardConfig(pis=["tp"]),
                 ReplayReader(db), device="cpu", seed=seed)
    eng.act(1)                                     # builds the networks
    return eng


def temps(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.parent.iterdir() if p.name.endswith(".tmp"))


def test_a_save_fsyncs_the_file_and_its_directory(tmp_path, make_session, monkeypatch):
    make_session(tmp_path / "r.db", ticks=20)
    eng = make_engine(tmp_path / "r.db")
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ckpt = eng.save(tmp_path / "ckpt" / "engine-latest.pt")
    assert synced == ["file", "dir"]                 # the data, then the rename
    assert temps(ckpt) == []
    make_engine(tmp_path / "r.db").load(ckpt)


SAVER = textwrap.dedent("""
    import sys, torch
    from capes.common.replay_db import ReplayReader
    from drl_engine.config import DQNConfig, RewardConfig
    from drl_engine.engine import Engine
    db, ckpt, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    eng = Engine(DQNConfig(stack=4, exploration_ticks=100), RewardConfig(pis=["tp"]),
                 ReplayReader(db), device="cpu")
    eng.act(1)
    ballast = torch.ones(mb << 18)                  # mb MiB of float32: a slow save
    plain = eng.state_dict
    eng.state_dict = lambda: {**plain(), "ballast": ballast}
    i = 1000
    while True:                                     # save, save, save... until killed
        eng.action_ticks = i
        eng.save(ckpt)
        i += 1
""")


def kill_mid_save(db: Path, ckpt: Path, mb: int = 96, tries: int = 6) -> None:
    """Run a process that saves ``ckpt`` in a loop and SIGKILL it while a temp file
    is being written (seen non-empty just before the kill, and still there after)."""
    script = ckpt.parent / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(tries):
        before = set(temps(ckpt))
        proc = subprocess.Popen([sys.executable, str(script), str(db), str(ckpt), str(mb)],
                                cwd=ROOT, env=env)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                fresh = [p for p in temps(ckpt) if p not in before]
                try:
                    if any(p.stat().st_size > (1 << 20) for p in fresh):
                        break
                except FileNotFoundError:
                    continue
                time.sleep(0.002)
            else:
                pytest.fail("the saver never started writing")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if set(temps(ckpt)) - before:
            return
    pytest.fail("could not kill the saver in the middle of a save")


def test_a_save_killed_mid_write_keeps_the_old_checkpoint_and_the_next_start_cleans_up(
        tmp_path, make_session):
    db = tmp_path / "r.db"
    make_session(db, ticks=20)
    ckpt = tmp_path / "ckpt" / "engine-latest.pt"
    first = make_engine(db)
    first.action_ticks = 7
    first.save(ckpt)

    kill_mid_save(db, ckpt)
    kill_mid_save(db, ckpt)
    left = temps(ckpt)
    # the second saver's first save removed the first one's temp: they never pile up
    assert len(left) == 1 and left[0].stat().st_size > 0, left

    # the checkpoint in place is whole: the first one or a later complete save
    state = torch.load(ckpt, weights_only=True)
    assert state["action_ticks"] == 7 or state["action_ticks"] >= 1000
    # a temp file of the code before atomic_write (engine-latest.ptXXXX.tmp) too
    legacy = ckpt.parent / "engine-latest.ptk2j4x1.tmp"
    legacy.write_bytes(b"\0" * 4096)
    unrelated = ckpt.parent / "notes.tmp"
    unrelated.write_text("keep me")

    # the next start (the engine daemon resumes with load) removes them
    resumed = make_engine(db, seed=1)
    resumed.load(ckpt)
    assert resumed.action_ticks == state["action_ticks"]
    assert temps(ckpt) == [unrelated]


def test_a_save_killed_before_any_checkpoint_exists_is_cleaned_by_the_first_save(
        tmp_path, make_session):
    db = tmp_path / "r.db"
    make_session(db, ticks=20)
    ckpt = tmp_path / "ckpt" / "engine-latest.pt"
    ckpt.parent.mkdir()
    stale = ckpt.parent / ".engine-latest.pt.abc123.tmp"
    stale.write_bytes(b"PK\3\4 half a zip")
    make_engine(db).save(ckpt)
    assert temps(ckpt) == [] and ckpt.exists()


def test_an_unreadable_checkpoint_is_a_clear_error(tmp_path, make_session):
    db = tmp_path / "r.db"
    make_session(db, ticks=20)
    bad = tmp_path / "engine-latest.pt"
    bad.write_bytes(b"PK\3\4 truncated")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        make_engine(db).load(bad)


def test_remove_stale_temps_escapes_the_name_and_keeps_other_files(tmp_path):
    (tmp_path / ".a[1].pt.x.tmp").write_text("stale")
    (tmp_path / ".a1.pt.x.tmp").write_text("another file's temp")
    (tmp_path / "a[1].pt").write_text("the file itself")
    assert [p.name for p in atomic.remove_stale_temps(tmp_path, "a[1].pt")] == [".a[1].pt.x.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a1.pt.x.tmp", "a[1].pt"]
    assert checkpoint.remove_stale_checkpoint_temps(tmp_path / "a1.pt") == [tmp_path / ".a1.pt.x.tmp"]


# -- the controller's state (issue 23, item 3): a restart resumes, it does not start over --
def _game_run(tmp: Path, seed: int = 3):
    """The default preset on the storage game: game, writer, reader, engine, source."""
    from capes.common.replay_db import ReplayWriter, SessionInfo
    from capes.experiments.converge_test import GameSource, load_config
    from storagegamesim.game import PI_NAMES, StorageGameSim
    cfg = load_config(overrides=["game.noise=0.1", "engine.exploration_ticks=400"])
    specs = list(cfg.game.param_specs().values())
    game = StorageGameSim(cfg.game, seed=seed)
    writer = ReplayWriter(tmp / "replay.db")
    session = writer.begin_session(SessionInfo(pi_names=list(PI_NAMES), node_names=["sim0"],
                                               params=specs))
    engine = Engine(cfg.engine, cfg.reward, ReplayReader(tmp / "replay.db"), device="cpu",
                    seed=seed)
    source = GameSource(game, writer, session.id, [s.name for s in specs])
    return cfg, game, writer, engine, source


def test_a_checkpoint_keeps_the_controller_and_the_restarted_engine_acts_the_same(tmp_path):
    """Save mid-session, then continue twice: the engine that ran on, and a new engine
    (a restarted process) that loaded the checkpoint against the same DB and game. Both
    know the same best-known setting, lags, detector, probe and ε, and take the same
    decisions from there: the restart forgot nothing."""
    import copy
    import sqlite3

    from capes.common.replay_db import ReplayWriter
    from drl_engine.loop import run_ticks
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    cfg, game, writer, eng_a, src_a = _game_run(a_dir)
    run_ticks(eng_a, src_a, max_ticks=300)
    guide_a = eng_a.guide
    assert guide_a is not None and guide_a.known.best_idx is not None
    ckpt = eng_a.save(tmp_path / "engine-latest.pt")
    with sqlite3.connect(a_dir / "replay.db") as src, \
            sqlite3.connect(b_dir / "replay.db") as dst:
        src.backup(dst)                             # the DB as the kill left it
    writer_b = ReplayWriter(b_dir / "replay.db")
    writer_b.session = copy.deepcopy(writer.session)   # the daemon's session goes on
    src_b = copy.copy(src_a)
    src_b.game, src_b.writer = copy.deepcopy(src_a.game), writer_b

    eng_b = Engine(cfg.engine, cfg.reward, ReplayReader(b_dir / "replay.db"), device="cpu",
                   seed=999)                                   # another seed: all restored
    eng_b.load(ckpt)
    assert eng_b.guide is not None
    g = eng_b.guide
    assert g.known.best_idx.tolist() == guide_a.known.best_idx.tolist()
    assert g.lags.tolist() == guide_a.lags.tolist()
    assert np.array_equal(g.grid_stats, guide_a.grid_stats)
    assert g.detector.samples == guide_a.detector.samples > 0
    assert g.seen_until == guide_a.seen_until
    assert (g.probe is None) == (guide_a.probe is None)
    assert eng_b.epsilon == eng_a.epsilon < 1.0
    assert eng_b.action_ticks == eng_a.action_ticks

    decisions = {}
    for name, eng, src in (("a", eng_a, src_a), ("b", eng_b, src_b)):
        seen = []
        run_ticks(eng, src, observers=[lambda r: seen.append(
            (r.decision.action, r.decision.explored) if r.decision else None)],
            max_ticks=60)
        src.writer.close()
        decisions[name] = seen
    # the same decisions, probes and greedy moves alike, for the next 30 ticks (later a
    # greedy choice may differ: the replay cache is rebuilt from the DB, so the
    # minibatches the network trains on are not the same draws)
    assert decisions["a"][:30] == decisions["b"][:30]
    assert sum(1 for d in decisions["b"] if d is not None) == 60


def test_a_checkpoint_of_the_engine_before_the_guide_was_kept_still_loads(tmp_path):
    """A checkpoint written before the controller's state was kept (no "guide" entry)
    resumes the networks and counters; the guide starts afresh."""
    cfg, game, writer, eng, src = _game_run(tmp_path)
    from drl_engine.loop import run_ticks
    run_ticks(eng, src, max_ticks=40)
    state = eng.state_dict()
    for key in ("guide", "guide_session", "local_bump", "change_alarms"):
        state.pop(key)
    torch.save(state, tmp_path / "old.pt")
    other = Engine(cfg.engine, cfg.reward, ReplayReader(tmp_path / "replay.db"),
                   device="cpu")
    other.load(tmp_path / "old.pt")
    other.update()
    assert other.action_ticks == eng.action_ticks and other.guide is None
    writer.close()


def test_every_engine_checkpoints_through_one_module_that_refuses_the_others_files(tmp_path):
    """Both engines save and load through ``checkpoint.Checkpoints``: a file is tagged
    with its engine's kind and version, another engine's file is one clear error (not a
    crash half-way through restoring it), and a killed save's temp file goes."""
    from drl_engine.checkpoint import Checkpoints
    flat = Checkpoints("flat", 1, "a flat-engine")
    node = Checkpoints("node_model", 1, "a node-model")
    stale = tmp_path / ".c.pt.abc123.tmp"
    stale.write_bytes(b"PK\3\4 half a zip")
    node.save({"x": 1}, tmp_path / "c.pt")
    assert not stale.exists() and node.load(tmp_path / "c.pt")["x"] == 1
    with pytest.raises(ValueError, match=r"not a flat-engine checkpoint of version 1 "
                                         r"\(found node_model version 1\)"):
        flat.load(tmp_path / "c.pt")
    torch.save({"version": 1, "y": 2}, tmp_path / "old.pt")   # before kinds: the flat one's
    assert flat.load(tmp_path / "old.pt")["y"] == 2
