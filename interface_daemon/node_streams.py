"""Ingest: one differential stream per monitored node, rebuilt into replay-DB rows.

Each node's frames go through its own :class:`~capes.common.protocol.DeltaDecoder`. The DB
session has ONE PI-name list shared by all nodes: a node's names are mapped into it by
name (new names are appended), and its row holds NaN for PIs it does not have. No
socket here, so the logic is testable on its own; the daemon feeds it payloads.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from capes.common.protocol import DecodeError, DeltaDecoder, Indicators, decode


@dataclass
class NodeStream:
    """What the daemon knows about one monitored node."""
    name: str
    decoder: DeltaDecoder
    key: str | None = None               # CURVE client key that first spoke for it
    identity: bytes = b""                # ROUTER identity of its latest connection
    index: int = -1                      # node index in the DB session
    pi_map: np.ndarray | None = None     # node PI index -> session PI index
    mapped_names: list[str] | None = None
    last_tick: int = -1
    last_seen: float = 0.0
    messages: int = 0
    last_full_request: float = -math.inf


@dataclass
class Outcome:
    """What one payload produced: a row to write, or the reason it was dropped; and
    whether to send the node a FullRequest (and why)."""
    stream: NodeStream | None = None
    tick: int = -1
    row: np.ndarray | None = None
    drop: str | None = None
    full_request: str | None = None
    layout_grew: bool = False


@dataclass
class Ingest:
    max_nodes: int = 1024
    max_bytes: int = 65536
    full_request_every_s: float = 1.0
    tick_seconds: float = 1.0
    max_clock_skew_s: float = 300.0       # agents tick on wall-clock boundaries; 0: off
    streams: dict[str, NodeStream] = field(default_factory=dict)
    pi_names: list[str] = field(default_factory=list)      # the session's PI layout
    node_names: list[str] = field(default_factory=list)    # the session's node layout
    latest_tick: int = -1

    def __post_init__(self):
        self._pi_index = {n: i for i, n in enumerate(self.pi_names)}

    def handle(self, payload: bytes, identity: bytes = b"", key: str | None = None,
               now: float | None = None) -> Outcome:
        """Decode and apply one indicator payload from peer ``identity`` (CURVE key
        name ``key``). Never raises for bad input: it becomes ``Outcome.drop``."""
        now = time.monotonic() if now is None else now
        try:
            msg = decode(payload, self.max_bytes)
        except DecodeError as exc:
            return Outcome(drop=exc.reason)
        if not isinstance(msg, Indicators):
            return Outcome(drop="type")
        # a tick far from the daemon's own clock would make readers allocate for the gap
        if (self.max_clock_skew_s and
                abs(msg.tick * self.tick_seconds - time.time()) > self.max_clock_skew_s):
            return Outcome(drop="tick_range")
        stream = self.streams.get(msg.node)
        if stream is None:
            if len(self.streams) >= self.max_nodes:
                return Outcome(drop="too_many_nodes")
            stream = self.streams[msg.node] = NodeStream(msg.node, DeltaDecoder(msg.node), key)
        elif stream.key != key:
            return Outcome(stream=stream, drop="auth")   # another key speaks for this node
        stream.identity = identity
        stream.last_seen = now
        stream.messages += 1
        out = Outcome(stream=stream, tick=msg.tick)
        try:
            vector = stream.decoder.apply(msg)
        except DecodeError as exc:
            out.drop = exc.reason
            vector = None
        if vector is None:
            out.drop = out.drop or stream.decoder.pending_full or "gap"
        else:
            out.layout_grew = self._map(stream)
            row = np.full(len(self.pi_names), np.nan, np.float32)
            row[stream.pi_map] = vector
            out.row = row
            stream.last_tick = msg.tick
            self.latest_tick = max(self.latest_tick, msg.tick)
        pending = stream.decoder.pending_full
        if pending and now - stream.last_full_request >= self.full_request_every_s:
            stream.last_full_request = now
            out.full_request = pending
        return out

    def _map(self, stream: NodeStream) -> bool:
        """Place the node and its PI names in the session layout; True if it grew."""
        grew = False
        if stream.index < 0:
            stream.index = len(self.node_names)
            self.node_names.append(stream.name)
            grew = True
        names = stream.decoder.names
        if stream.mapped_names is not names:
            idx = []
            for name in names:
                i = self._pi_index.get(name)
                if i is None:
                    i = self._pi_index[name] = len(self.pi_names)
                    self.pi_names.append(name)
                    grew = True
                idx.append(i)
            stream.pi_map = np.array(idx, np.int64)
            stream.mapped_names = names
        return grew
