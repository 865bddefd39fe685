"""A user's first real host (issue 36): the README's walk-through commands, run as
written, let this host's agents be heard; a key bound to the wrong node is named in the
daemon's log and told to its agent; the engine says once that the daemon is away; a
dry-run session's replay DB holds only the values that were in effect."""
from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capes.common.control_client import ControlClient, ControlError
from capes.common.deployment import KeysConfig, MonitorConfig
from capes.common.protocol import REFUSED, decode
from daemon_harness import ROOT, Agent, DaemonProcess, wait_for, write_config

PIS = ["cpu", "mem", "disk.sda.read_bps"]
WALKTHROUGH = "## Tune one real host"


def walkthrough_text(readme: Path = ROOT / "README.md") -> str:
    """The README's walk-through section."""
    text = readme.read_text()
    start = text.index(WALKTHROUGH)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def walkthrough_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """The shell commands of the README's walk-through section, one a line, in order
    (comments stripped): the tests run these, so the README and the tests stay in step."""
    section = walkthrough_text(readme)
    out = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def command(prefix: str) -> list[str]:
    """The walk-through's one command starting with ``prefix``, as argv."""
    found = [c for c in walkthrough_commands() if c.startswith(prefix)]
    assert len(found) == 1, f"README walk-through: {len(found)} commands start {prefix!r}"
    return shlex.split(found[0])


def client(tmp: Path, d: DaemonProcess) -> ControlClient:
    from capes.common import curve
    return ControlClient(d.info["grpc"], curve.load_token(KeysConfig(dir=str(tmp / "keys"))))


