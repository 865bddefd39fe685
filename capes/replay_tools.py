"""Replay DBs as an asset: inspect them, merge past sessions, export them.

The thesis (§5.2.7) promises that training experience from different sessions can be
saved and merged to train new models. These are the tools for that, each usable as a
library call and through ``capes replay info|merge|export``:

* :func:`describe` — what a DB holds: sessions, tick ranges, gaps, missing entries,
  names and specs, size on disk.
* :func:`merge` — copy the sessions of several DBs into one. Each session stays a
  session of its own (no transition spans two), keyed by its uuid so merging the
  same source twice adds nothing, with its provenance recorded. Sessions must agree
  with the output's layout by name unless ``allow_partial``; the output is replaced
  atomically, so an interrupted merge leaves the old OUT (or none) behind.
* :func:`export_csv`, :func:`export_npz` — the data for other tools.

None of this imports torch.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import sqlite3
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import quote

import numpy as np

from capes.replay_db import (SCHEMA, SCHEMA_VERSION, ReplayDBError, SessionInfo, _check_schema,
                             connect, decode_vec, read_sessions)

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

SPEC_FIELDS = ("min", "max", "step", "default", "forbidden", "nodes")


def differences(ref: SessionInfo, other: SessionInfo) -> list[str]:
    """How ``other``'s names and specs differ from ``ref``'s (orders do not count)."""
    out = []

    def diff_names(kind, a, b):
        missing = [n for n in a if n not in b]
        extra = [n for n in b if n not in a]
        if missing:
            out.append(f"{kind} missing: {', '.join(missing)}")
        if extra:
            out.append(f"{kind} extra: {', '.join(extra)}")

    diff_names("PIs", ref.pi_names, other.pi_names)
    diff_names("parameters", ref.param_names, other.param_names)
    diff_names("nodes", ref.node_names, other.node_names)
    theirs = {p.name: p for p in other.params}
    for p in ref.params:
        q = theirs.get(p.name)
        if q is None:
            continue
        for f in SPEC_FIELDS:
            if getattr(p, f) != getattr(q, f):
                out.append(f"parameter {p.name}: {f} {getattr(q, f)} (expected "
                           f"{getattr(p, f)})")
    if ref.tick_seconds != other.tick_seconds:
        out.append(f"tick length {other.tick_seconds:g} s (expected {ref.tick_seconds:g} s)")
    return out


class MergeError(ReplayDBError):
    """Sessions do not fit the output's layout; ``problems`` lists every difference."""

    def __init__(self, reference: str, problems: list[tuple[str, list[str]]]):
        self.problems = problems
        lines = [f"sessions differ from the layout of {reference}:"]
        for where, diffs in problems:
            lines.append(f"  {where}:")
            lines += [f"    {d}" for d in diffs]
        lines.append("use --allow-partial to merge them anyway (PIs and nodes are then "
                     "mapped by name and what is missing reads as missing)")
        super().__init__("\n".join(lines))


# -- merge ----------------------------------------------------------------------------------

@dataclass
class MergedSession:
    source: str
    source_session: int
    uuid: str
    session: int                  # its id in the output
    pis_rows: int                 # rows copied this time
    action_rows: int
    status: str                   # "added", "extended" (rows appended), "present"
    differences: list[str] = field(default_factory=list)


@dataclass
class MergeReport:
    out: str
    sessions: list[MergedSession]
    total_sessions: int           # in the output after the merge
    wall_s: float

    def count(self, status: str) -> int:
        return sum(1 for s in self.sessions if s.status == status)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class _Plan:
    source: Path
    info: SessionInfo
    status: str                   # "new" or "known"
    differences: list[str]
    param_order: list[int] | None = None   # reference index of each source parameter


TEMP_RE = r"\.{name}\.merge-(\d+)-[A-Za-z0-9_]+\.tmp"


