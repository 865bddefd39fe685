"""``capes replay merge``: copy the sessions of several replay DBs into one (thesis §5.2.7).

Each session stays a session of its own (no transition spans two), keyed by its uuid so
merging the same source twice adds nothing, with its provenance recorded. Sessions must
agree with the output's layout by name unless ``allow_partial``; the output is replaced
atomically, so an interrupted merge leaves the old OUT (or none) behind.
"""
from __future__ import annotations

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

from capes.common import actions
from capes.common.atomic import fsync_dir
from capes.common.replay_db import (
    SCHEMA,
    SCHEMA_VERSION,
    ReplayDBError,
    SessionInfo,
    _check_schema,
    _no_op,
    connect,
    index_of,
    read_sessions,
)

Progress = Callable[[str], None] | None


SPEC_FIELDS = ("min", "max", "step", "default", "forbidden", "nodes")


def differences(ref: SessionInfo, other: SessionInfo) -> list[str]:
    """How ``other``'s names and specs differ from ``ref``'s (orders do not count)."""
    out = []

    def diff_names(kind, a, b):
        sa, sb = set(a), set(b)             # sets: 65,535 names must not cost O(n²)
        missing = [n for n in a if n not in sb]
        extra = [n for n in b if n not in sa]
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
    where = index_of(ref.param_names)
    return [where[n] for n in info.param_names]


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
    conn.set_progress_handler(_no_op, 100_000)    # SIGTERM/Ctrl-C stop a long copy
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
    _check_row_types(conn, plan)
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


def _check_row_types(conn: sqlite3.Connection, plan: _Plan) -> None:
    """Rows are copied as they are, so a damaged source (a text tick, a vector that is
    not a blob) would be carried into OUT: refuse it (one scan, in SQLite)."""
    for table, blob in (("pis", "vec"), ("actions", "vals")):
        bad = conn.execute(
            f"SELECT COUNT(*) FROM src.{table} WHERE session=? AND (typeof(tick) != "
            f"'integer' OR typeof({blob}) != 'blob' OR typeof({'node' if table == 'pis' else 'action'})"
            f" != 'integer')", (plan.info.id,)).fetchone()[0]
        if bad:
            raise ReplayDBError(f"{plan.source} session {plan.info.id}: {bad} {table} row(s) "
                                f"of the wrong type (a damaged DB); nothing merged")


def _reordered_actions(conn, src_sid: int, sid: int, order: list[int]):
    """Actions rewritten for the reference's parameter order: moving parameter j of the
    source by m steps is moving parameter order[j] of the output by m steps."""
    inverse = np.argsort(order)
    for tick, action, blob in conn.execute("SELECT tick, action, vals FROM src.actions "
                                           "WHERE session=? ORDER BY tick", (src_sid,)):
        move = actions.decode(action, len(order))
        if move is not None:
            action = actions.encode(order[move[0]], move[1], len(order))
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
    fsync_dir(out.parent)
