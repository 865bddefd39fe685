"""The control agent loop: apply the daemon's parameter values, safely.

The agent holds a DEALER socket to the daemon's control ROUTER. On every connection it
sends a hello (``Ack`` with ``seq=0`` and the knobs' current values), repeated as a
heartbeat. Each :class:`capes.common.protocol.Action` carries ABSOLUTE values; the agent

* ignores an action older than the last one it handled (after a reconnect the daemon
  may have restarted, so the sequence starts afresh), and answers a repeat of the last
  one with the same ack, since the daemon re-sends what was not acknowledged;
* re-checks every value with the parameter's ``ParameterSpec.check_value`` (range, step
  grid, forbidden values, all with a tolerance), the daemon's ``[daemon.forbidden]`` and
  the parameter's ``min_dwell_s`` (no change sooner than that after its last change
  here or by an earlier run, whose time the state file keeps; restores are never held;
  the hello tells the daemon how long each knob is held), and refuses what fails
  (counted and logged with the reason), whatever the daemon said;
  a categorical value (an index) is handed to the applier by name;
* sets only what changes: a value the daemon asked for before (every action carries
  every knob) is not set again, so one step of one knob is one set (one ``gluster
  volume set``, not nine);
* reads the knob just before changing it, and every ``control.drift_check_s``: a knob
  found changed behind its back (by hand) is **left as it is** and held there until
  the agent restarts (later actions on it are refused, counted as "held by hand"),
  logged, counted, and told to the daemon (``Ack.drift``), which makes the value its
  own where only this node holds the knob; its recorded original is dropped (a restore
  leaves the operator's value);
* applies the rest through the applier configured for that parameter, reads the knob
  back, and acks the values now in force (in dry-run: logs, applies nothing, and acks
  the unchanged values, which is the truth; its hellos and acks say it is a dry run, so
  the daemon records no change as applied).

**Originals.** Before the agent first changes a knob it reads the value the host has
(``applier.read``, or ``read_text`` for a categorical knob) and records it in a small
JSON state file (``control.state_file``, written atomically, never trusted when read;
see :mod:`control_agent.state_file`), so a restarted or kill -9'd agent still knows it,
and never records a tuned value as an original. Restoring puts back those originals; the config's
``default`` is only the fallback where nothing was recorded. The agent restores on
SIGTERM/SIGINT and a clean stop, and, when ``restore_after_s`` > 0, after that long
without a word from the daemon: a tuner that lost its brain should not leave a
production system at an exploratory setting. There it restores only what it has
recorded or changed (a knob it never touched keeps the host's value);
``capes restore-defaults`` (no daemon needed) puts every knob back, to its default where
nothing was recorded. A knob restored successfully is forgotten, and the state file is
removed once it holds nothing. The daemon sends an Action only when a
value must change, so a quiet but live connection is not silence: ZMTP heartbeats
(PING/PONG) keep checking that the daemon answers, and the silence clock runs only while
there is no live connection and no message.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from capes.common import curve
from capes.common.config import ConfigError
from capes.common.deployment import DeploymentConfig
from capes.common.inbox import drain
from capes.common.params import ParameterSpec
from capes.common.protocol import Ack, Action, DecodeError, encode
from capes.common.stop_signal import StopSignal
from control_agent.appliers import Applier, ApplyError, build_applier
from control_agent.state_file import OriginalValues, applier_fingerprint, state_path

__all__ = ["ControlAgent", "OriginalValues", "build_appliers", "node_parameters",
           "state_path"]

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
        why = out[name].supports(name, params[name].categorical)
        if why is not None:
            raise ConfigError(source, f"control.appliers.{name}", f"{ac.name}: {why}")
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
    originals_recorded: int = 0
    unchanged: int = 0             # values the daemon asked for before: not set again
    drift: int = 0                 # knobs found changed behind the agent's back


class ControlAgent:
    """One node's control agent; ``run()`` serves the daemon until SIGTERM/SIGINT."""

    HEARTBEAT_S = 5.0      # hello repeated this often, so a daemon always knows the node
    QUIET_WARN_S = 60.0    # connected this long and never a word: say what it may mean

    def __init__(self, cfg: DeploymentConfig, dry_run: bool | None = None,
                 appliers: dict[str, Applier] | None = None, source: str = "<config>"):
        self.cfg = cfg
        self.node = cfg.control.node
        self.dry_run = cfg.control.dry_run if dry_run is None else dry_run
        self.specs = node_parameters(cfg)
        self.appliers = appliers if appliers is not None else build_appliers(cfg, source)
        self.forbidden = {name: list(cfg.daemon.forbidden.get(name, ()))
                          for name in self.specs}
        self.counters = ControlCounters()
        self.originals = OriginalValues(state_path(cfg), self.node,
                                        {n: applier_fingerprint(cfg, n) for n in self.specs},
                                        {n: s.min_dwell_s for n, s in self.specs.items()})
        for name, value in self.originals.values.items():
            log.info("%s: original value %s recorded %s by an earlier run; it is put back "
                     "when this agent restores", name, self.specs[name].describe(value),
                     time.strftime("%Y-%m-%d %H:%M:%S",
                                   time.localtime(self.originals.recorded_at[name])))
        self.touched: set[str] = set()     # knobs this process has changed
        self.changed_at: dict[str, float] = {}   # knob -> monotonic time of its last change
        for name in self.originals.changed_at:     # a dwell that outlived the last run
            left = self.originals.dwell_left(name)
            self.changed_at[name] = time.monotonic() - (self.specs[name].min_dwell_s - left)
            log.info("%s: changed by an earlier run; no change for %.1f s (min_dwell_s)",
                     name, left)
        self.current: dict[str, float] = {}
        for name in self.specs:
            value = self._read(name)
            if value is not None:
                self.current[name] = value
        self.requested: dict[str, float] = {}    # knob -> the daemon's last value for it
        self.drift_pending: dict[str, float] = {}   # hand-made changes not yet told
        # knobs an operator changed by hand: held as they set them until this agent
        # restarts (CAPES never fights an operator, also when the engine steps from its
        # own value of a knob every node holds a copy of)
        self.held: set[str] = set()
        self.last_seq = 0
        self.last_ack: Ack | None = None
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None

    # ------------------------------------------------------------------ knobs

    def _read_raw(self, param: str) -> float | str | None:
        """The knob's value as the host has it: a number, or a categorical knob's name."""
        applier = self.appliers[param]
        if self.specs[param].categorical:
            return applier.read_text(param)
        value = applier.read(param)
        # a knob reading "nan" or "inf" has no value to record or put back
        return value if value is None or math.isfinite(value) else None

    def _read(self, param: str) -> float | None:
        """The knob's value as the engine sees it (a categorical knob's index); None when
        unknown, or a name not among the parameter's values."""
        raw = self._read_raw(param)
        if isinstance(raw, str):
            return self.specs[param].index_of(raw)
        return raw

    def _refuse(self, param: str, value: float, reason: str) -> None:
        key = ("out of range" if reason.startswith("outside") else
               "off the step grid" if reason.startswith("off the step grid") else
               "dwell" if reason.startswith("dwell") else reason)
        n = self.counters.refused[key] = self.counters.refused.get(key, 0) + 1
        log.warning("refused %s = %r: %s (%d refused for this reason)", param, value, reason, n)

    def check(self, param: str, value: float) -> str | None:
        """Why ``value`` may not be set on ``param`` here (None: it may)."""
        spec = self.specs.get(param)
        if spec is None:
            return "unknown parameter on this node"
        why = spec.check_value(value)
        if why is None and any(abs(value - f) <= 1e-6 * spec.step
                               for f in self.forbidden[param]):
            why = "forbidden value"
        if why is None:
            why = self.check_dwell(param, value)
        return why

    def check_dwell(self, param: str, value: float, now: float | None = None) -> str | None:
        """Why changing ``param`` to ``value`` must wait (its ``min_dwell_s`` since its
        last change here has not passed), or None."""
        spec, last = self.specs[param], self.changed_at.get(param)
        cur = self.current.get(param)
        if spec.min_dwell_s <= 0 or last is None or (
                cur is not None and abs(value - cur) <= 1e-6 * spec.step):
            return None
        since = (time.monotonic() if now is None else now) - last
        if since < spec.min_dwell_s:
            return (f"dwell: changed {since:.1f} s ago, min_dwell_s is "
                    f"{spec.min_dwell_s:g} s")
        return None

    def _remember_original(self, param: str) -> bool:
        """Record the knob's value as found on the host before its first change; False
        when it was read but could not be saved (the change must not happen)."""
        if param in self.originals.values:
            return True
        raw = self._read_raw(param)
        if raw is None:
            if param not in self.touched:
                log.warning("%s: cannot read its value before changing it; restoring will "
                            "fall back to the config's default %s", param,
                            self.specs[param].describe(self.specs[param].default))
            return True
        try:
            self.originals.record(param, raw)
        except OSError as exc:
            log.error("%s: cannot save its original value %s to %s: %s", param, raw,
                      self.originals.path, exc.strerror or exc)
            return False
        self.counters.originals_recorded += 1
        log.info("%s: original value %s recorded", param, self.specs[param].describe(raw))
        return True

    def _set(self, param: str, value: float) -> float | None:
        """Apply one checked value; return the value now in force (None: unknown)."""
        applier = self.appliers[param]
        if not self._remember_original(param):
            self._refuse(param, value, "original value not saved")
            return self.current.get(param)
        spec = self.specs[param]
        try:
            applier.apply(param, spec.label(value))
        except (ApplyError, OSError) as exc:     # OSError: an applier's own bug, not fatal
            self.counters.apply_failed += 1
            log.error("could not apply %s = %s: %s", param, spec.describe(value), exc)
            now = self._read(param)
            if now is not None:
                self.current[param] = now
            return self.current.get(param)
        self.touched.add(param)
        self.counters.applied += 1
        before = self.current.get(param)
        now = self._read(param)
        self.current[param] = value if now is None else now
        if before is None or abs(self.current[param] - before) > 1e-6 * spec.step:
            self._note_change([param])
        return self.current[param]

    def _note_change(self, params) -> None:
        """Start the dwell of ``params`` now, here and in the state file (so that it
        outlives a restart of this agent)."""
        for param in params:
            self.changed_at[param] = time.monotonic()
        try:
            self.originals.changed(params)
        except OSError as exc:
            log.error("cannot save the change time of %s to %s: %s; a restarted agent "
                      "will not hold it to its min_dwell_s", ", ".join(params),
                      self.originals.path, exc.strerror or exc)

    def dwell_left(self) -> dict[str, float]:
        """Seconds before each knob under its dwell may change again (for the hello)."""
        now = time.monotonic()
        out = {}
        for param, last in self.changed_at.items():
            left = self.specs[param].min_dwell_s - (now - last)
            if left > 0:
                out[param] = left
        return out

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
            if self._unchanged(param, value):
                self.counters.unchanged += 1
            elif param in self.held:
                self._hold(param, value)
            elif (why := self.check(param, value)) is not None:
                self._refuse(param, value, why)
            elif self.dry_run:
                log.info("dry run: would set %s = %s (now %s)", param,
                         self.specs[param].describe(value),
                         self.specs[param].describe(self.current.get(param)))
            elif self.check_drift([param]):
                # changed by hand since: the engine stepped from a value no longer in
                # force; the operator's value stays, and the daemon is told
                self.requested[param] = value
                self._refuse(param, value, "changed by hand: left as it is")
            else:
                applied = self.counters.applied
                self._set(param, value)
                if self.counters.applied > applied:      # failed: asked again, tried again
                    self.requested[param] = value
            if param in self.current:
                acked[param] = self.current[param]
        self.last_ack = Ack(self.node, action.seq, acked, dry_run=self.dry_run,
                            drift=self._drift_to_tell())
        return self.last_ack

    def _hold(self, param: str, value: float) -> None:
        """Refuse a change of a knob an operator set by hand (counted; said once a knob,
        the first refusal already said why)."""
        n = self.counters.refused["held by hand"] = \
            self.counters.refused.get("held by hand", 0) + 1
        (log.info if n == 1 else log.debug)(
            "refused %s = %s: held as set by hand until this agent restarts (%d refused)",
            param, self.specs[param].describe(value), n)

    def _unchanged(self, param: str, value: float) -> bool:
        """Whether the daemon asked for this value of ``param`` before (applied then, or
        left to an operator who changed it by hand), or, at the first action, the knob
        already holds it: either way there is nothing to set. Actions carry every knob's
        value; only the ones that change are set (one `volume set`, not nine)."""
        spec = self.specs.get(param)
        if spec is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False                   # the checks say why (NaN is never "the same")
        asked = self.requested.get(param)
        if asked is None:
            cur = self.current.get(param)
            if cur is None or abs(value - cur) > 1e-6 * spec.step:
                return False
            self.requested[param] = value
            return True
        return abs(value - asked) <= 1e-6 * spec.step

    def check_drift(self, params=None) -> list[str]:
        """Read ``params`` (default: every knob) and note each found changed behind the
        agent's back since it last set or read it: logged, counted, kept (never put
        back: an operator's change wins) and told to the daemon with the next ack or
        hello. Its recorded original is dropped: the operator's value is the host's
        now, and a restore leaves it. Returns the knobs that drifted."""
        out = []
        for param in self.specs if params is None else params:
            known = self.current.get(param)
            if known is None:
                continue
            live = self._read(param)
            spec = self.specs[param]
            if live is None or abs(live - known) <= 1e-6 * spec.step:
                continue
            self.counters.drift += 1
            out.append(param)
            log.warning("%s: changed behind CAPES's back, %s -> %s (by hand?); held as it "
                        "is until this agent restarts, told to the daemon (%d such changes)", param,
                        spec.describe(known), spec.describe(live), self.counters.drift)
            self.current[param] = live
            self.drift_pending[param] = live
            self.held.add(param)
            self.touched.discard(param)
            try:
                self.originals.forget([param])
            except OSError as exc:
                log.error("cannot save %s: %s", self.originals.path, exc.strerror or exc)
        return out

    def _drift_to_tell(self) -> dict[str, float]:
        """The hand-made changes not yet told to the daemon (each told once, with the
        next ack or hello that goes out)."""
        told, self.drift_pending = self.drift_pending, {}
        return told

    def restore_plan(self, fallback: bool = False) -> dict[str, tuple[float | str, str]]:
        """What restoring sets: parameter -> (value for the applier, "original" or
        "default"). A recorded original first; the config's default for a knob this
        process changed without recording one, or for every other knob with
        ``fallback`` (``capes restore-defaults``); knobs in neither case are left alone."""
        plan = {}
        for param, spec in self.specs.items():
            if param in self.originals.values:
                plan[param] = (self.originals.values[param], "original")
            elif fallback or param in self.touched:
                plan[param] = (spec.label(spec.default), "default")
        return plan

    def restore_defaults(self, why: str = "asked", fallback: bool = False
                         ) -> tuple[dict[str, float | str], list[str]]:
        """Put back each knob's original value (see ``restore_plan``); return (what was
        set, by parameter: a number or a categorical name; the parameters that failed).
        Restored knobs are forgotten; the failed ones keep their recorded original."""
        self.counters.restores += 1
        plan = self.restore_plan(fallback)
        restored: dict[str, float | str] = {}
        failed: list[str] = []
        if self.dry_run:
            log.info("dry run: would restore (%s): %s", why, ", ".join(
                f"{k}={self.specs[k].describe(v)} ({src})" for k, (v, src) in plan.items())
                or "nothing")
            return restored, failed
        for param, (value, source) in plan.items():
            applier = self.appliers[param]
            try:
                applier.apply(param, value)
            except (ApplyError, OSError) as exc:
                failed.append(param)
                log.error("could not restore %s = %s (%s): %s", param,
                          self.specs[param].describe(value), source, exc)
                continue
            restored[param] = value
            now = self._read(param)
            if now is None:          # unreadable knob: trust the write
                now = (self.specs[param].index_of(value) if isinstance(value, str)
                       else float(value))
            if now is None:          # a categorical original that is not among values
                self.current.pop(param, None)
            else:
                self.current[param] = now
        self._note_change(list(restored))       # a restore is a change (never held)
        for param in restored:                   # the daemon's value is set again if asked
            self.requested.pop(param, None)
        self.originals.forget(restored)
        self.touched.difference_update(restored)
        log.info("restored (%s): %s%s", why,
                 ", ".join(f"{k}={self.specs[k].describe(v)} ({plan[k][1]})"
                           for k, v in restored.items()) or "nothing",
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
        drift = self._drift_to_tell()
        if self._send(Ack(self.node, 0, dict(self.current), self.dwell_left(),
                          dry_run=self.dry_run, drift=drift)):
            return True
        self.drift_pending = {**drift, **self.drift_pending}     # tell it next time
        return False

    def run(self, stop: StopSignal) -> int:
        """Serve the daemon until ``stop``; then restore the originals. Returns 0, or 1
        when a knob could not be restored."""
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
        drift_every = self.cfg.control.drift_check_s
        next_drift = time.monotonic() + drift_every
        log.info("control agent %s%s: %d parameters (%s) from %s", self.node,
                 " (DRY RUN)" if self.dry_run else "", len(self.specs),
                 ", ".join(self.specs), self.cfg.control.daemon)
        connected = heard_any = False
        connected_at = time.monotonic()
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
            if drift_every > 0 and now >= next_drift:
                next_drift = now + drift_every
                if self.check_drift():
                    self.hello()               # the daemon learns it now
                    next_heartbeat = now + self.HEARTBEAT_S
            if restore_after > 0 and not silent_restored and now - last_heard > restore_after:
                log.warning("no daemon for %.1f s", now - last_heard)
                self.restore_defaults("daemon silent")
                silent_restored = True
                self.hello()
            if connected and not heard_any and now - connected_at > self.QUIET_WARN_S:
                heard_any = True                   # said once
                log.warning("connected to %s for %.0f s and the daemon has sent nothing: "
                            "no engine tunes yet, tuning is off, or the daemon refuses key "
                            "%r for node %r (its log names a refused key)",
                            self.cfg.control.daemon, now - connected_at,
                            self.cfg.keys.client, self.node)
            wake = next_heartbeat - now
            if connected and not heard_any:
                wake = min(wake, connected_at + self.QUIET_WARN_S - now + 0.01)
            if drift_every > 0:
                wake = min(wake, next_drift - now)
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
                        connected_at = time.monotonic()
                    else:
                        log.info("disconnected from %s", self.cfg.control.daemon)
                        connected, last_heard = False, time.monotonic()
                elif sock is self.sock:
                    if self._receive():
                        last_heard = time.monotonic()
                        silent_restored, heard_any = False, True
                else:
                    stop.drain()
        _, failed = self.restore_defaults("stopping")
        self.hello()                       # best effort: tell the daemon the values now
        return 1 if failed else 0

    def _receive(self) -> bool:
        """Handle every waiting message; True when one came from a sane daemon."""
        heard = False
        for msg in drain(self.sock, self.cfg.daemon.max_message_bytes, self._malformed):
            if not isinstance(msg, Action):
                self.counters.bad_messages += 1
                continue
            heard = True
            ack = self.handle_action(msg)
            if ack is not None and not self._send(ack):
                self.counters.acks_dropped += 1
        return heard

    def _malformed(self, exc: DecodeError) -> None:
        self.counters.bad_messages += 1
        log.warning("dropped a message from the daemon: %s", exc)

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
                f"{c.restores} restores, {c.originals_recorded} originals recorded, "
                f"{c.unchanged} values unchanged (not set again), {c.drift} changed by hand"
                f"{f', {len(self.originals.values)} kept in {self.originals.path}' if self.originals.values else ''}")