def merge(sources: Iterable[str | Path], out: str | Path, allow_partial: bool = False,
          progress: Progress = None) -> MergeReport:
    """Merge the sessions of ``sources`` into ``out`` (into a copy of it, if it exists).

    Raises :class:`MergeError` before writing anything when a session's PIs,
    parameters, nodes or specs differ from the output's layout (the output's first
    session, else the first source session) and ``allow_partial`` is false. OUT is
    replaced by rename, so merge into a DB no daemon is writing at the time (its writer
    would go on writing to the replaced file).
    """
    t0 = time.perf_counter()
    out = Path(out).resolve()
    sources = [Path(s).resolve() for s in sources]
    if not sources:
        raise ReplayDBError("nothing to merge: name at least one source DB")
    say = progress or (lambda msg: None)
    _remove_stale_temps(out)

    plans, problems, reference = _plan_merge(sources, _read_infos(out) if out.exists()
                                             else [], out)
    if problems and not allow_partial:
        raise MergeError(reference, problems)

    tmp = _temp_path(out)
    conn = None
    try:
        conn = _open_output(tmp, out if out.exists() else None)
        by_uuid = {u: sid for u, sid in conn.execute("SELECT uuid, id FROM sessions")}
        done: list[MergedSession] = []
        attached = None
        for plan in plans:
            if attached != plan.source:
                if attached is not None:
                    conn.execute("DETACH DATABASE src")
                conn.execute("ATTACH DATABASE ? AS src", (_ro_uri(plan.source),))
                attached = plan.source
            done.append(_copy_session(conn, plan, by_uuid))
            conn.commit()
            m = done[-1]
            say(f"{m.status} {plan.source.name} session {m.source_session} -> session "
                f"{m.session}: {m.pis_rows} PI rows, {m.action_rows} actions")
        if attached is not None:
            conn.execute("DETACH DATABASE src")
        total = conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        _finish_output(conn, tmp)
        conn = None
        _replace(tmp, out)
    except BaseException:
        if conn is not None:
            conn.close()
        _remove_db_files(tmp)
        raise
    return MergeReport(str(out), done, total, time.perf_counter() - t0)


def _plan_merge(sources: list[Path], existing: list[SessionInfo], out: Path):
    """What to copy: one plan per source session, the sessions that differ from the
    reference layout (with how), and the reference's name."""
    known = {s.uuid: s for s in existing}
    reference = existing[0] if existing else None
    ref_name = f"{out.name} session {reference.id}" if reference else ""
    plans: list[_Plan] = []
    problems = []
    for src in sources:
        for info in _read_infos(src):
            if reference is None:
                reference, ref_name = info, f"{src.name} session {info.id}"
            target = known.get(info.uuid)
            if target is not None:          # merged before (or named twice): dedupe
                diffs = _growth_problems(target, info)
                if diffs:
                    raise ReplayDBError(f"{src} session {info.id} has the uuid of a session "
                                        f"already merged, with another layout: "
                                        f"{'; '.join(diffs)}")
                plans.append(_Plan(src, info, "known", [], _param_order(target, info)))
                continue
            diffs = differences(reference, info)
            if diffs:
                problems.append((f"{src} session {info.id} ({info.label or info.uuid})",
                                 diffs))
            plans.append(_Plan(src, info, "new", diffs,
                               None if diffs else _param_order(reference, info)))
            known[info.uuid] = _stored_as(info, plans[-1].param_order)
    return plans, problems, ref_name


def _read_infos(path: Path) -> list[SessionInfo]:
    conn = connect(path, readonly=True)
    try:
        _check_schema(conn, path)
        return read_sessions(conn)
    finally:
        conn.close()


def _param_order(ref: SessionInfo, info: SessionInfo) -> list[int] | None:
    """Where each of ``info``'s parameters sits in ``ref``'s order, when the two hold
    the same parameters in another order (actions index parameters, so such a
    session is stored in ``ref``'s order); None when nothing needs reordering."""
    if info.param_names == ref.param_names or sorted(info.param_names) != sorted(
            ref.param_names):
        return None
    return [ref.param_names.index(n) for n in info.param_names]


def _stored_as(info: SessionInfo, order: list[int] | None) -> SessionInfo:
    """``info`` as the merge stores it (parameters in the reference's order)."""
    if order is None:
        return info
    params = [None] * len(order)
    for j, k in enumerate(order):
        params[k] = info.params[j]
    return dataclasses.replace(info, params=params)


