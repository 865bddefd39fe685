"""Decode many wire messages at once: the interface daemon's ingest at tens of thousands
of frames per second.

:func:`parse_frames` reads every plain Indicators frame of a batch together in numpy:
the header fields (node, seq, tick, full, entry count) and the PI entries, as arrays.
The daemon's ingest (``interface_daemon.node_streams``) applies them without building a
message object per frame. :func:`decode_many` returns exactly what
:func:`~capes.common.protocol.decode` returns (or raises) for each message, on top of it.
A Python loop over each PI of each frame cost the daemon more than everything else on its
ingest path together (~24 changed PIs a frame at 30,000 frames/s is 720,000 entries a
second).

The batch parse only takes plain frames (no PI names, node name shorter than 128 bytes)
and only what it can vouch for: every other message, and every frame whose fields are
not plainly valid (a truncated or trailing entry, an unknown value encoding, a long
varint, an index out of range, a full frame that skips a PI, very many PIs), is marked
not ``ok`` and goes through the one-message decoder, so every error keeps its reason.
Kept apart from ``protocol`` so that the agents, which only use the one-message code,
never import numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import lz4.block
import numpy as np

from capes.common.protocol import (_KIND_BITS, _KIND_BF16, _KIND_F16, _KIND_F24, _KIND_F32,
                                   _KIND_INT, _KIND_NAN, MAX_PIS, MSG_INDICATORS, PROTOCOL_VERSION,
                                   DecodeError, Indicators, Message, decode, encode)

BATCH_MAX_PIS = 256      # frames with more entries are parsed one by one
BATCH_MIN = 16           # fewer frames than this: one by one is cheaper
# the longest body of a frame the batch parse can take (name, seq, tick, flags, entry
# count, entries of at most 8 bytes): longer ones (PI names, many PIs) are read one by
# one and never decompressed into the batch's arrays, so a flood of them costs no memory
MAX_BATCH_BODY = 1 + 127 + 9 + 9 + 1 + 2 + 8 * BATCH_MAX_PIS
_PAD = 16                # zero bytes after the last body: every read lands in the array
_HEAD = bytes((PROTOCOL_VERSION, MSG_INDICATORS))
# payload bytes after the key, by value encoding (INT: a varint, read per entry)
_WIDTH = np.zeros(8, np.int32)
_WIDTH[[_KIND_F32, _KIND_F16, _KIND_F24, _KIND_BF16]] = (4, 2, 3, 2)
_VALID_KIND = np.zeros(8, bool)
_VALID_KIND[[_KIND_F32, _KIND_INT, _KIND_NAN, _KIND_F16, _KIND_F24, _KIND_BF16]] = True


@dataclass
class FrameBatch:
    """The plain Indicators frames of a batch of payloads, as arrays (one entry per
    payload). Where ``ok[i]`` is false the payload is not a plain, valid frame and these
    fields mean nothing (``node[i]`` may still be its node name): decode it one by one.
    Payload ``i``'s PI entries are ``index[first[i]:first[i+1]]`` (the node's PI
    indices, increasing) and ``values[...]``; ``last[i]`` is its last index (-1: none)."""
    ok: np.ndarray
    node: list
    seq: np.ndarray
    tick: np.ndarray
    full: np.ndarray
    n: np.ndarray
    last: np.ndarray
    first: np.ndarray
    index: np.ndarray
    values: np.ndarray

    def message(self, i: int) -> Indicators:
        """Payload ``i`` (an ``ok`` one) as the one-message decoder returns it."""
        a, b = int(self.first[i]), int(self.first[i + 1])
        return Indicators(self.node[i], int(self.seq[i]), int(self.tick[i]), bool(self.full[i]),
                          dict(zip(self.index[a:b].tolist(), self.values[a:b].tolist())))


def decode_many(datas: Sequence[bytes], max_bytes: int = 65536) -> list[Message | DecodeError]:
    """``decode(d, max_bytes)`` for each of ``datas``: the message, or the
    :class:`DecodeError` it raises (returned, not raised)."""
    batch = parse_frames(datas, max_bytes) if len(datas) >= BATCH_MIN else None
    return [batch.message(i) if batch is not None and batch.ok[i] else decode_one(d, max_bytes)
            for i, d in enumerate(datas)]


def decode_one(data: bytes, max_bytes: int = 65536) -> Message | DecodeError:
    """``decode(data)``, or the DecodeError it raises."""
    try:
        return decode(data, max_bytes)
    except DecodeError as exc:
        return exc


def warm_up() -> None:
    """Decode one synthetic batch, so that numpy's one-time costs (lazy imports, first
    allocations) fall at start-up and not on the first burst of traffic."""
    frames = [encode(Indicators("warm-up", s, s, s == 0, {i: i / 3 for i in range(44)}))
              for s in range(BATCH_MIN)]
    decode_many(frames)


def parse_frames(datas: Sequence[bytes], max_bytes: int = 65536) -> FrameBatch:
    """Parse the plain Indicators frames among ``datas`` together (see :class:`FrameBatch`)."""
    count = len(datas)
    node: list = [None] * count
    bodies, where, sizes = [], [], []
    decompress, most = lz4.block.decompress, min(max_bytes, MAX_BATCH_BODY)
    for i, data in enumerate(datas):       # per frame: the envelope, lz4 and the node name
        if data[:2] != _HEAD or not 4 <= len(data) <= max_bytes:
            continue
        size, at = data[2], 3
        if size >= 0x80:
            if data[3] >= 0x80:
                continue                  # bodies of 16 KiB and more (never plain)
            size, at = (size & 0x7F) | data[3] << 7, 4
        if not 0 < size <= most:
            continue
        try:
            body = decompress(data[at:], uncompressed_size=size)
        except Exception:                 # lz4.block.LZ4BlockError: the decoder says why
            continue
        length = body[0]
        if len(body) != size or not 0 < length < 0x80 or length >= size:
            continue
        try:
            node[i] = body[1:1 + length].decode()
        except UnicodeDecodeError:
            continue
        bodies.append(body)
        where.append(i)
        sizes.append(size)
    where = np.array(where, np.int64)
    lengths = np.array(sizes, np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    e = np.frombuffer(b"".join(bodies) + bytes(_PAD), np.uint8)
    size = len(e) - _PAD                     # the first padding byte
    # the header after the node name: seq, tick (varints), flags (full or not), entries
    p = starts + 1 + e[starts]
    ok = p < ends
    seq, p, good = _varints(e, p, ends, 9)
    ok &= good
    tick, p, good = _varints(e, p, ends, 9)
    ok &= good & (p < ends)
    full = e[np.minimum(p, size)]
    ok &= full <= 1
    n, p, good = _varints(e, p + 1, ends, 2)
    ok &= good & (n <= BATCH_MAX_PIS)
    n = np.where(ok, n, 0)
    good, index, values = _entries(e, np.where(ok, p, ends), ends, n, full == 1)
    ok &= good

    out_ok = np.zeros(count, bool)
    out_ok[where] = ok
    counts = np.zeros(count, np.int64)
    counts[where] = n
    first = np.concatenate([[0], np.cumsum(counts)])
    last = np.where(counts > 0, index[np.maximum(first[1:] - 1, 0)] if len(index) else -1, -1)

    def spread(x, dtype):
        out = np.zeros(count, dtype)
        out[where] = x
        return out
    return FrameBatch(out_ok, node, spread(seq, np.int64), spread(tick, np.int64),
                      spread(full == 1, bool), counts, last, first, index, values)


def _varints(e: np.ndarray, p: np.ndarray, ends: np.ndarray,
             most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The varints at positions ``p`` (at most ``most`` bytes, inside their body): their
    values (int64), the positions after them and whether each was readable."""
    value = np.zeros(len(p), np.int64)
    length = np.zeros(len(p), np.int64)
    more = np.ones(len(p), bool)
    for b in range(most):
        byte = e[np.minimum(p + b, len(e) - 1)].astype(np.int64)
        value |= np.where(more, byte & 0x7F, 0) << (7 * b)
        length += more
        more &= byte >= 0x80
    return value, p + length, ~more & (p + length <= ends)


