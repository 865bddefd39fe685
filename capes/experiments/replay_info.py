"""``capes replay info``: what a replay DB holds — sessions, tick ranges, gaps, missing
entries, PI/node/parameter names and specs, size on disk. Imports no torch."""
from __future__ import annotations

import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from capes.common.replay_db import (
    SessionInfo,
    _check_schema,
    connect,
    decode_vec,
    read_sessions,
)

Progress = Callable[[str], None] | None


# -- info -----------------------------------------------------------------------------------

@dataclass
class SessionSummary:
    id: int
    uuid: str
    label: str
    started_at: float
    tick_seconds: float
    first_tick: int | None
    last_tick: int | None
    ticks: int                    # ticks with at least one PI row
    rows: int                     # PI rows (one per node and tick)
    actions: int
    node_names: list[str]
    pi_names: list[str]
    params: list[dict]
    gaps: list[list[int]]         # [first, last] of each run of ticks with no PI row
    missing_share: float | None   # missing entries / (span × nodes × PIs)
    nan_entries: int              # NaN (or not yet known) entries inside present rows
    absent_rows: int              # (tick, node) pairs in the span without a row
    provenance: dict

    @property
    def span(self) -> int:
        return 0 if self.first_tick is None else self.last_tick - self.first_tick + 1


@dataclass
class DBSummary:
    path: str
    schema_version: int
    created_by: str
    size_bytes: int               # the DB file plus its -wal and -shm files
    files: dict[str, int]
    sessions: list[SessionSummary]

    def to_json(self) -> dict:
        return asdict(self)


def disk_size(path: str | Path) -> dict[str, int]:
    """Bytes of the DB and of the WAL / shared-memory files beside it."""
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{path}{suffix}")
        if p.exists():
            out[p.name] = p.stat().st_size
    return out


def describe(path: str | Path) -> DBSummary:
    """Summarise a replay DB without loading it into memory."""
    path = Path(path)
    conn = connect(path, readonly=True)
    try:
        _check_schema(conn, path)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        sessions = [_summarise_session(conn, info) for info in read_sessions(conn)]
    finally:
        conn.close()
    files = disk_size(path)
    return DBSummary(str(path), int(meta["schema_version"]), meta.get("created_by", ""),
                     sum(files.values()), files, sessions)


def _summarise_session(conn: sqlite3.Connection, info: SessionInfo) -> SessionSummary:
    n_nodes, n_pis = len(info.node_names), len(info.pi_names)
    ticks = np.array([t for (t,) in conn.execute(
        "SELECT DISTINCT tick FROM pis WHERE session=? ORDER BY tick", (info.id,))], np.int64)
    rows = nan = 0
    cur = conn.execute("SELECT node, vec FROM pis WHERE session=?", (info.id,))
    while chunk := cur.fetchmany(20_000):
        vecs = [decode_vec(blob) for node, blob in chunk if node < n_nodes]
        rows += len(vecs)
        if vecs:
            lengths = np.fromiter((len(v) for v in vecs), np.int64, len(vecs))
            nan += int(np.isnan(np.concatenate(vecs)).sum())
            nan += int(np.clip(n_pis - lengths, 0, None).sum())
    actions = conn.execute("SELECT COUNT(*) FROM actions WHERE session=?",
                           (info.id,)).fetchone()[0]
    if len(ticks):
        first, last = int(ticks[0]), int(ticks[-1])
        span = last - first + 1
        jumps = np.flatnonzero(np.diff(ticks) > 1)
        gaps = [[int(ticks[j]) + 1, int(ticks[j + 1]) - 1] for j in jumps]
        absent = span * n_nodes - rows
        expected = span * n_nodes * n_pis
        share = (nan + absent * n_pis) / expected if expected else None
    else:
        first = last = share = None
        gaps, absent = [], 0
    return SessionSummary(
        id=info.id, uuid=info.uuid, label=info.label, started_at=info.started_at,
        tick_seconds=info.tick_seconds, first_tick=first, last_tick=last, ticks=len(ticks),
        rows=rows, actions=actions, node_names=info.node_names, pi_names=info.pi_names,
        params=[asdict(p) for p in info.params], gaps=gaps, missing_share=share,
        nan_entries=nan, absent_rows=absent, provenance=info.provenance)


def format_summary(s: DBSummary, max_names: int = 12) -> str:
    def names(xs):
        return ", ".join(xs[:max_names]) + (f", … ({len(xs)} in all)" if len(xs) > max_names
                                            else "")
    lines = [f"{s.path}: replay DB schema {s.schema_version}, {len(s.sessions)} session(s), "
             f"{_bytes(s.size_bytes)} on disk"]
    for ss in s.sessions:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ss.started_at))
        lines.append(f"session {ss.id}  {ss.uuid}  {ss.label!r}  started {started}")
        if ss.first_tick is None:
            lines.append("  no PI rows")
        else:
            share = f"{ss.missing_share:.2%}" if ss.missing_share is not None else "-"
            lines.append(f"  ticks {ss.first_tick}..{ss.last_tick} ({ss.ticks} with data, "
                         f"tick = {ss.tick_seconds:g} s), {ss.actions} actions, "
                         f"missing entries {share}")
        if ss.gaps:
            shown = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ss.gaps[:8])
            more = f", … ({len(ss.gaps)} gaps)" if len(ss.gaps) > 8 else ""
            lines.append(f"  gaps: {shown}{more}")
        lines.append(f"  nodes ({len(ss.node_names)}): {names(ss.node_names)}")
        lines.append(f"  PIs ({len(ss.pi_names)}): {names(ss.pi_names)}")
        for p in ss.params:
            forbidden = f" forbidden {p['forbidden']}" if p["forbidden"] else ""
            lines.append(f"  parameter {p['name']}: [{p['min']:g}, {p['max']:g}] "
                         f"step {p['step']:g} default {p['default']:g}{forbidden}")
        prov = ss.provenance or {}
        if "source_file" in prov:
            lines.append(f"  from {prov['source_file']} session "
                         f"{prov.get('source_session', '?')}"
                         + (f", merged {_when(prov['merged_at'])}" if "merged_at" in prov
                            else ""))
        elif "writer" in prov:
            lines.append(f"  written by {prov['writer']}")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# -- compatibility --------------------------------------------------------------------------

