"""Hardening, third round (issue 27, items 1, 2, 3 and 11), on real daemon processes:
keys are bound to their node names by default and a bound node belongs to its key
alone; a made-up node's hello never changes what real nodes are sent; nobody without
the token can hold a gRPC worker (reflection off, streams refused before any handler,
large requests refused) so ``capes status`` keeps working; ``is_loopback`` parses the
host strictly; half-sent HTTP requests to ``/metrics`` pin no thread for long and
scrapes keep working; the health service says NOT_SERVING for as long as the replay DB
cannot be written, a restart on a full disk included."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import psutil
import pytest

from capes.common import curve
from capes.common.control_client import ControlClient, TLSCertMissing, tls_certificate
from capes.common.deployment import KeysConfig
from capes.common.metrics import scrape
from daemon_harness import (ROOT, Agent, ControlAgent, DaemonProcess, fill_disk, mount_tmpfs,
                            wait_for, write_config)

PIS = ["cpu", "mem", "disk.sda.read_bps"]


def keys_for(tmp: Path, name: str) -> KeysConfig:
    return KeysConfig(dir=str(tmp / "keys"), client=name)


def keys_cli(tmp: Path, *args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "capes", "keys", "generate", "--dir",
                          str(tmp / "keys"), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def client(tmp: Path, d: DaemonProcess, timeout: float = 5.0) -> ControlClient:
    return ControlClient(d.info["grpc"], curve.load_token(keys_for(tmp, "x")), timeout)


# ----------------------------------------------------------------------- 1. key bindings

def test_keys_generate_binds_each_client_key_to_its_own_node(tmp_path, ctx):
    keys_cli(tmp_path, "--client", "n1", "--client", "n2", "--any-node", "shared")
    clients = tmp_path / "keys" / "clients"
    assert (clients / "n1.nodes").read_text() == "n1\n"
    assert (clients / "shared.nodes").read_text() == "*\n"      # the explicit opt-out
    curve.generate(tmp_path / "keys", ["old"])       # a key made before bindings: unbound
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    try:
        c = client(tmp_path, d)
        # another node's key and an unbound key both try to take n1 first
        intruders = []
        for key in ("n2", "old"):
            intruders.append(Agent(ctx, d.info["ingest"], keys_for(tmp_path, key), None,
                                   "n1", PIS))
            intruders[-1].send(1, [9.0, 9.0, 9.0])
            intruders.append(ControlAgent(ctx, d.info["control"], keys_for(tmp_path, key),
                                          "n1", {"window": 99.0, "rate": 50.0}))
        wait_for(lambda: c.status()["drops"].get("key_not_bound") == 4)
        assert c.nodes() == [] and c.status()["parameters"]["window"] == 10.0
        real = Agent(ctx, d.info["ingest"], keys_for(tmp_path, "n1"), None, "n1", PIS)
        real.send(2, [1.0, 1.0, 1.0])
        ctl = ControlAgent(ctx, d.info["control"], keys_for(tmp_path, "n1"), "n1",
                           {"window": 20.0, "rate": 50.0})
        wait_for(lambda: c.status()["rows_written"] == 1 and c.nodes()
                 and c.nodes()[0].get("control"))
        (n1,) = c.nodes()
        assert n1["name"] == "n1" and n1["key"] == "n1"
        assert c.status()["parameters"]["window"] == 20.0       # the real node's hello
        # the unbound key may still speak for a node no key is bound to
        free = Agent(ctx, d.info["ingest"], keys_for(tmp_path, "old"), None, "n9", PIS)
        free.send(3, [1.0, 1.0, 1.0])
        wait_for(lambda: c.status()["rows_written"] == 2)
        c.close()
    finally:
        assert d.stop() == 0
    assert "client keys bound to no node: old" in d.log.read_text()


def test_a_made_up_node_s_hello_never_changes_what_real_nodes_are_sent(tmp_path, ctx):
    curve.generate(tmp_path / "keys", ["n1", "shared"])
    curve.bind(tmp_path / "keys", "n1", ["n1"])
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    try:
        c = client(tmp_path, d)
        real = ControlAgent(ctx, d.info["control"], keys_for(tmp_path, "n1"), "n1",
                            {"window": 20.0, "rate": 50.0})
        wait_for(lambda: c.status()["parameters"]["window"] == 20.0)
        ghost = ControlAgent(ctx, d.info["control"], keys_for(tmp_path, "shared"),
                             "ghost", {"window": 99.0})
        wait_for(lambda: any(n["name"] == "ghost" for n in c.nodes()))
        assert c.status()["parameters"]["window"] == 20.0
        # actions: 1 = rate+, 2 = rate-, 3 = window+, 4 = window-
        r = c.submit_action(int(time.time() / 0.05), 3, {"window": 21.0, "rate": 50.0})
        assert r["accepted"], r
        a = real.recv()
        assert a is not None and a.values["window"] == 21.0
        assert ghost.recv(500) is not None          # it is sent the values, sets none
        c.close()
    finally:
        assert d.stop() == 0


def test_a_restarted_agent_whose_first_frame_was_lost_is_heard_again(tmp_path, ctx):
    """A new connection starts its sequence numbers afresh: a restarted agent whose
    first (seq 0) frame did not arrive is not refused as out of order until it has
    counted past its predecessor (found by the soak: two minutes of sim0 rows lost)."""
    curve.generate(tmp_path / "keys", ["mon"])
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    try:
        c = client(tmp_path, d)
        old = Agent(ctx, d.info["ingest"], keys_for(tmp_path, "mon"), None, "n1", PIS)
        for t in range(100):
            old.send(t, [float(t), 1.0, 2.0])
        wait_for(lambda: c.status()["rows_written"] == 100)
        old.close()
        new = Agent(ctx, d.info["ingest"], keys_for(tmp_path, "mon"), None, "n1", PIS)
        new.enc.frame(200, [0.0, 1.0, 2.0])              # its first frame, lost
        t = 201
        while c.status()["rows_written"] == 100:
            assert t < 260, c.status()["drops"]
            new.send(t, [float(t), 1.0, 2.0])            # answers FullRequests
            t += 1
            time.sleep(0.02)
        c.close()
    finally:
        assert d.stop() == 0


# ----------------------------------------------------------------------- 2. control plane

def _slow_streams(address: str, n: int) -> tuple[list, list]:
    """``n`` token-less reflection streams and ``n`` token-less health Watch streams,
    each kept open (their request iterators never end); return (calls, channels)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    never = threading.Event()

    def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        never.wait(60)
    calls, channels = [], []
    for _ in range(n):
        ch = grpc.insecure_channel(address)
        channels.append(ch)
        calls.append(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            requests(), timeout=60))
        calls.append(health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60))
    return calls, channels


