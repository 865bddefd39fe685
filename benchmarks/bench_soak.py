"""Soak: the whole stack against the simulator for a long time, with faults (issue 12).

What runs, as real processes on loopback with CURVE keys (like ``capes demo``): the
simulator node, the interface daemon, the monitoring agent and the control agent of the
simulator node ``sim0``, and the DRL engine. Beside them, in this process:

- a **fleet** of N monitoring agents (default 64): one thread, one DEALER socket and one
  ``DeltaEncoder`` per node (``f00``, ``f01``, ...), all with the key ``fleet`` bound to
  those node names (no ``daemon.nodes`` allow-list: the key bindings alone keep every
  node to its key), each sending one frame per tick with the simulator's three PIs,
  answering the daemon's FullRequests and keeping and resending its last seconds after a
  reconnect (the same ``monitor_agent.agent.Outbox`` and socket-monitor events) exactly
  as ``capes monitor-agent`` does. (N real agent processes would need N Python
  interpreters; the wire traffic is the same.) Every (node, tick) sent is remembered;
- a **rogue** client with an admitted key (bound to ``rogue0``): garbage bytes, corrupt
  lz4, oversized messages, frames for other nodes and unknown nodes, ticks far from the
  clock, PI-name floods, bursts of thousands of frames, an unauthenticated socket, junk on
  the control socket, and gRPC actions that are out of range, off the grid, forbidden,
  NaN or at absurd ticks;
- an **intruder** (issue 27, items 1-3): an admitted key bound to no node claims the
  bound nodes ``sim0`` and ``f00`` (frames and hellos) and says hello as made-up nodes
  with marker values (window 97, rate_limit 190); token-less reflection and health-Watch
  streams and token-less 4 MB calls on the gRPC control plane; 100 half-sent HTTP
  requests held open on the daemon's ``/metrics``. The sampler counts what got
  through: nodes held by the intruder, the marker values becoming the daemon's, status
  calls and scrapes that failed while the daemon was up, the daemon's thread count;
- **faults**: every ``--kill-every`` s a ``kill -9`` of the daemon, the engine, the
  monitoring agent or the control agent (in turn), restarted at once; every
  ``--fill-every`` s the disk holding the replay DB (a small tmpfs, needs root; skipped
  otherwise) is filled for ``--fill-hold`` s and freed (health sampled with the
  daemon's ``rows_written``: SERVING while no row is written is a false SERVING, goal 0;
  SERVING while rows still go into the WAL's space is true);
- **a clock step** (issue 38): at ``--skew-at`` of the run the last fleet node's clock
  steps ``--skew-s`` (3 s) ahead, and back after ``--skew-for`` s (then, like the
  monitoring agent, it sends nothing until its clock passes its last tick); the engine's
  status file says in how many of its decisions each node had a row: the skewed node's
  peers (sim0 and the rest of the fleet) must be seen in >= 95 % of them, over the run
  and over the step;
- **a knob changed by hand** (issue 38): at ``--hand-at`` of the run the simulator's
  ``window`` file is set 7 steps away, as an operator would; that change is not counted
  as an unrecorded action, it must not be undone (its next value is not the old one)
  and the control agent's or daemon's log should mention it;
- **observers**: the simulator's knob files polled every 5 ms (what was really applied),
  the replay DB read (read-only) every second (what was committed), the daemon's RSS,
  the engine's status file every second (the nodes it saw).

At the end every process is stopped cleanly and the table is printed:

- committed rows lost: rows seen committed in the DB that are gone at the end (goal 0);
- rows sent but never stored, split into those sent around a daemon kill (the
  uncommitted batch, the frames of the downtime and the differential frames before the
  restarted daemon resynchronises; the agents resend their last ``--resend`` seconds
  after a reconnect, so goal 0 here too) and all others (goal 0);
- actions applied but not recorded: knob changes seen in the simulator's files with no
  recorded action making that change within a few seconds (5 s before, or up to the
  skewed node's lead after: an action's tick is the one the engine decided on) (goal
  0); restores to the original values are counted apart;
- out-of-range values applied (goal 0), the daemon's RSS min/max, the recovery time after
  each kill, process crashes (exits nobody asked for), stale checkpoint temp files.

    python benchmarks/bench_soak.py --minutes 30          # the issue's soak
    python benchmarks/bench_soak.py --minutes 4 --json soak.json
    python benchmarks/bench_soak.py --quick               # 24 s, 8 agents, one of each fault
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# children are started while this process holds gRPC channels: no gRPC fork handlers
# (a fork-without-exec child stuck in them never got to exec the restarted daemon)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import psutil  # noqa: E402
import zmq  # noqa: E402

from capes.common import curve  # noqa: E402
from capes.common.control_client import ControlClient, ControlError  # noqa: E402
from capes.common.deployment import KeysConfig  # noqa: E402
from capes.common.metrics import scrape  # noqa: E402
from capes.common.params import ParameterSpec  # noqa: E402
from capes.common.protocol import (Ack, DeltaEncoder, FullRequest, Indicators,  # noqa: E402
                                   decode, encode)
from monitor_agent.agent import MonitorCounters, Outbox  # noqa: E402
from zmq.utils.monitor import recv_monitor_message  # noqa: E402

PARAMS = {"rate_limit": ParameterSpec(min=10, max=200, step=10, default=50, name="rate_limit"),
          "window": ParameterSpec(min=1, max=100, step=1, default=10, forbidden=[95],
                                  name="window")}
PIS = ["throughput", "window", "rate_limit"]
KILL_ORDER = ["interface-daemon", "drl-engine", "monitor-agent", "control-agent"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ processes
class Child:
    """One ``python -m capes ...`` process, restartable, logging (appending) to a file."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict):
        self.name, self.args, self.workdir, self.env = name, args, workdir, env
        self.proc: subprocess.Popen | None = None
        self.expected_exit = False
        self.crashes: list[int] = []
        self.start_failures: list[str] = []
        self.started_at = 0.0

    def start(self) -> None:
        with open(self.workdir / "logs" / f"{self.name}.log", "ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "capes", *self.args], cwd=self.workdir, stdout=fh,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                start_new_session=True)    # no preexec_fn: posix_spawn/vfork, no fork
        self.expected_exit = False
        self.started_at = time.time()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        self.expected_exit = True
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        self.expected_exit = True
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None


# ------------------------------------------------------------------------ the fleet
class Fleet(threading.Thread):
    """N monitoring agents in one thread: one CURVE DEALER, one encoder and one
    ``Outbox`` (frames of the last ``resend_s`` kept, resent after a reconnect) per node."""

    def __init__(self, ctx, endpoint: str, keys: KeysConfig, n: int, tick_s: float,
                 stop: threading.Event, resend_s: float = 10.0):
        super().__init__(name="fleet", daemon=True)
        self.names = [f"f{i:02d}" for i in range(n)]
        self.tick_s, self.stop_ev = tick_s, stop
        self.socks, self.encs, self.monitors, self.outboxes = [], [], [], []
        self.counters = MonitorCounters()                  # all nodes together
        keep = 1 + math.ceil(resend_s / tick_s)
        for name in self.names:
            s = curve.client_socket(ctx, zmq.DEALER, keys, "fleet")
            s.setsockopt(zmq.IMMEDIATE, 1)                 # as the monitoring agent
            self.monitors.append(s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            s.connect(endpoint)
            self.socks.append(s)
            enc = DeltaEncoder(name, PIS, 60, 15)
            self.encs.append(enc)
            self.outboxes.append(Outbox(enc, s, keep, self.counters))
        self.sent: dict[tuple[str, int], float] = {}      # (node, tick) -> wall time
        self.not_sent = 0                                  # not sent at its tick (kept)
        self.full_requests = 0
        self.rng = random.Random(1)
        # node index -> ticks its clock runs ahead (set from outside: a clock stepped
        # ahead and back). Stepped back, the node's ticks do not go back: like
        # ``capes monitor-agent`` it sends nothing until its clock passes its last tick
        self.ahead: dict[int, int] = {}

    def run(self) -> None:
        next_tick = int(time.time() / self.tick_s) + 1
        while not self.stop_ev.is_set():
            delay = next_tick * self.tick_s - time.time()
            if delay > 0:
                time.sleep(delay)
            tick = max(next_tick, int(time.time() / self.tick_s))
            now = time.time()
            for i, (s, enc, box) in enumerate(zip(self.socks, self.encs, self.outboxes)):
                while s.poll(0):
                    try:
                        msg = decode(s.recv(zmq.NOBLOCK))
                    except Exception:
                        continue
                    if isinstance(msg, FullRequest):
                        self.full_requests += 1
                        enc.request_full()
                while self.monitors[i].poll(0):            # (re)connected: resend
                    if recv_monitor_message(self.monitors[i])["event"] == \
                            zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        self.counters.connects += 1
                        box.resend()
                tp = 40 + 10 * math.sin(tick / 50 + i) + self.rng.random()
                box.add(tick + self.ahead.get(i, 0), [tp, 10 + i % 5, 50.0])
                for t in box.flush():
                    self.sent[(self.names[i], t)] = now
                if box.pending:
                    self.not_sent += 1
            next_tick = tick + 1

    def close(self) -> None:
        for s, m in zip(self.socks, self.monitors):
            s.disable_monitor()
            m.close(linger=0)
            s.close(linger=0)


# ------------------------------------------------------------------------ the rogue
class Rogue(threading.Thread):
    """An admitted but hostile client, and an unauthenticated one."""

    def __init__(self, ctx, endpoints: dict, keys: KeysConfig, grpc_addr: str, token: str,
                 tick_s: float, max_bytes: int, stop: threading.Event):
        super().__init__(name="rogue", daemon=True)
        self.ctx, self.endpoints, self.keys = ctx, endpoints, keys
        self.grpc_addr, self.token, self.tick_s = grpc_addr, token, tick_s
        self.max_bytes, self.stop_ev = max_bytes, stop
        self.sent = Counter()
        self.accepted_bad_actions: list[dict] = []
        self.rng = random.Random(7)

    def run(self) -> None:
        ing = curve.client_socket(self.ctx, zmq.DEALER, self.keys, "rogue")
        ing.connect(self.endpoints["ingest"])
        ctl = curve.client_socket(self.ctx, zmq.DEALER, self.keys, "rogue")
        ctl.connect(self.endpoints["control"])
        plain = self.ctx.socket(zmq.DEALER)             # no CURVE at all
        plain.linger = 0
        plain.connect(self.endpoints["ingest"])
        client = ControlClient(self.grpc_addr, self.token, timeout=2.0)
        seq, cycle = 10**6, 0
        try:
            while not self.stop_ev.wait(1.0):
                cycle += 1
                tick = int(time.time() / self.tick_s)
                out = [self.rng.randbytes(self.rng.randrange(0, 2000)) for _ in range(20)]
                out.append(bytes((1, 1, 50)) + self.rng.randbytes(50))       # bad lz4
                out.append(b"\x01" * (2 * self.max_bytes))                     # oversized
                names = [f"flood{cycle}_{i}" for i in range(3000)]             # PI-name flood
                for msg in (Indicators("f00", 0, tick, True, {0: 1.0}, PIS),   # not its node
                            Indicators("nobody", 0, tick, True, {0: 1.0}, PIS),
                            Indicators("rogue0", seq, 2**62, True, {0: 1.0}, PIS),
                            Indicators("rogue0", 0, tick, True,
                                       {i: 1.0 for i in range(len(names))}, names)):
                    try:
                        out.append(encode(msg))
                    except (ValueError, OverflowError, struct.error):
                        self.sent["unencodable (refused by our own encoder)"] += 1
                for m in out:
                    self._send(ing, m, "ingest")
                if cycle % 5 == 0:                         # a burst of valid frames
                    enc = DeltaEncoder("rogue0", PIS)
                    for k in range(2000):
                        self._send(ing, enc.frame(tick, [k, 1.0, 2.0]), "flood")
                for m in (self.rng.randbytes(100), encode(Ack("sim0", 5, {"window": 99.0})),
                          encode(Ack("rogue0", 0, {"window": 1e9}))):
                    self._send(ctl, m, "control")
                self._send(plain, encode(Indicators("f01", 0, tick, True, {0: 1.0}, PIS)),
                           "unauthenticated")
                while ing.poll(0):
                    ing.recv()
                while ctl.poll(0):
                    ctl.recv()
                if cycle % 3 == 0:
                    self._bad_actions(client, tick)
        finally:
            client.close()
            for s in (ing, ctl, plain):
                s.close(linger=0)

    def _send(self, sock, msg: bytes, kind: str) -> None:
        try:
            sock.send(msg, zmq.NOBLOCK)
            self.sent[kind] += 1
        except zmq.Again:
            self.sent[kind + " (HWM)"] += 1

    def _bad_actions(self, client: ControlClient, tick: int) -> None:
        for t, values in ((tick, {"window": 1000.0}), (tick, {"window": 95.0}),
                          (tick, {"window": 10.5}), (tick, {"rate_limit": -50.0}),
                          (tick, {"window": float("nan")}), (2**63 - 1, {"window": 11.0}),
                          (tick, {"window": 100.0, "rate_limit": 10.0})):
            try:
                r = client.submit_action(t, 1, values)
            except ControlError:
                self.sent["bad action (daemon down)"] += 1
                continue
            self.sent["bad action"] += 1
            if r["accepted"]:
                self.accepted_bad_actions.append({"tick": t, "values": values})


# ------------------------------------------------------------------------ the intruder
GHOST_VALUES = {"window": 97.0, "rate_limit": 190.0}     # marker values of made-up nodes


class Intruder(threading.Thread):
    """Issue 27's attacks on items 1-3, once a second (see the module docstring)."""

    HALF_SENT = 100

    def __init__(self, ctx, endpoints: dict, keys: KeysConfig, grpc_addr: str,
                 metrics_addr: str, stop: threading.Event):
        super().__init__(name="intruder", daemon=True)
        self.ctx, self.endpoints, self.keys = ctx, endpoints, keys
        self.grpc_addr, self.metrics_addr, self.stop_ev = grpc_addr, metrics_addr, stop
        self.sent = Counter()
        self.grpc_codes = Counter()          # what the token-less calls got back

    def run(self) -> None:
        import grpc
        ing = curve.client_socket(self.ctx, zmq.DEALER, self.keys, "intruder")
        ing.connect(self.endpoints["ingest"])
        ctl = curve.client_socket(self.ctx, zmq.DEALER, self.keys, "intruder")
        ctl.connect(self.endpoints["control"])
        channel = grpc.insecure_channel(self.grpc_addr, options=[
            ("grpc.max_send_message_length", 8 << 20)])
        streams: list = []
        half_sent: list[socket.socket] = []
        cycle = 0
        try:
            while not self.stop_ev.wait(1.0):
                cycle += 1
                tick = int(time.time() / 0.1)
                for node in ("sim0", "f00"):                         # bound to other keys
                    self._send(ing, encode(Indicators(node, 0, tick, True, {0: 1.0}, PIS)),
                               "claim bound node (frame)")
                    self._send(ctl, encode(Ack(node, 0, GHOST_VALUES)),
                               "claim bound node (hello)")
                self._send(ctl, encode(Ack(f"ghost{cycle % 20}", 0, GHOST_VALUES)),
                           "made-up node hello")
                while ing.poll(0):
                    ing.recv()
                while ctl.poll(0):
                    ctl.recv()
                streams = self._streams(channel, streams, grpc)
                if cycle % 10 == 0:
                    self._large_calls(channel, grpc)
                half_sent = self._half_sent(half_sent)
        finally:
            for call in streams:
                call.cancel()
            channel.close()
            for s in half_sent:
                s.close()
            for s in (ing, ctl):
                s.close(linger=0)

    _send = Rogue._send                  # count each message by kind (HWM apart)

    def _streams(self, channel, streams: list, grpc) -> list:
        """Keep 4 token-less reflection and 4 health-Watch streams open (reopen the
        ones that ended, counting how they ended)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        open_ = []
        for call in streams:
            if call.done():
                self.grpc_codes[f"stream {call.code().name}"] += 1
            else:
                open_.append(call)
        stop = self.stop_ev

        def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            stop.wait(120)
        while len(open_) < 8:
            if len(open_) % 2:
                open_.append(reflection_pb2_grpc.ServerReflectionStub(channel)
                             .ServerReflectionInfo(requests(), timeout=120))
            else:
                open_.append(health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=120))
            self.sent["token-less stream"] += 1
        return open_

    def _large_calls(self, channel, grpc) -> None:
        submit = channel.unary_unary("/capes.v1.ControlPlane/SubmitAction",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        blob = b"\x0a" + b"\xff" * (4 << 20)
        futures = [submit.future(blob, timeout=10) for _ in range(20)]
        for f in futures:
            try:
                f.result()
                self.grpc_codes["4 MB call OK"] += 1
            except grpc.RpcError as exc:
                self.grpc_codes[f"4 MB call {exc.code().name}"] += 1
        self.sent["token-less 4 MB call"] += len(futures)

    def _half_sent(self, socks: list[socket.socket]) -> list[socket.socket]:
        """Keep ``HALF_SENT`` requests to /metrics open, never finished."""
        host, port = self.metrics_addr.rsplit(":", 1)
        kept = []
        for s in socks:
            try:
                s.settimeout(0)
                if s.recv(1) == b"":
                    self.sent["half-sent request closed by the daemon"] += 1
                    s.close()
                    continue
            except (BlockingIOError, socket.timeout):
                pass
            except OSError:
                s.close()
                continue
            kept.append(s)
        while len(kept) < self.HALF_SENT:
            try:
                s = socket.create_connection((host, int(port)), timeout=0.5)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                break                                   # the daemon is down
            kept.append(s)
            self.sent["half-sent request"] += 1
        return kept


# ------------------------------------------------------------------------ observers
class KnobWatch(threading.Thread):
    """What was really applied: the simulator's knob files, polled every 5 ms."""

    def __init__(self, sim_dir: Path, stop: threading.Event):
        super().__init__(name="knobs", daemon=True)
        self.sim_dir, self.stop_ev = sim_dir, stop
        self.changes: list[tuple[float, str, float]] = []
        self.last: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop_ev.wait(0.005):
            for p in PARAMS:
                try:
                    v = float((self.sim_dir / p).read_text().strip())
                except (OSError, ValueError):
                    continue
                if self.last.get(p) != v:
                    if p in self.last:
                        self.changes.append((time.time(), p, v))
                    self.last[p] = v


class SeenWatch(threading.Thread):
    """What the engine saw: its status file's ``nodes_seen`` (the ticks it decided on
    and, per node, in how many of them the node had a row), every second, by engine
    life (pid: a kill -9 starts the counts afresh)."""

    def __init__(self, path: Path, stop: threading.Event):
        super().__init__(name="seen", daemon=True)
        self.path, self.stop_ev = path, stop
        self.samples: list[tuple[float, int, int, dict]] = []   # (time, pid, ticks, nodes)

    def run(self) -> None:
        while not self.stop_ev.wait(1.0):
            try:
                s = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            seen = s.get("nodes_seen") or {}
            if seen.get("ticks"):
                self.samples.append((time.time(), s["pid"], seen["ticks"], seen["nodes"]))

    def between(self, t0: float, t1: float) -> tuple[int, Counter]:
        """Ticks decided on in [t0, t1] and per node those it had a row in: each engine
        life's last sample in the window less its last one before (or zero)."""
        ticks, nodes = 0, Counter()
        for pid in {p for _, p, _, _ in self.samples}:
            mine = [x for x in self.samples if x[1] == pid]
            inside = [x for x in mine if t0 <= x[0] <= t1]
            if not inside:
                continue
            before = [x for x in mine if x[0] < t0]
            base = before[-1] if before else (0, pid, 0, {})
            ticks += inside[-1][2] - base[2]
            for n, c in inside[-1][3].items():
                nodes[n] += c - base[3].get(n, 0)
        return ticks, nodes


class DBWatch(threading.Thread):
    """What was committed: the replay DB read-only, every second."""

    def __init__(self, db: Path, stop: threading.Event):
        super().__init__(name="db", daemon=True)
        self.db, self.stop_ev = db, stop
        self.rows: set[tuple[int, int, int]] = set()       # (session, node index, tick)
        self.last_rowid = 0
        self.last_action_rowid = 0
        self.latest: dict[str, int] = defaultdict(lambda: -1)   # group -> latest tick
        self.node_names: dict[int, list[str]] = {}
        self.errors = 0

    def poll(self) -> None:
        if not self.db.exists():
            return
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
        try:
            for sid, nodes in conn.execute("SELECT id, node_names FROM sessions"):
                self.node_names[sid] = json.loads(nodes)
            for rowid, sid, tick, node in conn.execute(
                    "SELECT rowid, session, tick, node FROM pis WHERE rowid > ?",
                    (self.last_rowid,)):
                self.rows.add((sid, node, tick))
                self.last_rowid = max(self.last_rowid, rowid)
                names = self.node_names.get(sid, [])
                name = names[node] if node < len(names) else "?"
                group = "sim0" if name == "sim0" else "fleet" if name.startswith("f") else name
                self.latest[group] = max(self.latest[group], tick)
            for rowid, tick, action in conn.execute(
                    "SELECT rowid, tick, action FROM actions WHERE rowid > ?",
                    (self.last_action_rowid,)):
                self.last_action_rowid = max(self.last_action_rowid, rowid)
                if action != 0:      # NULL rows are also what refused actions leave
                    self.latest["action"] = max(self.latest["action"], tick)
        finally:
            conn.close()

    def run(self) -> None:
        while not self.stop_ev.wait(1.0):
            try:
                self.poll()
            except sqlite3.Error:
                self.errors += 1


class Sampler(threading.Thread):
    """The daemon's RSS (after its first 5 s) and its status, every second."""

    def __init__(self, children: dict[str, Child], grpc_addr: str, token: str,
                 metrics_addr: str, stop: threading.Event):
        super().__init__(name="sampler", daemon=True)
        self.children, self.stop_ev = children, stop
        self.client = ControlClient(grpc_addr, token, timeout=2.0)
        self.metrics_addr = metrics_addr
        self.rss: list[float] = []
        self.engine_rss: list[float] = []
        self.threads: list[int] = []                       # the daemon's thread count
        self.statuses: dict[int, dict] = {}                # daemon pid -> last status
        self.health: Counter = Counter()
        self.checks: Counter = Counter()                   # issue 27: what got through
        self.scrape_errors: list[str] = []

    def run(self) -> None:
        while not self.stop_ev.wait(1.0):
            e = self.children["drl-engine"]
            try:
                if e.alive():
                    self.engine_rss.append(psutil.Process(e.pid).memory_info().rss / 2**20)
            except psutil.Error:
                pass
            d = self.children["interface-daemon"]
            if not d.alive():
                continue
            settled = time.time() - d.started_at > 5        # past its restart
            pid = d.pid

            def up() -> bool:      # the same daemon still runs (no kill -9 meanwhile)
                return d.alive() and d.pid == pid
            try:
                if settled:
                    p = psutil.Process(d.pid)
                    self.rss.append(p.memory_info().rss / 2**20)
                    self.threads.append(p.num_threads())
            except psutil.Error:
                pass
            try:
                self.statuses[d.pid] = status = self.client.status()
                self.health[self.client.health()] += 1
                self.checks["status ok"] += 1
                if all(status["parameters"].get(k) == v for k, v in GHOST_VALUES.items()):
                    self.checks["ghost values in effect"] += 1
                for n in self.client.nodes():
                    if n.get("key") == "intruder" and not n["name"].startswith("ghost"):
                        self.checks["node held by the intruder"] += 1
            except ControlError:
                if settled and up():
                    self.checks["status failed (daemon up)"] += 1
            if settled:
                try:
                    scrape(self.metrics_addr, timeout=3.0)
                    self.checks["scrape ok"] += 1
                except (OSError, ValueError) as exc:
                    if up():
                        self.checks["scrape failed (daemon up)"] += 1
                        if len(self.scrape_errors) < 5:
                            self.scrape_errors.append(f"{time.strftime('%H:%M:%S')} {exc}")
        self.client.close()


# ------------------------------------------------------------------------ disk
class Disk:
    """A small tmpfs for the replay DB (root only), filled and freed on demand."""

    def __init__(self, path: Path, size_mb: int):
        self.path = path
        self.mounted = False
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.why = "not root: the DB is on the ordinary disk, no disk-full phases"
            return
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                              str(path)], capture_output=True, text=True)
        self.mounted = out.returncode == 0
        self.why = "" if self.mounted else f"cannot mount a tmpfs: {out.stderr.strip()}"

    def fill(self) -> Path:
        filler = self.path / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for size in (1 << 20, 65536, 4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError:
                    pass
        finally:
            os.close(fd)
        return filler

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


# ------------------------------------------------------------------------ the soak
def write_config(path: Path, work: Path, db: Path, ports: dict, tick_s: float,
                 fleet: list[str], max_pis: int, game_ticks: int = 3600) -> None:
    path.write_text(f"""
tick_seconds = {tick_s}
[keys]
dir = "{work / 'keys'}"
enabled = true
[daemon]
ingest = "tcp://127.0.0.1:{ports['ingest']}"
control = "tcp://127.0.0.1:{ports['control']}"
grpc = "127.0.0.1:{ports['grpc']}"
db = "{db}"
commit_every_s = {max(tick_s, 0.1)}
ack_timeout_s = 0.5
full_request_every_s = {tick_s}
max_clock_skew_s = 120
max_pis_per_node = {max_pis}
metrics = "127.0.0.1:{ports['metrics']}"
[monitor]
node = "sim0"
daemon = "tcp://127.0.0.1:{ports['ingest']}"
collectors = [{{ name = "simulator", options = {{ dir = "sim" }} }}]
[control]
node = "sim0"
daemon = "tcp://127.0.0.1:{ports['control']}"
restore_after_s = 10.0
state_file = "{work / 'control-state.json'}"
[control.appliers.window]
name = "file"
options = {{ path = "sim/window" }}
[control.appliers.rate_limit]
name = "file"
options = {{ path = "sim/rate_limit" }}
[parameters.window]
min = 1
max = 100
step = 1
default = 10
forbidden = [95]
[parameters.rate_limit]
min = 10
max = 200
step = 10
default = 50
[engine]
preset = "default"
exploration_ticks = 3000
hidden_width = 256
[reward]
objective = "throughput"
pis = ["throughput"]
type = "diff"
[game]
noise = 0.01
time_limit_ticks = {game_ticks}
""")


def wait_for(pred, timeout: float, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return None


def soak(args) -> dict:
    tick_s = args.tick
    work = Path(args.workdir or tempfile.mkdtemp(prefix="capes-soak-")).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    disk = Disk(work / "disk", args.disk_mb) if args.disk else None
    db = (work / "disk" if disk else work) / "replay.db"
    ports = {k: free_port() for k in ("ingest", "control", "grpc", "metrics")}
    fleet_names = [f"f{i:02d}" for i in range(args.agents)]
    cfg = work / "soak.toml"
    # the simulator plays (--keep-running) until its time limit: longer than the soak,
    # or its exit at 3600 ticks (6 min at 0.1 s) would count as a crash
    game_ticks = min(10**9, int(args.minutes * 60 / tick_s) + 36_000)
    write_config(cfg, work, db, ports, tick_s, fleet_names, args.max_pis_per_node, game_ticks)
    keys = work / "keys"
    curve.generate(keys, ["monitor", "control", "engine", "fleet", "rogue", "intruder"])
    curve.bind(keys, "fleet", fleet_names)
    curve.bind(keys, "monitor", ["sim0"])
    curve.bind(keys, "control", ["sim0"])
    curve.bind(keys, "rogue", ["rogue0"])
    kc = KeysConfig(dir=str(keys))
    token = curve.load_token(kc)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    c = ["--config", str(cfg)]
    children = {
        "sim-node": Child("sim-node", ["sim-node", "--dir", "sim", "--tick-seconds",
                                       str(tick_s), "--seed", "1", "--keep-running",
                                       "--config", str(cfg)], work, env),
        "interface-daemon": Child("interface-daemon", ["interface-daemon", *c,
                                  "--ready-file", "daemon.ready"], work, env),
        "monitor-agent": Child("monitor-agent", ["monitor-agent", *c, "--set",
                               "keys.client=monitor"], work, env),
        "control-agent": Child("control-agent", ["control-agent", *c, "--set",
                               "keys.client=control"], work, env),
        "drl-engine": Child("drl-engine", ["drl-engine", *c, "--seed", "0",
                            "--checkpoint-dir", str(work / "checkpoints"),
                            "--status-file", "engine.json", "--log-every", "30"], work, env),
    }
    stop = threading.Event()
    ctx = zmq.Context()
    kills: list[dict] = []
    fills: list[dict] = []
    t0 = time.time()
    grpc_addr = f"127.0.0.1:{ports['grpc']}"
    dbw = DBWatch(db, stop)
    knobs = KnobWatch(work / "sim", stop)
    fleet = rogue = sampler = intruder = None
    seenw = SeenWatch(work / "engine.json", stop)
    skew: dict = {}          # the clock step: node, ticks ahead, when on and off
    hand: dict = {}          # the knob changed by hand: param, from, to, when

    def start_daemon() -> float:
        ready = work / "daemon.ready"
        d = children["interface-daemon"]
        for attempt in range(3):
            ready.unlink(missing_ok=True)
            d.start()
            if wait_for(ready.exists, 30):
                return time.time()
            state = "exited" if not d.alive() else _proc_state(d.pid)
            d.start_failures.append(state)
            log(f"the daemon did not get ready in 30 s ({state}):\n"
                + tail(work, "interface-daemon"))
            d.kill9()
        raise RuntimeError("the daemon did not start three times in a row")

    try:
        log(f"work dir {work}; tick {tick_s} s; {args.agents} fleet agents + sim0; "
            f"{args.minutes:g} min; kill every {args.kill_every:g} s; "
            + (f"disk {args.disk_mb} MB tmpfs, full every {args.fill_every:g} s for "
               f"{args.fill_hold:g} s" if disk and disk.mounted else
               f"no disk-full phases ({disk.why if disk else 'disabled'})"))
        if disk and not disk.mounted:
            disk = None
        children["sim-node"].start()
        wait_for(lambda: (work / "sim" / "window").exists(), 20)
        start_daemon()
        for name in ("monitor-agent", "control-agent", "drl-engine"):
            children[name].start()
        endpoints = {"ingest": f"tcp://127.0.0.1:{ports['ingest']}",
                     "control": f"tcp://127.0.0.1:{ports['control']}"}
        fleet = Fleet(ctx, endpoints["ingest"], kc, args.agents, tick_s, stop, args.resend)
        rogue = Rogue(ctx, endpoints, kc, grpc_addr, token, tick_s, 65_536, stop)
        metrics_addr = f"127.0.0.1:{ports['metrics']}"
        intruder = Intruder(ctx, endpoints, kc, grpc_addr, metrics_addr, stop)
        sampler = Sampler(children, grpc_addr, token, metrics_addr, stop)
        for th in (dbw, knobs, fleet, sampler, seenw):
            th.start()
        if args.rogue:
            rogue.start()
        if args.intruder:
            intruder.start()

        end = t0 + args.minutes * 60
        skew_on = t0 + args.skew_at * args.minutes * 60 if args.skew_s else math.inf
        hand_at = t0 + args.hand_at * args.minutes * 60 if args.hand_at >= 0 else math.inf
        next_kill = t0 + args.kill_every
        next_fill = t0 + args.fill_offset if disk else math.inf
        k = 0
        while time.time() < end:
            time.sleep(0.2)
            if sampler.engine_rss and sampler.engine_rss[-1] > args.engine_rss_limit_mb:
                log(f"the engine's RSS passed {args.engine_rss_limit_mb} MiB: stopping early")
                break
            for ch in children.values():               # a crash: count it, restart
                if not ch.alive() and not ch.expected_exit:
                    ch.crashes.append(ch.proc.returncode)
                    log(f"{ch.name} exited by itself ({ch.proc.returncode}); restarting\n"
                        + tail(work, ch.name))
                    start_daemon() if ch.name == "interface-daemon" else ch.start()
            now = time.time()
            if now >= skew_on and not skew:                 # one node's clock steps ahead
                i = len(fleet.names) - 1
                fleet.ahead[i] = round(args.skew_s / tick_s)
                skew.update(node=fleet.names[i], ticks=fleet.ahead[i], on=now)
                log(f"{fleet.names[i]}'s clock stepped {args.skew_s:g} s ahead")
            elif skew and "off" not in skew and now >= skew["on"] + args.skew_for:
                fleet.ahead.clear()                         # ... and back
                skew["off"] = now
                log(f"{skew['node']}'s clock stepped back")
            if now >= hand_at and not hand:
                hand.update(change_by_hand(work / "sim", "window"))
                log(f"window changed by hand: {hand['from']:g} -> {hand['to']:g}")
            if now >= next_fill and now + args.fill_hold < end:
                fills.append(disk_full(disk, args.fill_hold, sampler, dbw))
                next_fill += args.fill_every
                next_kill = max(next_kill, time.time() + 5)
            elif now >= next_kill:
                target = KILL_ORDER[k % len(KILL_ORDER)]
                k += 1
                kills.append(kill_and_recover(target, children, start_daemon, dbw, knobs,
                                              tick_s, args.recovery_timeout, sampler.client))
                next_kill += args.kill_every
        log("stopping")
    finally:
        stop.set()
        for th in (fleet, rogue, intruder, sampler, knobs, seenw):
            if th is not None and th.is_alive():
                th.join(10)
        for name in ("drl-engine", "control-agent", "monitor-agent", "interface-daemon",
                     "sim-node"):
            if children[name].proc is not None:
                children[name].stop()
        if fleet is not None:
            fleet.close()
        ctx.term()
        if disk is not None and disk.mounted:        # copy the DB off the tmpfs first
            for f in db.parent.glob(db.name + "*"):
                shutil.copy2(f, work / f.name)
            disk.unmount()
            disk = None
            db = work / db.name
    dbw.db = db
    dbw.poll()                                          # the last look, all stopped
    result = analyse(args, work, db, tick_s, fleet, rogue, dbw, knobs, sampler, kills,
                     fills, children, hand)
    result.update(seen_report(seenw, skew, t0, time.time()))
    result["hand_change"] = hand_report(hand, knobs, work)
    result["intruder_sent"] = dict(intruder.sent) if intruder and args.intruder else {}
    result["intruder_grpc_codes"] = dict(intruder.grpc_codes) if intruder else {}
    result["sampler_checks"] = dict(sampler.checks) if sampler else {}
    result["scrape_errors"] = sampler.scrape_errors if sampler else []
    result["daemon_threads_max"] = max(sampler.threads) if sampler and sampler.threads \
        else None
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _proc_state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        state = next((line for line in status if line.startswith("State:")), "")
        return f"{state.split(':', 1)[-1].strip()}, wchan {wchan or '-'}"
    except OSError:
        return "unknown"


def tail(work: Path, name: str, n: int = 8) -> str:
    try:
        lines = (work / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


def control_caught_up(client: ControlClient, since: float) -> bool:
    """The restarted control agent said hello (heard from after ``since``) and has
    acknowledged every action the daemon sent it."""
    try:
        for n in client.nodes():
            if n["name"] == "sim0" and n.get("control"):
                return (time.time() - n["idle_s"] > since
                        and n["acked_seq"] >= n["action_seq"])
    except ControlError:
        pass
    return False


def change_by_hand(sim: Path, param: str) -> dict:
    """An operator's change of ``param`` behind CAPES' back: its file set to a value 7
    steps away (in range, not forbidden)."""
    spec = PARAMS[param]
    old = float((sim / param).read_text().strip())
    new = old + 7 * spec.step if old + 7 * spec.step <= spec.max - spec.step else \
        old - 7 * spec.step
    if spec.check_value(new) is not None:
        new -= spec.step
    (sim / param).write_text(f"{new:g}\n")
    return {"param": param, "from": old, "to": new, "t": time.time()}


def hand_report(hand: dict, knobs: "KnobWatch", work: Path, within_s: float = 30.0) -> dict:
    """What followed the change by hand: the knob's next values (undone: the first of
    them is the value it had, 7 steps away, where an engine step from the hand's value
    lands 1 step away; a later walk back is the engine's tuning), and the lines of the
    control agent's and the daemon's logs that mention it (the control agent notices a
    value changed behind its back, issue 38)."""
    if not hand:
        return {}
    later = [(round(t - hand["t"], 2), v) for t, p, v in knobs.changes
             if p == hand["param"] and hand["t"] + 0.01 < t <= hand["t"] + within_s
             and not (v == hand["to"] and t - hand["t"] < 1.0)]
    lines = []
    for name in ("control-agent", "interface-daemon", "drl-engine"):
        f = work / "logs" / f"{name}.log"
        text = f.read_text(errors="replace") if f.exists() else ""
        lines += [f"{name}: {ln.strip()}" for ln in text.splitlines()
                  if hand["param"] in ln and "not applied" not in ln and any(
                      w in ln.lower() for w in ("by hand", "behind", "drift"))]
    return {**hand, "next_values": later[:8],
            "undone": bool(later) and later[0][1] == hand["from"],
            "log_lines": lines[:5]}


def seen_report(seenw: "SeenWatch", skew: dict, t0: float, t1: float) -> dict:
    """The share of the engine's decisions in which each peer of the skewed node (sim0
    and the fleet but it) had a row: the worst peer's, over the run and over the skew
    (from the step ahead to 5 s after the step back)."""
    out = {"skew": skew}
    spans = {"run": (t0, t1)}
    if skew:
        spans["skew"] = (skew["on"], skew.get("off", t1) + 5.0)
    for label, (a, b) in spans.items():
        ticks, nodes = seenw.between(a, b)
        peers = {n: c for n, c in nodes.items()
                 if (n == "sim0" or n.startswith("f")) and n != skew.get("node")}
        worst = min(peers, key=peers.get) if peers and ticks else None
        out[f"seen_{label}_ticks"] = ticks
        out[f"seen_{label}_worst_peer"] = worst
        out[f"seen_{label}_worst_share"] = peers[worst] / ticks if worst else None
        out[f"seen_{label}_skewed_share"] = (nodes.get(skew["node"], 0) / ticks
                                             if skew and ticks else None)
    return out


def kill_and_recover(target: str, children: dict[str, Child], start_daemon, dbw: DBWatch,
                     knobs: KnobWatch, tick_s: float, timeout: float,
                     client: ControlClient) -> dict:
    """kill -9 ``target``, restart it at once, and time until it does its job again."""
    t_kill = time.time()
    kill_tick = int(t_kill / tick_s)
    children[target].kill9()
    if target == "interface-daemon":
        start_daemon()
    else:
        children[target].start()
    t_restart = time.time()
    ev = {"target": target, "t": t_kill, "restart_s": t_restart - t_kill}

    def after(group):
        return lambda: dbw.latest[group] > kill_tick
    checks = {"interface-daemon": [("rows", after("fleet")), ("actions", after("action"))],
              "drl-engine": [("actions", after("action"))],
              "monitor-agent": [("rows", after("sim0"))],
              "control-agent": [("acked", lambda: control_caught_up(client, t_restart))]}
    for what, pred in checks[target]:
        ok = wait_for(pred, timeout - (time.time() - t_kill), every=0.1)
        ev[what + "_s"] = time.time() - t_kill if ok else None
    done = [v for k, v in ev.items() if k.endswith("_s") and k != "restart_s"]
    ev["recovery_s"] = None if None in done else max(done)
    log(f"kill -9 {target}: restarted in {ev['restart_s']:.1f} s, recovered in "
        + (f"{ev['recovery_s']:.1f} s" if ev["recovery_s"] is not None else "NOT recovered"))
    return ev


def disk_full(disk: Disk, hold: float, sampler: Sampler, dbw: DBWatch) -> dict:
    t = time.time()
    filler = disk.fill()
    health = Counter()
    end = time.time() + hold
    written = None
    while time.time() < end:
        try:                  # SERVING is true while rows are still written (WAL space)
            rows = sampler.client.status()["rows_written"]
            state = sampler.client.health()
            if state == "SERVING":
                state += ", rows written" if written is None or rows > written \
                    else ", NO rows written"
            health[state] += 1
            written = rows
        except Exception:
            pass
        time.sleep(0.5)
    filler.unlink()
    freed = time.time()
    before = dbw.latest["fleet"]
    ok = wait_for(lambda: dbw.latest["fleet"] > before and
                  sampler.client.health() == "SERVING", 60, every=0.2)
    ev = {"t": t, "hold_s": hold, "health_while_full": dict(health),
          "recovery_s": time.time() - freed if ok else None}
    log(f"disk full for {hold:g} s (health {dict(health)}); serving and writing again "
        + (f"{ev['recovery_s']:.1f} s after space returned" if ok else "NOT recovered"))
    return ev


def analyse(args, work, db, tick_s, fleet, rogue, dbw, knobs, sampler, kills, fills,
            children, hand=None) -> dict:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    sessions = {sid: (json.loads(nodes), [p["name"] for p in json.loads(params)])
                for sid, nodes, params in conn.execute(
                    "SELECT id, node_names, params FROM sessions")}
    final = {(sessions[sid][0][node], tick)
             for sid, tick, node in conn.execute("SELECT session, tick, node FROM pis")}
    actions = []
    for sid, tick, action, blob in conn.execute(
            "SELECT session, tick, action, vals FROM actions ORDER BY tick"):
        vals = struct.unpack(f"<{len(blob) // 4}f", blob)
        actions.append((tick, action, dict(zip(sessions[sid][1], vals))))
    conn.close()

    # rows: committed then lost; sent and never stored (around daemon kills or not)
    seen = set()
    for sid, node, tick in dbw.rows:
        names = sessions.get(sid, ([], []))[0]
        seen.add((names[node] if node < len(names) else f"?{node}", tick))
    committed_lost = seen - final
    sent = fleet.sent if fleet else {}
    missing = [(key, t) for key, t in sent.items() if key not in final]
    daemon_kills = [e for e in kills if e["target"] == "interface-daemon"]
    commit_s = max(tick_s, 0.1)

    def near_kill(t):
        for e in daemon_kills:
            back = e["t"] + (e.get("rows_s") or args.recovery_timeout)
            if e["t"] - commit_s - 1.0 <= t <= back + 1.0:
                return True
        return False
    lost_at_kills = sum(1 for _, t in missing if near_kill(t))
    # sent in the last second before the stop: the clean stop commits them, but a
    # frame still in flight when the daemon got SIGTERM is not a loss of the daemon's
    stop_t = max(sent.values()) if sent else 0
    in_flight = sum(1 for _, t in missing if not near_kill(t) and t > stop_t - 1.0)
    unexplained = len(missing) - lost_at_kills - in_flight

    # actions: every knob change seen must be a recorded change nearby
    recorded = defaultdict(list)                       # param -> [(tick, value)] changes
    prev: dict[str, float] = {}
    for tick, action, vals in actions:
        for p, v in vals.items():
            if prev.get(p) != v:
                recorded[p].append((tick, v))
            prev[p] = v
    used = set()
    # an action is recorded at the tick the engine decided on; a node whose clock runs
    # ahead (the skew fault) can put that tick up to its skew ahead of the moment the
    # change lands (after a daemon restart the engine may read the skewed node first)
    ahead_s = 1.0 + max(0.0, args.skew_s)
    not_recorded, restored, out_of_range = [], 0, []
    for t, p, v in knobs.changes:
        spec = PARAMS[p]
        if hand and p == hand["param"] and v == hand["to"] and abs(t - hand["t"]) < 1.0:
            continue                                   # the operator's, not CAPES'
        why = spec.check_value(v)
        if why is not None:
            out_of_range.append((t, p, v, why))
        match = None
        for i, (tick, rv) in enumerate(recorded[p]):
            if (p, i) not in used and rv == v and t - 5.0 <= tick * tick_s <= t + ahead_s:
                match = i
                break
        if match is not None:
            used.add((p, match))
        elif v == spec.default:
            restored += 1
        else:
            not_recorded.append((t, p, v))

    statuses = sampler.statuses if sampler else {}
    drops = Counter()
    for s in statuses.values():
        drops.update(s.get("drops", {}))
    ckpt_temps = [p.name for p in (work / "checkpoints").glob("*.tmp")] \
        if (work / "checkpoints").exists() else []
    rss = sampler.rss if sampler else []
    result = {
        "minutes": args.minutes, "tick_s": tick_s, "fleet_agents": args.agents,
        "frames_sent_by_fleet": len(sent), "fleet_not_sent_hwm": fleet.not_sent if fleet else 0,
        "fleet_resend_s": args.resend,
        "fleet_frames_resent": fleet.counters.resent if fleet else 0,
        "fleet_frames_lost_unsent": fleet.counters.lost if fleet else 0,
        "rows_in_db": len(final),
        "committed_rows_lost": len(committed_lost),
        "rows_never_stored_total": len(missing),
        "rows_never_stored_at_daemon_kills": lost_at_kills,
        "rows_never_stored_in_flight_at_stop": in_flight,
        "rows_lost_unexplained": unexplained,
        "actions_recorded": len(actions),
        "knob_changes_applied": len(knobs.changes),
        "applied_not_recorded": len(not_recorded),
        "applied_not_recorded_examples": not_recorded[:5],
        # what surrounds each: the file's changes and the DB's recorded changes of that
        # knob from 8 s before to 3 s after (epoch s; recorded: tick × tick_s)
        "applied_not_recorded_context": [
            {"applied": [c for c in knobs.changes if c[1] == p and t - 8 <= c[0] <= t + 3],
             "recorded": [(round(tick * tick_s, 2), v) for tick, v in recorded[p]
                          if t - 8 <= tick * tick_s <= t + 3]}
            for t, p, _ in not_recorded[:3]],
        "restored_to_original": restored,
        "out_of_range_applied": len(out_of_range),
        "out_of_range_examples": out_of_range[:5],
        "rogue_bad_actions_accepted": len(rogue.accepted_bad_actions) if rogue else 0,
        "rogue_sent": dict(rogue.sent) if rogue else {},
        "daemon_drops": dict(drops),
        "daemon_rss_mb_min": min(rss) if rss else None,
        "daemon_rss_mb_max": max(rss) if rss else None,
        "engine_rss_mb_max": max(sampler.engine_rss) if sampler and sampler.engine_rss else None,
        "max_pis_per_node": args.max_pis_per_node,
        "health_samples": dict(sampler.health) if sampler else {},
        "kills": kills, "disk_full": fills,
        "crashes": {n: ch.crashes for n, ch in children.items() if ch.crashes},
        "start_failures": {n: ch.start_failures for n, ch in children.items()
                           if ch.start_failures},
        "stale_checkpoint_temps": ckpt_temps,
        "db_watch_errors": dbw.errors,
        "workdir": str(work),
    }
    return result


def print_table(r: dict) -> None:
    def row(name, value, goal=""):
        print(f"  {name:<52} {value!s:>14}  {goal}")
    print(f"\nsoak: {r['minutes']:g} min, tick {r['tick_s']:g} s, {r['fleet_agents']} fleet "
          f"agents + sim0 (real monitor and control agents), rogue client "
          f"{'on' if r['rogue_sent'] else 'off'}")
    row("fleet frames sent", r["frames_sent_by_fleet"])
    row(f"fleet frames resent after reconnects (last {r['fleet_resend_s']:g} s kept)",
        r["fleet_frames_resent"])
    row("fleet frames never sent (left the resend window)", r["fleet_frames_lost_unsent"])
    row("rows in the replay DB (fleet + sim0)", r["rows_in_db"])
    row("committed rows lost", r["committed_rows_lost"], "(goal 0)")
    row("sent, never stored: around a daemon kill -9", r["rows_never_stored_at_daemon_kills"],
        "(goal 0: agents resend)")
    row("sent, never stored: in flight at the final stop", r["rows_never_stored_in_flight_at_stop"])
    row("sent, never stored: otherwise", r["rows_lost_unexplained"], "(goal 0)")
    row("knob changes applied (simulator files)", r["knob_changes_applied"])
    row("actions applied but not recorded", r["applied_not_recorded"], "(goal 0)")
    row("restores to the original values", r["restored_to_original"])
    row("out-of-range values applied", r["out_of_range_applied"], "(goal 0)")
    row("rogue's bad actions accepted", r["rogue_bad_actions_accepted"], "(goal 0)")
    rss = (f"{r['daemon_rss_mb_min']:.0f} / {r['daemon_rss_mb_max']:.0f}"
           if r["daemon_rss_mb_min"] is not None else "n/a")
    row("daemon RSS min / max (MiB)", rss)
    if r["engine_rss_mb_max"] is not None:
        row("engine RSS max (MiB)", f"{r['engine_rss_mb_max']:.0f}",
            f"(daemon.max_pis_per_node = {r['max_pis_per_node']})")
    row("process crashes (exits nobody asked for)", sum(map(len, r["crashes"].values())),
        "(goal 0)")
    row("stale checkpoint temp files at the end", len(r["stale_checkpoint_temps"]), "(goal 0)")
    row("daemon restarts that hung (not ready in 30 s)",
        sum(map(len, r["start_failures"].values())), "(goal 0)")
    print("  kills (kill -9, restarted at once):")
    for e in r["kills"]:
        parts = [f"{k[:-2]} {v:.1f} s" if v is not None else f"{k[:-2]} NOT"
                 for k, v in e.items() if k.endswith("_s") and k not in ("restart_s", "recovery_s")]
        rec = f"{e['recovery_s']:.1f} s" if e["recovery_s"] is not None else "NOT recovered"
        print(f"    at {e['t'] - r['kills'][0]['t'] if r['kills'] else 0:6.0f} s  "
              f"{e['target']:<17} restart {e['restart_s']:4.1f} s, recovered {rec:>8} "
              f"({', '.join(parts)})")
    for f in r["disk_full"]:
        rec = f"{f['recovery_s']:.1f} s" if f["recovery_s"] is not None else "NOT"
        print(f"  disk full {f['hold_s']:g} s: health while full {f['health_while_full']}, "
              f"writing and SERVING again {rec} after space returned")
    checks = r["sampler_checks"]
    row("intruder: nodes held (sampled every second)",
        checks.get("node held by the intruder", 0), "(goal 0)")
    row("intruder: made-up nodes' values in effect", checks.get("ghost values in effect", 0),
        "(goal 0)")
    row("capes status failed while the daemon was up",
        checks.get("status failed (daemon up)", 0), f"(goal 0; {checks.get('status ok', 0)} ok)")
    row("/metrics scrapes failed while the daemon was up",
        checks.get("scrape failed (daemon up)", 0), f"(goal 0; {checks.get('scrape ok', 0)} ok)")
    row("daemon threads max", r["daemon_threads_max"])
    for e in r["scrape_errors"]:
        print(f"    scrape failed: {e}")
    if r.get("skew"):
        sk = r["skew"]
        print(f"  clock step: {sk['node']} {sk['ticks']} ticks ahead for "
              f"{sk.get('off', 0) - sk['on']:.0f} s, then back")
    for label in ("run", "skew"):
        share = r.get(f"seen_{label}_worst_share")
        if r.get(f"seen_{label}_ticks"):
            row(f"peers seen, worst ({label}: {r[f'seen_{label}_ticks']} decisions)",
                f"{share:.3f}" if share is not None else "n/a",
                f"(goal >= 0.95; {r[f'seen_{label}_worst_peer']}; the skewed node "
                f"{r[f'seen_{label}_skewed_share'] or 0:.3f})")
    h = r.get("hand_change") or {}
    if h:
        row(f"hand change {h['param']} {h['from']:g} -> {h['to']:g}: undone",
            h["undone"], f"(goal False; next values {h['next_values'][:4]})")
        row("hand change reported in the logs", len(h["log_lines"]) > 0, "(goal True)")
        for ln in h["log_lines"][:3]:
            print(f"    {ln[:150]}")
    print(f"  daemon drops (summed over daemon lives): {r['daemon_drops']}")
    print(f"  rogue sent: {r['rogue_sent']}")
    print(f"  intruder sent: {r['intruder_sent']}")
    print(f"  intruder's token-less gRPC calls ended: {r['intruder_grpc_codes']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--agents", type=int, default=64, help="fleet monitoring agents")
    p.add_argument("--tick", type=float, default=0.1, help="tick seconds")
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--fill-every", type=float, default=120.0)
    p.add_argument("--fill-offset", type=float, default=90.0, help="first disk-full phase")
    p.add_argument("--fill-hold", type=float, default=15.0)
    p.add_argument("--disk-mb", type=int, default=256)
    p.add_argument("--no-disk", dest="disk", action="store_false")
    p.add_argument("--no-rogue", dest="rogue", action="store_false")
    p.add_argument("--no-intruder", dest="intruder", action="store_false",
                   help="no issue-27 intruder (keys, control plane, /metrics)")
    p.add_argument("--quick", action="store_true",
                   help="24 s, 8 fleet agents, one kill -9 of the daemon, one disk-full "
                        "phase (root), rogue and intruder on: the CI smoke run (< 60 s)")
    p.add_argument("--recovery-timeout", type=float, default=45.0)
    p.add_argument("--resend", type=float, default=10.0, metavar="S",
                   help="the fleet's monitor.resend_s: seconds of frames kept and sent "
                        "again after a reconnect (0: none, as before issue 12's fix)")
    p.add_argument("--engine-rss-limit-mb", type=int, default=6000,
                   help="stop the soak early when the engine grows past this")
    p.add_argument("--max-pis-per-node", type=int, default=16,
                   help="daemon.max_pis_per_node (the default 4096 lets the rogue's PI-name "
                        "flood widen the engine's input to ~2M floats: 9.5 GB in 2 min)")
    p.add_argument("--skew-s", type=float, default=3.0,
                   help="one fleet node's clock stepped this far ahead (0: never)")
    p.add_argument("--skew-at", type=float, default=0.3, metavar="FRACTION",
                   help="... at this fraction of the run")
    p.add_argument("--skew-for", type=float, default=120.0, metavar="S",
                   help="... and stepped back after this long")
    p.add_argument("--hand-at", type=float, default=0.6, metavar="FRACTION",
                   help="the simulator's window changed by hand at this fraction of the "
                        "run (< 0: never)")
    p.add_argument("--workdir")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.agents, args.kill_every = 24 / 60, 8, 12.0
        args.fill_offset, args.fill_hold, args.fill_every = 4.0, 3.0, 1e9
        args.disk_mb, args.recovery_timeout = 64, 20.0
        args.skew_for = 6.0
        args.hand_at = 0.75   # 18 s: between the kills at 12 and 24 s, not on one
    r = soak(args)
    print_table(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1, default=str))
    failed = failed_goals(r)
    if failed:       # last, so that a log's tail names what failed and how
        print("soak: goals missed: " + "; ".join(failed))
    return 1 if failed else 0


def failed_goals(r: dict) -> list[str]:
    """The goals the run missed, each with its figure (and examples where kept)."""
    checks = r["sampler_checks"]
    serving_unwritten = sum(f["health_while_full"].get("SERVING, NO rows written", 0)
                            for f in r["disk_full"])
    goals = [
        ("SERVING while no rows were written (disk full)", serving_unwritten, None),
        ("committed rows lost", r["committed_rows_lost"], None),
        ("sent, never stored (not around a kill)", r["rows_lost_unexplained"], None),
        ("actions applied but not recorded", r["applied_not_recorded"],
         r.get("applied_not_recorded_examples")),
        ("out-of-range values applied", r["out_of_range_applied"],
         r.get("out_of_range_examples")),
        ("rogue's bad actions accepted", r["rogue_bad_actions_accepted"], None),
        ("nodes held by the intruder", checks.get("node held by the intruder"), None),
        ("made-up nodes' values in effect", checks.get("ghost values in effect"), None),
        ("capes status failed (daemon up)", checks.get("status failed (daemon up)"), None),
        ("/metrics scrapes failed (daemon up)", checks.get("scrape failed (daemon up)"), None),
        ("peers seen < 0.95 (run)", (r.get("seen_run_worst_share") or 1.0) < 0.95, None),
        ("peers seen < 0.95 (skew)", (r.get("seen_skew_worst_share") or 1.0) < 0.95, None),
        ("hand change undone", (r.get("hand_change") or {}).get("undone"), None),
    ]
    return [f"{name}: {value}" + (f" e.g. {examples}" if examples else "")
            for name, value, examples in goals if value]


if __name__ == "__main__":
    sys.exit(main())
