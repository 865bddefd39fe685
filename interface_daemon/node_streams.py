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

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from capes.common.frame_batch import BATCH_MIN, FrameBatch, decode_one, parse_frames, warm_up
from capes.common.protocol import DecodeError, DeltaDecoder, Indicators, Message, decode


log = logging.getLogger("capes.interface_daemon")

BATCH_BYTES = 256 << 10    # payload bytes parsed together (handle_many): what a chunk
#                            decodes is held until applied, so big frames must not pile up


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
    node: str = ""                   # the node a refused message named (key_not_bound)


@dataclass
class Rows:
    """Rows of many frames applied together (:meth:`Ingest.handle_many`): for each, its
    position in the batch, tick, node index in the DB session and PI row (float32 in the
    session's PI order, NaN where the node has no such PI; as wide as the session's PI
    list was when the batch began)."""
    at: list[int]
    ticks: np.ndarray
    nodes: np.ndarray
    rows: np.ndarray

    @classmethod
    def none(cls, width: int = 0) -> "Rows":
        return cls([], np.zeros(0, np.int64), np.zeros(0, np.int64),
                   np.zeros((0, width), np.float32))


@dataclass
class Handled:
    """What :meth:`Ingest.handle_many` made of a batch: blocks of :class:`Rows` from the
    frames it applied together (in batch order; a later block may be wider), and an
    :class:`Outcome` for every other message, as (position, outcome) in batch order."""
    blocks: list[Rows]
    outcomes: list[tuple[int, Outcome]]


