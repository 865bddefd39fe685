"""The CAPES wire protocol: differential, lz4-compressed, strictly bounded messages.

Four messages travel between agents and the interface daemon (see ``docs/protocol.md``):

* :class:`Indicators` (monitoring agent -> daemon): a node's PIs at one tick. A *full*
  frame carries every PI (and, when asked for or first in a stream, their names); a
  *delta* frame only the PIs whose value changed since the node's previous frame.
* :class:`FullRequest` (daemon -> monitoring agent): "send me a full frame with names".
* :class:`Action` (daemon -> control agent): ABSOLUTE new values, so a lost or repeated
  message can never make a parameter drift.
* :class:`Ack` (control agent -> daemon): the values it actually applied; ``seq=0`` is
  the hello a control agent sends on connect (and as a heartbeat).

Every message is ``version byte, type byte, varint body length, lz4 block of the body``.
Nothing here uses pickle or imports torch. :func:`decode` trusts nothing: every length is
bounded before it is used and every failure is a :class:`DecodeError` whose ``reason``
is one short fixed string, so the daemon can count drops by reason.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Sequence

import lz4.block

PROTOCOL_VERSION = 1

MSG_INDICATORS = 1
MSG_FULL_REQUEST = 2
MSG_ACTION = 3
MSG_ACK = 4

MAX_STRING = 255          # bytes of one node, PI or parameter name
MAX_PIS = 4096            # PIs per node
MAX_PARAMS = 1024         # parameters in one Action or Ack
MAX_SEQ = (1 << 63) - 1   # sequence numbers and ticks are unsigned 63-bit integers

DECODE_REASONS = ("version", "truncated", "oversize", "decompress", "type", "malformed",
                  "unknown_node", "out_of_order", "duplicate", "auth")

# Value encodings of one PI entry (the low 3 bits of its key varint).
_KIND_F32, _KIND_INT, _KIND_NAN, _KIND_F16, _KIND_F24, _KIND_BF16 = 0, 1, 2, 3, 4, 5
_KIND_BITS = 3
_F32 = struct.Struct("<f")
_F16 = struct.Struct("<e")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_NAN_BITS = 0x7FC00000


class DecodeError(ValueError):
    """A message was refused. ``reason`` is one of :data:`DECODE_REASONS` (a counter key)."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass
class Indicators:
    """A node's PIs at ``tick``. ``values`` maps PI index -> value (float32 precision).
    Full frames carry every index 0..n-1; ``names`` is set on full frames that start a
    stream or answer a :class:`FullRequest`."""
    node: str
    seq: int
    tick: int
    full: bool
    values: dict[int, float]
    names: list[str] | None = None


@dataclass
class FullRequest:
    """Daemon -> monitoring agent: send a full frame with names on your next tick. A
    ``reason`` starting with :data:`REFUSED` says instead that the daemon refuses this
    agent's frames (its key is not bound to the node it speaks as)."""
    node: str
    reason: str = ""


REFUSED = "refused:"


@dataclass
class Action:
    """Daemon -> control agent: the ABSOLUTE new values of the parameters it holds."""
    seq: int
    tick: int
    values: dict[str, float]


@dataclass
class Ack:
    """Control agent -> daemon: the values it applied for Action ``seq``; ``seq=0`` is
    the hello (sent on connect and as a heartbeat) naming the node and its current values.
    ``dwell``: seconds before each parameter under its ``min_dwell_s`` may change again
    on the node (a restarted daemon learns them from the hello). On the wire they are
    entries ``"dwell_s <parameter>"`` of the values map: a name with a space is never a
    parameter's, so a daemon that does not know them ignores them. ``dry_run``: the
    agent sets nothing (``--dry-run``), so the daemon records no change as applied; on
    the wire the entry :data:`DRY_RUN_ENTRY` = 1. ``drift``: knobs
    found changed behind the agent's back (by hand), with the value found, which the
    agent now keeps; entries ``"drift <parameter>"`` the same way (protocol version
    unchanged: an older daemon ignores them and an older agent sends none)."""
    node: str
    seq: int
    values: dict[str, float] = field(default_factory=dict)
    dwell: dict[str, float] = field(default_factory=dict)
    dry_run: bool = False
    drift: dict[str, float] = field(default_factory=dict)


DWELL_PREFIX = "dwell_s "
DRIFT_PREFIX = "drift "
DRY_RUN_ENTRY = "mode dry_run"


