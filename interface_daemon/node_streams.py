"""Ingest: one differential stream per monitored node, rebuilt into replay-DB rows.

Each node's frames go through its own :class:`~capes.common.protocol.DeltaDecoder`. The DB
session has ONE PI-name list shared by all nodes: a node's names are mapped into it by
name (new names are appended), and its row holds NaN for PIs it does not have. No
socket here, so the logic is testable on its own; the daemon feeds it payloads.

Nothing a client sends can grow the daemon without bound: nodes, PI names per node, PI
names in the session and name lengths are capped, ticks must lie near the daemon's
clock, node names must be in the allow-list when there is one, and a tick a node has
already sent is never stored again (history is append-only). A second connection
claiming a node that is live (heard from within ``liveness_s`` and its connection still
there, ``peer_alive``) is refused (``node_live``); the same agent reconnecting after its
old connection died is not. Each refusal is a drop reason the daemon counts.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from capes.common.frame_batch import decode_many, warm_up
from capes.common.protocol import DecodeError, DeltaDecoder, Indicators, Message, decode


BATCH_BYTES = 16 << 10     # payload bytes decoded together (handle_many)


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
    announced: set[str] = field(default_factory=set)   # every PI name it has used
    last_tick: int = -1
    last_seen: float = 0.0
    messages: int = 0
    last_full_request: float = -math.inf
    live_until: float = -math.inf        # its connection was found alive: trust it until


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


def tick_in_range(tick: int, tick_seconds: float, max_skew_s: float,
                  now: float | None = None) -> bool:
    """Whether ``tick`` lies within ``max_skew_s`` of the wall clock. Agents tick on
    wall-clock boundaries; a tick far away would make replay-DB readers allocate for
    the gap, so frames and actions outside the window are refused."""
    now = time.time() if now is None else now
    return abs(tick * tick_seconds - now) <= max_skew_s


@dataclass
class Ingest:
    max_nodes: int = 1024
    max_bytes: int = 65536
    full_request_every_s: float = 1.0
    tick_seconds: float = 1.0
    max_clock_skew_s: float = 300.0       # agents tick on wall-clock boundaries
    max_pis_per_node: int = 4096          # distinct PI names one node may announce
    max_pi_name_bytes: int = 128
    max_session_pis: int = 65_535         # PI names of all nodes together
    allowed_nodes: frozenset[str] = frozenset()            # empty: any node name
    may_speak: Callable[[str | None, str], bool] = lambda key, node: True   # key binding
    liveness_s: float = 15.0              # heard from this recently: the node is live
    peer_alive: Callable[[NodeStream], bool] = lambda stream: False  # its connection is up
    # node -> newest tick an earlier daemon stored for it: resends of those are dropped
    resume_ticks: dict[str, int] = field(default_factory=dict)
    streams: dict[str, NodeStream] = field(default_factory=dict)
    pi_names: list[str] = field(default_factory=list)      # the session's PI layout
    node_names: list[str] = field(default_factory=list)    # the session's node layout
    latest_tick: int = -1

    def __post_init__(self):
        if not self.max_clock_skew_s > 0:
            raise ValueError("max_clock_skew_s must be > 0")
        self._pi_index = {n: i for i, n in enumerate(self.pi_names)}
        warm_up()

    def handle(self, payload: bytes, identity: bytes = b"", key: str | None = None,
               now: float | None = None) -> Outcome:
        """Decode and apply one indicator payload from peer ``identity`` (CURVE key
        name ``key``). Never raises for bad input: it becomes ``Outcome.drop``."""
        try:
            msg = decode(payload, self.max_bytes)
        except DecodeError as exc:
            msg = exc
        return self.apply(msg, identity, key, now)

    def handle_many(self, messages: list[tuple[bytes, bytes, str | None]]) -> list[Outcome]:
        """:meth:`handle` for each (identity, payload, key) of ``messages``, in order;
        their frames are decoded together (:func:`~capes.common.frame_batch.decode_many`),
        BATCH_BYTES of payload at a time: what a batch decodes is held until it is
        applied, so a flood of big frames must not pile up."""
        out: list[Outcome] = []
        start = 0
        while start < len(messages):
            end, size = start, 0
            while end < len(messages) and (end == start or size < BATCH_BYTES):
                size += len(messages[end][1])
                end += 1
            chunk = messages[start:end]
            decoded = decode_many([payload for _, payload, _ in chunk], self.max_bytes)
            out += [self.apply(msg, identity, key)
                    for (identity, _, key), msg in zip(chunk, decoded)]
            start = end
        return out

    def apply(self, msg: Message | DecodeError, identity: bytes = b"", key: str | None = None,
              now: float | None = None) -> Outcome:
        """Apply one decoded payload (or the error decoding it raised)."""
        now = time.monotonic() if now is None else now
        if isinstance(msg, DecodeError):
            return Outcome(drop=msg.reason)
        if not isinstance(msg, Indicators):
            return Outcome(drop="type")
        if not tick_in_range(msg.tick, self.tick_seconds, self.max_clock_skew_s):
            return Outcome(drop="tick_range")
        if self.allowed_nodes and msg.node not in self.allowed_nodes:
            return Outcome(drop="node_not_allowed")
        if not self.may_speak(key, msg.node):
            return Outcome(drop="key_not_bound")          # the key is bound to other nodes
        stream = self.streams.get(msg.node)
        if stream is None:
            if len(self.streams) >= self.max_nodes:
                return Outcome(drop="too_many_nodes")
            stream = self.streams[msg.node] = NodeStream(msg.node, DeltaDecoder(msg.node), key)
            stream.last_tick = self.resume_ticks.pop(msg.node, -1)
        elif stream.key != key:
            return Outcome(stream=stream, drop="auth")   # another key speaks for this node
        elif identity != stream.identity and self._live(stream, now):
            return Outcome(stream=stream, drop="node_live")  # a second connection
        if stream.identity and identity != stream.identity:
            # a new connection: deltas wait for a full frame, and sequence numbers start
            # afresh (a restarted agent counts from 0; had its first frame been lost, the
            # old agent's higher numbers would refuse it for minutes). Ticks, not
            # sequence numbers, keep history append-only.
            stream.decoder.vector = None
            stream.decoder.last_seq = None
        stream.identity = identity
        stream.last_seen = now
        stream.messages += 1
        out = Outcome(stream=stream, tick=msg.tick)
        out.drop = self._refuse_names(stream, msg.names)
        vector = None
        if out.drop is None:
            try:
                vector = stream.decoder.apply(msg)
            except DecodeError as exc:
                out.drop = exc.reason
        if out.drop is None and vector is not None and msg.tick <= stream.last_tick:
            out.drop, vector = "replayed", None          # append-only: never rewrite a tick
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

    def _live(self, stream: NodeStream, now: float) -> bool:
        """Whether ``stream``'s connection is live: heard from within ``liveness_s`` and
        still connected (asked of ``peer_alive`` at most once per
        ``full_request_every_s``, since the daemon's probe reaches the live agent)."""
        if not stream.identity or now - stream.last_seen > self.liveness_s:
            return False
        if now < stream.live_until:
            return True
        if self.peer_alive(stream):
            stream.live_until = now + self.full_request_every_s
            return True
        return False

    def _refuse_names(self, stream: NodeStream, names: list[str] | None) -> str | None:
        """Why a frame announcing ``names`` is refused (None: it is not): names too long,
        or more distinct names than the node or the session may have. Checked before
        the decoder keeps them, so a name flood costs the daemon no memory."""
        if names is None:
            return None
        if any(len(n.encode()) > self.max_pi_name_bytes for n in names):
            return "pi_name_length"
        new = [n for n in names if n not in stream.announced]
        if len(stream.announced) + len(new) > self.max_pis_per_node:
            return "too_many_pis"
        unseen = sum(1 for n in new if n not in self._pi_index)
        if len(self.pi_names) + unseen > self.max_session_pis:
            return "too_many_pis"
        return None

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
            stream.announced.update(names)
        return grew
