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

import pytest
import torch

from capes.common import atomic
from capes.common.replay_db import ReplayReader
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine import engine as engmod
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
    assert engmod.remove_stale_checkpoint_temps(tmp_path / "a1.pt") == [tmp_path / ".a1.pt.x.tmp"]