Message = Indicators | FullRequest | Action | Ack


# --------------------------------------------------------------------------- encoding

def _varint(out: bytearray, n: int) -> None:
    if n < 0 or n > MAX_SEQ:
        raise ValueError(f"integer {n} outside [0, 2^63)")
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _string(out: bytearray, text: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > MAX_STRING:
        raise ValueError(f"name longer than {MAX_STRING} bytes: {text[:40]!r}...")
    _varint(out, len(raw))
    out += raw


def _f32(value: float) -> float:
    """``value`` rounded to float32, the precision of the wire and of the replay DB."""
    try:
        return _F32.unpack(_F32.pack(value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _pi_value(out: bytearray, key: int, value: float) -> None:
    """Append one PI entry in the shortest exact encoding of its float32 value."""
    key <<= _KIND_BITS
    if math.isnan(value):
        _varint(out, key | _KIND_NAN)
        return
    if value.is_integer() and abs(value) < 2 ** 31 and not (value == 0 and
                                                             math.copysign(1, value) < 0):
        n = int(value)
        zz = (n << 1) ^ (n >> 63)
        if zz < 1 << 14:                       # at most 2 bytes
            _varint(out, key | _KIND_INT)
            _varint(out, zz)
            return
    try:
        half = _F16.pack(value)
        if _F16.unpack(half)[0] == value:
            _varint(out, key | _KIND_F16)
            out += half
            return
    except OverflowError:
        pass
    raw = _F32.pack(value)
    if raw[0] == 0 and raw[1] == 0:            # bfloat16: low 16 bits of float32 zero
        _varint(out, key | _KIND_BF16)
        out += raw[2:]
    elif raw[0] == 0:                          # low 8 bits zero
        _varint(out, key | _KIND_F24)
        out += raw[1:]
    elif value.is_integer() and abs(value) < 1 << 20:
        _varint(out, key | _KIND_INT)          # 3 bytes, still shorter than float32
        _varint(out, (int(value) << 1) ^ (int(value) >> 63))
    else:
        _varint(out, key | _KIND_F32)
        out += raw


def quantise(value: float, mantissa_bits: int) -> float:
    """``value`` as float32 rounded to ``mantissa_bits`` explicit mantissa bits (23 =
    float32 itself). 15 bits (relative error <= 1.5e-5) travel in 3 bytes, 7 bits
    (<= 0.4 %) in 2; PIs are measurements far noisier than that."""
    value = _f32(value)
    drop = 23 - mantissa_bits
    if drop <= 0 or not math.isfinite(value):
        return value
    bits = _U32.unpack(_F32.pack(value))[0]
    bits = (bits + (1 << (drop - 1))) & ~((1 << drop) - 1) & 0xFFFFFFFF
    if (bits >> 23) & 0xFF == 0xFF:            # rounded up into infinity: keep the max
        bits = (bits & 0x80000000) | 0x7F7FFFFF
        bits &= ~((1 << drop) - 1)
    return _F32.unpack(_U32.pack(bits))[0]


def _float_map(out: bytearray, values: dict[str, float]) -> None:
    if len(values) > MAX_PARAMS:
        raise ValueError(f"more than {MAX_PARAMS} parameters")
    _varint(out, len(values))
    for name, value in values.items():
        _string(out, name)
        out += _F64.pack(float(value))


def _body(msg: Message) -> tuple[int, bytes]:
    out = bytearray()
    if isinstance(msg, Indicators):
        _string(out, msg.node)
        _varint(out, msg.seq)
        _varint(out, msg.tick)
        out.append((1 if msg.full else 0) | (2 if msg.names is not None else 0))
        if msg.names is not None:
            if len(msg.names) > MAX_PIS:
                raise ValueError(f"more than {MAX_PIS} PIs")
            _varint(out, len(msg.names))
            for name in msg.names:
                _string(out, name)
        indices = sorted(msg.values)
        if len(indices) > MAX_PIS:
            raise ValueError(f"more than {MAX_PIS} PIs")
        _varint(out, len(indices))
        prev = -1
        for i in indices:
            if i < 0 or i >= MAX_PIS:
                raise ValueError(f"PI index {i} outside [0, {MAX_PIS})")
            _pi_value(out, i - prev - 1, _f32(float(msg.values[i])))
            prev = i
        return MSG_INDICATORS, bytes(out)
    if isinstance(msg, FullRequest):
        _string(out, msg.node)
        _string(out, msg.reason)
        return MSG_FULL_REQUEST, bytes(out)
    if isinstance(msg, Action):
        _varint(out, msg.seq)
        _varint(out, msg.tick)
        _float_map(out, msg.values)
        return MSG_ACTION, bytes(out)
    if isinstance(msg, Ack):
        _string(out, msg.node)
        _varint(out, msg.seq)
        flag = {DRY_RUN_ENTRY: 1.0} if msg.dry_run and len(msg.values) < MAX_PARAMS else {}
        extra = {prefix + n: v for prefix, table in ((DWELL_PREFIX, msg.dwell),
                                                     (DRIFT_PREFIX, msg.drift))
                 for n, v in table.items() if len((prefix + n).encode()) <= MAX_STRING}
        room = max(0, MAX_PARAMS - len(msg.values) - len(flag))   # the values fit first
        _float_map(out, {**msg.values, **flag, **dict(list(extra.items())[:room])})
        return MSG_ACK, bytes(out)
    raise TypeError(f"not a CAPES message: {type(msg).__name__}")


def encode(msg: Message) -> bytes:
    """One message as bytes: version, type, body length, lz4 block of the body."""
    kind, body = _body(msg)
    head = bytearray((PROTOCOL_VERSION, kind))
    _varint(head, len(body))
    return bytes(head) + lz4.block.compress(body, store_size=False)


# --------------------------------------------------------------------------- decoding

class _Reader:
    """A bounds-checked cursor over a decompressed body."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise DecodeError("truncated", "body ends early")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        n = shift = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise DecodeError("malformed", "varint too long")
        if n > MAX_SEQ:
            raise DecodeError("malformed", "integer too large")
        return n

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise DecodeError("truncated", "body ends early")
        chunk = self.buf[self.pos:end]
        self.pos = end
        return chunk

    def string(self) -> str:
        n = self.varint()
        if n > MAX_STRING:
            raise DecodeError("malformed", "name too long")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("malformed", "name is not UTF-8") from None

    def count(self, limit: int, what: str) -> int:
        n = self.varint()
        if n > limit:
            raise DecodeError("malformed", f"more than {limit} {what}")
        return n

    def float_map(self) -> dict[str, float]:
        n = self.count(MAX_PARAMS, "parameters")
        out: dict[str, float] = {}
        for _ in range(n):
            name = self.string()
            if name in out:
                raise DecodeError("malformed", f"parameter {name!r} repeated")
            out[name] = _F64.unpack(self.take(8))[0]
        return out

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise DecodeError("malformed", "trailing bytes")


def _pi_values(r: _Reader, n: int) -> tuple[dict[int, float], int]:
    """The ``n`` PI entries at the reader's cursor: {PI index: value} and the last index."""
    values: dict[int, float] = {}
    index = -1
    for _ in range(n):
        key = r.varint()
        index += (key >> _KIND_BITS) + 1
        if index >= MAX_PIS:
            raise DecodeError("malformed", "PI index out of range")
        kind = key & 7
        if kind == _KIND_F32:
            values[index] = _F32.unpack(r.take(4))[0]
        elif kind == _KIND_F16:
            values[index] = _F16.unpack(r.take(2))[0]
        elif kind == _KIND_NAN:
            values[index] = math.nan
        elif kind == _KIND_F24:
            values[index] = _F32.unpack(b"\0" + r.take(3))[0]
        elif kind == _KIND_BF16:
            values[index] = _F32.unpack(b"\0\0" + r.take(2))[0]
        elif kind != _KIND_INT:
            raise DecodeError("malformed", f"unknown value encoding {kind}")
        else:
            zz = r.varint()
            if zz >= 1 << 32:
                raise DecodeError("malformed", "integer PI too large")
            values[index] = float((zz >> 1) ^ -(zz & 1))
    return values, index


@dataclass
class _Head:
    """An Indicators body read up to its PI entries (``pos``: where they start)."""
    node: str
    seq: int
    tick: int
    full: bool
    names: list[str] | None
    n: int
    pos: int


def _indicators_head(r: _Reader) -> _Head:
    node = r.string()
    if not node:
        raise DecodeError("malformed", "empty node name")
    seq = r.varint()
    tick = r.varint()
    flags = r.byte()
    if flags & ~3:
        raise DecodeError("malformed", "unknown flags")
    full = bool(flags & 1)
    names = None
    if flags & 2:
        if not full:
            raise DecodeError("malformed", "names on a delta frame")
        names = [r.string() for _ in range(r.count(MAX_PIS, "PIs"))]
        if len(set(names)) != len(names):
            raise DecodeError("malformed", "PI name repeated")
    n = r.count(MAX_PIS, "PIs")
    return _Head(node, seq, tick, full, names, n, r.pos)


def _indicators(head: _Head, values: dict[int, float], index: int) -> Indicators:
    """The message of ``head`` and its PI entries (``index``: the last one's PI)."""
    n = head.n
    if head.full and index != n - 1:
        raise DecodeError("malformed", "full frame does not carry every PI")
    if head.names is not None and len(head.names) != n:
        raise DecodeError("malformed", f"{len(head.names)} names for {n} values")
    return Indicators(head.node, head.seq, head.tick, head.full, values, head.names)


def _open(data: bytes, max_bytes: int) -> tuple[int, _Reader]:
    """Check a message's header and decompress its body: (message type, body reader)."""
    if len(data) > max_bytes:
        raise DecodeError("oversize", f"{len(data)} bytes > {max_bytes}")
    if len(data) < 3:
        raise DecodeError("truncated", "shorter than a header")
    if data[0] != PROTOCOL_VERSION:
        raise DecodeError("version", f"version {data[0]}, this CAPES speaks "
                                     f"{PROTOCOL_VERSION}")
    kind = data[1]
    if kind not in (MSG_INDICATORS, MSG_FULL_REQUEST, MSG_ACTION, MSG_ACK):
        raise DecodeError("type", f"unknown message type {kind}")
    head = _Reader(bytes(data[2:12]))
    size = head.varint()
    if size > max_bytes:
        raise DecodeError("oversize", f"body of {size} bytes > {max_bytes}")
    packed = bytes(data[2 + head.pos:])
    if size == 0:
        raise DecodeError("malformed", "empty body")
    try:
        body = lz4.block.decompress(packed, uncompressed_size=size)
    except Exception as exc:     # lz4.block.LZ4BlockError and friends
        raise DecodeError("decompress", str(exc)) from None
    if len(body) != size:
        raise DecodeError("decompress", f"body is {len(body)} bytes, header says {size}")
    return kind, _Reader(body)


def _decode_body(kind: int, r: _Reader) -> Message:
    """The message of type ``kind`` in the body ``r`` (every byte of it)."""
    if kind == MSG_INDICATORS:
        head = _indicators_head(r)
        msg: Message = _indicators(head, *_pi_values(r, head.n))
    elif kind == MSG_FULL_REQUEST:
        msg = FullRequest(r.string(), r.string())
    elif kind == MSG_ACTION:
        msg = Action(r.varint(), r.varint(), r.float_map())
    else:
        node = r.string()
        if not node:
            raise DecodeError("malformed", "empty node name")
        seq, entries = r.varint(), r.float_map()
        dwell = {n[len(DWELL_PREFIX):]: v for n, v in entries.items()
                 if n.startswith(DWELL_PREFIX)}
        dry_run = entries.pop(DRY_RUN_ENTRY, 0.0) == 1.0
        drift = {n[len(DRIFT_PREFIX):]: v for n, v in entries.items()
                 if n.startswith(DRIFT_PREFIX)}
        values = {n: v for n, v in entries.items()
                  if not n.startswith((DWELL_PREFIX, DRIFT_PREFIX))}
        msg = Ack(node, seq, values, dwell, dry_run=dry_run, drift=drift)
    r.end()
    return msg


def decode(data: bytes, max_bytes: int = 65536) -> Message:
    """Parse one message; raise :class:`DecodeError` for anything not exactly valid.
    ``max_bytes`` bounds both the message and its decompressed body (no lz4 bombs).
    (:func:`capes.common.frame_batch.decode_many` parses many at once, for the daemon.)"""
    return _decode_body(*_open(data, max_bytes))


# --------------------------------------------------------------------------- delta streams

class DeltaEncoder:
    """Monitoring-agent side of one node's stream: sends only the PIs that changed.

    The first frame is full and carries the names; then a full frame (values only) every
    ``full_every`` frames, and a full frame with names after :meth:`request_full`.
    Values travel as float32, the replay DB's precision; ``mantissa_bits`` < 23 rounds
    them further (see :func:`quantise`), which makes messages smaller and stops jitter
    below that precision from counting as a change.
    """

    def __init__(self, node: str, names: list[str], full_every: int = 60,
                 mantissa_bits: int = 23):
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        if not 1 <= mantissa_bits <= 23:
            raise ValueError("mantissa_bits must be in [1, 23]")
        if len(set(names)) != len(names):
            raise ValueError("PI names must be unique")
        if len(names) > MAX_PIS:
            raise ValueError(f"more than {MAX_PIS} PIs")
        self.node = node
        self.names = list(names)
        self.full_every = full_every
        self.mantissa_bits = mantissa_bits
        self.seq = 0
        self._last: list[int] | None = None
        self._since_full = 0
        self._want_names = True

    def request_full(self) -> None:
        """The daemon asked: the next frame is full and carries the names."""
        self._want_names = True

    def message(self, tick: int, values: Sequence[float]) -> Indicators:
        """The next frame as a message (``frame`` encodes it)."""
        if len(values) != len(self.names):
            raise ValueError(f"{len(values)} values for {len(self.names)} PIs")
        m = self.mantissa_bits
        vals = [quantise(float(v), m) for v in values]
        bits = [_NAN_BITS if v != v else _U32.unpack(_F32.pack(v))[0] for v in vals]
        full = self._want_names or self._last is None or self._since_full >= self.full_every
        if full:
            changed = dict(enumerate(vals))
            self._since_full = 0
        else:
            last = self._last
            changed = {i: v for i, (v, b) in enumerate(zip(vals, bits)) if b != last[i]}
        self._since_full += 1
        msg = Indicators(self.node, self.seq, int(tick), full, changed,
                         list(self.names) if self._want_names else None)
        self._want_names = False
        self._last = bits
        self.seq += 1
        return msg

    def frame(self, tick: int, values: Sequence[float]) -> bytes:
        """Encode the PIs of ``tick``: only the changed ones unless a full frame is due."""
        return encode(self.message(tick, values))


class DeltaDecoder:
    """Daemon side of one node's stream: rebuilds the node's full PI vector.

    :meth:`apply` returns the vector after a frame, or None when it cannot be rebuilt
    (no full frame yet, or a gap in the sequence); then ``pending_full`` says why and
    the daemon should send a :class:`FullRequest`. A full frame with names and ``seq``
    0 starts a new stream (the agent restarted).
    """

    def __init__(self, node: str):
        self.node = node
        self.names: list[str] | None = None
        # the node's PIs (a list here; the daemon's batched ingest keeps a numpy array)
        self.vector: list[float] | None = None
        self.last_seq: int | None = None
        self.pending_full: str | None = "unknown_node"

    def apply(self, msg: Indicators) -> list[float] | None:
        if msg.node != self.node:
            raise DecodeError("malformed", f"frame of node {msg.node!r} sent to {self.node!r}")
        restart = msg.full and msg.names is not None and msg.seq == 0
        if self.last_seq is not None and msg.seq <= self.last_seq and not (
                restart and self.last_seq > 0):
            if msg.seq == self.last_seq:
                raise DecodeError("duplicate", f"seq {msg.seq} again")
            self.pending_full = self.pending_full or "out_of_order"
            raise DecodeError("out_of_order", f"seq {msg.seq} after {self.last_seq}")
        in_order = self.last_seq is not None and msg.seq == self.last_seq + 1
        self.last_seq = msg.seq
        if msg.full:
            if msg.names is not None:
                self.names = list(msg.names)
            if self.names is None or len(msg.values) != len(self.names):
                self.vector = None
                self.pending_full = "unknown_node" if self.names is None else "gap"
                return None
            self.vector = [msg.values[i] for i in range(len(msg.values))]
            self.pending_full = None
            return list(self.vector)
        if self.vector is None or not in_order:
            if self.vector is not None:
                self.vector = None
                self.pending_full = "gap"
            elif self.pending_full is None:
                self.pending_full = "gap"
            return None
        vector = self.vector
        if msg.values and max(msg.values) >= len(vector):
            self.vector = None
            self.pending_full = "gap"
            raise DecodeError("malformed", "delta names a PI beyond the node's names")
        for i, v in msg.values.items():
            vector[i] = v
        return list(vector)
