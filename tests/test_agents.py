"""The monitoring and control agents, in process and as real processes talking to a
tiny fake daemon (a ROUTER socket on loopback, CURVE disabled)."""
from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from capes.common import config as cfgmod
from capes.common.config import ConfigError
from capes.common.deployment import DeploymentConfig
from capes.common.protocol import Ack, Action, DeltaDecoder, FullRequest, Indicators, decode, encode
from capes.common.stop_signal import StopSignal
from control_agent.agent import ControlAgent
from monitor_agent.agent import MonitorAgent
from daemon_harness import free_port_below_ephemeral

REPO = Path(__file__).resolve().parent.parent


def knob_dir(tmp_path: Path) -> Path:
    """A simulator node's knob files, at their defaults."""
    d = tmp_path / "node"
    d.mkdir()
    (d / "window").write_text("10\n")
    (d / "rate_limit").write_text("50\n")
    (d / "throughput").write_text("13.5\n")
    return d


def deployment_toml(tmp_path: Path, knobs: Path, port: int, **control) -> Path:
    control.setdefault("state_file", f'"{tmp_path / "control-state.json"}"')
    extra = "".join(f"{k} = {v}\n" for k, v in control.items())
    text = f"""
tick_seconds = 0.05
[keys]
enabled = false
[monitor]
node = "sim1"
daemon = "tcp://127.0.0.1:{port}"
full_frame_every = 1000
collectors = [{{ name = "simulator", options = {{ dir = "{knobs}" }} }},
              {{ name = "timeofday" }}]
[control]
node = "sim1"
daemon = "tcp://127.0.0.1:{port}"
{extra}
[control.appliers.window]
name = "file"
options = {{ path = "{knobs}/window" }}
[control.appliers.rate_limit]
name = "file"
options = {{ path = "{knobs}/rate_limit" }}
[parameters.window]
min = 1
max = 100
step = 1
default = 10
forbidden = [13]
[parameters.rate_limit]
min = 10
max = 200
step = 10
default = 50
"""
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return path


def load(path: Path, *overrides: str) -> DeploymentConfig:
    return cfgmod.load(DeploymentConfig, path, overrides)


@pytest.fixture
def router():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close()
    ctx.term()


def recv(sock: zmq.Socket, timeout: float = 10.0):
    """(identity, decoded message) of the next message, or AssertionError."""
    if not sock.poll(timeout * 1000):
        raise AssertionError("fake daemon: nothing received")
    ident, data = sock.recv_multipart()
    return ident, decode(data)


def recv_until(sock, predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("fake daemon: expected message never came")
        ident, msg = recv(sock, left)
        if predicate(msg):
            return ident, msg


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "capes", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=10)[1]


# ---------------------------------------------------------------- control agent, in process

@pytest.fixture
def control(tmp_path):
    knobs = knob_dir(tmp_path)
    cfg = load(deployment_toml(tmp_path, knobs, 1))
    agent = ControlAgent(cfg)
    yield agent, knobs
    agent.close()


def test_control_agent_applies_checked_absolute_values(control):
    agent, knobs = control
    assert agent.current == {"rate_limit": 50, "window": 10}    # read from the knobs
    ack = agent.handle_action(Action(seq=1, tick=100, values={"window": 50, "rate_limit": 200}))
    assert ack == Ack("sim1", 1, {"window": 50, "rate_limit": 200})
    assert (knobs / "window").read_text() == "50\n"
    assert (knobs / "rate_limit").read_text() == "200\n"


def test_control_agent_refuses_out_of_range_forbidden_and_unknown(control):
    agent, knobs = control
    ack = agent.handle_action(Action(1, 1, {"window": 500, "rate_limit": 5,
                                            "max_rpcs": 8, }))
    ack2 = agent.handle_action(Action(2, 2, {"window": 13, "rate_limit": math.nan}))
    assert (knobs / "window").read_text() == "10\n"
    assert (knobs / "rate_limit").read_text() == "50\n"
    assert ack.values == {"window": 10, "rate_limit": 50}        # what is really in force
    assert ack2.values == {"window": 10, "rate_limit": 50}
    assert agent.counters.refused == {"out of range": 2, "unknown parameter on this node": 1,
                                      "forbidden value": 1, "not a finite number": 1}
    assert agent.counters.applied == 0


