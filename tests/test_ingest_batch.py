"""The daemon's batched ingest (Ingest.handle_many: frames that extend a node's stream
applied together in numpy) does exactly what applying each message on its own does:
the same rows, the same drops and FullRequests, the same stream state afterwards, for
streams in order and for every way a stream goes wrong (gaps, repeats, reordering,
reconnects, another key, ticks out of the window or replayed, new PIs, garbage)."""
from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from capes.common.frame_batch import BATCH_MIN
from capes.common.protocol import Ack, DeltaEncoder, FullRequest, encode
from interface_daemon.node_streams import Ingest


def traffic(seed: int, faults: float, nodes: int = 6, ticks: int = 40
            ) -> list[tuple[bytes, bytes, str]]:
    """(identity, payload, key) of ``nodes`` agents over ``ticks`` ticks, interleaved,
    with faults sprinkled in (``faults``: their rate, 1 = about one frame in eight)."""
    rng = random.Random(seed)
    now = int(time.time()) - ticks
    agents = []
    for a in range(nodes):
        names = [f"pi{(a * 3 + i) % 20}" for i in range(8 + a)]     # shared and own PIs
        agents.append({"enc": DeltaEncoder(f"node{a}", names, full_every=rng.choice([5, 60])),
                       "vals": [float(rng.randint(0, 9)) for _ in names],
                       "id": b"conn-%d" % a, "key": "k0"})
    out = []
    for t in range(ticks):
        for a in rng.sample(range(nodes), nodes):
            ag = agents[a]
            for i in range(len(ag["vals"])):
                r = rng.random()
                if r < 0.4:
                    ag["vals"][i] = rng.choice([rng.random() * 1e6, float(rng.randint(-5, 5)),
                                                math.nan, -0.0, 1 / 3])
            fault = rng.random() / faults
            tick = now + t
            if fault < 0.03:
                tick = now + t + 10 ** 6                     # far from the clock
            elif fault < 0.05:
                tick = now + t - 3                           # replayed
            if rng.random() / faults < 0.03 or ag.pop("answer", False) and rng.random() < 0.5:
                ag["enc"].request_full()                     # names again (asked for)
            frame = ag["enc"].frame(tick, ag["vals"])
            kind = rng.random() / faults
            if kind < 0.04:
                ag["answer"] = True                          # lost: a gap (the daemon asks)
                continue
            out.append((ag["id"], frame, ag["key"]))
            if kind < 0.07:
                out.append((ag["id"], frame, ag["key"]))     # repeated
            elif kind < 0.09 and len(out) > 2:
                out[-1], out[-2] = out[-2], out[-1]          # reordered
            elif kind < 0.10:
                out.append((ag["id"], frame, "k1"))          # another key
            elif kind < 0.11:
                ag["id"] = ag["id"] + b"'"                   # reconnected
                ag["answer"] = True
            elif kind < 0.12:
                out.append((ag["id"], rng.choice([b"", b"\x01\x01\x05garbage", frame[:-3],
                                                 encode(Ack(f"node{a}", 0, {"w": 1.0})),
                                                 encode(FullRequest(f"node{a}"))]), ag["key"]))
    return out


def ingest() -> Ingest:
    # every pending stream asks for a full frame (no rate limit that depends on timing)
    return Ingest(max_nodes=100, tick_seconds=1.0, max_clock_skew_s=300,
                  full_request_every_s=0.0)


def one_by_one(messages):
    g = ingest()
    return g, [g.handle(payload, identity, key) for identity, payload, key in messages]


def batched(messages, rng):
    """handle_many over batches of random sizes (most large enough for the fast path);
    per message: (row, tick, node index, drop, full request), rows as the fast path or
    apply() made them."""
    g, got, start = ingest(), [], 0
    g.fast = 0
    while start < len(messages):
        end = start + rng.choice([1, BATCH_MIN, 30, 60])
        chunk = messages[start:end]
        res = g.handle_many(chunk)
        out = [None] * len(chunk)
        for pos, o in res.outcomes:
            out[pos] = (o.row, o.tick, o.stream.index if o.row is not None else -1, o.drop,
                        o.full_request)
        for rows in res.blocks:
            g.fast += len(rows.at)
            for k, pos in enumerate(rows.at):
                out[pos] = (rows.rows[k], int(rows.ticks[k]), int(rows.nodes[k]), None, None)
        assert None not in out
        got += out
        start = end
    return g, got