def _growth_problems(old: SessionInfo, new: SessionInfo) -> list[str]:
    """A session merged before may since have grown, but only by appending names."""
    out = []
    for kind, a, b in (("PIs", old.pi_names, new.pi_names),
                       ("nodes", old.node_names, new.node_names)):
        if b[:len(a)] != a and a[:len(b)] != b:
            out.append(f"{kind} {a} vs {b}")
    theirs = {p.name: asdict(p) for p in new.params}
    if {p.name: asdict(p) for p in old.params} != theirs:
        out.append("parameters differ")
    return out


def _temp_path(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.merge-{os.getpid()}-",
                                suffix=".tmp")
    os.close(fd)
    os.unlink(name)          # SQLite creates it; an empty file would be "not a database"
    return Path(name)


def _remove_stale_temps(out: Path) -> None:
    """Temp files of merges whose process died (killed, power cut) are removed."""
    if not out.parent.is_dir():
        return
    pattern = re.compile(TEMP_RE.format(name=re.escape(out.name)) + r"(-wal|-shm|-journal)?$")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and not _alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_db_files(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _ro_uri(path: Path) -> str:
    return f"file:{quote(str(path))}?mode=ro"


def _open_output(tmp: Path, base: Path | None) -> sqlite3.Connection:
    """The temp output: a consistent copy of ``base`` (WAL included) or a new DB."""
    conn = sqlite3.connect(f"file:{quote(str(tmp))}?mode=rwc", uri=True,
                           isolation_level="DEFERRED")
    if base is not None:
        src = connect(base, readonly=True)
        try:
            _check_schema(src, base)
            src.backup(conn)
        finally:
            src.close()
    # a temp file is thrown away on any failure: no journal, no syncs until the end
    conn.execute("PRAGMA journal_mode=OFF")
    conn.execute("PRAGMA synchronous=OFF")
    conn.executescript(SCHEMA)
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                 (str(SCHEMA_VERSION),))
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('created_by', 'capes')")
    conn.commit()
    _check_schema(conn, tmp)
    return conn


def _copy_session(conn: sqlite3.Connection, plan: _Plan, by_uuid: dict) -> MergedSession:
    info = plan.info
    if plan.status == "known":
        sid = by_uuid[info.uuid]
        old_pis, old_nodes = conn.execute("SELECT pi_names, node_names FROM sessions "
                                          "WHERE id=?", (sid,)).fetchone()
        if len(info.pi_names) > len(json.loads(old_pis)) or \
                len(info.node_names) > len(json.loads(old_nodes)):
            conn.execute("UPDATE sessions SET pi_names=?, node_names=? WHERE id=?",
                         (json.dumps(info.pi_names), json.dumps(info.node_names), sid))
        verb = "INSERT OR IGNORE"
    else:
        params = _stored_as(info, plan.param_order).params
        provenance = {"source_file": str(plan.source), "source_session": info.id,
                      "source_uuid": info.uuid, "merged_at": time.time()}
        if info.provenance:
            provenance["source_provenance"] = info.provenance
        if plan.differences:
            provenance["differences"] = plan.differences
        cur = conn.execute(
            "INSERT INTO sessions (uuid, label, started_at, tick_seconds, pi_names, "
            "node_names, params, provenance) VALUES (?,?,?,?,?,?,?,?)",
            (info.uuid, info.label, info.started_at, info.tick_seconds,
             json.dumps(info.pi_names), json.dumps(info.node_names),
             json.dumps([asdict(p) for p in params]), json.dumps(provenance)))
        sid = cur.lastrowid
        by_uuid[info.uuid] = sid
        verb = "INSERT"
    before = conn.total_changes
    conn.execute(f"{verb} INTO main.pis (session, tick, node, vec) SELECT ?, tick, node, vec "
                 f"FROM src.pis WHERE session=? ORDER BY tick, node", (sid, info.id))
    pis_rows = conn.total_changes - before
    before = conn.total_changes
    if plan.param_order is None:
        conn.execute(f"{verb} INTO main.actions (session, tick, action, vals) SELECT ?, tick, "
                     f"action, vals FROM src.actions WHERE session=? ORDER BY tick",
                     (sid, info.id))
    else:
        conn.executemany(f"{verb} INTO main.actions VALUES (?,?,?,?)",
                         list(_reordered_actions(conn, info.id, sid, plan.param_order)))
    action_rows = conn.total_changes - before
    if plan.status == "known":
        status = "extended" if pis_rows or action_rows else "present"
    else:
        status = "added"
    return MergedSession(str(plan.source), info.id, info.uuid, sid, pis_rows, action_rows,
                         status, plan.differences)