def _varint_lengths(e: np.ndarray, most: int) -> np.ndarray:
    """The length of the varint that would start at each byte of ``e``, capped at
    ``most + 1`` (longer ones are refused anyway); uint8."""
    high = e >> 7
    run = high.copy()                        # run[k]: bytes k..k+b all continue
    length = 1 + high
    for b in range(1, most):
        run[:-b] &= high[b:]
        length += run
    return length


def _entries(e, starts, ends, n, full) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse ``n[r]`` PI entries from ``starts[r]`` for every frame ``r`` together:
    whether each frame's entries are plainly valid (exactly filling its body), and the
    PI index and value of every entry, frame by frame."""
    rows = len(starts)
    size = len(e) - _PAD
    kind = e & 7
    klen = _varint_lengths(e, 3)             # a key: at most 3 bytes (4: refused)
    vlen = _varint_lengths(e, 5)             # an integer value: at most 5 (6: refused)
    width = _WIDTH.astype(np.int64)
    # the entries' positions, one vectorised step per PI for all frames; unclipped, so
    # an entry running past its body never lands exactly on the body's end
    pos = np.empty((rows, int(n.max(initial=0)) + 1), np.int64)
    pos[:, 0] = starts
    for j in range(1, pos.shape[1]):
        at = np.minimum(pos[:, j - 1], size)
        k = kind[at]
        q = at + klen[at]
        pos[:, j] = q + np.where(k == _KIND_INT, vlen[q], width[k])
    ok = pos[np.arange(rows), n] == ends     # no entry past its body, no byte after
    p = np.minimum(pos[:, :-1][np.arange(pos.shape[1] - 1) < n[:, None]], size)
    row = np.repeat(np.arange(rows), n)
    first = np.concatenate([[0], np.cumsum(n)])          # each frame's first entry in p
    k, kl = kind[p], klen[p]
    bad = (kl > 3) | ~_VALID_KIND[k]
    b = e[p].astype(np.int32), e[p + 1].astype(np.int32), e[p + 2].astype(np.int32)
    key = (b[0] & 0x7F) | np.where(kl > 1, (b[1] & 0x7F) << 7, 0) \
        | np.where(kl > 2, (b[2] & 0x7F) << 14, 0)
    gap = (key >> _KIND_BITS) + 1
    total = np.concatenate([[0], np.cumsum(gap)])
    index = total[1:] - np.repeat(total[first[:-1]], n) - 1
    bad |= index >= MAX_PIS

    q = p + kl                               # each entry's value bytes
    b0, b1, b2, b3 = (e[q + i].astype(np.int32) for i in range(4))
    bits = np.select([k == _KIND_F24, k == _KIND_BF16],
                     [(b0 << 8) | (b1 << 16) | (b2 << 24), (b0 << 16) | (b1 << 24)],
                     b0 | (b1 << 8) | (b2 << 16) | (b3 << 24))
    with np.errstate(invalid="ignore"):      # a signalling NaN is quieted, as by struct
        values = bits.astype(np.uint32).view(np.float32).astype(np.float64)
        half = (b0 | (b1 << 8)).astype(np.uint16).view(np.float16).astype(np.float64)
    values = np.where(k == _KIND_F16, half, values)
    values[k == _KIND_NAN] = np.nan
    ints = np.flatnonzero(k == _KIND_INT)
    if len(ints):
        qi = q[ints]
        ql = vlen[qi]
        zz = np.zeros(len(ints), np.int64)
        for i in range(min(5, int(ql.max()))):
            zz |= np.where(ql > i, e[qi + i] & 0x7F, 0).astype(np.int64) << (7 * i)
        bad[ints] |= (ql > 5) | (zz >= 1 << 32)
        values[ints] = (zz >> 1) ^ -(zz & 1)
    ok &= np.bincount(row, weights=bad, minlength=rows) == 0
    if len(index):                           # a full frame carries PIs 0..n-1
        ok &= ~full | (np.where(n > 0, index[np.maximum(first[1:] - 1, 0)], -1) == n - 1)
    return ok, index.astype(np.int64), values
