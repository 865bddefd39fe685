"""Test helpers: an interface daemon as a real process on 127.0.0.1, and a synthetic
monitoring agent / control agent speaking the wire protocol."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from capes.common import curve
from capes.common.protocol import Ack, Action, DeltaEncoder, FullRequest, decode, encode

ROOT = Path(__file__).resolve().parents[1]

PARAMS = """
[parameters.window]
min = 1
max = 100
step = 1
default = 10
forbidden = [13]

[parameters.rate]
min = 10
max = 200
step = 10
default = 50
nodes = ["n1"]
"""


def write_config(tmp: Path, keys: bool = True, ingest: str = "tcp://127.0.0.1:0",
                 control: str = "tcp://127.0.0.1:0", grpc: str = "127.0.0.1:0",
                 extra: str = "", max_clock_skew_s: float = 1e10,
                 commit_every_s: float = 0.1, db: Path | None = None) -> Path:
    """A deployment file for a daemon on 127.0.0.1. The default skew (317 years) lets
    tests use small made-up ticks; pass a realistic one to test the clock rule."""
    cfg = tmp / "deploy.toml"
    cfg.write_text(f"""
tick_seconds = 0.05
[keys]
dir = "{tmp / 'keys'}"
enabled = {'true' if keys else 'false'}
[daemon]
ingest = "{ingest}"
control = "{control}"
grpc = "{grpc}"
db = "{db or tmp / 'replay.db'}"
commit_every_s = {commit_every_s}
ack_timeout_s = 0.3
full_request_every_s = 0.05
max_clock_skew_s = {max_clock_skew_s}
{extra}
{PARAMS}
""")
    return cfg


class DaemonProcess:
    """``capes interface-daemon`` started as a subprocess; always stop() it."""

    def __init__(self, config: Path, ready: Path):
        self.ready_file = ready
        if ready.exists():
            ready.unlink()
        self.log = ready.with_suffix(".log")
        with open(self.log, "ab") as log:      # a file, not a pipe: it can never fill up
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "capes", "interface-daemon", "--config", str(config),
                 "--ready-file", str(ready), "--log-level", "INFO"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("daemon did not get ready")
            time.sleep(0.02)
        self.info = json.loads(ready.read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Agent:
    """A synthetic monitoring agent: a DEALER with its own DeltaEncoder."""

    def __init__(self, ctx, endpoint: str, keys, name: str | None, node: str,
                 pis: list[str], full_every: int = 60):
        self.sock = curve.client_socket(ctx, zmq.DEALER, keys, name)
        self.sock.connect(endpoint)
        self.enc = DeltaEncoder(node, pis, full_every)
        self.full_requests = 0

    def send(self, tick: int, values) -> None:
        self.poll_requests()
        self.sock.send(self.enc.frame(tick, values))

    def poll_requests(self) -> None:
        while self.sock.poll(0):
            msg = decode(self.sock.recv())
            if isinstance(msg, FullRequest):
                self.full_requests += 1
                self.enc.request_full()

    def close(self) -> None:
        self.sock.close(linger=0)


class ControlAgent:
    """A synthetic control agent: says hello with ``values``, receives and acks Actions."""

    def __init__(self, ctx, endpoint, keys, node, values):
        self.sock = curve.client_socket(ctx, zmq.DEALER, keys)
        self.sock.connect(endpoint)
        self.node = node
        self.sock.send(encode(Ack(node, 0, values)))

    def recv(self, timeout_ms=3000) -> Action | None:
        if not self.sock.poll(timeout_ms):
            return None
        return decode(self.sock.recv())

    def ack(self, action: Action) -> None:
        self.sock.send(encode(Ack(self.node, action.seq, action.values)))


def mount_tmpfs(path: Path, size: str) -> None:
    """Mount a small tmpfs at ``path`` (skip the test without root); the caller
    unmounts it (``umount -l``) in a ``finally``."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")


def fill_disk(disk: Path) -> Path:
    """Fill the filesystem to the last byte; return the filler to delete later."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def free_port_below_ephemeral() -> int:
    """A free loopback TCP port below the kernel's ephemeral range, for a test that
    closes a port and binds it again while clients keep reconnecting: a client that
    reconnects to a closed port inside that range can be given that port as its own
    source and connect to itself (TCP self-connect), and the port is then in use."""
    import random
    import socket
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randint(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_for(predicate, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every)