def _reordered_actions(conn, src_sid: int, sid: int, order: list[int]):
    """Actions rewritten for the reference's parameter order: increasing parameter j
    of the source is increasing parameter order[j] of the output."""
    inverse = np.argsort(order)
    for tick, action, blob in conn.execute("SELECT tick, action, vals FROM src.actions "
                                           "WHERE session=? ORDER BY tick", (src_sid,)):
        if action:
            j, sign = divmod(action - 1, 2)
            action = 1 + 2 * order[j] + sign
        vals = np.frombuffer(blob, "<f4")[inverse]
        yield sid, tick, action, vals.astype("<f4").tobytes()


def _finish_output(conn: sqlite3.Connection, tmp: Path) -> None:
    """Leave the temp as a self-contained WAL-mode replay DB on stable storage."""
    conn.commit()
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())


def _replace(tmp: Path, out: Path) -> None:
    """Put the finished temp in place of ``out`` in one rename.

    A WAL left beside the old ``out`` would be replayed onto the new file, so it is
    checkpointed into the old file first (its content is already in the copy)."""
    if Path(f"{out}-wal").exists():
        conn = sqlite3.connect(str(out))
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
    os.replace(tmp, out)
    for suffix in ("-wal", "-shm"):
        leftover = Path(f"{tmp}{suffix}")
        leftover.unlink(missing_ok=True)
    dir_fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- export ---------------------------------------------------------------------------------

def _union(lists: Iterable[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for names in lists:
        for n in names:
            seen.setdefault(n, None)
    return list(seen)


def action_label(action: int, param_names: list[str]) -> str:
    if action == 0:
        return "null"
    k, sign = divmod(action - 1, 2)
    if k >= len(param_names):
        return str(action)
    return f"{param_names[k]}{'+' if sign == 0 else '-'}"


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
        with _atomic(out, "w", newline="") as fh:
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
    pi_pos = np.array([pi_cols.index(p) for p in info.pi_names], np.int64)
    param_pos = [param_cols.index(p) for p in info.param_names]
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
                    action_here = action_label(action, info.param_names)
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


def session_arrays(conn: sqlite3.Connection, info: SessionInfo) -> dict[str, np.ndarray]:
    """One session, dense over its tick range in its own names: ``ticks`` (T,),
    ``pis`` (T, nodes, PIs) float32 with NaN where missing, ``actions`` (T,) int16
    (-1: none), ``values`` (T, parameters) float32 in effect during each tick."""
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


def export_npz(db: str | Path, out: str | Path, progress: Progress = None) -> list[str]:
    """NPZ for numpy users: ``sessions`` (ids), ``session_uuids``, ``info`` (the JSON
    of :func:`describe`), and per session ``s<id>_ticks``, ``s<id>_pis``,
    ``s<id>_actions``, ``s<id>_values``, ``s<id>_pi_names``, ``s<id>_node_names``,
    ``s<id>_param_names`` (see :func:`session_arrays`). Loads with
    ``np.load(path)`` (no pickle). Returns the array names."""
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
            for key, arr in session_arrays(conn, info).items():
                arrays[f"s{info.id}_{key}"] = arr
            for key, names in (("pi_names", info.pi_names), ("node_names", info.node_names),
                               ("param_names", info.param_names)):
                arrays[f"s{info.id}_{key}"] = np.array(names, dtype=str)
            if progress:
                progress(f"session {info.id}: {len(arrays[f's{info.id}_ticks'])} ticks")
    finally:
        conn.close()
    with _atomic(out, "wb") as fh:
        np.savez(fh, **arrays)
    return list(arrays)


class _atomic:
    """Write a file under a temp name beside it; rename into place only on success."""

    def __init__(self, path: str | Path, mode: str, **kw):
        self.path = Path(path)
        self.mode, self.kw = mode, kw

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.",
                                        suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)       # as open() would have made it
        self.fh = os.fdopen(fd, self.mode, **self.kw)
        return self.fh

    def __exit__(self, exc_type, *exc):
        try:
            if exc_type is None:
                self.fh.flush()
                os.fsync(self.fh.fileno())
            self.fh.close()
            if exc_type is None:
                os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)
        return False


