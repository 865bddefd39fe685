"""Operator experience (issue 14): Prometheus metrics of the daemon and the engine,
TensorBoard scalars, `capes status` for daemon and engine (also of a running demo via
its work dir), the demo's children dying with it, clean stops, `--log-level` on every
command, `capes replay plot`."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq
from daemon_harness import ROOT, Agent, DaemonProcess, wait_for, write_config

from capes.common import curve
from capes.common.control_client import ControlClient
from capes.common.deployment import DaemonConfig, KeysConfig
from capes.common.metrics import (by_label, one, parse_address, registry_for, scrape,
                                  serve_metrics, tensorboard_available)
from capes.common.replay_db import ReplayWriter, SessionInfo
from capes.common.params import ParameterSpec

CAPES = [sys.executable, "-m", "capes"]
needs_tensorboard = pytest.mark.skipif(not tensorboard_available(),
                                       reason="tensorboard is not installed (optional extra)")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- metrics

def test_metrics_address_is_validated_and_a_busy_port_does_not_stop_the_process():
    assert parse_address("") is None
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:0") == ("::1", 0)
    for bad in ("9464", "host:", "host:99999", "host:port"):
        with pytest.raises(ValueError):
            parse_address(bad)
    cfg = DaemonConfig(metrics="localhost")
    with pytest.raises(ValueError, match="metrics"):
        cfg.validate()
    DaemonConfig(metrics="").validate()
    first = serve_metrics(registry_for([], lambda: {}), "127.0.0.1:0", "test")
    try:
        assert serve_metrics(registry_for([], lambda: {}), first.address, "test") is None
    finally:
        first.close()


def test_daemon_metrics_scraped_over_http_while_it_ingests(tmp_path):
    curve.generate(tmp_path / "keys", ["mon"])
    cfg = write_config(tmp_path, extra='metrics = "127.0.0.1:0"')
    daemon = DaemonProcess(cfg, tmp_path / "ready.json")
    ctx = zmq.Context()
    try:
        url = daemon.info["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        keys = KeysConfig(dir=str(tmp_path / "keys"), client="mon")
        agent = Agent(ctx, daemon.info["ingest"], keys, "mon", "n1", ["throughput", "cpu"])
        control = ControlClient(daemon.info["grpc"], curve.load_token(keys))
        seen = []
        for i in range(60):                       # ingesting while being scraped
            agent.send(100 + i, [float(i), 1.0])
            if i % 20 == 19:
                time.sleep(0.2)
                seen.append(one(scrape(url), "capes_daemon_messages_total"))
        assert seen == sorted(seen) and seen[-1] > seen[0] > 0
        wait_for(lambda: one(scrape(url), "capes_daemon_db_rows_written_total") == 60)
        # action 3 = window + 1 (parameters in name order: rate, window)
        assert control.submit_action(200, 3, {"window": 11.0, "rate": 50.0})["accepted"]
        assert not control.submit_action(201, 3, {"window": 13.0, "rate": 50.0})["accepted"]
        sock = ctx.socket(zmq.DEALER)                                    # no CURVE
        sock.connect(daemon.info["ingest"])
        s = scrape(url)
        assert one(s, "capes_daemon_up") == 1 and one(s, "capes_daemon_db_healthy") == 1
        assert one(s, "capes_daemon_messages_total") == 60
        assert one(s, "capes_daemon_db_commits_total") >= 1
        assert one(s, "capes_daemon_db_commit_seconds_count") >= 1
        assert s["capes_daemon_db_commit_seconds_bucket"][(("le", "+Inf"),)] >= 1
        assert by_label(s, "capes_daemon_node_last_tick", "node") == {"n1": 159}
        assert by_label(s, "capes_daemon_node_last_tick_timestamp_seconds", "node")["n1"] \
            == pytest.approx(159 * 0.05)
        acts = by_label(s, "capes_daemon_actions_total", "event")
        assert acts["submitted"] == 2 and acts["accepted"] == 1 and acts["refused"] == 1
        assert sum(by_label(s, "capes_daemon_actions_refused_total", "reason").values()) == 1
        assert by_label(s, "capes_daemon_parameter_value", "parameter") == {
            "window": 11.0, "rate": 50.0}
        assert one(s, "capes_daemon_tuning") == 1 and one(s, "capes_daemon_session_id") == 1
        sock.close(linger=0)
        control.close()
        agent.close()
    finally:
        ctx.destroy(linger=0)
        assert daemon.stop() == 0
    # a clean stop folds the WAL into the DB and removes the lock file
    assert (tmp_path / "replay.db").exists()
    assert not (tmp_path / "replay.db-wal").exists()
    assert not (tmp_path / "replay.db.lock").exists()


def test_metric_names_are_documented():
    from drl_engine.daemon import ENGINE_METRICS
    from interface_daemon.counters import DAEMON_METRICS
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = [m.name for m in DAEMON_METRICS + ENGINE_METRICS if f"`{m.name}`" not in doc]
    assert not missing, f"docs/metrics.md does not name {missing}"
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    used = set(re.findall(r"capes_[a-z_]+", exprs))
    known = {m.name for m in DAEMON_METRICS + ENGINE_METRICS}
    known |= {f"{m.name}_{s}" for m in DAEMON_METRICS + ENGINE_METRICS
              if m.kind == "histogram" for s in ("bucket", "sum", "count")}
    assert used and used <= known, used - known


# ---------------------------------------------------------------------------- engine

@pytest.mark.slow
def test_engine_metrics_status_file_and_capes_status(tmp_path):
    curve.generate(tmp_path / "keys", ["mon", "engine"])
    cfg = write_config(tmp_path, extra='metrics = ""')
    daemon = DaemonProcess(cfg, tmp_path / "ready.json")
    ctx = zmq.Context()
    engine = None
    metrics = f"127.0.0.1:{free_port()}"
    status_file = tmp_path / "engine.json"
    tb = tmp_path / "tb"
    try:
        keys = KeysConfig(dir=str(tmp_path / "keys"), client="mon")
        agent = Agent(ctx, daemon.info["ingest"], keys, "mon", "n1", ["throughput", "cpu"])
        tick = int(time.time() / 0.05)
        for _ in range(30):
            agent.send(tick, [float(tick % 7), 1.0])
            tick += 1
            time.sleep(0.01)
        engine = subprocess.Popen(
            CAPES + ["drl-engine", "--config", str(cfg), "--set",
                     f"daemon.grpc={daemon.info['grpc']}", "--set", "engine.stack=2",
                     "--set", "keys.client=engine", "--device", "cpu",
                     "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
                     "--status-file", str(status_file), "--metrics", metrics,
                     "--log-every", "0.5"]
            + (["--tensorboard", str(tb)] if tensorboard_available() else []),
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        def engine_metrics():
            try:
                return scrape(metrics)
            except OSError:
                return {}

        deadline = time.monotonic() + 60
        while True:
            assert engine.poll() is None, engine.stderr.read()[-3000:]
            assert time.monotonic() < deadline, engine_metrics()
            agent.send(tick, [float(tick % 7), 1.0])
            tick += 1
            time.sleep(0.05)
            s = engine_metrics()
            if (one(s, "capes_engine_train_steps_total") or 0) >= 5 and \
                    one(s, "capes_engine_q_spread") is not None and \
                    one(s, "capes_engine_checkpoint_age_seconds") is not None:
                break
        assert 0 < one(s, "capes_engine_epsilon") <= 1
        assert one(s, "capes_engine_loss") is not None
        assert one(s, "capes_engine_q_spread") >= 0
        assert one(s, "capes_engine_last_tick_timestamp_seconds") == pytest.approx(
            time.time(), abs=30)
        assert set(by_label(s, "capes_engine_parameter_value", "parameter")) == {"rate",
                                                                                  "window"}
        assert sum(s["capes_engine_decisions_total"].values()) >= 1
        file = json.loads(status_file.read_text())
        assert file["tick_time"].endswith("Z") and file["epsilon"] > 0
        # `capes status` shows the daemon and the engine (from its metrics)
        out = subprocess.run(CAPES + ["status", "--config", str(cfg), "--grpc",
                                      daemon.info["grpc"], "--engine-metrics", metrics],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("daemon ") and "\nengine (metrics " in out.stdout
        assert re.search(r"tick \d+ of the session \(\d{4}-\d\d-\d\dT[\d:]+Z\), ε [01]\.\d+", out.stdout), \
            out.stdout
        out = subprocess.run(CAPES + ["status", "--json", "--config", str(cfg), "--grpc",
                                      daemon.info["grpc"], "--engine-status",
                                      str(status_file)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        doc = json.loads(out.stdout)
        assert doc["ticks_written"] > 0 and doc["engine"]["train_steps"] >= 5
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(20) == 0
        log = engine.stderr.read()
        assert re.search(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ INFO capes.drl_engine: tick \d+ "
                         r"\(\d{4}-", log, re.M), log[-2000:]
        assert "tick None" not in log
        if tensorboard_available():
            from tensorboard.backend.event_processing.event_accumulator import \
                EventAccumulator
            acc = EventAccumulator(str(tb))
            acc.Reload()
            tags = set(acc.Tags()["scalars"])
            assert {"engine/loss", "engine/epsilon", "engine/reward", "engine/q_spread",
                    "parameters/window", "parameters/rate"} <= tags, tags
        agent.close()
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        ctx.destroy(linger=0)
        daemon.stop()


def test_tensorboard_missing_is_one_clear_line(tmp_path):
    if tensorboard_available():
        pytest.skip("tensorboard is installed")
    out = subprocess.run(CAPES + ["drl-engine", "--tensorboard", str(tmp_path / "tb"),
                                  "--set", "daemon.grpc=127.0.0.1:1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "pip install 'capes[tensorboard]'" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------------- demo

def _start_demo(work: Path) -> subprocess.Popen:
    log = open(work.parent / "demo.log", "wb")
    return subprocess.Popen(CAPES + ["demo", "--workdir", str(work), "--timeout", "240",
                                     "--plot", str(work.parent / "demo.png")],
                            cwd=work.parent, stdout=log, stderr=subprocess.STDOUT)


def _demo_children(work: Path, demo: subprocess.Popen, timeout: float = 60) -> dict:
    def ready():
        assert demo.poll() is None, (work.parent / "demo.log").read_text()[-3000:]
        try:
            return json.loads((work / "capes-demo.json").read_text())
        except (OSError, ValueError):
            return None
    return wait_for(ready, timeout=timeout, every=0.2)["children"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_capes_status_workdir_against_a_running_demo_and_a_clean_stop(tmp_path):
    work = tmp_path / "work"
    demo = _start_demo(work)
    try:
        children = _demo_children(work, demo)
        assert set(children) == {"sim-node", "interface-daemon", "monitor-agent",
                                 "control-agent", "drl-engine"}

        def status():
            out = subprocess.run(CAPES + ["status", "--workdir", str(work), "--json"],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=60)
            doc = json.loads(out.stdout) if out.stdout.strip() else {}
            engine = doc.get("engine", {})
            ok = out.returncode == 0 and doc.get("ticks_written", 0) > 20 and \
                engine.get("train_steps", 0) > 0 and engine.get("values")
            return doc if ok else None
        doc = wait_for(status, timeout=90, every=1.0)
        assert doc["nodes"] == 1 and doc["tuning"] and not doc["drops"]
        assert set(doc["parameters"]) == {"window", "rate_limit"}
        engine = doc["engine"]
        assert set(engine["values"]) == {"window", "rate_limit"}
        assert 1 <= engine["values"]["window"] <= 100
        assert engine["tick_time"].endswith("Z") and 0 < engine["epsilon"] <= 1
        text = subprocess.run(CAPES + ["status", "--workdir", str(work)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60).stdout
        assert "latest tick" in text and "ε" in text and "values: rate_limit=" in text
        info = json.loads((work / "capes-demo.json").read_text())
        metrics = scrape(info["daemon_metrics"])
        assert one(metrics, "capes_daemon_messages_total") > 20
        assert by_label(metrics, "capes_daemon_node_applied_value", "parameter")
        # the live line (printed once a second) catches up with the values status shows
        wait_for(lambda: re.search(r"rate limit \d+\s+window \d+",
                                   (tmp_path / "demo.log").read_text()), timeout=30, every=0.2)
        demo.send_signal(signal.SIGINT)          # Ctrl-C: every process stops cleanly
        # 130: stopped by the Ctrl-C; 0: it had won (within seconds) and stopped cleanly
        # by itself first. Either way the checks below are of a clean stop.
        assert demo.wait(60) in (130, 0)
    finally:
        if demo.poll() is None:
            demo.kill()
    log = (tmp_path / "demo.log").read_text()
    assert "processes stopped: 5, all cleanly" in log, log[-3000:]
    assert not [p for p in children.values() if _alive(p)]
    assert (work / "replay.db").exists() and (work / "logs" / "drl-engine.log").exists()
    assert not (work / "replay.db-wal").exists(), sorted(os.listdir(work))
    assert not (work / "replay.db.lock").exists()
    assert (work / "checkpoints" / "engine-latest.pt").exists()
    assert json.loads((work / "capes-demo.json").read_text())["stopped"]
    # the live lines show applied values, in range, never a half-written 0
    shown = re.findall(r"rate limit (\d+)\s+window (\d+)", log)
    assert shown and all(10 <= int(r) <= 200 and 1 <= int(w) <= 100 for r, w in shown)


@pytest.mark.slow
def test_sigkill_of_the_demo_stops_all_its_children_within_5_s(tmp_path):
    work = tmp_path / "work"
    demo = _start_demo(work)
    try:
        children = _demo_children(work, demo)
        time.sleep(1.0)
        assert all(_alive(p) for p in children.values())
        demo.send_signal(signal.SIGKILL)
        demo.wait(10)
        t0 = time.monotonic()
        while any(_alive(p) for p in children.values()) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        left = {n: p for n, p in children.items() if _alive(p)}
    finally:
        for pid in children.values() if "children" in locals() else ():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"still running 5 s after kill -9 of the demo: {left}"


# ---------------------------------------------------------------------------- CLI

MINIMAL_ARGS = {"replay": ["info", "x.db"], "train": ["--replay", "x.db", "--steps", "1",
                                                      "--out", "m.pt"],
                "tuning": ["on"], "training": ["off"], "keys": ["generate"]}


def test_every_command_accepts_log_level_and_log_format(capsys):
    """``--log-level``/``--log-format`` at the end of any command line (also after a
    ``capes replay`` action); a command's own required arguments may still be missing."""
    from capes.cli import COMMANDS, build_parser
    for name in COMMANDS:
        argv = [name, *MINIMAL_ARGS.get(name, []), "--log-level", "debug",
                "--log-format", "json"]
        try:
            args = build_parser(argv).parse_args(argv)
        except SystemExit:
            err = capsys.readouterr().err
            assert "the following arguments are required" in err, (name, err)
            assert "--log-level" not in err.split("error:")[-1], (name, err)
            continue
        assert args.log_level == "DEBUG" and args.log_format == "json", name
    argv = ["replay", "--log-level", "WARNING", "info", "x.db"]
    assert build_parser(argv).parse_args(argv).log_level == "WARNING"