def test_control_agent_ignores_old_and_reacks_repeated_actions(control):
    agent, knobs = control
    first = agent.handle_action(Action(5, 1, {"window": 40}))
    assert agent.handle_action(Action(5, 1, {"window": 40})) == first    # re-ack
    assert agent.handle_action(Action(4, 1, {"window": 99})) is None     # older: ignored
    assert (knobs / "window").read_text() == "40\n"
    assert agent.counters.duplicates == 1 and agent.counters.stale == 1
    assert agent.counters.applied == 1


def test_control_agent_dry_run_applies_nothing(tmp_path):
    knobs = knob_dir(tmp_path)
    agent = ControlAgent(load(deployment_toml(tmp_path, knobs, 1)), dry_run=True)
    ack = agent.handle_action(Action(1, 1, {"window": 60}))
    agent.restore_defaults()
    assert (knobs / "window").read_text() == "10\n"
    assert ack.values == {"window": 10}
    agent.close()


def test_control_agent_config_errors_name_the_key(tmp_path):
    knobs = knob_dir(tmp_path)
    path = deployment_toml(tmp_path, knobs, 1)
    with pytest.raises(ConfigError, match="control.appliers.window: file: path: give"):
        ControlAgent(load(path, 'control.appliers.window.name="file"',
                          "control.appliers.window.options={}"))
    cfg = load(path)
    del cfg.control.appliers["window"]
    with pytest.raises(ConfigError, match="control.appliers.window: no applier configured"):
        ControlAgent(cfg)
    with pytest.raises(ConfigError, match="no parameter 'nope'"):
        ControlAgent(load(path, 'control.appliers.nope.name="file"'))
    # a parameter meant for other nodes needs no applier here
    cfg = load(path, 'parameters.window.nodes=["oss1"]')
    del cfg.control.appliers["window"]
    assert list(ControlAgent(cfg).specs) == ["rate_limit"]


