"""The wire protocol: round trips, delta streams, and strict bounded decoding."""
from __future__ import annotations

import math
import struct

import lz4.block
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from capes.common.protocol import (PROTOCOL_VERSION, Ack, Action, DecodeError, DeltaDecoder,
                            DeltaEncoder, FullRequest, Indicators, decode, encode, quantise)

f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
names_st = st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=50, unique=True)


def same(a: float, b: float) -> bool:
    """Equal as float32 values (NaN equal to NaN)."""
    return (math.isnan(a) and math.isnan(b)) or np.float32(a) == np.float32(b)


def test_every_message_round_trips():
    msgs = [Indicators("node-1", 7, 1_700_000_000, True, {0: 1.5, 1: -2.0, 2: 3e9},
                       ["a", "b", "c"]),
            Indicators("n", 8, 9, False, {5: 0.1, 40: math.inf}),
            FullRequest("node-1", "gap"),
            Action(12, 34, {"window": 51.0, "rate": 0.1}),
            Ack("node-1", 0, {"window": 10.0})]
    for msg in msgs:
        back = decode(encode(msg))
        assert type(back) is type(msg)
        if isinstance(msg, Indicators):
            assert (back.node, back.seq, back.tick, back.full, back.names) == \
                   (msg.node, msg.seq, msg.tick, msg.full, msg.names)
            assert back.values.keys() == msg.values.keys()
            assert all(same(back.values[k], v) for k, v in msg.values.items())
        else:
            assert back == msg


def test_actions_carry_exact_float64_values():
    values = {"a": 0.1, "b": 1 / 3, "c": -1e-300}
    assert decode(encode(Action(1, 2, values))).values == values


@settings(max_examples=60, deadline=None)
@given(names=names_st, data=st.data(), full_every=st.integers(1, 10))
def test_delta_stream_rebuilds_every_vector(names, data, full_every):
    enc = DeltaEncoder("node", names, full_every)
    dec = DeltaDecoder("node")
    n = len(names)
    vec = data.draw(st.lists(f32, min_size=n, max_size=n))
    for tick in range(data.draw(st.integers(1, 15))):
        # a few PIs change per tick, as on a real host
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=4)):
            vec[i] = data.draw(f32)
        if data.draw(st.booleans()) and tick % 5 == 3:
            enc.request_full()
        got = dec.apply(decode(enc.frame(tick, vec)))
        assert got is not None and len(got) == n
        assert all(same(g, v) for g, v in zip(got, vec))
        assert dec.names == names


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_decode_error(data):
    for blob in (data, bytes([PROTOCOL_VERSION]) + data,
                 bytes([PROTOCOL_VERSION, 1]) + data):
        try:
            decode(blob)
        except DecodeError as exc:
            assert exc.reason in ("version", "truncated", "oversize", "decompress", "type",
                                  "malformed")


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.integers(1, 4))
def test_random_bodies_only_raise_decode_error(body, kind):
    """Valid framing and lz4 around a random body: the body parser must hold too."""
    blob = bytes([PROTOCOL_VERSION, kind, len(body)]) if len(body) < 128 else None
    if blob is None:
        return
    try:
        decode(blob + lz4.block.compress(body, store_size=False))
    except DecodeError as exc:
        assert exc.reason in ("truncated", "malformed")


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_corrupted_frames_only_raise_decode_error(data):
    enc = DeltaEncoder("n", [f"pi{i}" for i in range(20)])
    raw = bytearray(enc.frame(1, [float(i) for i in range(20)]))
    for _ in range(data.draw(st.integers(1, 5))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(raw))
    except DecodeError:
        pass


def good_frame() -> bytes:
    return DeltaEncoder("n", ["a", "b"]).frame(1, [1.0, 2.0])