def _synthetic_db(path: Path, ticks: int = 300) -> Path:
    rng = np.random.default_rng(0)
    params = [ParameterSpec(name="rate_limit", min=10, max=200, step=10, default=50),
              ParameterSpec(name="window", min=1, max=100, step=1, default=10)]
    with ReplayWriter(path) as w:
        w.begin_session(SessionInfo(pi_names=["throughput", "window", "rate_limit"],
                                    node_names=["sim0"], params=params,
                                    tick_seconds=0.05, label="synthetic"))
        window, rate = 10.0, 50.0
        for t in range(ticks):
            a = int(rng.integers(5))
            if a == 3:
                window = min(100.0, window + 1)
            elif a == 4:
                window = max(1.0, window - 1)
            tp = 100 * np.exp(-0.5 * ((window - 50) / 20) ** 2) + rng.normal(0, 1)
            w.add_pis(t, 0, [tp, window, rate])
            w.add_action(t, a, [rate, window])
        w.commit()
    return path


def test_replay_plot_writes_a_png(tmp_path):
    db = _synthetic_db(tmp_path / "r.db")
    out = subprocess.run(CAPES + ["replay", "plot", str(db), "-o", str(tmp_path / "r.png"),
                                  "--pis", "window,rate_limit", "--log-level", "WARNING"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "session 1, 300 ticks, 300 actions" in out.stdout
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(CAPES + ["replay", "plot", str(db), "--pis", "nope"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "nope" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_train_says_its_config_and_writes_tensorboard_scalars(tmp_path):
    db = _synthetic_db(tmp_path / "r.db")
    args = ["train", "--replay", str(db), "--steps", "40", "--chunk", "10", "--out",
            str(tmp_path / "m.pt"), "--device", "cpu", "--set", "engine.stack=2"]
    if tensorboard_available():
        args += ["--tensorboard", str(tmp_path / "tb")]
    out = subprocess.run(CAPES + args, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    first = out.stderr.splitlines()[0]
    assert first.startswith("config: ") and first.split()[1].endswith("configs/simulator.toml")
    if tensorboard_available():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 30, 40]


@needs_tensorboard
def test_tensorboard_writer_writes_events(tmp_path):
    from capes.common.metrics import tensorboard_writer
    w = tensorboard_writer(str(tmp_path))
    w.add_scalar("x", 1.0, 0)
    w.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_config_paths_resolve_against_the_config_file(tmp_path):
    from capes.common.deployment import resolve_config_paths
    table = {"keys": {"dir": "keys"}, "daemon": {"db": "/var/lib/capes/r.db"},
             "control": {"state_file": "auto"}, "tick_seconds": 1.0}
    out = resolve_config_paths(table, tmp_path / "etc" / "capes.toml")
    assert out["keys"]["dir"] == str(tmp_path / "etc" / "keys")
    assert out["daemon"]["db"] == "/var/lib/capes/r.db"
    assert out["control"]["state_file"] == "auto" and table["keys"]["dir"] == "keys"


def _unit(path: Path) -> dict[str, list[str]]:
    """key -> values of a systemd unit (continuation lines joined)."""
    out: dict[str, list[str]] = {}
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_systemd_units_restart_run_as_a_user_and_call_real_commands():
    import shlex
    from capes.cli import build_parser
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert {u.name for u in units} == {
        "capes-interface-daemon.service", "capes-drl-engine.service",
        "capes-monitor-agent@.service", "capes-control-agent@.service"}
    for unit in units:
        u = _unit(unit)
        assert u["Restart"] == ["on-failure"] and u["User"], unit.name
        for line in u["ExecStart"] + u.get("ExecStopPost", []):
            argv = shlex.split(line.replace("${CAPES_CONFIG}", "/etc/capes/capes.toml")
                               .replace("%i", "node01"))
            argv = [a for a in argv if not a.startswith("$")]
            assert argv[0].endswith("/capes"), line
            build_parser(argv[1:]).parse_args(argv[1:])      # every option exists
    control = _unit(ROOT / "deploy" / "systemd" / "capes-control-agent@.service")
    assert "restore-defaults" in control["ExecStopPost"][0]
    # after every stop, dry-run ones too: only recorded originals, never the config's guess
    assert "--to-config-default" not in control["ExecStopPost"][0]
