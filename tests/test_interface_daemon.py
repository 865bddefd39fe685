"""The interface daemon as a real process on 127.0.0.1: ingest into the replay DB,
hostile input counted and dropped, CURVE admission, checked actions to the right
agents, the gRPC control plane, and crash safety."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import lz4.block
import numpy as np
import pytest
import zmq

from capes.common import curve
from capes.common.control_client import ControlClient, ControlError
from capes.common.deployment import KeysConfig
from capes.common.protocol import PROTOCOL_VERSION, Action, DeltaEncoder, Indicators, encode
from capes.common.replay_db import ReplayReader
from daemon_harness import ROOT, Agent, ControlAgent, DaemonProcess, wait_for, write_config

PIS = ["cpu", "mem", "disk.sda.read_bps"]


@pytest.fixture
def deployment(tmp_path):
    curve.generate(tmp_path / "keys", ["mon", "ctl"])
    return tmp_path


@pytest.fixture
def daemon(deployment):
    d = DaemonProcess(write_config(deployment), deployment / "ready.json")
    try:
        yield d
    finally:
        d.stop()


def keys_for(tmp, name: str) -> KeysConfig:
    return KeysConfig(dir=str(tmp / "keys"), client=name)


def client(tmp, d: DaemonProcess) -> ControlClient:
    return ControlClient(d.info["grpc"], curve.load_token(keys_for(tmp, "x")))


def rows(db) -> dict:
    """{node: {tick: vector}} of every session in the DB, by PI name."""
    out: dict = {}
    with ReplayReader(db) as r:
        for data in r.sessions.values():
            for i in range(data.length):
                for n, node in enumerate(r.layout.node_names):
                    vec = data.pis[i, n]
                    if not np.isnan(vec).all():
                        out.setdefault(node, {})[data.first_tick + i] = dict(
                            zip(r.layout.pi_names, vec.tolist()))
    return out


def test_indicator_streams_become_replay_db_rows(deployment, daemon, ctx):
    a1 = Agent(ctx, daemon.info["ingest"], keys_for(deployment, "mon"), None, "n1", PIS)
    a2 = Agent(ctx, daemon.info["ingest"], keys_for(deployment, "mon"), None, "n2",
               ["mem", "net.eth0.tx_bps"], full_every=4)
    sent1, sent2 = {}, {}
    for t in range(100, 112):
        v1 = [float(t % 3), 1000.0, 0.25 * t]
        v2 = [2000.0 + t, math.nan if t == 105 else 1.5]
        a1.send(t, v1)
        a2.send(t, v2)
        sent1[t], sent2[t] = v1, v2
    c = client(deployment, daemon)
    try:
        wait_for(lambda: c.status()["rows_written"] == 24)
        s = c.status()
        assert s["messages"] == 24 and s["drops"] == {} and s["nodes"] == 2
        assert s["ticks_written"] == 12 and s["latest_tick"] == 111 and s["pis"] == 4
        nodes = {n["name"]: n for n in c.nodes()}
        assert nodes["n1"]["monitor"] and nodes["n1"]["pis"] == 3 and nodes["n1"]["key"] == "mon"
    finally:
        c.close()
    got = rows(deployment / "replay.db")
    for t, v in sent1.items():
        assert [got["n1"][t][k] for k in PIS] == v
        assert math.isnan(got["n1"][t]["net.eth0.tx_bps"])      # n1 has no such PI
    for t, (mem, tx) in sent2.items():
        assert got["n2"][t]["mem"] == mem and math.isnan(got["n2"][t]["cpu"])
        assert got["n2"][t]["net.eth0.tx_bps"] == tx or (math.isnan(tx) and math.isnan(
            got["n2"][t]["net.eth0.tx_bps"]))


def raw_frame(kind: int, body: bytes, claimed: int | None = None) -> bytes:
    size = len(body) if claimed is None else claimed
    head = bytearray([PROTOCOL_VERSION, kind])
    while size >= 0x80:
        head.append((size & 0x7F) | 0x80)
        size >>= 7
    head.append(size)
    return bytes(head) + lz4.block.compress(body, store_size=False)


def test_every_malformed_class_is_counted_and_dropped(deployment, daemon, ctx):
    sock = curve.client_socket(ctx, zmq.DEALER, keys_for(deployment, "mon"))
    sock.connect(daemon.info["ingest"])
    enc = DeltaEncoder("good", PIS)
    f0 = enc.frame(1, [1.0, 2.0, 3.0])
    f1 = enc.frame(2, [1.0, 2.0, 4.0])
    f2 = enc.frame(3, [1.0, 5.0, 4.0])
    stranger = DeltaEncoder("stranger", PIS)
    stranger.frame(1, [0.0, 0.0, 0.0])
    bomb = b"\x00" * 2_000_000
    hostile = {
        "version": [bytes([7]) + f0[1:]],
        "type": [bytes([PROTOCOL_VERSION, 42]) + f0[2:], encode(Action(1, 1, {"w": 1.0}))],
        "truncated": [f0[:2], raw_frame(1, b"\x04go")],
        "oversize": [b"\x01\x01" + b"x" * 70_000, raw_frame(1, bomb)],
        "decompress": [raw_frame(1, bomb, claimed=1000), bytes([1, 1, 50]) + b"\xf0garbage"],
        "malformed": [raw_frame(1, b"\x01n\x00\x00\x07\x00"),      # unknown flag bits
                      [b"two", b"frames"]],
        "unknown_node": [stranger.frame(2, [1.0, 1.0, 1.0])],
        "duplicate": [f1],
        "out_of_order": [encode(Indicators("good", 0, 0, False, {}))],
    }
    sock.send(f0)
    sock.send(f1)
    for reason, blobs in hostile.items():
        for blob in blobs:
            if isinstance(blob, list):
                sock.send_multipart(blob)
            else:
                sock.send(blob)
    sock.send(f2)                                 # the good stream carries on
    c = client(deployment, daemon)
    try:
        expected = {k: len(v) for k, v in hostile.items()}
        wait_for(lambda: c.status()["drops"] == expected and c.status()["rows_written"] == 3)
        assert c.health() == "SERVING"
    finally:
        c.close()
    got = rows(deployment / "replay.db")
    assert set(got) == {"good"} and sorted(got["good"]) == [1, 2, 3]
    assert got["good"][3] == {"cpu": 1.0, "mem": 5.0, "disk.sda.read_bps": 4.0}


def test_peer_without_an_allowed_key_gets_nothing_into_the_db(deployment, daemon, ctx,
                                                              tmp_path_factory):
    other = tmp_path_factory.mktemp("intruder")
    curve.generate(other, ["mon"])                # same name, different key
    (other / "server.key").write_text((deployment / "keys" / "server.key").read_text())
    intruder = Agent(ctx, daemon.info["ingest"], KeysConfig(dir=str(other), client="mon"),
                     None, "evil", PIS)
    plain = ctx.socket(zmq.DEALER)
    plain.linger = 0                      # it never gets through: do not wait for it
    plain.connect(daemon.info["ingest"])
    for t in range(5):
        intruder.send(t, [1.0, 2.0, 3.0])
        plain.send(DeltaEncoder("evil2", PIS).frame(t, [1.0, 2.0, 3.0]))
    honest = Agent(ctx, daemon.info["ingest"], keys_for(deployment, "mon"), None, "n1", PIS)
    honest.send(1, [1.0, 1.0, 1.0])
    c = client(deployment, daemon)
    try:
        wait_for(lambda: c.status()["rows_written"] == 1)
        time.sleep(0.3)
        s = c.status()
        assert s["messages"] == 1 and s["auth_denied"] >= 1
    finally:
        c.close()
        for a in (intruder, honest):
            a.close()
        plain.close()
    assert set(rows(deployment / "replay.db")) == {"n1"}


def test_a_node_is_pinned_to_the_key_that_first_spoke_for_it(deployment, daemon, ctx):
    a = Agent(ctx, daemon.info["ingest"], keys_for(deployment, "mon"), None, "n1", PIS)
    a.send(1, [1.0, 1.0, 1.0])
    b = Agent(ctx, daemon.info["ingest"], keys_for(deployment, "ctl"), None, "n1", PIS)
    b.send(2, [9.0, 9.0, 9.0])
    c = client(deployment, daemon)
    try:
        wait_for(lambda: c.status()["drops"].get("auth") == 1)
    finally:
        c.close()


def test_actions_are_checked_recorded_and_sent_to_their_targets(deployment, daemon, ctx):
    keys = keys_for(deployment, "ctl")
    n1 = ControlAgent(ctx, daemon.info["control"], keys, "n1", {"window": 10.0, "rate": 50.0})
    n2 = ControlAgent(ctx, daemon.info["control"], keys, "n2", {"window": 10.0})
    c = client(deployment, daemon)
    try:
        wait_for(lambda: len(c.nodes()) == 2)
        # actions (parameters in name order): 1 = rate+, 2 = rate-, 3 = window+, 4 = window-
        r = c.submit_action(10, 1, {"rate": 60.0})          # rate targets n1 only
        assert r["accepted"] and r["sent_to"] == 1
        a = n1.recv()
        assert a.seq == r["seq"] and a.values == {"rate": 60.0, "window": 10.0}
        n1.ack(a)
        assert n2.recv(300) is None
        r = c.submit_action(11, 3, {"window": 13.0})        # forbidden
        assert not r["accepted"] and "forbidden" in r["reason"]
        r = c.submit_action(12, 3, {"window": 1000.0})      # out of range
        assert not r["accepted"] and r["values"] == {"rate": 60.0, "window": 10.0}
        assert n1.recv(300) is None and n2.recv(100) is None
        r = c.submit_action(13, 3, {"window": 11.0})
        assert r["accepted"] and r["sent_to"] == 2
        a1, a2 = n1.recv(), n2.recv()
        assert a1.values == {"rate": 60.0, "window": 11.0} and a2.values == {"window": 11.0}
        n1.ack(a1)                                          # n2 does not ack ...
        again = n2.recv(2000)                               # ... and gets it again
        assert again is not None and again.seq == a2.seq and again.values == a2.values
        n2.ack(again)
        s = c.set_tuning(False)
        assert not s["tuning"]
        r = c.submit_action(14, 3, {"window": 12.0})
        assert not r["accepted"] and n1.recv(300) is None
        s = c.status()
        assert s["actions"]["refused_forbidden"] == 1 and s["actions"]["refused_range"] == 1
        assert s["actions"]["acked"] == 3 and s["parameters"] == {"rate": 60.0, "window": 11.0}
        wait_for(lambda: c.status()["commits"] >= 1)
    finally:
        c.close()
    time.sleep(0.2)
    with ReplayReader(deployment / "replay.db") as r:
        data = next(iter(r.sessions.values()))
        order = list(r.layout.param_names)
        recorded = {data.first_tick + i: (int(data.actions[i]), data.after[i].tolist())
                    for i in range(data.length) if data.actions[i] >= 0}
    assert order == ["rate", "window"]
    assert recorded == {10: (1, [60.0, 10.0]), 11: (0, [60.0, 10.0]), 12: (0, [60.0, 10.0]),
                        13: (3, [60.0, 11.0]), 14: (0, [60.0, 11.0])}


def test_control_plane_needs_the_token_and_the_cli_speaks_to_it(deployment, daemon):
    with ControlClient(daemon.info["grpc"], token="wrong") as bad:
        with pytest.raises(ControlError, match="UNAUTHENTICATED"):
            bad.status()
        assert bad.health() == "SERVING"                 # the health check is open
    cfg = deployment / "deploy.toml"
    cli = [sys.executable, "-m", "capes"]
    out = subprocess.run(cli + ["workload-changed", "--config", str(cfg), "--grpc",
                                daemon.info["grpc"]], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(cli + ["status", "--json", "--config", str(cfg), "--grpc",
                                daemon.info["grpc"]], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["workload_epoch"] == 1 and status["tuning"] and status["training"]
    c = client(deployment, daemon)
    try:
        assert not c.set_training(False)["training"]
        assert c.workload_changed()["workload_epoch"] == 2
    finally:
        c.close()


def test_sigkill_loses_no_committed_tick_and_agents_reconnect(deployment, ctx):
    first = DaemonProcess(write_config(deployment), deployment / "ready.json")
    info = first.info
    agent = Agent(ctx, info["ingest"], keys_for(deployment, "mon"), None, "n1", PIS)
    try:
        c = client(deployment, first)
        for t in range(30):
            agent.send(t, [float(t), 1.0, 2.0])
        wait_for(lambda: c.status()["ticks_written"] == 30)
        c.close()
        for t in range(30, 40):                            # in flight when it dies
            agent.send(t, [float(t), 1.0, 2.0])
        first.stop(signal.SIGKILL)
        committed = rows(deployment / "replay.db")["n1"]
        assert set(range(30)) <= set(committed)
        assert all(committed[t]["cpu"] == t for t in committed)
        # same endpoints again: the agent's DEALER reconnects by itself
        again = DaemonProcess(write_config(deployment, ingest=info["ingest"],
                                           control=info["control"]),
                              deployment / "ready2.json")
        try:
            t = 40
            deadline = time.monotonic() + 15
            # frames sent before the full frame are dropped (unknown node), so under load
            # tick 45 itself may be among them: wait for any tick from 45 on
            while max(rows(deployment / "replay.db").get("n1", {0: None})) < 45:
                assert time.monotonic() < deadline, (
                    f"agent did not resynchronise: {client(deployment, again).status()}")
                agent.send(t, [float(t), 1.0, 2.0])
                t += 1
                time.sleep(0.05)
            assert agent.full_requests >= 1
        finally:
            assert again.stop() == 0
        after = rows(deployment / "replay.db")["n1"]
        assert all(after[k] == v for k, v in committed.items())
        assert all(after[t]["cpu"] == t for t in after)
    finally:
        agent.close()
        first.stop()


def test_sigterm_commits_every_row_received(deployment, ctx):
    d = DaemonProcess(write_config(deployment), deployment / "ready.json")
    try:
        agent = Agent(ctx, d.info["ingest"], keys_for(deployment, "mon"), None, "n1", PIS)
        for t in range(20):
            agent.send(t, [float(t), 0.0, 0.0])
        c = client(deployment, d)
        wait_for(lambda: c.status()["messages"] == 20)
        c.close()
        agent.close()
    finally:
        assert d.stop(signal.SIGTERM) == 0
    assert sorted(rows(deployment / "replay.db")["n1"]) == list(range(20))


def test_a_second_daemon_on_the_same_db_is_refused(deployment, daemon):
    out = subprocess.run([sys.executable, "-m", "capes", "interface-daemon", "--config",
                          str(deployment / "deploy.toml")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert "another interface daemon" in out.stderr and str(daemon.proc.pid) in out.stderr


def test_frames_with_a_tick_far_from_the_daemon_clock_are_dropped():
    from interface_daemon.node_streams import Ingest
    ingest = Ingest(tick_seconds=1.0, max_clock_skew_s=60)
    enc = DeltaEncoder("n1", ["a", "b"])
    now = int(time.time())
    assert ingest.handle(enc.frame(now, [1.0, 2.0])).row is not None
    assert ingest.handle(enc.frame(now + 10**9, [1.0, 3.0])).drop == "tick_range"
    assert ingest.handle(enc.frame(3, [1.0, 3.0])).drop == "tick_range"
    assert ingest.latest_tick == now