@pytest.mark.parametrize("blob,reason", [
    (b"", "truncated"),
    (bytes([9]) + good_frame()[1:], "version"),
    (bytes([PROTOCOL_VERSION, 77]) + good_frame()[2:], "type"),
    (good_frame()[:-3], "decompress"),
    (bytes([PROTOCOL_VERSION, 1, 0x80, 0x80, 0x80, 0x80, 0x10]) + b"\x00" * 20, "oversize"),
    (b"x" * 70_000, "oversize"),
    (bytes([PROTOCOL_VERSION, 1, 5]) + b"\xff\xff\xff\xff", "decompress"),
])
def test_malformed_messages_name_their_reason(blob, reason):
    with pytest.raises(DecodeError) as info:
        decode(blob)
    assert info.value.reason == reason


def test_decompression_bomb_is_bounded():
    body = b"\x00" * 1_000_000                     # compresses to ~4 KB
    packed = lz4.block.compress(body, store_size=False)
    assert len(packed) < 65536
    # honest header: refused before decompressing
    head = bytearray([PROTOCOL_VERSION, 1])
    n = len(body)
    while n >= 0x80:
        head.append((n & 0x7F) | 0x80)
        n >>= 7
    head.append(n)
    with pytest.raises(DecodeError) as info:
        decode(bytes(head) + packed)
    assert info.value.reason == "oversize"
    # lying header: decompression stops at the declared size
    with pytest.raises(DecodeError) as info:
        decode(bytes([PROTOCOL_VERSION, 1, 100]) + packed)
    assert info.value.reason == "decompress"


def test_truncated_body_and_trailing_bytes():
    def framed(body: bytes) -> bytes:
        return bytes([PROTOCOL_VERSION, 2, len(body)]) + lz4.block.compress(body, store_size=False)
    with pytest.raises(DecodeError) as info:
        decode(framed(b"\x05ab"))                 # string of 5 bytes, 2 present
    assert info.value.reason == "truncated"
    with pytest.raises(DecodeError) as info:
        decode(framed(b"\x01a\x00junk"))
    assert info.value.reason == "malformed"
    with pytest.raises(DecodeError) as info:
        decode(framed(b"\x02\xff\xfe\x00"))       # not UTF-8
    assert info.value.reason == "malformed"


def test_full_frame_must_carry_every_pi():
    msg = Indicators("n", 0, 1, True, {0: 1.0, 2: 3.0}, None)
    with pytest.raises(DecodeError) as info:
        decode(encode(msg))
    assert info.value.reason == "malformed"


def test_only_changed_pis_are_sent():
    names = [f"pi{i}" for i in range(44)]
    enc = DeltaEncoder("n", names, full_every=1000)
    vals = [float(i) * 1.37 for i in range(44)]
    first = decode(enc.frame(0, vals))
    assert first.full and first.names == names
    vals[3] += 1
    vals[40] = math.nan
    delta = decode(enc.frame(1, vals))
    assert not delta.full and delta.names is None and sorted(delta.values) == [3, 40]
    assert decode(enc.frame(2, vals)).values == {}        # nothing changed
    assert len(enc.frame(3, vals)) < 30


def test_periodic_full_frames_and_requested_names():
    enc = DeltaEncoder("n", ["a", "b"], full_every=3)
    frames = [decode(enc.frame(t, [1.0, 2.0])) for t in range(7)]
    assert [f.full for f in frames] == [True, False, False, True, False, False, True]
    assert frames[0].names == ["a", "b"] and frames[3].names is None
    enc.request_full()
    f = decode(enc.frame(7, [1.0, 2.0]))
    assert f.full and f.names == ["a", "b"]


