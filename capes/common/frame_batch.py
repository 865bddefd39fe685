"""Decode many wire messages at once: the interface daemon's ingest at tens of thousands
of frames per second.

:func:`decode_many` returns exactly what :func:`~capes.common.protocol.decode` returns
(or raises) for each message, but parses the PI entries of every Indicators frame in the
batch together in numpy. A Python loop over each PI of each frame cost the daemon more
than everything else on its ingest path together (~24 changed PIs a frame at 30,000
frames/s is 720,000 entries a second).

The batch parse only takes plain frames (no PI names, short header fields) and only
what it can vouch for: every other message, and every frame whose entries are not plainly
valid (a truncated or trailing entry, an unknown value encoding, a long varint, an index
out of range, a full frame that skips a PI, very many PIs), goes through the one-message
decoder, so every error keeps its reason. Kept apart from ``protocol`` so that the
agents, which only use the one-message code, never import numpy.
"""
from __future__ import annotations

from typing import Sequence

import lz4.block
import numpy as np

from capes.common.protocol import (_KIND_BITS, _KIND_BF16, _KIND_F16, _KIND_F24, _KIND_F32,
                                   _KIND_INT, _KIND_NAN, MAX_PIS, MSG_INDICATORS, PROTOCOL_VERSION,
                                   DecodeError, Indicators, Message, _Head, _indicators, _open,
                                   _pi_values, _Reader, decode, encode)

BATCH_MAX_PIS = 256      # frames with more entries are parsed one by one
BATCH_MIN = 16           # fewer frames than this: one by one is cheaper
_PAD = 16                # zero bytes after the last body: every read lands in the array
# payload bytes after the key, by value encoding (INT: a varint, read per entry)
_WIDTH = np.zeros(8, np.int32)
_WIDTH[[_KIND_F32, _KIND_F16, _KIND_F24, _KIND_BF16]] = (4, 2, 3, 2)
_VALID_KIND = np.zeros(8, bool)
_VALID_KIND[[_KIND_F32, _KIND_INT, _KIND_NAN, _KIND_F16, _KIND_F24, _KIND_BF16]] = True


def decode_many(datas: Sequence[bytes], max_bytes: int = 65536) -> list[Message | DecodeError]:
    """``decode(d, max_bytes)`` for each of ``datas``: the message, or the
    :class:`DecodeError` it raises (returned, not raised)."""
    out: list = [None] * len(datas)
    batch: list[tuple[int, _Head, bytes]] = []
    for i, data in enumerate(datas):
        plain = _plain_head(data, max_bytes)
        if plain is not None and plain[0].n <= BATCH_MAX_PIS:
            batch.append((i, *plain))
            continue
        try:                     # the rest (names, other types, errors): one by one
            out[i] = decode(data, max_bytes)
        except DecodeError as exc:
            out[i] = exc
    if len(batch) < BATCH_MIN:
        for i, head, body in batch:
            out[i] = _one(head, body)
    elif batch:
        for (i, head, body), msg in zip(batch, _entries(batch)):
            out[i] = msg if msg is not None else _one(head, body)
    return out


def warm_up() -> None:
    """Decode one synthetic batch, so that numpy's one-time costs (lazy imports, first
    allocations) fall at start-up and not on the first burst of traffic."""
    frames = [encode(Indicators("warm-up", s, s, s == 0, {i: i / 3 for i in range(44)}))
              for s in range(BATCH_MIN)]
    decode_many(frames)


def _plain_head(data: bytes, max_bytes: int) -> tuple[_Head, bytes] | None:
    """The header and body of a plain Indicators frame (no names, node name and
    integers short), read inline; None for anything else, which the one-message code
    then reads (and says what is wrong with it)."""
    if not 4 <= len(data) <= max_bytes or data[0] != PROTOCOL_VERSION \
            or data[1] != MSG_INDICATORS:
        return None
    try:
        size, at = _varint_at(data, 2)
        if not 0 < size <= max_bytes:
            return None
        body = lz4.block.decompress(data[at:], uncompressed_size=size)
        length = body[0]
        if len(body) != size or not 0 < length < 0x80:
            return None
        node = body[1:1 + length].decode()
        seq, pos = _varint_at(body, 1 + length)
        tick, pos = _varint_at(body, pos)
        full = body[pos]
        n, pos = _varint_at(body, pos + 1)
    except Exception:        # short, corrupt or not UTF-8: the one-message code says which
        return None
    if full > 1 or n > MAX_PIS:
        return None
    return _Head(node, seq, tick, full == 1, None, n, pos), body