class _Chain:
    """A node's frames in one batch that extend its stream in order (the fast path):
    their positions, and the sequence number and tick of the last one."""
    __slots__ = ("stream", "seq", "tick", "width", "at")

    def __init__(self, stream: NodeStream, seq: int, tick: int, width: int):
        self.stream, self.seq, self.tick, self.width = stream, seq, tick, width
        self.at: list[int] = []


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
    fast_path_errors: int = 0             # batched ingest failed (a bug): applied one by one

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

    def handle_many(self, messages: list[tuple[bytes, bytes, str | None]]) -> Handled:
        """:meth:`handle` for each (identity, payload, key) of ``messages``, in order, at
        tens of thousands a second: BATCH_BYTES of payload at a time are parsed together
        (:func:`~capes.common.frame_batch.parse_frames`), and the frames that simply
        extend a known node's stream (its connection and key, the next sequence number
        or a full frame, a newer tick inside the clock window, no names) are applied
        together in numpy: their rows come back in blocks of :class:`Rows`. Every other message
        goes through :meth:`apply`, after the node's frames applied together (a node's
        frames after its first one that needs :meth:`apply` all go through it), so each
        node's frames take effect in order and every refusal keeps its reason."""
        blocks, outcomes = [], []
        cuts, size = [], 0
        for i, (_, payload, _) in enumerate(messages):
            if size >= BATCH_BYTES:
                cuts.append(i)
                size = 0
            size += len(payload)
        for start, end in zip([0] + cuts, cuts + [len(messages)]):
            rows, slow = self._handle_chunk(messages[start:end])
            if rows.at:
                rows.at = [start + i for i in rows.at]
                blocks.append(rows)
            outcomes += [(start + i, out) for i, out in slow]
        return Handled(blocks, outcomes)

    def _handle_chunk(self, messages: list[tuple[bytes, bytes, str | None]]
                      ) -> tuple[Rows, list[tuple[int, Outcome]]]:
        """:meth:`handle_many` for one chunk of messages: (rows, other outcomes)."""
        width = len(self.pi_names)
        if len(messages) >= BATCH_MIN:       # fewer: one by one is cheaper
            try:
                return self._fast_chunk(messages, width)
            except Exception:                # a bug, never bad input: cost nothing, say it
                self.fast_path_errors += 1
                if self.fast_path_errors == 1:
                    log.exception("batched ingest failed; these frames are applied one "
                                  "by one (reported once)")
        return Rows.none(width), [(i, self.handle(payload, identity, key))
                                  for i, (identity, payload, key) in enumerate(messages)]

    def _fast_chunk(self, messages: list[tuple[bytes, bytes, str | None]], width: int
                    ) -> tuple[Rows, list[tuple[int, Outcome]]]:
        """The chains applied together, then every other message one by one. Nothing is
        changed before the chains are written back, so an error before then leaves the
        chunk to be applied one by one."""
        batch = parse_frames([payload for _, payload, _ in messages], self.max_bytes)
        near = np.abs(batch.tick * self.tick_seconds - time.time()) <= self.max_clock_skew_s
        fast = (batch.ok & near).tolist()
        seqs, ticks, fulls = batch.seq.tolist(), batch.tick.tolist(), batch.full.tolist()
        counts, lasts = batch.n.tolist(), batch.last.tolist()
        chains: dict[str, _Chain] = {}
        broken: set[str] = set()             # nodes with a frame for apply() in this chunk
        slow: list[int] = []
        for i, (identity, _, key) in enumerate(messages):
            node = batch.node[i]
            if fast[i] and node not in broken:
                chain = chains.get(node) or self._chain(node, key, identity, chains)
                if chain is not None and key == chain.stream.key and \
                        identity == chain.stream.identity and ticks[i] > chain.tick and (
                            seqs[i] > chain.seq and counts[i] == chain.width if fulls[i]
                            else seqs[i] == chain.seq + 1 and lasts[i] < chain.width):
                    chain.seq, chain.tick = seqs[i], ticks[i]
                    chain.at.append(i)
                    continue
            if node is None:
                # not a plain frame: whose is it? (decoded again below, so that a chunk
                # of PI-name floods is never held in memory at once)
                msg = decode_one(messages[i][1], self.max_bytes)
                node = msg.node if isinstance(msg, Indicators) else None
            if node is not None:
                broken.add(node)
            slow.append(i)
        rows = self._apply_chains([c for c in chains.values() if c.at], batch, width)
        outcomes = []                        # (from here on, nothing raises for bad input)
        for i in slow:
            identity, payload, key = messages[i]
            msg = batch.message(i) if batch.ok[i] else decode_one(payload, self.max_bytes)
            outcomes.append((i, self.apply(msg, identity, key)))
        return rows, outcomes

    def _chain(self, node: str, key: str | None, identity: bytes,
               chains: dict[str, _Chain]) -> _Chain | None:
        """A chain for ``node``'s frames in this batch, when its stream is one they can
        simply extend: known, allowed, rebuilt (no full frame awaited) and mapped into
        the session; None otherwise (its frames go through :meth:`apply`)."""
        stream = self.streams.get(node)
        if stream is None or stream.key != key or stream.identity != identity:
            return None
        dec = stream.decoder
        if dec.vector is None or dec.pending_full is not None or dec.last_seq is None \
                or stream.index < 0 or stream.mapped_names is not dec.names:
            return None
        if (self.allowed_nodes and node not in self.allowed_nodes) or \
                not self.may_speak(key, node):
            return None
        chain = chains[node] = _Chain(stream, dec.last_seq, stream.last_tick, len(dec.vector))
        return chain

    def _apply_chains(self, chains: list[_Chain], batch: FrameBatch, width: int) -> Rows:
        """Apply every chain's frames (full and delta) to its node's vector at once: each
        frame's entries are written into its own row, and a forward fill down each node's
        rows (from the node's vector before the batch) carries what did not change."""
        if not chains:
            return Rows.none(width)
        now = time.monotonic()
        sizes = np.array([len(c.at) for c in chains])
        base = np.concatenate([[0], np.cumsum(sizes + 1)[:-1]])    # each node's first row
        at = np.array([i for c in chains for i in c.at])          # frames, node by node
        group = np.repeat(np.arange(len(chains)), sizes)
        row_of = np.arange(len(at)) + group + 1                   # each frame's row
        table = np.full((len(at) + len(chains), width), np.nan)
        known = np.zeros(table.shape, bool)
        known[base] = True
        # each node's PI map, all together: the columns of its vector in the table
        maps = [c.stream.pi_map for c in chains]
        lens = np.array([len(m) for m in maps])
        offset = np.concatenate([[0], np.cumsum(lens)[:-1]])
        cols = np.concatenate(maps)
        table[np.repeat(base, lens), cols] = np.concatenate(
            [c.stream.decoder.vector for c in chains])
        # every entry of those frames: its row, and its column via the node's PI map
        n, first = batch.n[at], batch.first[at]
        entry = np.arange(int(n.sum())) + np.repeat(first - (np.cumsum(n) - n), n)
        col = cols[np.repeat(offset[group], n) + batch.index[entry]]
        r = np.repeat(row_of, n)
        table[r, col] = batch.values[entry]
        known[r, col] = True
        # forward fill: each cell takes the latest row at or above it that set it
        src = np.where(known, np.arange(len(table))[:, None], 0)
        np.maximum.accumulate(src, axis=0, out=src)
        table = table[src, np.arange(width)]
        # each node's vector after its last frame (a numpy array: DeltaDecoder takes it)
        flat = table[np.repeat(base + sizes, lens), cols]
        for c, k, a, b in zip(chains, sizes.tolist(), offset.tolist(), (offset + lens).tolist()):
            st = c.stream
            # a copy: a view would keep the whole batch's array alive as long as the node
            st.decoder.vector, st.decoder.last_seq = flat[a:b].copy(), c.seq
            st.last_tick, st.last_seen = c.tick, now
            st.messages += k
        self.latest_tick = max(self.latest_tick, max(c.tick for c in chains))
        order = np.argsort(at, kind="stable")
        nodes = np.array([c.stream.index for c in chains])[group]
        return Rows(at[order].tolist(), batch.tick[at[order]], nodes[order],
                    table[row_of[order]].astype(np.float32))

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
            return Outcome(drop="key_not_bound", node=msg.node)   # bound to other nodes
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