def test_the_readme_key_command_lets_this_hosts_agents_be_heard(tmp_path, ctx):
    """Keys made by the README's own command: the monitoring agent speaking as this
    host (its default node name) is heard, nothing is dropped as key_not_bound; the
    same key speaking for another node is refused, named in the daemon's log within
    10 s, and its agent is told."""
    argv = command("capes keys generate")
    argv[argv.index("--dir") + 1] = str(tmp_path / "keys")
    done = subprocess.run([sys.executable, "-m", "capes", *argv[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    host = MonitorConfig().node                   # the name the agents speak as
    assert f"key 'monitor' speaks for node {host!r}" in done.stdout, done.stdout
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    try:
        c = client(tmp_path, d)
        keys = KeysConfig(dir=str(tmp_path / "keys"), client="monitor")
        agent = Agent(ctx, d.info["ingest"], keys, None, host, PIS)
        for tick in range(1, 4):
            agent.send(tick, [1.0, 2.0, float(tick)])
        wait_for(lambda: c.status()["rows_written"] >= 3)
        assert [n["name"] for n in c.nodes()] == [host]
        assert "key_not_bound" not in c.status()["drops"]
        t0 = time.monotonic()
        wrong = Agent(ctx, d.info["ingest"], keys, None, "elsewhere", PIS)
        wrong.send(1, [1.0, 2.0, 3.0])
        wait_for(lambda: "refused messages from key 'monitor' speaking for node "
                         "'elsewhere'" in d.log.read_text(), timeout=10)
        assert time.monotonic() - t0 < 10
        assert "--bind monitor=elsewhere" in d.log.read_text()
        assert wrong.sock.poll(5000), "the refused agent was told nothing"
        told = decode(wrong.sock.recv())
        assert told.reason.startswith(REFUSED) and "'elsewhere'" in told.reason
        for tick in range(2, 30):                     # rate-limited: named once a minute
            wrong.send(tick, [1.0, 2.0, 3.0])
        wait_for(lambda: c.status()["drops"].get("key_not_bound", 0) >= 29)
        assert d.log.read_text().count("refused messages from key") == 1
        assert wrong.full_requests == 0                # and told once, too
        c.close()
    finally:
        d.stop()


def test_the_monitor_agent_warns_when_the_daemon_refuses_its_frames(tmp_path, caplog):
    from capes.common.protocol import FullRequest, encode
    from monitor_agent.agent import MonitorAgent, MonitorCounters

    class Sock:
        def __init__(self, msgs):
            self.msgs = msgs

        def recv(self, flags=0):
            import zmq
            if not self.msgs:
                raise zmq.Again()
            return self.msgs.pop(0)

    agent = MonitorAgent.__new__(MonitorAgent)     # its socket replaced by a stub
    from capes.common.deployment import DeploymentConfig
    agent.cfg = DeploymentConfig()
    agent.mon = agent.cfg.monitor
    agent.sock = Sock([encode(FullRequest(agent.mon.node, f"{REFUSED} node 'x' is not "
                                                          "this key's"))])
    agent.counters = MonitorCounters()
    with caplog.at_level(logging.WARNING, logger="capes.monitor_agent"):
        agent.handle_incoming()
    assert "the daemon refuses this agent's frames" in caplog.text
    assert agent.counters.full_requests == 0


def test_the_engine_says_once_that_the_daemon_is_away_and_once_that_it_is_back(caplog):
    from drl_engine.daemon import LiveSource

    class Client:
        away = True

        def status(self):
            if self.away:
                raise ControlError("interface daemon unreachable at 127.0.0.1:1")
            return {"workload_epoch": 0, "parameters": {}, "session_id": 1,
                    "tuning": True, "training": True}

    class Engine:
        def param_names(self):
            return []

    c = Client()
    source = LiveSource(c, Engine())
    with caplog.at_level(logging.INFO, logger="capes.drl_engine"):
        for _ in range(30):                           # 30 ticks with the daemon down
            assert source.observe().session is None
        c.away = False
        source.observe()
        source.observe()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert sum("daemon is away" in m for m in lines) == 1, lines
    assert sum("daemon is back" in m for m in lines) == 1, lines


def test_a_dry_run_session_records_only_the_values_in_effect(tmp_path, ctx):
    """A --dry-run control agent on file-backed knobs: every action row of the replay DB
    holds the files' values (NULL actions), never the engine's proposals; the agent
    still logs what it would set, and the files never change."""
    import signal
    import sqlite3

    import numpy as np

    from capes.common import curve
    from capes.common.replay_db import read_sessions
    from daemon_harness import PARAMS
    curve.generate(tmp_path / "keys", ["ctl"])
    curve.bind(tmp_path / "keys", "ctl", ["n1"])
    knobs = tmp_path / "knobs"
    knobs.mkdir()
    (knobs / "window").write_text("37\n")
    (knobs / "rate").write_text("190\n")
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(f"""
tick_seconds = 0.05
[keys]
dir = "{tmp_path / 'keys'}"
client = "ctl"
[control]
node = "n1"
daemon = "{d.info['control']}"
state_file = "{tmp_path / 'control-state.json'}"
[control.appliers.window]
name = "file"
options = {{ path = "{knobs / 'window'}" }}
[control.appliers.rate]
name = "file"
options = {{ path = "{knobs / 'rate'}" }}
{PARAMS}
""")
    log = tmp_path / "agent.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "capes", "control-agent", "--config",
                                 str(agent_toml), "--dry-run", "--log-level", "INFO"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    c = client(tmp_path, d)
    try:
        # the hello's values (the files') are the daemon's values in effect
        wait_for(lambda: c.status()["parameters"] == {"window": 37.0, "rate": 190.0}, 20)
        for tick in range(1, 21):      # action 3 = window + 1 (parameters in name order)
            now = c.status()["parameters"]["window"]
            r = c.submit_action(tick, 3, {"window": now + 1})
            assert not r["accepted"] and "dry run" in r["reason"], r
            assert r["values"] == {"window": 37.0, "rate": 190.0}
        wait_for(lambda: "dry run: would set window = 38" in log.read_text())
        s = c.status()
        assert s["actions"]["dry_run"] == 20 and s["actions"].get("ack_mismatch", 0) == 0
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        d.stop()
    assert (knobs / "window").read_text() == "37\n" and (knobs / "rate").read_text() == "190\n"
    conn = sqlite3.connect(tmp_path / "replay.db")
    names = [p.name for p in read_sessions(conn)[0].params]
    rows = conn.execute("SELECT action, vals FROM actions").fetchall()
    conn.close()
    assert len(rows) == 20
    for action, vals in rows:
        assert action == 0
        assert dict(zip(names, np.frombuffer(vals, "<f4").tolist())) == \
            {"window": 37.0, "rate": 190.0}


@pytest.mark.parametrize("recorded", [True, False])
def test_replay_plot_finds_the_objective_the_daemon_recorded(tmp_path, recorded):
    """``capes replay plot DB`` needs no --config: the daemon keeps the session's
    [reward] in its provenance, and the plot takes the objective from there."""
    from capes.common.params import ParameterSpec
    from capes.common.replay_db import ReplayWriter, SessionInfo
    from capes.experiments.replay_plot import plot_session
    prov = {"reward": {"objective": "throughput", "pis": ["app_bytes_s"],
                       "type": "diff_avg", "options": {"window": 5}}} if recorded else {}
    with ReplayWriter(tmp_path / "r.db") as w:
        w.begin_session(SessionInfo(pi_names=["app_bytes_s", "cpu"], node_names=["h"],
                                    params=[ParameterSpec(name="ra", min=128, max=4096,
                                                          step=128, default=128)],
                                    tick_seconds=1.0, provenance=prov))
        for t in range(40):
            w.add_pis(t, 0, [1e6 * (1 + t % 7), 0.5])
            w.add_action(t, 0, [128.0])
        w.commit()
    report = plot_session(tmp_path / "r.db", tmp_path / "r.png")
    assert (tmp_path / "r.png").exists()
    if recorded:
        assert report.note == ""                       # the objective panel is drawn
    else:
        assert "no objective/reward panel" in report.note     # the default's PI is absent


def test_the_daemon_records_the_reward_table_with_the_session(tmp_path):
    from interface_daemon.daemon import _reward_table
    from capes.common.deployment import DeploymentConfig
    cfg = DeploymentConfig()
    cfg.reward = {"objective": "throughput", "pis": ["x"]}
    assert _reward_table(cfg) == {"reward": {"objective": "throughput", "pis": ["x"]}}
    cfg.reward = {}
    assert _reward_table(cfg) == {}


def test_the_converge_plot_draws_a_loss_recorded_every_third_tick(tmp_path, monkeypatch):
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from capes.experiments.plots import plot_converge
    monkeypatch.setattr(plt, "close", lambda fig=None: None)     # keep it to look at
    n = 30
    trace = {"true_throughput": [1.0] * n, "window": [10] * n, "rate_limit": [50] * n,
             "epsilon": [1.0] * n, "loss": [None, None, 0.5] * (n // 3)}
    report = {"runs": [{"trace": trace, "noise": 0.01, "reward": "diff", "seed": 0}],
              "cells": [{"noise": 0.01, "reward": "diff", "converge_times": [12], "wins": 1,
                         "runs": 1, "median_ci95": None}],
              "preset": "default", "seeds_per_cell": 1}
    plot_converge(report, tmp_path / "c.png")
    fig = plt.gcf()
    x, y = fig.axes[3].lines[0].get_data()                # the loss panel
    assert list(x) == list(range(2, n, 3)) and all(math.isfinite(v) for v in y)
    plt.close(fig)


def test_the_demo_does_not_call_its_own_stop_a_failure():
    import signal

    from capes.experiments.demo import exit_report
    line = exit_report({"interface-daemon": 0, "sim-node": -signal.SIGTERM,
                        "drl-engine": -signal.SIGTERM, "control-agent": 0})
    assert line == "processes stopped: 4, all cleanly; 2 stopped while still starting"
    line = exit_report({"interface-daemon": 1, "sim-node": -signal.SIGKILL})
    assert "non-zero exits: {'interface-daemon': 1, 'sim-node': -9}" in line


def test_status_shows_the_tick_of_the_session_as_the_demo_does(tmp_path):
    from capes.commands.status import format_engine, format_status, session_start_tick
    from capes.common.params import ParameterSpec
    from capes.common.replay_db import ReplayWriter, SessionInfo
    with ReplayWriter(tmp_path / "r.db") as w:
        info = w.begin_session(SessionInfo(pi_names=["tp"], node_names=["sim"],
                                           params=[ParameterSpec(name="w", min=1, max=9,
                                                                 step=1, default=5)],
                                           tick_seconds=0.05))
    start = int(info.started_at // 0.05)
    s = {"session_id": info.id, "db_path": str(tmp_path / "r.db"), "latest_tick": start + 35,
         "tick_seconds": 0.05, "drops": {}, "actions": {}, "parameters": {}, "tuning": True,
         "training": True, "workload_epoch": 0, "uptime_s": 3, "session_uuid": "u",
         "nodes": 1, "pis": 1, "messages": 1, "bytes": 1, "rows_written": 1,
         "ticks_written": 1, "commits": 1, "full_requests": 0, "auth_denied": 0}
    s["session_start_tick"] = session_start_tick(s["db_path"], s["session_id"])
    assert s["session_start_tick"] == start == session_start_tick(s["db_path"])   # newest
    assert "latest tick 35 of the session (" in format_status(s)
    assert format_engine({"tick": start + 30}, start).startswith("tick 30 of the session")
    assert session_start_tick(str(tmp_path / "elsewhere.db"), 1) is None   # another host's


def test_each_commands_set_example_is_a_key_that_loads():
    """Every command's ``--set`` help gives an example of its own, and each one loads."""
    from capes.cli import SET_EXAMPLES, build_parser
    from capes.settings import load_settings
    seen = set()
    for command, example in SET_EXAMPLES.items():
        parser = build_parser([command])
        sub = next(a for a in parser._subparsers._group_actions).choices[command]
        text = sub.format_help()
        assert f"--set {example}" in " ".join(text.split()), command
        default = next((a.default for a in sub._actions if a.dest == "config"), None)
        load_settings(default, [example])                   # a real key, a valid value
        seen.add(example)
    assert len(seen) >= 8


def test_a_typo_in_a_config_key_gets_a_did_you_mean_not_every_key():
    from capes.common.config import ConfigError
    from capes.settings import load_settings
    with pytest.raises(ConfigError) as exc:
        load_settings(None, ["engine.gama=0.9"])
    assert str(exc.value).endswith("engine.gama: unknown key (did you mean gamma?)")
    with pytest.raises(ConfigError) as exc:
        load_settings(None, ["engine.zzzzzz=1"])
    assert "none of this table's" in str(exc.value) and "learning_rate" not in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_settings(None, ["keys.zzzzzz=1"])                 # a small table: listed
    assert "known: " in str(exc.value) and "client" in str(exc.value)


def test_config_list_says_what_each_config_is_for_in_whole_words():
    from capes.commands.config import _first_line
    from capes.common import shipped_configs as shipped
    for name in shipped.config_names():
        text = _first_line(shipped.config_path(name))
        assert "…" not in text and len(text) <= 90, (name, text)
        assert not re.search(r"\b(issue|seed|session|round) \d", text), (name, text)


def test_evaluate_workload_help_lists_every_shipped_job():
    from capes.cli import build_parser
    from capes.experiments.workload_driver import available_workloads
    sub = next(a for a in build_parser(["evaluate"])._subparsers._group_actions)
    text = " ".join(sub.choices["evaluate"].format_help().split())
    assert len(available_workloads()) >= 10
    for job in available_workloads():
        assert re.search(rf"\b{re.escape(job)}\b", text), job


@pytest.mark.parametrize("value, text", [
    (896200.0, "896200"), (-65740.0, "-65740"), (0.1392, "0.1392"), (1.2e-05, "0.000012"),
    (4194304.0, "4194304"), (1e6, "1000000"), (0.0, "0"), (None, "-"), (2.5, "2.5")])
def test_user_figures_have_no_e_notation(value, text):
    from capes.common.metrics import fmt
    from capes.common.params import ParameterSpec
    assert fmt(value) == text
    if value is not None and value == int(value) and value >= 0:
        spec = ParameterSpec(name="dirty_bytes", min=0, max=1 << 32, step=1, default=0)
        assert spec.describe(value) == text                  # a knob's value in a log


def test_a_control_agent_the_daemon_never_answers_warns_once(tmp_path, caplog, monkeypatch):
    """Connected, and not a word back (the daemon refuses its key, or nothing tunes):
    the agent says so once, naming its key and node, instead of waiting in silence."""
    import threading

    import zmq

    from capes.common.stop_signal import StopSignal
    from control_agent.agent import ControlAgent
    from test_agents import deployment_toml, knob_dir, load
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = load(deployment_toml(tmp_path, knob_dir(tmp_path), port))
        monkeypatch.setattr(ControlAgent, "QUIET_WARN_S", 0.5)
        agent = ControlAgent(cfg)
        stop = StopSignal()
        timer = threading.Timer(3.0, stop.set)
        timer.start()
        with caplog.at_level(logging.WARNING, logger="capes.control_agent"):
            agent.run(stop)
        agent.close()
    finally:
        sock.close()
        ctx.term()
    said = [r.getMessage() for r in caplog.records if "has sent nothing" in r.getMessage()]
    assert len(said) == 1 and "node 'sim1'" in said[0], said
