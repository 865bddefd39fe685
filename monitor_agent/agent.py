"""The monitoring agent loop: collect every tick, send one differential frame.

Every ``tick_seconds`` the agent asks each collector for its PIs, lays them out in one
vector whose order is fixed at start, and sends a :class:`capes.common.protocol.DeltaEncoder`
frame (only the PIs that changed; a full frame every ``full_frame_every`` ticks and
whenever the daemon sends a :class:`FullRequest`) on a DEALER socket.

Ticks are wall-clock based, ``tick = int(time.time() / tick_seconds)``, so every agent
of a cluster numbers the same second alike without talking to the others; the agent
sleeps until the next tick boundary. It never blocks on the daemon: sends are
non-blocking on a socket with a small high-water mark that only queues on a live
connection (ZMQ_IMMEDIATE). ZeroMQ reconnects by itself.

Nothing is lost at a daemon restart (within ``monitor.resend_s``): the agent keeps the
PI vectors of its last ``resend_s`` seconds (:class:`Outbox`). A frame the socket cannot
take now (daemon away, queue full) waits there and goes out, in tick order, as soon as
the socket can take it; and on every reconnection (a socket-monitor
``HANDSHAKE_SUCCEEDED`` after the first one), every kept frame is sent again, starting
with a full frame with names, so a restarted daemon needs no FullRequest round trip and gets the frames its
killed predecessor received but never committed. The daemon drops ticks it already
stored (history is append-only). Frames that leave the window before they could be sent
are counted as lost.

Light by design: no torch, no NumPy; the only work per tick is the collectors' reads
and one small encode.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from capes.common import curve
from capes.common.config import ConfigError
from capes.common.deployment import DeploymentConfig
from capes.common.inbox import drain
from capes.common.protocol import REFUSED, DecodeError, DeltaEncoder, FullRequest, encode
from capes.common.registry import PluginError
from capes.common.stop_signal import StopSignal
from monitor_agent.collectors import Collector, build_collector

log = logging.getLogger("capes.monitor_agent")

NAN = float("nan")


def build_collectors(cfg: DeploymentConfig, source: str = "<config>") -> list[Collector]:
    """The collectors of ``[monitor]``, each built from its table (errors name the key)."""
    out = []
    for i, c in enumerate(cfg.monitor.collectors):
        key = f"monitor.collectors[{i}]"
        try:
            out.append(build_collector(c.name, c.options))
        except PluginError as exc:     # unknown name, or an option it does not take
            raise exc.config_error(source, key) from None
        except ValueError as exc:
            raise ConfigError(source, key, f"{c.name}: {exc}") from None
    return out


@dataclass
class MonitorCounters:
    ticks: int = 0
    sent: int = 0
    bytes_sent: int = 0
    full_frames: int = 0
    dropped: int = 0               # not sent at its tick (daemon away, queue full): kept
    resent: int = 0                # kept frames sent again after a reconnect
    lost: int = 0                  # left the resend window before they could be sent
    connects: int = 0              # handshakes with a daemon (the first one included)
    full_requests: int = 0
    bad_messages: int = 0          # undecodable or unexpected messages from the daemon
    collector_errors: dict[str, int] = field(default_factory=dict)
    late_ticks: int = 0            # ticks skipped because the agent fell behind


class Sampler:
    """All collectors as one vector with a fixed order of names; started here (a
    collector's ``start``: what acts), so that building one never acts."""

    def __init__(self, collectors: list[Collector]):
        self.collectors = collectors
        self.layout: list[tuple[Collector, list[str], int]] = []
        self.names: list[str] = []
        owner: dict[str, str] = {}
        for col in collectors:             # (a duck-typed collector may have neither)
            for effect in getattr(col, "effects", list)():   # beyond reading, said once
                log.info("collector %s %s", col.name, effect)
            getattr(col, "start", lambda: None)()     # what acts: here, never at build
            names = col.names()
            for n in names:
                if n in owner:
                    raise ValueError(f"PI {n!r} is reported by both the {owner[n]!r} and "
                                     f"the {col.name!r} collector")
                owner[n] = col.name
            self.layout.append((col, names, len(self.names)))
            self.names.extend(names)
        self.vector = [NAN] * len(self.names)
        self.errors: dict[str, int] = {}

    def sample(self) -> list[float]:
        """Collect every collector into ``self.vector`` (reused) and return it. A
        collector that raises gives NaN for its PIs this tick and is counted."""
        vec = self.vector
        for col, names, offset in self.layout:
            try:
                values = col.collect()
            except Exception as exc:       # one broken source must not stop the agent
                n = self.errors[col.name] = self.errors.get(col.name, 0) + 1
                if n == 1 or math.log2(n).is_integer():
                    log.warning("collector %s failed (%d times): %s", col.name, n, exc)
                values = {}
            get = values.get
            for i, name in enumerate(names):
                vec[offset + i] = get(name, NAN)
        return vec

    def close(self) -> None:
        for col in self.collectors:
            col.close()


class Outbox:
    """One node's outgoing frames: the PI vectors of the last ``keep`` ticks, sent in
    tick order through ``encoder`` on ``sock``, never blocking. A frame the socket cannot
    take now stays pending for :meth:`flush`; :meth:`resend` (after a reconnect) makes
    every kept frame pending again, from a full frame with names. Used by the monitoring
    agent and by the soak benchmark's fleet."""

    MAX_KEEP = 36_000

    def __init__(self, encoder: DeltaEncoder, sock: zmq.Socket, keep: int,
                 counters: MonitorCounters | None = None):
        self.encoder, self.sock = encoder, sock
        self.keep = max(1, min(int(keep), self.MAX_KEEP))
        self.kept: deque[list] = deque()      # [tick, values, sent at least once]
        self.pending = 0                      # the newest `pending` kept frames go out next
        self.counters = counters if counters is not None else MonitorCounters()

    def add(self, tick: int, values) -> None:
        """Keep the frame of ``tick`` (a tick not newer than the last one is ignored;
        the same tick again, still pending, takes the newer values)."""
        if self.kept and tick <= self.kept[-1][0]:
            if tick == self.kept[-1][0] and self.pending:
                self.kept[-1][1] = list(values)
            return
        self.kept.append([tick, list(values), False])
        self.pending += 1
        if len(self.kept) > self.keep:
            _, _, was_sent = self.kept.popleft()
            if self.pending > len(self.kept):
                self.pending = len(self.kept)
                if not was_sent:
                    self.counters.lost += 1

    def flush(self) -> list[int]:
        """Send the pending frames, oldest first, until the socket would block; return
        the ticks that went out for the first time."""
        c, first = self.counters, []
        while self.pending:
            entry = self.kept[-self.pending]
            msg = self.encoder.message(entry[0], entry[1])
            frame = encode(msg)
            try:
                self.sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                self.encoder.request_full()   # the daemon misses this one: resync after
                return first
            self.pending -= 1
            c.sent += 1
            c.bytes_sent += len(frame)
            c.full_frames += msg.full
            if entry[2]:
                c.resent += 1
            else:
                entry[2] = True
                first.append(entry[0])
        return first

    def resend(self) -> None:
        """A (re)connection: every kept frame goes out again, from a full frame with
        names (a restarted daemon may not have committed them; it drops ticks it has)."""
        self.pending = len(self.kept) if self.keep > 1 else self.pending
        self.encoder.request_full()


class MonitorAgent:
    """One node's monitoring agent. ``run()`` loops until SIGTERM/SIGINT or ``stop``."""

    SEND_HWM = 16      # frames queued for a live but slow daemon before dropping

    def __init__(self, cfg: DeploymentConfig, collectors: list[Collector] | None = None,
                 context: zmq.Context | None = None, source: str = "<config>"):
        self.cfg = cfg
        self.mon = cfg.monitor
        self.tick_seconds = cfg.tick_seconds
        if collectors is None:
            collectors = build_collectors(cfg, source)
        try:
            self.sampler = Sampler(collectors)
        except ValueError as exc:
            raise ConfigError(source, "monitor.collectors", str(exc)) from None
        self.encoder = DeltaEncoder(self.mon.node, self.sampler.names, self.mon.full_frame_every,
                                    mantissa_bits=self.mon.mantissa_bits)
        self.counters = MonitorCounters(collector_errors=self.sampler.errors)
        self._own_context = context is None
        self.ctx = context or zmq.Context(1)
        self.sock = curve.client_socket(self.ctx, zmq.DEALER, cfg.keys, hwm=self.SEND_HWM)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        keep = 1 + math.ceil(self.mon.resend_s / self.tick_seconds)
        self.outbox = Outbox(self.encoder, self.sock, keep, self.counters)
        self.sock.connect(self.mon.daemon)

    @property
    def names(self) -> list[str]:
        return self.sampler.names

    def current_tick(self) -> int:
        return int(time.time() / self.tick_seconds)

    def send_tick(self, tick: int) -> bool:
        """Collect the frame of ``tick`` and send what is pending; False when this
        frame could not go out now (it is kept and sent when the socket can take it)."""
        self.outbox.add(tick, self.sampler.sample())
        self.counters.ticks += 1
        self.handle_monitor()
        self.outbox.flush()
        if self.outbox.pending:
            self.counters.dropped += 1
            return False
        return True

    def handle_monitor(self) -> None:
        """Connection events: on every handshake with a daemon, send the kept frames
        again (a restarted daemon lost what it had not committed)."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.counters.connects += 1
                if self.counters.connects > 1:
                    # the first connection lost nothing: what was sent before its
                    # handshake is queued on it (or still pending); resending it would
                    # only show up as the daemon's "replayed" drops on a clean start
                    log.info("reconnected to %s: sending the last %d frames again",
                             self.mon.daemon, len(self.outbox.kept))
                    self.outbox.resend()
                self.outbox.flush()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                log.info("disconnected from %s", self.mon.daemon)

    def handle_incoming(self) -> None:
        """Drain messages from the daemon; a FullRequest makes the next frame full."""
        for msg in drain(self.sock, self.cfg.daemon.max_message_bytes, self._malformed):
            if isinstance(msg, FullRequest) and msg.reason.startswith(REFUSED):
                log.warning("the daemon refuses this agent's frames: %s (key %r; bind it "
                            "to node %r with `capes keys generate --bind`)",
                            msg.reason[len(REFUSED):].strip(), self.cfg.keys.client,
                            self.mon.node)
            elif isinstance(msg, FullRequest) and msg.node in ("", self.mon.node):
                self.counters.full_requests += 1
                self.encoder.request_full()
            else:
                self.counters.bad_messages += 1

    def _malformed(self, exc: DecodeError) -> None:
        self.counters.bad_messages += 1
        log.debug("dropped a message from the daemon: %s", exc)

    def run(self, stop: StopSignal, max_ticks: int | None = None) -> int:
        """Send one frame per tick until ``stop`` is set (or ``max_ticks`` frames)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        poller.register(stop.fileno(), zmq.POLLIN)
        next_tick = self.current_tick() + 1
        log.info("monitoring agent %s: %d PIs every %g s to %s", self.mon.node,
                 len(self.names), self.tick_seconds, self.mon.daemon)
        while not stop.is_set():
            delay = next_tick * self.tick_seconds - time.time()
            if delay > 0:
                # pending frames: wake when the socket can take them (no connection:
                # never writable, so no busy loop)
                poller.modify(self.sock, zmq.POLLIN | (zmq.POLLOUT if self.outbox.pending
                                                       else 0))
                for sock, ev in poller.poll(delay * 1000.0):
                    if sock is self.sock:
                        if ev & zmq.POLLIN:
                            self.handle_incoming()
                        if ev & zmq.POLLOUT:
                            self.outbox.flush()
                    elif sock is self.monitor:
                        self.handle_monitor()
                    else:
                        stop.drain()
                continue
            now_tick = max(self.current_tick(), next_tick)
            if now_tick > next_tick:       # overslept (suspended, overloaded): skip ahead
                self.counters.late_ticks += now_tick - next_tick
            self.send_tick(now_tick)
            next_tick = now_tick + 1
            if max_ticks is not None and self.counters.ticks >= max_ticks:
                break
        return 0

    def close(self) -> None:
        self.sampler.close()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self._own_context:
            self.ctx.term()

    def summary(self) -> str:
        c = self.counters
        return (f"{c.ticks} ticks, {c.sent} frames sent ({c.bytes_sent} B, {c.full_frames} "
                f"full), {c.dropped} "
                f"not sent at their tick, {c.resent} resent, {c.lost} lost, {c.connects} "
                f"connections, {c.full_requests} full requests, {c.bad_messages} bad messages, "
                f"{sum(c.collector_errors.values())} collector errors")
