"""``capes train``'s fast path (minibatches drawn on the device, chosen by the device)
and its progress output: the device-drawn batches are the host path's transitions,
training on them lowers the loss, the choice follows the device, and the CLI shows a
bar on a terminal, lines elsewhere, nothing with --quiet, and its steps/s at the end;
--fast/--no-fast force a path, --fast without CUDA is a one-line error, --json has the
figures, and a model trained on any path starts a converge run (--init-model)."""
import io
import json
import re
import sys

import numpy as np
import pytest
import torch

from capes.cli import main as capes_main
from capes.common.progress import Progress
from capes.common.replay_db import ReplayReader
from capes.experiments.offline_training import (DEFAULT_CONFIG, load_training_config,
                                                train_offline)
from drl_engine.device_transitions import DeviceTransitions, use_device_sampling
from drl_engine.engine import Engine
from recorded_game import record_and_merge


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Two seeded converge runs of the default game (300 ticks each), merged."""
    return record_and_merge(tmp_path_factory.mktemp("fastpath"), 300)


def test_device_batches_are_the_host_paths_transitions(merged):
    """Every valid transition of both sessions, gathered on the device, equals what
    Experience assembles on the host for the same (session, tick)."""
    cfg = load_training_config(DEFAULT_CONFIG)
    engine = Engine(cfg.engine, cfg.reward, ReplayReader(merged), device="cpu", seed=3)
    exp = engine.experience
    dev = DeviceTransitions(exp, "cpu", seed=3)
    ticks = dev.ticks.numpy()
    sids, counts = exp.candidates()
    assert len(sids) == 2
    base, seen = 0, 0
    for sid in sids:
        d, data = exp.derived[sid], exp.reader.sessions[sid]
        lost = exp.stack + exp.n_step + exp.shift - 1
        i = np.arange(d.n - lost) + exp.stack - 1
        valid = i[exp._valid(data, d, i)]
        k = np.flatnonzero((ticks >= base) & (ticks < base + d.n))
        assert np.array_equal(ticks[k] - base, valid)          # the same transitions
        host = exp._assemble([(sid, valid)], len(valid))
        got = dev.at(torch.as_tensor(k))
        for f in ("obs", "next_obs", "actions", "rewards", "discounts"):
            np.testing.assert_array_equal(getattr(got, f).numpy(), getattr(host, f), f)
        base += d.n
        seen += len(valid)
    assert dev.count == seen > 0
    b = dev.batch(64)                                           # a draw: full, in range
    assert b.obs.shape == (64, exp.obs_dim) and b.actions.shape == (64,)
    engine.close()


def test_training_on_device_drawn_batches_lowers_the_loss(merged, tmp_path):
    """As far as the host path's does (1-step targets, as test_offline_training's: the
    last 200 of 600 steps at 0.27 of the first 50 on both paths, seed 1)."""
    torch.set_num_threads(1)
    cfg = load_training_config(DEFAULT_CONFIG, ["engine.n_step=1"])
    final = {}
    for sampling in ("device", "host"):
        report = train_offline(merged, tmp_path / "m.pt", steps=600, cfg=cfg, chunk=50,
                               device="cpu", sampling=sampling, seed=1)
        losses = [p["loss"] for p in report.curve]
        assert report.sampling == sampling and report.steps == 600 and not report.cuda_graph
        assert np.isfinite(losses).all() and np.mean(losses[-4:]) < 0.5 * losses[0]
        final[sampling] = np.mean(losses[-4:])
    assert final["device"] < 1.5 * final["host"]


def test_the_fast_path_is_chosen_by_the_device(merged, tmp_path):
    assert use_device_sampling("auto", torch.device("cuda")) is True
    assert use_device_sampling("auto", torch.device("cuda", 1)) is True
    assert use_device_sampling("auto", "cpu") is False
    assert use_device_sampling("device", "cpu") is True        # the ablation, forced
    assert use_device_sampling("host", "cuda") is False
    with pytest.raises(ValueError, match="--sampling"):
        use_device_sampling("gpu", "cpu")
    report = train_offline(merged, tmp_path / "m.pt", steps=20, chunk=10, device="cpu")
    assert report.sampling == "host"                           # auto on the CPU


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    clock = iter(range(100)).__next__
    tty = io.StringIO()
    bar = Progress(100, tty, tty=True, redraw_s=0, clock=clock)
    for step in (10, 50, 100):
        bar.update(step, "loss 0.5")
    bar.close()
    text = tty.getvalue()
    assert text.count("\r[") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "100/100 100%" in text and "ETA" in text
    log = io.StringIO()
    lines = Progress(1000, log, tty=False, lines=4)
    for step in range(50, 1001, 50):
        lines.update(step, "x")
    lines.close()
    assert log.getvalue().splitlines() == [f"step {s:>4}/1000  x" for s in
                                           (250, 500, 750, 1000)]
    quiet = io.StringIO()
    q = Progress(10, quiet, quiet=True, tty=True)
    q.update(10, "x")
    q.close()
    assert quiet.getvalue() == ""


def test_train_cli_reports_progress_path_and_steps_per_s(merged, tmp_path, capsys,
                                                          monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    torch.set_num_threads(1)
    args = ["train", "--replay", str(merged), "--steps", "40", "--chunk", "10",
            "--device", "cpu"]
    assert capes_main(args + ["--out", str(tmp_path / "a.pt")]) == 0
    out = capsys.readouterr()
    assert "step 40/40  loss" in out.err and "\r" not in out.err   # not a terminal
    assert "40 steps on 2 session(s)" in out.out and "steps/s on the plain path (cpu, " \
        "minibatches sampled on the host)" in out.out
    assert capes_main(args + ["--out", str(tmp_path / "b.pt"), "--quiet",
                              "--sampling", "device"]) == 0
    out = capsys.readouterr()
    assert "step " not in out.err and "minibatches drawn on the device" in out.out


def train_cli(merged, tmp_path, name, *extra):
    """``capes train`` on ``merged`` (60 steps in chunks of 20, on the CPU): its return
    code and the --json report (None when it failed)."""
    out = tmp_path / f"{name}.json"
    rc = capes_main(["train", "--replay", str(merged), "--steps", "60", "--chunk", "20",
                     "--out", str(tmp_path / f"{name}.pt"), "--json", str(out), *extra])
    return rc, (json.loads(out.read_text()) if rc == 0 else None)


def test_train_cli_progress_counts_to_the_total_and_json_has_the_figures(
        merged, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    torch.set_num_threads(1)
    rc, doc = train_cli(merged, tmp_path, "a", "--device", "cpu")
    assert rc == 0
    err = capsys.readouterr().err
    steps = [int(m) for m in re.findall(r"^step +(\d+)/60  loss", err, re.M)]
    assert steps == [20, 40, 60]                              # one line a chunk, to 60/60
    assert doc["steps"] == 60 and doc["device"] == "cpu" and doc["path"] == "plain"
    assert doc["sampling"] == "host" and doc["cuda_graph"] is False
    assert doc["wall_s"] > 0 and doc["steps_per_s"] == pytest.approx(60 / doc["wall_s"])
    assert doc["final_loss"] == doc["curve"][-1]["loss"] and np.isfinite(doc["final_loss"])


def test_fast_and_no_fast_force_a_path_and_the_model_is_the_same_kind(
        merged, tmp_path, capsys, monkeypatch):
    """--no-fast is the plain path on any device; on the CPU --sampling device alone is
    drawn there without a graph; the checkpoint's config is the one given either way,
    and each model starts a converge run (``--init-model``)."""
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    torch.set_num_threads(1)
    rc, plain = train_cli(merged, tmp_path, "plain", "--no-fast")
    assert rc == 0 and plain["path"] == "plain" and plain["steps"] == 60
    rc, drawn = train_cli(merged, tmp_path, "drawn", "--device", "cpu", "--sampling", "device")
    assert rc == 0 and drawn["path"] == "device-drawn" and drawn["sampling"] == "device"
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("plain", "drawn"))
    assert a.keys() == b.keys() and a["config"] == b["config"]
    assert a["config"]["cuda_graph"] is True                 # --no-fast did not write it
    capsys.readouterr()
    for name in ("plain", "drawn"):
        assert capes_main(["converge-test", "--init-model", str(tmp_path / f"{name}.pt"),
                           "--set", "game.time_limit_ticks=30", "--seeds", "1",
                           "--device", "cpu", "--quiet"]) == 0
    capsys.readouterr()
    assert capes_main(["converge-test", "--init-model", str(tmp_path / "plain.json"),   # it
                       "--set", "game.time_limit_ticks=30", "--seeds", "1", "--device",  # reads
                       "cpu", "--quiet"]) == 2                                           # it
    assert "not a readable checkpoint" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_forcing_the_fast_path_without_cuda_is_a_one_line_error(merged, tmp_path, capsys,
                                                                 monkeypatch):
    """Exit 2 and a line that says why, before the DB is read (a missing DB is not what
    it complains about), never a traceback; the same for --device cuda or a bad name."""
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    missing = tmp_path / "none.db"
    cases = {("--fast",): "--fast: the fast path runs on a CUDA device and there is none",
             ("--fast", "--device", "cpu"): "--fast with --device cpu",
             ("--device", "cuda"): "--device cuda requested but no CUDA device",
             ("--device", "gpu"): "--device 'gpu': not a device",
             ("--no-fast", "--sampling", "device"): "--no-fast draws minibatches on the host"}
    for extra, message in cases.items():
        for db in (missing, merged):
            rc = capes_main(["train", "--replay", str(db), "--steps", "10",
                             "--out", str(tmp_path / "x.pt"), *extra])
            err = capsys.readouterr().err
            assert rc == 2, extra
            assert err.startswith(f"capes train: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_fast_is_the_default_and_no_fast_the_plain_path(merged, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    for extra, path in (((), "fast"), (("--fast",), "fast"), (("--no-fast",), "plain")):
        rc, doc = train_cli(merged, tmp_path, path, *extra)
        assert rc == 0 and doc["path"] == path and doc["device"].startswith("cuda")
        assert doc["cuda_graph"] is (path == "fast") and np.isfinite(doc["final_loss"])
    assert "on the fast path (cuda" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_auto_takes_the_graphed_device_drawn_path_and_learns(merged, tmp_path):
    """The fast path itself (tools/gpu/check.sh runs this on a lent GPU): chosen by
    ``auto``, replayed as a CUDA graph, every chunk's loss read (the live engine's a
    tick late), and the loss falls as the host path's does there."""
    cfg = load_training_config(DEFAULT_CONFIG, ["engine.n_step=1"])
    final = {}
    for sampling in ("auto", "host"):
        report = train_offline(merged, tmp_path / "m.pt", steps=600, cfg=cfg, chunk=50,
                               device="cuda", sampling=sampling, seed=1)
        losses = [p["loss"] for p in report.curve]
        assert report.cuda_graph and report.steps == 600 and len(losses) == 12
        assert report.sampling == ("device" if sampling == "auto" else "host")
        assert np.isfinite(losses).all() and np.mean(losses[-4:]) < 0.5 * losses[0]
        final[sampling] = np.mean(losses[-4:])
    assert final["auto"] < 1.5 * final["host"]
