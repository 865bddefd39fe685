"""``capes replay export``: a replay DB as long CSV or as NumPy arrays (NPZ), for other
tools. Files are written atomically."""
from __future__ import annotations

import csv
import json
import sqlite3
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from capes.common.actions import name as action_name
from capes.common.atomic import atomic_write
from capes.experiments.replay_info import describe
from capes.common.replay_db import (
    ReplayDBError,
    SessionInfo,
    _check_schema,
    connect,
    decode_vec,
    index_of,
    read_sessions,
)

Progress = Callable[[str], None] | None

# the most memory (and NPZ bytes) one session's dense arrays may take: one stray tick far
# ahead must not turn a 70 kB DB into gigabytes of NaN (CSV is sparse: use it then)
MAX_DENSE_BYTES = 1 << 30


def _union(lists: Iterable[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for names in lists:
        for n in names:
            seen.setdefault(n, None)
    return list(seen)


def export_csv(db: str | Path, out: str | Path, progress: Progress = None) -> int:
    """Long CSV: one row per session, tick and node, one column per PI (by name, the
    union of all sessions'), then the action chosen at that tick and the parameters'
    values in effect during it. Returns the number of data rows."""
    db = Path(db)
    conn = connect(db, readonly=True)
    try:
        _check_schema(conn, db)
        infos = read_sessions(conn)
        pi_cols = _union(s.pi_names for s in infos)
        param_cols = _union(s.param_names for s in infos)
        n = 0
        with atomic_write(out, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["session", "tick", "node", *pi_cols, "action",
                        *(f"param.{p}" for p in param_cols)])
            for info in infos:
                n += _write_session_csv(conn, info, w, pi_cols, param_cols)
                if progress:
                    progress(f"session {info.id}: {n} rows so far")
    finally:
        conn.close()
    return n


def _write_session_csv(conn, info: SessionInfo, w, pi_cols, param_cols) -> int:
    pi_where, param_where = index_of(pi_cols), index_of(param_cols)     # O(P), not O(P²)
    pi_pos = np.array([pi_where[p] for p in info.pi_names], np.int64)
    param_pos = [param_where[p] for p in info.param_names]
    values = [""] * len(param_cols)
    for k, spec in zip(param_pos, info.params):
        values[k] = _num(spec.default)
    actions = conn.execute("SELECT tick, action, vals FROM actions WHERE session=? "
                           "ORDER BY tick", (info.id,))
    pending = actions.fetchone()
    last_tick, action_here, n = None, "", 0
    for tick, node, blob in conn.execute("SELECT tick, node, vec FROM pis WHERE session=? "
                                         "ORDER BY tick, node", (info.id,)):
        if tick != last_tick:
            # actions up to the previous tick set the values in effect during this one
            action_here = ""
            while pending is not None and pending[0] <= tick:
                a_tick, action, vals = pending
                if a_tick == tick:
                    action_here = action_name(action, info.param_names)
                    break
                for k, v in zip(param_pos, np.frombuffer(vals, "<f4")):
                    values[k] = _num(v)
                pending = actions.fetchone()
            last_tick = tick
        row = [""] * len(pi_cols)
        vec = decode_vec(blob)
        for j, v in zip(pi_pos[:len(vec)], vec):
            if not np.isnan(v):
                row[j] = _num(v)
        node_name = info.node_names[node] if node < len(info.node_names) else str(node)
        w.writerow([info.id, tick, node_name, *row, action_here, *values])
        n += 1
    return n


def _num(v) -> str:
    """The shortest text that reads back as the same float32."""
    return str(np.float32(v)).removesuffix(".0")


def session_arrays(conn: sqlite3.Connection, info: SessionInfo,
                   max_bytes: int = MAX_DENSE_BYTES) -> dict[str, np.ndarray]:
    """One session, dense over its tick range in its own names: ``ticks`` (T,),
    ``pis`` (T, nodes, PIs) float32 with NaN where missing, ``actions`` (T,) int16
    (-1: none), ``values`` (T, parameters) float32 in effect during each tick.
    ReplayDBError when they would take more than ``max_bytes``."""
    lo, hi = conn.execute("SELECT MIN(tick), MAX(tick) FROM pis WHERE session=?",
                          (info.id,)).fetchone()
    alo, ahi = conn.execute("SELECT MIN(tick), MAX(tick) FROM actions WHERE session=?",
                            (info.id,)).fetchone()
    bounds = [t for t in (lo, hi, alo, ahi) if t is not None]
    N, P, K = len(info.node_names), len(info.pi_names), len(info.params)
    if not bounds:
        return {"ticks": np.zeros(0, np.int64), "pis": np.zeros((0, N, P), np.float32),
                "actions": np.zeros(0, np.int16), "values": np.zeros((0, K), np.float32)}
    first, last = min(bounds), max(bounds)
    T = last - first + 1
    size = T * (4 * N * P + 8 * K + 10)
    if size > max_bytes:
        have = conn.execute("SELECT COUNT(*) FROM (SELECT tick FROM pis WHERE session=? "
                            "UNION SELECT tick FROM actions WHERE session=?)",
                            (info.id, info.id)).fetchone()[0]
        raise ReplayDBError(
            f"session {info.id} spans {T:,} ticks ({first}..{last}) for {have:,} ticks "
            f"with data (a stray tick far from the others?): its dense arrays would take "
            f"{size / 1e9:.1f} GB, over --max-bytes {max_bytes:,}; export --format csv "
            f"(one line per stored row) or raise --max-bytes")
    pis = np.full((T, N, P), np.nan, np.float32)
    cur = conn.execute("SELECT tick, node, vec FROM pis WHERE session=?", (info.id,))
    while chunk := cur.fetchmany(20_000):
        for tick, node, blob in chunk:
            if node < N:
                vec = decode_vec(blob)
                pis[tick - first, node, :len(vec)] = vec
    actions = np.full(T, -1, np.int16)
    after = np.full((T, K), np.nan, np.float32)
    for tick, action, blob in conn.execute("SELECT tick, action, vals FROM actions "
                                           "WHERE session=?", (info.id,)):
        actions[tick - first] = action
        after[tick - first] = np.frombuffer(blob, "<f4")
    values = np.empty((T, K), np.float32)
    current = np.array([p.default for p in info.params], np.float32)
    acted = ~np.isnan(after).all(axis=1)
    for i in range(T):       # values in effect: set by the last action before the tick
        values[i] = current
        if acted[i]:
            current = after[i]
    return {"ticks": np.arange(first, last + 1, dtype=np.int64), "pis": pis,
            "actions": actions, "values": values}


def export_npz(db: str | Path, out: str | Path, progress: Progress = None,
               max_bytes: int = MAX_DENSE_BYTES) -> list[str]:
    """NPZ for numpy users: ``sessions`` (ids), ``session_uuids``, ``info`` (the JSON
    of :func:`describe`), and per session ``s<id>_ticks``, ``s<id>_pis``,
    ``s<id>_actions``, ``s<id>_values``, ``s<id>_pi_names``, ``s<id>_node_names``,
    ``s<id>_param_names`` (see :func:`session_arrays`). Loads with
    ``np.load(path)`` (no pickle). Returns the array names. A session whose dense
    arrays would exceed ``max_bytes`` is a ReplayDBError before anything is written."""
    db = Path(db)
    summary = describe(db)
    conn = connect(db, readonly=True)
    arrays: dict[str, np.ndarray] = {}
    try:
        infos = read_sessions(conn)
        arrays["sessions"] = np.array([s.id for s in infos], np.int64)
        arrays["session_uuids"] = np.array([s.uuid for s in infos], dtype="U32")
        arrays["info"] = np.array(json.dumps(summary.to_json()))
        for info in infos:
            for key, arr in session_arrays(conn, info, max_bytes).items():
                arrays[f"s{info.id}_{key}"] = arr
            for key, names in (("pi_names", info.pi_names), ("node_names", info.node_names),
                               ("param_names", info.param_names)):
                arrays[f"s{info.id}_{key}"] = np.array(names, dtype=str)
            if progress:
                progress(f"session {info.id}: {len(arrays[f's{info.id}_ticks'])} ticks")
    finally:
        conn.close()
    with atomic_write(out, "wb") as fh:
        np.savez(fh, **arrays)
    return list(arrays)