def test_restore_defaults_without_an_original_leaves_the_knob_and_says_so(tmp_path):
    """No recorded original: the host's value stays (the config's default is a guess
    about this host); ``--to-config-default`` asks for the guess on purpose."""
    knobs = knob_dir(tmp_path)
    path = deployment_toml(tmp_path, knobs, 1)
    (knobs / "window").write_text("77\n")
    (knobs / "rate_limit").write_text("190\n")

    def restore(*extra):
        return subprocess.run([sys.executable, "-m", "capes", "restore-defaults", "--config",
                               str(path), *extra], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
    done = restore()
    assert done.returncode == 0, done.stderr
    assert (knobs / "window").read_text() == "77\n"
    assert (knobs / "rate_limit").read_text() == "190\n"
    assert "window: left at 77 (no original recorded" in done.stdout
    assert "--to-config-default sets 10" in done.stdout
    done = restore("--to-config-default")
    assert done.returncode == 0, done.stderr
    assert (knobs / "window").read_text() == "10\n"
    assert (knobs / "rate_limit").read_text() == "50\n"
    assert "window = 10 (default)" in done.stdout


# ---------------------------------------------------------------- control agent, as a process

def test_control_agent_process_applies_acks_and_restores_on_sigterm(tmp_path, router):
    sock, port = router
    knobs = knob_dir(tmp_path)
    proc = start("control-agent", "--config", str(deployment_toml(tmp_path, knobs, port)))
    try:
        ident, hello = recv(sock, 20)
        assert hello == Ack("sim1", 0, {"rate_limit": 50, "window": 10})
        sock.send_multipart([ident, encode(Action(1, 7, {"window": 50, "rate_limit": 200}))])
        _, ack = recv_until(sock, lambda m: m.seq == 1)
        assert ack.values == {"window": 50, "rate_limit": 200}
        assert (knobs / "window").read_text() == "50\n"
        sock.send_multipart([ident, encode(Action(2, 8, {"window": 500}))])   # out of range
        _, ack = recv_until(sock, lambda m: m.seq == 2)
        assert ack.values == {"window": 50}
        sock.send_multipart([ident, b"\x01\x03garbage"])                       # hostile bytes
        sock.send_multipart([ident, encode(Action(3, 9, {"window": 50}))])
        recv_until(sock, lambda m: m.seq == 3)          # still serving after the garbage
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert (knobs / "window").read_text() == "10\n"
        assert (knobs / "rate_limit").read_text() == "50\n"
        _, bye = recv_until(sock, lambda m: m.seq == 0 and m.values.get("window") == 10)
        assert bye.values == {"rate_limit": 50, "window": 10}
    finally:
        err = finish(proc)
    assert "refused" in err and "1 bad messages" in err


@pytest.mark.slow
def test_control_agent_process_restores_when_the_daemon_is_gone(tmp_path):
    """A live but quiet daemon is not silence; a daemon gone for restore_after_s is.
    When it comes back, the agent says hello again and applies its actions."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = free_port_below_ephemeral()                # closed and bound again below
    sock.bind(f"tcp://127.0.0.1:{port}")
    knobs = knob_dir(tmp_path)
    proc = start("control-agent", "--config",
                 str(deployment_toml(tmp_path, knobs, port, restore_after_s=0.5)))
    try:
        ident, _ = recv(sock, 20)
        sock.send_multipart([ident, encode(Action(1, 1, {"window": 33}))])
        recv_until(sock, lambda m: m.seq == 1)
        time.sleep(1.0)                               # quiet, but connected
        assert (knobs / "window").read_text() == "33\n"
        sock.close(linger=0)                          # the daemon dies
        t0 = time.monotonic()
        while (knobs / "window").read_text() != "10\n":
            assert time.monotonic() - t0 < 5, "defaults not restored after the daemon left"
            time.sleep(0.05)
        assert time.monotonic() - t0 > 0.3
        assert proc.poll() is None                    # still waiting for a daemon
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{port}")          # a new daemon on the same address
        ident, hello = recv_until(sock, lambda m: m.seq == 0)
        assert hello.values == {"rate_limit": 50, "window": 10}
        sock.send_multipart([ident, encode(Action(1, 2, {"window": 44}))])   # seq anew
        recv_until(sock, lambda m: m.seq == 1)
        assert (knobs / "window").read_text() == "44\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        finish(proc)
        sock.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- monitoring agent

def test_monitor_agent_process_streams_differential_frames(tmp_path, router):
    sock, port = router
    knobs = knob_dir(tmp_path)
    proc = start("monitor-agent", "--config", str(deployment_toml(tmp_path, knobs, port)))
    try:
        ident, first = recv(sock, 20)
        # Frames sent before the TCP connection is up are dropped (never block), so
        # the first one through may have seq > 0, but it is always a full frame.
        assert isinstance(first, Indicators) and first.full
        assert first.names == ["throughput", "window", "rate_limit",
                               "month", "weekday", "hour", "minute"]
        assert abs(first.tick - int(time.time() / 0.05)) <= 10     # wall-clock ticks
        decoder = DeltaDecoder("sim1")
        vector = decoder.apply(first)
        assert vector[:3] == [13.5, 10, 50]
        (knobs / "throughput").write_text("87.25\n")
        _, msg = recv_until(sock, lambda m: 0 in m.values)
        assert not msg.full and set(msg.values) == {0}   # only the PI that changed
        ticks = [first.tick]
        for _ in range(5):
            _, m = recv(sock)
            ticks.append(m.tick)
        assert ticks == sorted(set(ticks))               # one frame per tick, in order
        sock.send_multipart([ident, encode(FullRequest("sim1", "gap"))])
        _, full = recv_until(sock, lambda m: m.full)
        assert full.names is not None and full.values[0] == 87.25
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        finish(proc)


def test_monitor_agent_never_blocks_and_resyncs_after_drops(tmp_path):
    """With no daemon, frames are dropped at once and counted; the first frame that
    gets through afterwards is a full one with names."""
    ctx = zmq.Context()
    # a port with nobody on it (no zmq socket bound and closed first: zmq closes a
    # listener in its I/O thread, after close() returns, and the bind below then raced it)
    port = free_port_below_ephemeral()
    knobs = knob_dir(tmp_path)
    cfg = load(deployment_toml(tmp_path, knobs, port))
    agent = MonitorAgent(cfg, context=ctx)
    daemon = None
    try:
        t0 = time.monotonic()
        assert agent.send_tick(1) is False and agent.send_tick(2) is False
        assert time.monotonic() - t0 < 0.5 and agent.counters.dropped == 2
        daemon = ctx.socket(zmq.ROUTER)
        daemon.bind(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while not agent.send_tick(3):
            assert time.monotonic() < deadline, "agent never reconnected"
            time.sleep(0.05)
        _, msg = recv(daemon)
        assert msg.full and msg.names is not None
    finally:
        agent.close()
        if daemon is not None:
            daemon.close(linger=0)
        ctx.term()


def test_monitor_agent_run_sends_one_frame_per_tick(tmp_path):
    knobs = knob_dir(tmp_path)
    cfg = load(deployment_toml(tmp_path, knobs, 1))
    agent = MonitorAgent(cfg)
    try:
        with StopSignal() as stop:
            t0 = time.monotonic()
            agent.run(stop, max_ticks=3)
            assert agent.counters.ticks == 3
            assert 0.09 < time.monotonic() - t0 < 2     # three 50 ms ticks
    finally:
        agent.close()


def test_duplicate_pi_names_are_a_clear_error(tmp_path):
    knobs = knob_dir(tmp_path)
    cfg = load(deployment_toml(tmp_path, knobs, 1),
               'monitor.collectors=[{name="timeofday"}, {name="timeofday", options={utc=true}}]')
    with pytest.raises(ConfigError, match="'month' is reported by both"):
        MonitorAgent(cfg)
    bad = load(deployment_toml(tmp_path, knobs, 1),
               'monitor.collectors=[{name="timeofday", options={tz="UTC"}}]')
    with pytest.raises(ConfigError, match=r"monitor.collectors\[0\].options"):
        MonitorAgent(bad)


# ---------------------------------------------------------------- the simulator as a node

def test_agents_tune_the_sim_node_like_a_real_node(tmp_path, router):
    """sim-node, monitor-agent and control-agent as processes; the fake daemon reads
    the throughput the monitoring agent streams and sets the knobs through the control
    agent; the throughput it then receives is the peak's."""
    sock, port = router
    node_dir = tmp_path / "node"
    cfg = deployment_toml(tmp_path, node_dir, port)
    procs = [start("sim-node", "--dir", str(node_dir), "--tick-seconds", "0.05",
                   "--keep-running", "--set", "game.noise=0")]
    try:
        deadline = time.monotonic() + 20
        while not (node_dir / "window").exists():
            assert time.monotonic() < deadline, "sim node did not start"
            time.sleep(0.05)
        procs += [start("monitor-agent", "--config", str(cfg)),
                  start("control-agent", "--config", str(cfg))]
        decoder = DeltaDecoder("sim1")
        seen = {"control": None, "throughput": None, "ack": None}

        def daemon_sees(want):
            """Play daemon until ``want(seen)``: rebuild the PI stream, ask for a full
            frame when it cannot, remember the control agent and its latest ack."""
            def step(ident, msg):
                if isinstance(msg, Indicators):
                    vec = decoder.apply(msg)
                    if vec is None:
                        sock.send_multipart([ident, encode(FullRequest("sim1"))])
                    else:
                        seen["throughput"] = vec[0]
                elif isinstance(msg, Ack):
                    seen["control"], seen["ack"] = ident, msg
                return want(seen)
            deadline = time.monotonic() + 20
            while not step(*recv(sock, max(0.1, deadline - time.monotonic()))):
                assert time.monotonic() < deadline, f"daemon never saw it: {seen}"

        daemon_sees(lambda s: s["control"] and s["throughput"] is not None)
        assert seen["throughput"] < 60
        sock.send_multipart([seen["control"], encode(Action(1, 1, {"window": 50,
                                                                 "rate_limit": 200}))])
        daemon_sees(lambda s: s["ack"] is not None and s["ack"].seq == 1)
        assert seen["ack"].values == {"window": 50, "rate_limit": 200}
        daemon_sees(lambda s: s["throughput"] > 99)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=10)
            finish(p)
    assert (node_dir / "window").read_text() == "10\n"     # defaults restored on exit
