"""Batch decoding (the daemon's ingest): decode_many says exactly what decode says, for
valid frames, corrupt ones and every other message, in any mix."""
from __future__ import annotations

import math

import lz4.block
from hypothesis import given, settings
from hypothesis import strategies as st

from capes.common.frame_batch import BATCH_MIN, decode_many
from capes.common.protocol import (MSG_INDICATORS, PROTOCOL_VERSION, Ack, Action, DecodeError,
                                   DeltaEncoder, FullRequest, Indicators, _open, decode,
                                   encode)

# every value encoding: NaN, small and large integers, float16-, bfloat16-, 24-bit- and
# full float32-exact values, infinities, signed zeros
values_st = st.one_of(st.just(math.nan), st.integers(-2 ** 31, 2 ** 31 - 1).map(float),
                      st.sampled_from([0.0, -0.0, 1.5, 65504.0, 6e-8, 3.0e38, -2.5e-39,
                                       math.inf, -math.inf, 1 / 3, 1e9 + 0.5]),
                      st.floats(width=32))


@st.composite
def frames(draw) -> bytes:
    """An Indicators frame: full (with or without names) or a sparse delta."""
    n = draw(st.integers(0, 60))
    if draw(st.booleans()):
        idx = list(range(n))
        full = draw(st.booleans())
    else:
        idx = sorted(draw(st.sets(st.integers(0, 4095), max_size=n)))
        full = False
    names = [f"pi{i}" for i in idx] if full and draw(st.booleans()) else None
    vals = {i: draw(values_st) for i in idx}
    return encode(Indicators(draw(st.text(min_size=1, max_size=12)), draw(st.integers(0, 2 ** 63 - 1)),
                             draw(st.integers(0, 2 ** 62)), full, vals, names))


def answer(data: bytes):
    try:
        return decode(data)
    except DecodeError as exc:
        return exc


def same(a, b) -> bool:
    if isinstance(a, DecodeError) or isinstance(b, DecodeError):
        return type(a) is type(b) and (a.reason, str(a)) == (b.reason, str(b))
    if type(a) is not type(b):
        return False
    if not isinstance(a, Indicators):
        return a == b
    if (a.node, a.seq, a.tick, a.full, a.names) != (b.node, b.seq, b.tick, b.full, b.names):
        return False
    return list(a.values) == list(b.values) and all(
        (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))
        for x, y in zip(a.values.values(), b.values.values()))


def reframe(body: bytes) -> bytes:
    """An Indicators message around ``body`` as it is (valid or not)."""
    head = bytearray((PROTOCOL_VERSION, MSG_INDICATORS))
    n = len(body)
    while n >= 0x80:
        head.append((n & 0x7F) | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + lz4.block.compress(body, store_size=False)


@settings(max_examples=15, deadline=None)
@given(st.lists(frames(), min_size=BATCH_MIN, max_size=32))
def test_valid_frames_decode_as_one_by_one(batch):
    assert all(same(answer(d), got) for d, got in zip(batch, decode_many(batch)))


@settings(max_examples=25, deadline=None)
@given(st.lists(frames(), min_size=1, max_size=8), st.data())
def test_corrupt_frames_get_the_same_reason(seeds, data):
    """Bodies mutated after decompression (so lz4 does not catch it): bytes changed, cut,
    appended, inserted; mixed with valid frames so the batch path sees them."""
    batch = list(seeds) * (BATCH_MIN // len(seeds) + 1)
    for k in range(len(batch)):
        if not data.draw(st.booleans()):
            continue
        body = bytearray(_open(batch[k], 65536)[1].buf)
        for _ in range(data.draw(st.integers(1, 3))):
            op = data.draw(st.integers(0, 3))
            at = data.draw(st.integers(0, max(0, len(body) - 1)))
            if op == 0 and body:
                body[at] = data.draw(st.integers(0, 255))
            elif op == 1:
                del body[at:]
            elif op == 2:
                body += data.draw(st.binary(min_size=1, max_size=6))
            else:
                body.insert(at, data.draw(st.integers(0, 255)))
        batch[k] = reframe(bytes(body)) if body else batch[k][:3]
    assert all(same(answer(d), got) for d, got in zip(batch, decode_many(batch)))


def test_other_messages_and_garbage_in_a_batch():
    enc = DeltaEncoder("node-1", [f"pi{i}" for i in range(44)])
    frames_ = [enc.frame(1_700_000_000 + t, [float(t * i) / 7 for i in range(44)])
               for t in range(20)]
    others = [encode(FullRequest("n", "gap")), encode(Action(3, 4, {"w": 1.0})),
              encode(Ack("n", 0, {"w": 2.0})), b"", b"\x01", b"garbage" * 9,
              bytes([PROTOCOL_VERSION, MSG_INDICATORS, 5]) + b"\xff" * 4,
              frames_[3][:-2], b"x" * 70_000]
    batch = frames_[:10] + others + frames_[10:]
    got = decode_many(batch)
    assert all(same(answer(d), g) for d, g in zip(batch, got))
    assert [type(g).__name__ for g in got[10:10 + len(others)]] == \
        ["FullRequest", "Action", "Ack"] + ["DecodeError"] * 6
    assert got[-1].tick == 1_700_000_019 and len(got[-1].values) > 0