def _varint_at(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` (at most 9 bytes, so below 2^63) and the position after it;
    ValueError for a longer one (the one-message code then reads it)."""
    n = shift = 0
    for end in range(pos, pos + 9):
        b = buf[end]
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, end + 1
        shift += 7
    raise ValueError("long varint")


def _one(head: _Head, body: bytes) -> Message | DecodeError:
    """The one-message decoder's answer for the entries of ``head`` in ``body``."""
    r = _Reader(body)
    r.pos = head.pos
    try:
        msg = _indicators(head, *_pi_values(r, head.n))
        r.end()
    except DecodeError as exc:
        return exc
    return msg


def _entries(batch: list[tuple[int, _Head, bytes]]) -> list[Message | None]:
    """Parse the PI entries of every frame in ``batch`` together; None for a frame the
    one-message decoder must read (anything not plainly valid)."""
    regions = [body[head.pos:] for _, head, body in batch]
    lengths = np.array([len(r) for r in regions])
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # int32 throughout (bytes, positions, keys; a 4-byte value's bits wrap and are
    # reinterpreted as uint32): small temporaries
    e = np.frombuffer(b"".join(regions) + bytes(_PAD), np.uint8).astype(np.int32)
    size = len(e) - _PAD                     # the first padding byte
    at = np.arange(len(e), dtype=np.int32)
    # bytes of the varint starting at each byte: up to the next byte below 0x80 (the
    # padding has one), found by a running minimum from the end
    vlen = np.minimum.accumulate(np.where(e < 0x80, at, len(e))[::-1])[::-1] - at + 1
    kind = e & 7
    payload = np.minimum(at + vlen, size)
    step = vlen + np.where(kind == _KIND_INT, vlen[payload], _WIDTH[kind])
    nxt = np.minimum(at + step, size)        # the next entry, if one starts here

    n = np.array([head.n for _, head, _ in batch])
    rows = len(batch)
    pos = np.empty((rows, max(1, int(n.max()))), np.int32)
    pos[:, 0] = starts
    for j in range(1, pos.shape[1]):         # one vectorised step per PI, all frames
        pos[:, j] = nxt[pos[:, j - 1]]
    p = pos[np.arange(pos.shape[1]) < n[:, None]]        # every entry, frame by frame
    row = np.repeat(np.arange(rows), n)
    first = np.concatenate([[0], np.cumsum(n)])          # each frame's first entry in p
    last = pos[np.arange(rows), np.maximum(n - 1, 0)]
    ok = np.where(n > 0, last + step[last], starts) == ends   # no entry past its body,
    #                                                           no byte after the last
    k, kl = kind[p], vlen[p]
    bad = (kl > 3) | ~_VALID_KIND[k]
    key = (e[p] & 0x7F) | np.where(kl > 1, (e[p + 1] & 0x7F) << 7, 0) \
        | np.where(kl > 2, (e[p + 2] & 0x7F) << 14, 0)
    gap = (key >> _KIND_BITS) + 1
    total = np.concatenate([[0], np.cumsum(gap)])
    index = total[1:] - np.repeat(total[first[:-1]], n) - 1
    bad |= index >= MAX_PIS

    q = p + kl                               # each entry's value bytes
    b0, b1, b2, b3 = e[q], e[q + 1], e[q + 2], e[q + 3]
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
        for b in range(min(5, int(ql.max()))):
            zz |= np.where(ql > b, e[qi + b] & 0x7F, 0).astype(np.int64) << (7 * b)
        bad[ints] |= (ql > 5) | (zz >= 1 << 32)
        values[ints] = (zz >> 1) ^ -(zz & 1)
    ok &= np.bincount(row, weights=bad, minlength=rows) == 0
    full = np.array([head.full for _, head, _ in batch])
    if len(index):
        ok &= ~full | (np.where(n > 0, index[np.maximum(first[1:] - 1, 0)], -1) == n - 1)

    out: list[Message | None] = []
    index_l, values_l, first_l = index.tolist(), values.tolist(), first.tolist()
    for (_, head, _), good, a, b in zip(batch, ok.tolist(), first_l, first_l[1:]):
        if not good:
            out.append(None)
            continue
        try:
            out.append(_indicators(head, dict(zip(index_l[a:b], values_l[a:b])),
                                   index_l[b - 1] if b > a else -1))
        except DecodeError:
            out.append(None)                 # names that do not match: say it one by one
    return out
