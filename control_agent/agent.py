"""The control agent loop: apply the daemon's parameter values, safely.

The agent holds a DEALER socket to the daemon's control ROUTER. On every connection it
sends a hello (``Ack`` with ``seq=0`` and the knobs' current values), repeated as a
heartbeat. Each :class:`capes.common.protocol.Action` carries ABSOLUTE values; the agent

* ignores an action older than the last one it handled (after a reconnect the daemon
  may have restarted, so the sequence starts afresh), and answers a repeat of the last
  one with the same ack, since the daemon re-sends what was not acknowledged;
* re-checks every value with the parameter's ``ParameterSpec.check_value`` and refuses
  what is out of range or forbidden (counted and logged), whatever the daemon said;
* applies the rest through the applier configured for that parameter, reads the knob
  back, and acks the values now in force (in dry-run: logs, applies nothing, and acks
  the unchanged values, which is the truth).

Every parameter goes back to its default on SIGTERM/SIGINT, on ``capes
restore-defaults`` (no daemon needed) and, when ``restore_after_s`` > 0, after that
long without a word from the daemon: a tuner that lost its brain should not leave a
production system at an exploratory setting. The daemon sends an Action only when a
value must change, so a quiet but live connection is not silence: ZMTP heartbeats
(PING/PONG) keep checking that the daemon answers, and the silence clock runs only while
there is no live connection and no message.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from capes.common import curve
from capes.common.config import ConfigError
from capes.common.deployment import DeploymentConfig
from capes.common.params import ParameterSpec
from capes.common.protocol import Ack, Action, DecodeError, decode, encode
from capes.common.stop_signal import StopSignal
from control_agent.appliers import Applier, ApplyError, build_applier

log = logging.getLogger("capes.control_agent")


def node_parameters(cfg: DeploymentConfig) -> dict[str, ParameterSpec]:
    """The parameters this node's control agent sets (``nodes`` empty: every node)."""
    node = cfg.control.node
    return {name: spec for name, spec in sorted(cfg.parameters.items())
            if not spec.nodes or node in spec.nodes}


def build_appliers(cfg: DeploymentConfig, source: str = "<config>") -> dict[str, Applier]:
    """One applier per parameter of this node, from ``[control.appliers.<param>]``."""
    params = node_parameters(cfg)
    for name in cfg.control.appliers:
        if name not in cfg.parameters:
            raise ConfigError(source, f"control.appliers.{name}",
                              f"no parameter {name!r} in [parameters]")
    out = {}
    for name in params:
        ac = cfg.control.appliers.get(name)
        if ac is None:
            raise ConfigError(source, f"control.appliers.{name}",
                              f"no applier configured for parameter {name!r}")
        try:
            out[name] = build_applier(ac.name, ac.options)
        except TypeError as exc:
            raise ConfigError(source, f"control.appliers.{name}.options",
                              f"{ac.name}: {exc}") from None
        except ValueError as exc:
            raise ConfigError(source, f"control.appliers.{name}", f"{ac.name}: {exc}") from None
    return out


@dataclass
class ControlCounters:
    actions: int = 0
    applied: int = 0               # parameter values applied
    refused: dict[str, int] = field(default_factory=dict)   # reason -> values refused
    apply_failed: int = 0
    duplicates: int = 0            # the last action again: re-acked
    stale: int = 0                 # an older action: ignored
    bad_messages: int = 0
    acks_dropped: int = 0          # daemon away when the ack was due
    restores: int = 0


