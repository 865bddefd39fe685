"""The action plane: checked actions out to the control agents they target, acks back.

Actions carry ABSOLUTE values, so resending is always safe: each control agent gets the
values of the parameters that target its node (``ParameterSpec.nodes``; empty = every
node), and the latest Action is re-sent to an agent that has not acknowledged it within
``ack_timeout_s`` or that reconnects (but a second connection claiming a node whose
agent is live is refused, ``node_live``). Sequence numbers start at the daemon's start
time in milliseconds and only grow, so a restarted daemon never reuses an old one.
No socket here: the daemon passes a ``send(identity, payload) -> bool`` function.

A hello's values (what an agent holds) become the daemon's current values only while
the engine has not set them, and only from a node the deployment vouches for
(``vouched``: named in ``daemon.nodes`` or a parameter's ``nodes``, or bound to the
speaking key): a made-up node name never changes what is sent to real nodes.

The daemon takes an engine action in two steps, :meth:`ActionPlane.decide` (check it,
change nothing) and, once its row is committed to the replay DB, :meth:`ActionPlane.
broadcast`: an action that reaches a control agent is always recorded.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from capes.common.params import ParameterSpec
from capes.common.protocol import Ack, Action, DecodeError, decode, encode
from interface_daemon.action_checker import ActionChecker, Verdict
from interface_daemon.counters import Counters

log = logging.getLogger("capes.interface_daemon")


@dataclass
class ControlPeer:
    """One control agent, as the daemon knows it."""
    name: str
    key: str | None
    identity: bytes = b""
    applied: dict[str, float] = field(default_factory=dict)   # what it says it holds
    desired: dict[str, float] = field(default_factory=dict)   # what it should hold
    seq: int = 0                     # latest Action sent to it
    acked: int = 0                   # latest Action it acknowledged
    sent_at: float = 0.0
    tick: int = 0
    last_seen: float = 0.0
    messages: int = 0
    live_until: float = 0.0          # its connection was found alive: trust it until
    dry_run: bool = False            # it sets nothing (its hellos and acks say so)


class ActionPlane:
    def __init__(self, specs: list[ParameterSpec], checker: ActionChecker,
                 counters: Counters, send: Callable[[bytes, bytes], bool],
                 ack_timeout_s: float = 2.0, max_nodes: int = 1024, max_bytes: int = 65536,
                 allowed_nodes: frozenset[str] = frozenset(),
                 may_speak: Callable[[str | None, str], bool] = lambda key, node: True,
                 liveness_s: float = 15.0,
                 peer_alive: Callable[[ControlPeer], bool] = lambda peer: False,
                 vouched: Callable[[str | None, str], bool] = lambda key, node: True):
        self.specs = {s.name: s for s in specs}
        self.order = [s.name for s in specs]
        self.checker = checker
        self.counters = counters
        self.send = send
        self.ack_timeout_s = ack_timeout_s
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self.allowed_nodes = allowed_nodes      # empty: any node a parameter targets
        self.may_speak = may_speak              # (CURVE key, node) -> bound to it?
        self.liveness_s = liveness_s            # heard from this recently: the node is live
        self.peer_alive = peer_alive            # its connection is still there?
        self.vouched = vouched                  # (key, node) -> a real node: adopt its hello
        self.peers: dict[str, ControlPeer] = {}
        self.current = {s.name: float(s.default) for s in specs}
        self.decided: set[str] = set()       # parameters set by an accepted action
        self.seq = time.time_ns() // 1_000_000

    def targets(self, node: str) -> list[str]:
        """The parameters that a control agent on ``node`` holds."""
        return [n for n in self.order if not self.specs[n].nodes or node in self.specs[n].nodes]

    # ------------------------------------------------------------------ from agents

    def handle(self, payload: bytes, identity: bytes, key: str | None = None,
               now: float | None = None) -> str | None:
        """Process one control-agent message; return the drop reason, or None."""
        now = time.monotonic() if now is None else now
        self.counters.control_messages += 1
        try:
            msg = decode(payload, self.max_bytes)
        except DecodeError as exc:
            return exc.reason
        if not isinstance(msg, Ack):
            return "type"
        if not self.may_speak(key, msg.node):
            return "key_not_bound"
        peer = self.peers.get(msg.node)
        if peer is None:
            if not self.node_allowed(msg.node):
                return "node_not_allowed"
            if len(self.peers) >= self.max_nodes:
                return "too_many_nodes"
            peer = self.peers[msg.node] = ControlPeer(msg.node, key)
        elif peer.key != key:
            return "auth"
        elif identity != peer.identity and self._live(peer, now):
            return "node_live"           # a second connection claiming a live node
        reconnected = identity != peer.identity
        peer.identity = identity
        peer.last_seen = now
        peer.messages += 1
        peer.dry_run = msg.dry_run
        held = self.targets(msg.node)
        values = {n: v for n, v in msg.values.items() if n in self.specs}
        peer.applied.update(values)
        for name, left in msg.dwell.items():       # the node's dwell outlives our restart
            if name in held:
                self.checker.hold(name, left, now)
        if msg.drift:
            self._adopt_drift(msg, key, held)
        if msg.seq == 0:                                     # hello / heartbeat
            adopt = held if self.vouched(key, msg.node) else ()
            dry = set(self.dry_only(adopt))     # only dry-run agents: the host's values
            for name in adopt:                               # adopt values nobody set yet
                v = values.get(name)
                if (name not in self.decided or name in dry) and v is not None and \
                        self.checker.check_value(name, v) is None:
                    self.current[name] = float(v)
            if peer.seq > peer.acked:
                self._send(peer, now, resend=True)
            elif reconnected:
                want = {n: self.current[n] for n in held if n in self.decided}
                if want and any(peer.applied.get(n) != v for n, v in want.items()):
                    peer.desired = want
                    self.seq += 1
                    peer.seq = self.seq
                    self._send(peer, now)
        elif msg.seq == peer.seq:
            if peer.acked != msg.seq:
                self.counters.actions["acked"] += 1
                if not peer.dry_run and any(values.get(n) != v
                                            for n, v in peer.desired.items()):
                    self.counters.actions["ack_mismatch"] += 1
            peer.acked = msg.seq
        else:
            self.counters.actions["stale_ack"] += 1
        return None

    def _adopt_drift(self, msg: Ack, key: str | None, held: list[str]) -> None:
        """A knob changed by hand on the node (the agent leaves it so): its value becomes
        the daemon's, so the engine's next action steps from it and does not put the old
        one back; counted (``drift``) and logged. A knob every node holds a copy of stays
        as the others have it (the node's agent keeps the hand-made value). From a vouched node only, and only a
        value the action checker allows (else ``drift_refused``: the engine's own value
        stays the daemon's)."""
        vouched = self.vouched(key, msg.node)
        for name, value in msg.drift.items():
            if name not in held:
                continue
            if not vouched or self.checker.check_value(name, value) is not None:
                self.counters.actions["drift_refused"] += 1
                log.warning("node %s: %s changed by hand to %g, which is not taken as "
                            "current (%s)", msg.node, name, value,
                            "node not vouched for" if not vouched else
                            self.checker.check_value(name, value))
                continue
            self.counters.actions["drift"] += 1
            holders = [p for p in self.peers if name in self.targets(p)]
            if len(holders) > 1:           # one node's copy of a knob every node holds
                log.warning("node %s: %s changed by hand to %g; that node keeps it, the "
                            "others keep %g", msg.node, name, value, self.current[name])
                continue
            log.warning("node %s: %s changed by hand, %g -> %g; the engine now steps "
                        "from %g", msg.node, name, self.current[name], value, value)
            self.current[name] = float(value)
            peer = self.peers.get(msg.node)
            if peer is not None and name in peer.desired:
                peer.desired[name] = float(value)

    def _live(self, peer: ControlPeer, now: float) -> bool:
        """Whether ``peer``'s connection is live: heard from within ``liveness_s`` and
        still connected (``peer_alive`` asked at most once per second)."""
        if not peer.identity or now - peer.last_seen > self.liveness_s:
            return False
        if now < peer.live_until:
            return True
        if self.peer_alive(peer):
            peer.live_until = now + 1.0
            return True
        return False

    def node_allowed(self, node: str) -> bool:
        """A control agent may speak for a node of the allow-list (when there is one)
        that at least one parameter targets: a made-up node gets no say."""
        if self.allowed_nodes and node not in self.allowed_nodes:
            return False
        return bool(self.targets(node))

    # ------------------------------------------------------------------ from the engine

    def decide(self, action: int, values: dict[str, float], tuning: bool,
               check_step: bool = True) -> Verdict:
        """Check an engine action without changing anything (see :meth:`broadcast`).
        ``check_step``: the action must be the one-step change its number stands for."""
        self.counters.actions["submitted"] += 1
        verdict = self.checker.check(action, values, self.current)
        if check_step:
            verdict = self.checker.check_step(action, verdict, self.current)
        verdict = self.checker.check_dwell(verdict, self.current)
        if not verdict.ok:
            self.refuse(verdict.key)
            return verdict
        if not tuning:
            self.counters.actions["tuning_off"] += 1
            return Verdict(dict(self.current), "tuning is off", "tuning_off")
        dry = self.dry_only(n for n, v in verdict.values.items() if v != self.current[n])
        if dry:
            self.counters.actions["dry_run"] += 1
            return Verdict(dict(self.current), f"dry run: the control agents holding "
                           f"{', '.join(dry)} set nothing", "dry_run", dict(verdict.values))
        return verdict

    def dry_only(self, names) -> list[str]:
        """The parameters among ``names`` held by control agents that all run dry (and
        by at least one): a change to them would never happen."""
        out = []
        for name in names:
            holders = [p for p in self.peers.values() if name in self.targets(p.name)]
            if holders and all(p.dry_run for p in holders):
                out.append(name)
        return out

    def preview(self, tick: int, proposed: dict[str, float]) -> int:
        """Send an action held for dry run to its dry-run agents, which log what they
        would set and set nothing; the current values stay. Return agents sent to."""
        now = time.monotonic()
        self.seq += 1
        sent = 0
        for peer in self.peers.values():
            want = {n: proposed[n] for n in self.targets(peer.name) if n in proposed}
            if peer.dry_run and want and want != peer.desired:
                peer.desired, peer.seq, peer.tick = want, self.seq, tick
                sent += self._send(peer, now)
        return sent

    def refuse(self, key: str) -> None:
        """Count a refused action under ``refused`` and ``refused_<key>``."""
        self.counters.actions["refused"] += 1
        self.counters.actions[f"refused_{key}"] += 1

    def submit(self, tick: int, action: int, values: dict[str, float], tuning: bool
               ) -> tuple[Verdict, int, int]:
        """:meth:`decide` (values only, no step rule) then :meth:`broadcast`, with no
        replay DB in between: for tests of the plane alone; the daemon records first."""
        verdict = self.decide(action, values, tuning, check_step=False)
        if not verdict.ok:
            return verdict, 0, 0
        seq, sent = self.broadcast(tick, verdict)
        return verdict, seq, sent

    def broadcast(self, tick: int, verdict: Verdict) -> tuple[int, int]:
        """Make an accepted verdict current and send it to the agents it concerns;
        return (seq, agents sent to)."""
        self.counters.actions["accepted"] += 1
        changed = {n for n, v in verdict.values.items() if v != self.current[n]}
        self.checker.changed(self.current, verdict.values)
        self.current = dict(verdict.values)
        self.decided.update(self.current)        # hello values are no longer adopted
        now = time.monotonic()
        self.seq += 1
        sent = 0
        for peer in self.peers.values():
            want = {n: self.current[n] for n in self.targets(peer.name)}
            in_sync = all(peer.applied.get(n) == v for n, v in want.items())
            if not want or (not changed.intersection(want) and peer.seq == peer.acked
                            and in_sync):
                continue
            peer.desired, peer.seq, peer.tick = want, self.seq, tick
            sent += self._send(peer, now)
        return self.seq, sent

    def resend_due(self, now: float | None = None) -> int:
        """Re-send the latest Action to every agent that has not acked it in time."""
        now = time.monotonic() if now is None else now
        n = 0
        for peer in self.peers.values():
            if peer.seq > peer.acked and now - peer.sent_at >= self.ack_timeout_s:
                n += self._send(peer, now, resend=True)
        return n

    def _send(self, peer: ControlPeer, now: float, resend: bool = False) -> bool:
        peer.sent_at = now
        payload = encode(Action(peer.seq, max(peer.tick, 0), peer.desired))
        if self.send(peer.identity, payload):
            self.counters.actions["resent" if resend else "sent"] += 1
            return True
        self.counters.actions["send_failed"] += 1
        return False