def same_row(a, b, width) -> bool:
    if a is None or b is None:
        return a is None and b is None
    pa = np.full(width, np.nan, np.float32)
    pb = pa.copy()
    pa[:len(a)], pb[:len(b)] = a, b
    return pa.tobytes() == pb.tobytes()              # NaN and -0.0 alike


@pytest.mark.parametrize("faults", [0.1, 1.0])
@pytest.mark.parametrize("seed", range(8))
def test_batched_ingest_does_what_one_by_one_does(seed, faults):
    messages = traffic(seed, faults)
    ref, want = one_by_one(messages)
    g, got = batched(messages, random.Random(seed))
    assert g.fast > len(messages) * (0.5 if faults < 1 else 0.2)    # the fast path ran
    assert g.fast_path_errors == 0
    width = len(ref.pi_names)
    for k, (o, b) in enumerate(zip(want, got)):
        row, tick, node, drop, full = b
        assert same_row(o.row, row, width), k
        assert drop == o.drop and full == o.full_request, k
        if o.row is not None:
            assert (tick, node) == (o.tick, o.stream.index), k
    assert g.pi_names == ref.pi_names and g.node_names == ref.node_names
    assert g.latest_tick == ref.latest_tick
    assert set(g.streams) == set(ref.streams)
    for name, s in ref.streams.items():
        t = g.streams[name]
        assert (t.last_tick, t.messages, t.identity, t.key, t.decoder.last_seq,
                t.decoder.pending_full) == (s.last_tick, s.messages, s.identity, s.key,
                                            s.decoder.last_seq, s.decoder.pending_full), name
        assert (s.decoder.vector is None) == (t.decoder.vector is None)
        if s.decoder.vector is not None:
            assert np.array(s.decoder.vector, np.float32).tobytes() == \
                np.array(t.decoder.vector, np.float32).tobytes()


def test_most_frames_of_clean_streams_take_the_fast_path():
    """Nodes streaming in order: after each node's first frame (names, new layout: one by
    one) every frame is applied together, so the daemon's cost per frame stays low."""
    now = int(time.time())
    encs = [DeltaEncoder(f"n{a}", [f"p{i}" for i in range(44)]) for a in range(20)]
    messages = [(b"c%d" % a, e.frame(now - 50 + t, [float(t + i) for i in range(44)]), None)
                for t in range(30) for a, e in enumerate(encs)]
    g = ingest()
    res = g.handle_many(messages[:20])                  # first frames: names, new nodes
    assert not res.blocks and all(o.row is not None for _, o in res.outcomes)
    res = g.handle_many(messages[20:])
    assert sum(len(r.at) for r in res.blocks) == len(messages) - 20 and not res.outcomes
    assert g.streams["n7"].last_tick == now - 50 + 29
    assert list(g.streams["n7"].decoder.vector) == [float(29 + i) for i in range(44)]


def test_a_failure_of_the_batched_path_costs_no_frame(monkeypatch):
    """Were the batch parse to fail (a bug: it refuses bad input, never raises on it),
    the chunk is applied one by one: same rows, and the failure is counted."""
    import interface_daemon.node_streams as ns

    def broken(*_):
        raise IndexError("a bug")
    monkeypatch.setattr(ns, "parse_frames", broken)
    messages = traffic(3, 0.1)
    ref, want = one_by_one(messages)
    g = ingest()
    res = g.handle_many(messages)
    assert not res.blocks and g.fast_path_errors >= 1
    assert [o.drop for _, o in res.outcomes] == [o.drop for o in want]
    assert all(same_row(a.row, b.row, len(ref.pi_names))
               for (_, a), b in zip(res.outcomes, want))