class ControlAgent:
    """One node's control agent; ``run()`` serves the daemon until SIGTERM/SIGINT."""

    HEARTBEAT_S = 5.0      # hello repeated this often, so a daemon always knows the node

    def __init__(self, cfg: DeploymentConfig, dry_run: bool | None = None,
                 appliers: dict[str, Applier] | None = None, source: str = "<config>"):
        self.cfg = cfg
        self.node = cfg.control.node
        self.dry_run = cfg.control.dry_run if dry_run is None else dry_run
        self.specs = node_parameters(cfg)
        self.appliers = appliers if appliers is not None else build_appliers(cfg, source)
        self.counters = ControlCounters()
        self.current: dict[str, float] = {}
        for name in self.specs:
            value = self.appliers[name].read(name)
            if value is not None:
                self.current[name] = value
        self.last_seq = 0
        self.last_ack: Ack | None = None
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None

    # ------------------------------------------------------------------ knobs

    def _refuse(self, param: str, value: float, reason: str) -> None:
        key = "out of range" if reason.startswith("outside") else reason
        n = self.counters.refused[key] = self.counters.refused.get(key, 0) + 1
        log.warning("refused %s = %r: %s (%d refused for this reason)", param, value, reason, n)

    def _set(self, param: str, value: float) -> float | None:
        """Apply one checked value; return the value now in force (None: unknown)."""
        applier = self.appliers[param]
        try:
            applier.apply(param, value)
        except ApplyError as exc:
            self.counters.apply_failed += 1
            log.error("could not apply %s = %r: %s", param, value, exc)
            now = applier.read(param)
            if now is not None:
                self.current[param] = now
            return self.current.get(param)
        self.counters.applied += 1
        now = applier.read(param)
        self.current[param] = value if now is None else now
        return self.current[param]

    def handle_action(self, action: Action) -> Ack | None:
        """Check and apply one action; the ack to send (None: ignore it)."""
        if action.seq <= self.last_seq:
            if action.seq == self.last_seq and self.last_ack is not None:
                self.counters.duplicates += 1
                return self.last_ack
            self.counters.stale += 1
            log.debug("ignoring action %d (already at %d)", action.seq, self.last_seq)
            return None
        self.counters.actions += 1
        self.last_seq = action.seq
        acked: dict[str, float] = {}
        for param, value in action.values.items():
            spec = self.specs.get(param)
            if spec is None:
                self._refuse(param, value, "unknown parameter on this node")
                continue
            why = spec.check_value(value)
            if why is not None:
                self._refuse(param, value, why)
            elif self.dry_run:
                log.info("dry run: would set %s = %r (now %r)", param, value,
                         self.current.get(param))
            else:
                self._set(param, value)
            if param in self.current:
                acked[param] = self.current[param]
        self.last_ack = Ack(self.node, action.seq, acked)
        return self.last_ack

    def restore_defaults(self, why: str = "asked") -> tuple[dict[str, float], list[str]]:
        """Set every parameter of this node to its default; (values in force, failures)."""
        self.counters.restores += 1
        restored, failed = {}, []
        if self.dry_run:
            log.info("dry run: would restore defaults (%s): %s", why,
                     ", ".join(f"{k}={s.default:g}" for k, s in self.specs.items()))
            return restored, failed
        for param, spec in self.specs.items():
            applier = self.appliers[param]
            try:
                applier.apply(param, spec.default)
            except ApplyError as exc:
                failed.append(param)
                log.error("could not restore %s = %r: %s", param, spec.default, exc)
                continue
            now = applier.read(param)
            restored[param] = self.current[param] = spec.default if now is None else now
        log.info("restored defaults (%s): %s%s", why,
                 ", ".join(f"{k}={v:g}" for k, v in restored.items()) or "nothing",
                 f"; FAILED: {', '.join(failed)}" if failed else "")
        return restored, failed

    # ------------------------------------------------------------------ socket

    def connect(self, context: zmq.Context | None = None) -> None:
        self.ctx = context or zmq.Context.instance()
        self.sock = curve.client_socket(self.ctx, zmq.DEALER, self.cfg.keys, hwm=64)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)       # never queue for an absent daemon
        # a daemon that stops answering pings (hung, host gone) counts as disconnected
        ivl = self.cfg.control.restore_after_s / 4 or self.HEARTBEAT_S
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(1000 * min(ivl, 1.0)))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3000 * min(ivl, 1.0)))
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.cfg.control.daemon)

    def _send(self, msg) -> bool:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def hello(self) -> bool:
        return self._send(Ack(self.node, 0, dict(self.current)))

    def run(self, stop: StopSignal) -> int:
        """Serve the daemon until ``stop``; then restore the defaults. Returns 0, or 1
        when a default could not be restored."""
        if self.sock is None:
            self.connect()
        poller = zmq.Poller()
        for s in (self.sock, self.monitor, stop.fileno()):
            poller.register(s, zmq.POLLIN)
        restore_after = self.cfg.control.restore_after_s
        last_heard = time.monotonic()
        silent_restored = False
        hello_until = 0.0          # after a handshake: retry the hello until it goes out
        next_heartbeat = time.monotonic() + self.HEARTBEAT_S
        log.info("control agent %s%s: %d parameters (%s) from %s", self.node,
                 " (DRY RUN)" if self.dry_run else "", len(self.specs),
                 ", ".join(self.specs), self.cfg.control.daemon)
        connected = False
        while not stop.is_set():
            now = time.monotonic()
            if connected:
                last_heard = now
            if now < hello_until and self.hello():
                hello_until = 0.0
                next_heartbeat = now + self.HEARTBEAT_S
            elif now >= next_heartbeat:
                self.hello()
                next_heartbeat = now + self.HEARTBEAT_S
            if restore_after > 0 and not silent_restored and now - last_heard > restore_after:
                log.warning("no daemon for %.1f s", now - last_heard)
                self.restore_defaults("daemon silent")
                silent_restored = True
                self.hello()
            wake = next_heartbeat - now
            if now < hello_until:
                wake = 0.02
            elif restore_after > 0 and not silent_restored:
                wake = min(wake, last_heard + restore_after - now + 0.01)
            for sock, _ in poller.poll(max(wake, 0.0) * 1000.0):
                if sock is self.monitor:
                    event = recv_monitor_message(self.monitor)
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        log.info("connected to %s", self.cfg.control.daemon)
                        self.last_seq, self.last_ack = 0, None   # maybe a new daemon
                        hello_until = time.monotonic() + 1.0
                        connected, silent_restored = True, False
                    else:
                        log.info("disconnected from %s", self.cfg.control.daemon)
                        connected, last_heard = False, time.monotonic()
                elif sock is self.sock:
                    if self._receive():
                        last_heard = time.monotonic()
                        silent_restored = False
                else:
                    stop.drain()
        _, failed = self.restore_defaults("stopping")
        self.hello()                       # best effort: tell the daemon the defaults
        return 1 if failed else 0

    def _receive(self) -> bool:
        """Handle every waiting message; True when one came from a sane daemon."""
        heard = False
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return heard
            try:
                msg = decode(data, self.cfg.daemon.max_message_bytes)
            except DecodeError as exc:
                self.counters.bad_messages += 1
                log.warning("dropped a message from the daemon: %s", exc)
                continue
            if not isinstance(msg, Action):
                self.counters.bad_messages += 1
                continue
            heard = True
            ack = self.handle_action(msg)
            if ack is not None and not self._send(ack):
                self.counters.acks_dropped += 1

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        if self.sock is not None:
            self.sock.close(linger=200)    # lets the last hello (the defaults) go out
        for applier in self.appliers.values():
            applier.close()

    def summary(self) -> str:
        c = self.counters
        refused = ", ".join(f"{n} {why}" for why, n in c.refused.items()) or "none"
        return (f"{c.actions} actions, {c.applied} values applied, refused: {refused}, "
                f"{c.apply_failed} failed, "
                f"{c.duplicates} duplicates, {c.stale} stale, {c.bad_messages} bad messages, "
                f"{c.restores} restores")