def _close(calls: list, channels: list) -> None:
    for call in calls:
        call.cancel()
    for ch in channels:
        ch.close()


def _capes_status(tmp: Path, d: DaemonProcess) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capes", "status", "--config",
                           str(tmp / "deploy.toml"), "--grpc", d.info["grpc"],
                           "--engine-metrics", "", "--timeout", "10", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_reflection_when_asked_for_is_served_behind_the_token(tmp_path):
    """``daemon.grpc_reflection = true`` (for grpcurl): the daemon starts and lists its
    services to a caller with the token, and refuses one without it."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from interface_daemon.control_service import TOKEN_HEADER
    curve.generate(tmp_path / "keys", ["mon"])
    d = DaemonProcess(write_config(tmp_path, extra="grpc_reflection = true"),
                      tmp_path / "ready.json")
    try:
        token = curve.load_token(keys_for(tmp_path, "x"))
        with grpc.insecure_channel(d.info["grpc"]) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
            reply = next(iter(stub.ServerReflectionInfo(
                iter(ask), timeout=10, metadata=((TOKEN_HEADER, token),))))
            names = {s.name for s in reply.list_services_response.service}
            assert "grpc.health.v1.Health" in names and any("Control" in n for n in names)
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(stub.ServerReflectionInfo(iter(ask), timeout=10)))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert d.stop() == 0


def test_token_less_streams_cannot_block_capes_status(tmp_path):
    curve.generate(tmp_path / "keys", ["mon"])
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    calls, channels = [], []
    try:
        calls, channels = _slow_streams(d.info["grpc"], 8)
        time.sleep(1.0)                             # let them reach the server
        out = _capes_status(tmp_path, d)
        assert out.returncode == 0, out.stderr
        assert '"rows_written"' in out.stdout
        codes = Counter()
        for call in calls:                          # refused at once, none left open
            try:
                for _ in call:
                    pass
                codes["ended"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
        # every stream refused, none served or left open (a stream held open would end in
        # DEADLINE_EXCEEDED). Which refusal a stream gets depends on timing: the token check
        # (UNAUTHENTICATED, or UNIMPLEMENTED for a method it hides) or, on a loaded host,
        # the per-connection stream bound (UNAVAILABLE: 3 of 16 in one CI run), so only the
        # set of codes is asserted; the token check itself is tested by the reflection test
        assert codes["ended"] == 0 and sum(codes.values()) == 16, codes
        assert set(codes) <= {"UNAUTHENTICATED", "UNIMPLEMENTED", "UNAVAILABLE"}, codes
    finally:
        _close(calls, channels)
        assert d.stop() == 0


def test_token_less_large_requests_are_refused_and_memory_stays_flat(tmp_path):
    curve.generate(tmp_path / "keys", ["mon"])
    d = DaemonProcess(write_config(tmp_path), tmp_path / "ready.json")
    calls, channels = [], []
    try:
        proc = psutil.Process(d.proc.pid)
        calls, channels = _slow_streams(d.info["grpc"], 4)      # the pool blocked, before
        time.sleep(0.5)
        before = proc.memory_info().rss
        ch = grpc.insecure_channel(d.info["grpc"], options=[
            ("grpc.max_send_message_length", 8 << 20)])
        channels.append(ch)
        submit = ch.unary_unary("/capes.v1.ControlPlane/SubmitAction",
                                request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        blob = b"\x0a" + b"\xff" * (4 << 20)
        futures = [submit.future(blob, timeout=20) for _ in range(120)]
        codes = Counter()
        for f in futures:
            try:
                f.result()
                codes["OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
        grown = (proc.memory_info().rss - before) / 2**20
        assert codes == {"RESOURCE_EXHAUSTED": 120}, codes
        assert grown < 100, f"the daemon grew {grown:.0f} MiB"
        out = _capes_status(tmp_path, d)
        assert out.returncode == 0, out.stderr
    finally:
        _close(calls, channels)
        assert d.stop() == 0


@pytest.mark.parametrize("address, loopback", [
    ("127.attacker.example:1", False), ("localhost.attacker.example:1", False),
    ("127.0.0.1.nip.io:1", False), ("[::ffff:127.0.0.1]:1", False),
    ("127.0.0.1:1", True), ("127.9.9.9:1", True), ("LOCALHOST:1", True),
    ("[::1]:1", True), ("ipv4:127.0.0.1:1", True)])
def test_is_loopback_reads_ip_literals_and_localhost_only(address, loopback):
    assert curve.is_loopback(address) is loopback


def test_the_token_never_goes_in_clear_text_to_a_name_that_looks_local(tmp_path):
    """A client told to reach ``127.attacker.example`` needs the certificate (TLS),
    it does not send the token in clear text."""
    curve.generate(tmp_path / "keys", ["mon"])
    keys = KeysConfig(dir=str(tmp_path / "keys"))
    cert = tls_certificate("127.attacker.example:50051", keys)
    assert cert is not None or pytest.fail("no TLS for a routable name")
    with pytest.raises(TLSCertMissing):
        tls_certificate("127.attacker.example:50051", KeysConfig(dir=str(tmp_path / "none")))


# ----------------------------------------------------------------------- 3. /metrics

def _half_sent(address: str, n: int) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    out = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")     # never the blank line
        out.append(s)
    return out


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, BlockingIOError):
        return False


def test_half_sent_metrics_requests_pin_no_threads_and_scrapes_go_on(tmp_path):
    curve.generate(tmp_path / "keys", ["mon"])
    d = DaemonProcess(write_config(tmp_path, extra='metrics = "127.0.0.1:0"'),
                      tmp_path / "ready.json")
    socks: list[socket.socket] = []
    try:
        address = d.info["metrics"].split("//", 1)[1].split("/", 1)[0]
        proc = psutil.Process(d.proc.pid)
        assert scrape(address)["capes_daemon_up"]
        threads = proc.num_threads()
        socks = _half_sent(address, 100)
        # one thread per slot at most (an evicted one may take a moment to end)
        wait_for(lambda: proc.num_threads() <= threads + 16, timeout=5)
        assert scrape(address, timeout=5)["capes_daemon_up"]       # while they hang
        out = _capes_status(tmp_path, d)
        assert out.returncode == 0, out.stderr
        wait_for(lambda: all(_closed_by_peer(s) for s in socks), timeout=10)
        wait_for(lambda: proc.num_threads() <= threads + 1, timeout=5)
        assert scrape(address)["capes_daemon_up"]
    finally:
        for s in socks:
            s.close()
        assert d.stop() == 0


# ----------------------------------------------------------------------- 11. disk full

def test_health_is_not_serving_all_the_time_the_disk_is_full(tmp_path, ctx):
    """A daemon restarted (kill -9) on a full disk cannot begin its session: health
    must stay NOT_SERVING, not flip to SERVING at every empty commit; and come back
    by itself once space returns."""
    curve.generate(tmp_path / "keys", ["mon"])
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "4m")
    d = None
    stop = threading.Event()
    try:
        cfg = write_config(tmp_path, db=disk / "replay.db", extra="max_buffered_rows = 200")
        d = DaemonProcess(cfg, tmp_path / "ready.json")
        c = client(tmp_path, d)
        mon = Agent(ctx, d.info["ingest"], keys_for(tmp_path, "mon"), None, "n1", PIS)
        for t in range(20):
            mon.send(t, [float(t), 1.0, 2.0])
        wait_for(lambda: c.status()["rows_written"] == 20)
        c.close()
        filler = fill_disk(disk)
        d.stop(signal.SIGKILL)
        d = DaemonProcess(cfg, tmp_path / "ready.json")
        c = client(tmp_path, d)
        mon.close()
        mon = Agent(ctx, d.info["ingest"], keys_for(tmp_path, "mon"), None, "n1", PIS)

        def send():
            tick = 1000
            while not stop.is_set():
                mon.send(tick, [float(tick), 1.0, 2.0])
                tick += 1
                time.sleep(0.01)
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for(lambda: c.health() == "NOT_SERVING")
        health = Counter()
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            health[c.health()] += 1
            time.sleep(0.01)
        assert health["SERVING"] == 0 and health["NOT_SERVING"] > 50, health
        filler.unlink()
        wait_for(lambda: c.health() == "SERVING", timeout=10)
        wait_for(lambda: c.status()["rows_written"] > 0)
        stop.set()
        sender.join(5)
        c.close()
        assert d.stop() == 0
        assert "Traceback" not in d.log.read_text()
    finally:
        stop.set()
        if d is not None:
            d.stop()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