def test_decoder_asks_for_a_full_frame_after_a_gap():
    enc, dec = DeltaEncoder("n", ["a", "b"]), DeltaDecoder("n")
    assert dec.apply(decode(enc.frame(0, [1.0, 2.0]))) == [1.0, 2.0]
    enc.frame(1, [5.0, 2.0])                                  # lost on the way
    assert dec.apply(decode(enc.frame(2, [5.0, 6.0]))) is None
    assert dec.pending_full == "gap"
    assert dec.apply(decode(enc.frame(3, [5.0, 7.0]))) is None   # still no base
    enc.request_full()
    assert dec.apply(decode(enc.frame(4, [5.0, 8.0]))) == [5.0, 8.0]
    assert dec.pending_full is None


def test_decoder_refuses_unknown_node_duplicates_and_reordering():
    enc = DeltaEncoder("n", ["a"])
    f0, f1, f2 = (enc.frame(t, [float(t)]) for t in range(3))
    dec = DeltaDecoder("n")
    assert dec.apply(decode(f1)) is None and dec.pending_full == "unknown_node"
    dec = DeltaDecoder("n")
    dec.apply(decode(f0))
    dec.apply(decode(f1))
    with pytest.raises(DecodeError) as info:
        dec.apply(decode(f1))
    assert info.value.reason == "duplicate"
    with pytest.raises(DecodeError) as info:                  # an older delta
        dec.apply(decode(encode(Indicators("n", 0, 0, False, {}))))
    assert info.value.reason == "out_of_order"
    assert dec.apply(decode(f2)) == [2.0]                     # state untouched


def test_agent_restart_starts_a_new_stream():
    dec = DeltaDecoder("n")
    enc = DeltaEncoder("n", ["a"])
    for t in range(5):
        dec.apply(decode(enc.frame(t, [float(t)])))
    restarted = DeltaEncoder("n", ["a", "b"])
    assert dec.apply(decode(restarted.frame(9, [1.0, 2.0]))) == [1.0, 2.0]
    assert dec.names == ["a", "b"]


def test_delta_index_beyond_names_is_malformed():
    dec = DeltaDecoder("n")
    dec.apply(decode(DeltaEncoder("n", ["a"]).frame(0, [1.0])))
    with pytest.raises(DecodeError) as info:
        dec.apply(decode(encode(Indicators("n", 1, 1, False, {5: 1.0}))))
    assert info.value.reason == "malformed"


def test_values_are_sent_in_their_shortest_exact_form():
    for value, size in ((7.0, 1), (-300.0, 2), (0.5, 2), (math.nan, 0), (0.1, 4),
                        (1e6 + 1, 3), (quantise(1234.567e6, 15), 3),
                        (quantise(0.1, 7), 2), (quantise(-3.3e9, 7), 2)):
        body = encode(Indicators("n", 0, 0, False, {0: value}))
        lone = encode(Indicators("n", 0, 0, False, {}))
        assert len(body) - len(lone) == 1 + size, value
        got = decode(body).values[0]
        assert same(got, value)
    assert struct.pack("<f", decode(encode(Indicators("n", 0, 0, False, {0: -0.0}))).values[0]) \
        == struct.pack("<f", -0.0)


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=32), st.integers(1, 23))
def test_quantise_bounds_the_relative_error(value, bits):
    assume(value == 0 or abs(value) >= 1.2e-38)              # normal floats: relative error
    q = quantise(value, bits)
    assert abs(q - value) <= abs(value) * 2.0 ** -bits or (
        abs(value) > 3e38 and math.isfinite(q))             # clipped below infinity
    assert quantise(q, bits) == q


@settings(max_examples=40, deadline=None)
@given(names=names_st, data=st.data(), bits=st.integers(1, 23))
def test_quantised_streams_rebuild_the_quantised_vectors(names, data, bits):
    enc, dec = DeltaEncoder("node", names, 5, mantissa_bits=bits), DeltaDecoder("node")
    n = len(names)
    for tick in range(data.draw(st.integers(1, 8))):
        vec = data.draw(st.lists(f32, min_size=n, max_size=n))
        got = dec.apply(decode(enc.frame(tick, vec)))
        assert all(same(g, quantise(v, bits)) for g, v in zip(got, vec))
