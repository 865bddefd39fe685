"""The replay DB: every PI and action CAPES has seen, in SQLite (WAL mode).

Layout (schema version 1):

* ``meta(key, value)``: schema version and who made the file.
* ``sessions``: one row per tuning session, with the metadata needed to read its data:
  PI names, node names, parameter specs (JSON), tick length, label, provenance.
* ``pis(session, tick, node, vec)``: one row per node and tick; ``vec`` is the node's PI
  vector as little-endian float32 in the session's PI order (NaN = missing). A vector
  shorter than the PI list means the trailing PIs were not known yet. A ``vec`` whose
  length is not a multiple of 4 is stored compactly (see :func:`encode_vec`): the
  writer lz4-compresses a vector when that makes it smaller (idle counters, zeros and
  repeated values do), which keeps the paper's 70-hour DB well under its 0.5 GB.
* ``actions(session, tick, action, vals)``: the action chosen at ``tick`` (0 = NULL,
  1 + 2k = increase parameter k, 2 + 2k = decrease it) and every parameter's value
  after it, float32 in the session's parameter order.

One process writes (:class:`ReplayWriter`: the interface daemon, or the converge test);
any number read (:class:`ReplayReader`), each keeping an in-memory cache that it
refreshes incrementally by rowid. Readers map every session onto one :class:`Layout`
by name, so sessions recorded with other PI orders or missing PIs still read correctly
(missing entries become NaN and Algorithm 2's tolerance applies).
"""
from __future__ import annotations

import itertools
import json
import logging
import sqlite3
import struct
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import lz4.block
import numpy as np

from capes.common import actions
from capes.common.params import ParameterSpec

log = logging.getLogger("capes.replay_db")

SCHEMA_VERSION = 1
INSERT_ROWS = 200        # rows per INSERT statement (800 parameters: under SQLite's old 999)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY,
    uuid TEXT NOT NULL UNIQUE,
    label TEXT NOT NULL DEFAULT '',
    started_at REAL NOT NULL,
    tick_seconds REAL NOT NULL,
    pi_names TEXT NOT NULL,
    node_names TEXT NOT NULL,
    params TEXT NOT NULL,
    provenance TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS pis (
    session INTEGER NOT NULL, tick INTEGER NOT NULL, node INTEGER NOT NULL,
    vec BLOB NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS pis_key ON pis(session, tick, node);
CREATE TABLE IF NOT EXISTS actions (
    session INTEGER NOT NULL, tick INTEGER NOT NULL, action INTEGER NOT NULL,
    vals BLOB NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS actions_key ON actions(session, tick);
"""


class ReplayDBError(RuntimeError):
    """The file is not a replay DB this version can read, or a write was refused."""


# -- compact PI vectors --------------------------------------------------------------------
# A raw vector is n × 4 bytes. An encoded one is a header byte (codec << 2 | pad), the
# number of floats (uint16 LE), the codec's body and ``pad`` (0 or 1) zero bytes, chosen
# so its length is never a multiple of 4: the length alone tells the two apart, rows
# stay self-contained (a merge copies them as they are) and old rows stay valid.
CODEC_LZ4 = 1
_HEADER = struct.Struct("<BH")


def encode_vec(vec: np.ndarray, compress: bool = True) -> bytes:
    """``vec`` as stored in ``pis.vec``: lz4 when that is smaller, else raw float32."""
    return encode_vecs(np.asarray(vec, dtype="<f4")[None], compress)[0]


def encode_vecs(rows: np.ndarray, compress: bool = True) -> list[bytes]:
    """:func:`encode_vec` of each row of a 2-D array (one call for a batch of rows)."""
    raw = np.ascontiguousarray(rows, dtype="<f4")
    n = raw.shape[1]
    # slices of one bytes object: the same bytes as each row's tobytes(), at ~60 % of
    # the time (1,000 rows a tick in the cluster test)
    flat, w = raw.tobytes(), 4 * n
    out = [flat[i:i + w] for i in range(0, len(flat), w)] if w else [b""] * len(raw)
    if not compress or n < 8 or n > 0xFFFF:
        return out
    lz4_compress = lz4.block.compress
    heads = [_HEADER.pack(CODEC_LZ4 << 2 | pad, n) for pad in (0, 1)]
    for k, flat in enumerate(out):
        body = lz4_compress(flat, store_size=False)
        size = _HEADER.size + len(body)
        if size % 4:
            if size < 4 * n:
                out[k] = heads[0] + body
        elif size + 1 < 4 * n:
            out[k] = heads[1] + body + b"\0"
    return out


def decode_vec(blob: bytes) -> np.ndarray:
    """A ``pis.vec`` value back as a float32 vector (read-only view for raw rows); a
    ReplayDBError for a value that is not one (damaged or crafted)."""
    if not isinstance(blob, bytes):
        raise ReplayDBError(f"PI vector stored as {type(blob).__name__}, not a blob")
    if len(blob) % 4 == 0:
        return np.frombuffer(blob, "<f4")
    if len(blob) < _HEADER.size:
        raise ReplayDBError(f"PI vector of {len(blob)} bytes")
    head, n = _HEADER.unpack_from(blob)
    codec, pad = head >> 2, head & 3
    if codec != CODEC_LZ4:
        raise ReplayDBError(f"PI vector stored with unknown codec {codec}")
    body = blob[_HEADER.size:len(blob) - pad]
    try:
        raw = lz4.block.decompress(body, uncompressed_size=4 * n)
    except lz4.block.LZ4BlockError as exc:
        raise ReplayDBError(f"damaged PI vector ({exc})") from None
    if len(raw) != 4 * n:
        raise ReplayDBError(f"damaged PI vector ({len(raw)} bytes for {n} floats)")
    return np.frombuffer(raw, "<f4")


@dataclass
class SessionInfo:
    """What a session's rows mean. ``params`` are in action order."""
    pi_names: list[str]
    node_names: list[str]
    params: list[ParameterSpec]
    tick_seconds: float = 1.0
    label: str = ""
    uuid: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    provenance: dict = field(default_factory=dict)
    id: int = 0

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]


@dataclass(frozen=True)
class Layout:
    """The shape every session is read into: nodes × PIs per tick, and parameters."""
    node_names: tuple[str, ...]
    pi_names: tuple[str, ...]
    param_names: tuple[str, ...]

    @classmethod
    def of(cls, info: SessionInfo) -> "Layout":
        return cls(tuple(info.node_names), tuple(info.pi_names), tuple(info.param_names))


def connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    """Open a replay DB with the pragmas every CAPES process uses."""
    path = Path(path)
    if readonly:
        if not path.exists():
            raise ReplayDBError(f"{path}: no such replay DB")
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a crash of the process loses nothing committed; a power cut
        # may lose the last transactions but never corrupts the file.
        conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    if readonly:
        # let Python's signal handlers run during a long query (Ctrl-C, SIGTERM): the
        # query then stops with sqlite3.OperationalError("interrupted")
        conn.set_progress_handler(_no_op, 100_000)
    return conn


def _no_op() -> int:
    return 0


# the tables a replay DB must have, with the columns the readers use
TABLE_COLUMNS = {
    "meta": {"key", "value"},
    "sessions": {"id", "uuid", "label", "started_at", "tick_seconds", "pi_names",
                 "node_names", "params", "provenance"},
    "pis": {"session", "tick", "node", "vec"},
    "actions": {"session", "tick", "action", "vals"},
}


def _check_schema(conn: sqlite3.Connection, path) -> None:
    """A ReplayDBError unless the file is a replay DB of this schema version, each of
    its tables a real table with the expected columns: a crafted file whose ``pis`` is
    a view (say, an endless recursive query) is refused before any query runs on it."""
    try:
        kinds = dict(conn.execute("SELECT name, type FROM sqlite_master WHERE name IN "
                                  "('meta', 'sessions', 'pis', 'actions')").fetchall())
        for table, columns in TABLE_COLUMNS.items():
            if kinds.get(table) != "table":
                why = f"no table {table}" if table not in kinds else \
                    f"{table} is a {kinds[table]}, not a table"
                raise ReplayDBError(f"{path}: not a CAPES replay DB ({why})")
            have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
            if not columns <= have:
                raise ReplayDBError(f"{path}: not a CAPES replay DB (table {table} lacks "
                                    f"{', '.join(sorted(columns - have))})")
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        raise ReplayDBError(f"{path}: not a CAPES replay DB ({exc})") from None
    if row is None:
        raise ReplayDBError(f"{path}: not a CAPES replay DB (no schema version)")
    if str(row[0]) != str(SCHEMA_VERSION):
        raise ReplayDBError(f"{path}: schema version {str(row[0])[:20]!r}, this CAPES "
                            f"reads {SCHEMA_VERSION}")


def _names(text, what: str) -> list[str]:
    names = json.loads(text)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{what} is not a list of names")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} repeats a name")
    return names


def _session_from_row(row) -> SessionInfo:
    """One ``sessions`` row, checked: a ReplayDBError naming the session for a field of
    the wrong type or shape (a damaged or crafted DB), never a TypeError later."""
    sid, suuid, label, started, tick_s, pis, nodes, params, prov = row
    try:
        if not isinstance(sid, int) or not isinstance(suuid, str) or \
                not isinstance(label, str):
            raise ValueError("id, uuid or label of the wrong type")
        for name, x in (("started_at", started), ("tick_seconds", tick_s)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x == x:
                raise ValueError(f"{name} is not a number")
        if not tick_s > 0:
            raise ValueError("tick_seconds is not > 0")
        raw = json.loads(params)
        if not isinstance(raw, list) or not all(isinstance(p, dict) for p in raw):
            raise ValueError("params is not a list of parameter specs")
        specs = [ParameterSpec(**p) for p in raw]
        if not all(isinstance(p.name, str) for p in specs):
            raise ValueError("a parameter without a name")
        provenance = json.loads(prov)
        if not isinstance(provenance, dict):
            raise ValueError("provenance is not an object")
        return SessionInfo(pi_names=_names(pis, "pi_names"),
                           node_names=_names(nodes, "node_names"), params=specs,
                           tick_seconds=float(tick_s), label=label, uuid=suuid,
                           started_at=float(started), provenance=provenance, id=sid)
    except (TypeError, ValueError, RecursionError) as exc:     # JSONDecodeError, bad fields
        raise ReplayDBError(f"session {sid!r}: damaged metadata ({str(exc)[:200]})") from None


SESSION_COLUMNS = ("id, uuid, label, started_at, tick_seconds, pi_names, node_names, "
                   "params, provenance")


def read_sessions(conn: sqlite3.Connection) -> list[SessionInfo]:
    rows = conn.execute(f"SELECT {SESSION_COLUMNS} FROM sessions ORDER BY id").fetchall()
    return [_session_from_row(r) for r in rows]


@dataclass
class Committed:
    """What one :meth:`ReplayWriter.commit` stored. ``ignored`` rows had a key that was
    already stored: history is append-only, so they were dropped, never rewritten."""
    rows: int = 0
    actions: int = 0
    rows_ignored: int = 0
    actions_ignored: int = 0
    ticks: list[int] = field(default_factory=list)     # ticks of the PI rows attempted

    @property
    def empty(self) -> bool:
        return not (self.rows or self.actions or self.rows_ignored or self.actions_ignored)


class ReplayWriter:
    """The single writer. Rows are buffered and committed in one WAL transaction per
    ``commit()``: a crash loses at most the uncommitted batch, never a committed tick.
    Stored rows are never rewritten (a row whose key is stored is ignored and counted).
    ``max_pending`` bounds the PI-row buffer while commits fail: the oldest row makes
    room and is counted in ``dropped``. ``compress=False`` stores every PI vector raw
    (see :func:`encode_vec`)."""

    def __init__(self, path: str | Path, compress: bool = True, max_pending: int | None = None):
        self.path = Path(path)
        self.compress = compress
        self.max_pending = max_pending
        self.dropped = 0
        self._insert_sql: dict[tuple[str, int], str] = {}
        try:
            self.conn = connect(self.path)
            with self.conn:
                self.conn.executescript(SCHEMA)
                self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                                  (str(SCHEMA_VERSION),))
                self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('created_by', 'capes')")
        except sqlite3.Error as exc:
            raise ReplayDBError(f"{self.path}: cannot open as a replay DB for writing "
                                f"({exc})") from None
        _check_schema(self.conn, self.path)
        self._pis: deque[tuple] = deque()
        self._actions: list[tuple] = []
        self._layout: tuple[str, str] | None = None      # JSON of names not yet stored
        self.session: SessionInfo | None = None

    @property
    def pending(self) -> int:
        """Buffered rows (PIs and actions) not committed yet."""
        return len(self._pis) + len(self._actions)

    def begin_session(self, info: SessionInfo) -> SessionInfo:
        """Start a new session (its transitions never join another session's)."""
        self.commit()
        with self.conn:
            cur = self.conn.execute(
                "INSERT INTO sessions (uuid, label, started_at, tick_seconds, pi_names, "
                "node_names, params, provenance) VALUES (?,?,?,?,?,?,?,?)",
                (info.uuid, info.label, info.started_at, info.tick_seconds,
                 json.dumps(info.pi_names), json.dumps(info.node_names),
                 json.dumps([asdict(p) for p in info.params]), json.dumps(info.provenance)))
        info.id = cur.lastrowid
        self.session = info
        return info

    def update_layout(self, pi_names: list[str], node_names: list[str]) -> None:
        """Append newly seen PIs or nodes to the current session (never reorders). The
        names are stored by the next commit, in the same transaction as the rows."""
        s = self._require_session()
        if pi_names[:len(s.pi_names)] != s.pi_names or \
                node_names[:len(s.node_names)] != s.node_names:
            raise ReplayDBError("layout may only grow by appending names")
        s.pi_names, s.node_names = list(pi_names), list(node_names)
        self._layout = (json.dumps(s.pi_names), json.dumps(s.node_names))

    def add_pis(self, tick: int, node: int, vec: np.ndarray) -> bool:
        """Buffer one row; True when the buffer was full and its oldest row was dropped."""
        s = self._require_session()
        if not 0 <= node < len(s.node_names):
            raise ReplayDBError(f"node index {node} not in session layout")
        vec = np.asarray(vec, dtype="<f4")
        if vec.ndim != 1 or len(vec) > len(s.pi_names):
            raise ReplayDBError(f"PI vector of shape {vec.shape} does not fit "
                                f"{len(s.pi_names)} PIs")
        full = self.max_pending is not None and len(self._pis) >= self.max_pending
        if full:
            self._pis.popleft()
            self.dropped += 1
        self._pis.append((s.id, int(tick), int(node), encode_vec(vec, self.compress)))
        return full

    def add_pis_rows(self, tick: int, nodes, rows) -> int:
        """One tick of rows, one per node of ``nodes`` (:meth:`add_pis_many`)."""
        nodes = np.asarray(nodes, np.int64).reshape(-1)
        return self.add_pis_many(np.full(len(nodes), int(tick), np.int64), nodes,
                                 np.asarray(rows, dtype="<f4").reshape(len(nodes), -1))

    def add_pis_many(self, ticks, nodes, rows: np.ndarray) -> int:
        """:meth:`add_pis` for many rows at once (``rows``: one per tick and node, all
        as wide); return how many of the oldest buffered rows were dropped to make room."""
        s = self._require_session()
        rows = np.asarray(rows, dtype="<f4")
        ticks, nodes = np.asarray(ticks, np.int64), np.asarray(nodes, np.int64)
        if rows.ndim != 2 or rows.shape[1] > len(s.pi_names) or \
                not len(ticks) == len(nodes) == len(rows):
            raise ReplayDBError(f"PI rows of shape {rows.shape} do not fit "
                                f"{len(s.pi_names)} PIs and {len(ticks)} ticks")
        if len(nodes) and not 0 <= nodes.min() <= nodes.max() < len(s.node_names):
            raise ReplayDBError(f"node index {nodes.max()} not in session layout")
        self._pis.extend(zip(itertools.repeat(s.id), ticks.tolist(), nodes.tolist(),
                             encode_vecs(rows, self.compress)))
        excess = 0 if self.max_pending is None else max(0, len(self._pis) - self.max_pending)
        for _ in range(excess):
            self._pis.popleft()
        self.dropped += excess
        return excess

    def add_action(self, tick: int, action: int, values) -> None:
        s = self._require_session()
        vals = np.asarray(values, dtype="<f4")
        if vals.shape != (len(s.params),):
            raise ReplayDBError(f"{len(vals)} parameter values for {len(s.params)} parameters")
        if not actions.valid(action, len(s.params)):
            most = actions.count(len(s.params), actions.MAX_STEPS) - 1
            raise ReplayDBError(f"action {action} outside [0, {most}]")
        self._actions.append((s.id, int(tick), int(action), vals.tobytes()))

    def discard_actions(self) -> int:
        """Forget the buffered actions (their commit failed and they were not applied)."""
        n = len(self._actions)
        self._actions.clear()
        return n

    def commit(self, max_rows: int | None = None, durable: bool = False) -> Committed:
        """Store the layout, every buffered action and the ``max_rows`` oldest PI rows
        (all when None) in one transaction. On an error nothing of it is stored and
        everything stays buffered, so a later commit can retry. ``durable``: fsync the
        WAL before returning, so the rows survive a power cut too (a plain commit
        survives any crash of the process)."""
        n = len(self._pis) if max_rows is None else min(max_rows, len(self._pis))
        pis = list(self._pis) if n == len(self._pis) else list(itertools.islice(self._pis, n))
        done = Committed(ticks=[row[1] for row in pis])
        if not (pis or self._actions or self._layout):
            return done
        if durable:
            self.conn.execute("PRAGMA synchronous=FULL")
        try:
            with self.conn:
                if self._layout:
                    self.conn.execute("UPDATE sessions SET pi_names=?, node_names=? WHERE "
                                      "id=?", (*self._layout, self._require_session().id))
                done.rows = self._insert("pis", pis)
                done.actions = self._insert("actions", self._actions)
        finally:
            if durable:
                self.conn.execute("PRAGMA synchronous=NORMAL")
        done.rows_ignored = len(pis) - done.rows
        done.actions_ignored = len(self._actions) - done.actions
        if n == len(self._pis):
            self._pis.clear()
        else:
            for _ in range(n):
                self._pis.popleft()
        self._actions.clear()
        self._layout = None
        return done

    def _insert(self, table: str, rows: list[tuple]) -> int:
        """Insert ``rows`` in order, ignoring keys already stored; return how many were
        stored. Up to ``INSERT_ROWS`` rows a statement: one multi-row INSERT cost ~0.6 of
        ``executemany``'s time per row (1,000 rows a tick of the cluster test)."""
        stored, k = 0, INSERT_ROWS
        for i in range(0, len(rows), k):
            chunk = rows[i:i + k]
            sql = self._insert_sql.get((table, len(chunk)))
            if sql is None:
                sql = self._insert_sql[table, len(chunk)] = \
                    f"INSERT OR IGNORE INTO {table} VALUES " + ",".join(["(?,?,?,?)"] * len(chunk))
            stored += self.conn.execute(sql, list(itertools.chain.from_iterable(chunk))).rowcount
        return stored

    def close(self, commit: bool = True) -> None:
        """Commit what is buffered (unless ``commit`` is false) and close."""
        try:
            if commit:
                self.commit()
        finally:
            self.conn.close()

    def _require_session(self) -> SessionInfo:
        if self.session is None:
            raise ReplayDBError("no session: call begin_session() first")
        return self.session

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SessionData:
    """One session's cached data, mapped onto the reader's layout.

    ``pis[i]`` is tick ``first_tick + i`` as a (nodes, PIs) float32 array, NaN where
    missing (or stored as ±inf: no measurement); ``actions[i]`` the action taken then (-1 = none); ``values[i]`` the
    parameters' values in effect *during* that tick (after the previous action).
    """

    # a gap between rows costs memory like rows: allow this much (or a day of 1 s ticks)
    GAP_BYTES = 256 << 20

    def __init__(self, info: SessionInfo, layout: Layout, max_gap: int | None = None):
        self.info = info
        self.first_tick: int | None = None
        self.length = 0
        self.dirty_from = 0       # lowest index changed since a consumer last looked
        n, p, k = len(layout.node_names), len(layout.pi_names), len(layout.param_names)
        tick_bytes = 4 * (n * p + k) + 2
        # ticks a row may lie beyond the loaded range (see plausible)
        self.max_gap = max_gap or max(86_400, self.GAP_BYTES // tick_bytes)
        self.anchor: int | None = None   # where the first row must lie (the median tick)
        self.skipped = 0          # rows too far from the others: not loaded
        self.pis = np.full((0, n, p), np.nan, np.float32)
        self.actions = np.full(0, -1, np.int16)
        self.after = np.full((0, k), np.nan, np.float32)   # values after the action at i
        self._remap(layout)

    def _remap(self, layout: Layout) -> None:
        info = self.info
        # by dict, not list.index: 65,535 PI names cost O(P), not a minute of O(P²)
        nodes, pis, params = (index_of(x) for x in (layout.node_names, layout.pi_names,
                                                     info.param_names))
        self.node_map = np.array([nodes.get(n, -1) for n in info.node_names], np.int64)
        pi_map = [pis.get(n, -1) for n in info.pi_names]
        self.pi_src = np.array([i for i, d in enumerate(pi_map) if d >= 0], np.int64)
        self.pi_dst = np.array([d for d in pi_map if d >= 0], np.int64)
        self.identity_pis = pi_map == list(range(len(layout.pi_names)))
        self.param_map = [params.get(n, -1) for n in layout.param_names]
        self.defaults = np.array(
            [info.params[j].default if j >= 0 else np.nan for j in self.param_map], np.float32)

    def reserve(self, first_tick: int, last_tick: int) -> None:
        """Make room for ticks up to ``last_tick`` in one allocation when many rows are
        about to load (a big DB then needs no doubling copies and no slack); small
        growth keeps amortised doubling."""
        if self.first_tick is None:
            self.first_tick = first_tick
        need = last_tick - self.first_tick + 1
        if need > len(self.pis):
            cap = need if need > 2 * len(self.pis) else max(1024, 2 * len(self.pis))
            self.pis = _grow(self.pis, cap, np.nan)
            self.actions = _grow(self.actions, cap, -1)
            self.after = _grow(self.after, cap, np.nan)

    def plausible(self, tick: int) -> bool:
        """Whether ``tick`` lies within ``max_gap`` of the ticks loaded so far (of the
        session's median tick before any): a row far away, such as tick 2^63-1 stored
        by an older daemon, would make the arrays allocate for the whole gap."""
        if self.first_tick is None:
            return self.anchor is None or abs(tick - self.anchor) <= self.max_gap
        return self.first_tick - self.max_gap <= tick < \
            self.first_tick + self.length + self.max_gap

    def _ensure(self, tick: int) -> int | None:
        """Grow the arrays (amortised doubling) so ``tick`` has a slot; return its index,
        or None (counted in ``skipped``) for a tick too far from the others."""
        if not self.plausible(tick):
            self.skipped += 1
            if self.skipped == 1:
                log.warning("replay DB session %d: tick %d lies far from the others; "
                            "skipping such rows", self.info.id, tick)
            return None
        if self.first_tick is None:
            self.first_tick = tick
        if tick < self.first_tick:       # rare: an older tick arrived late
            shift = self.first_tick - tick
            self.pis = np.concatenate([np.full((shift,) + self.pis.shape[1:], np.nan,
                                               np.float32), self.pis])
            self.actions = np.concatenate([np.full(shift, -1, np.int16), self.actions])
            self.after = np.concatenate([np.full((shift, self.after.shape[1]), np.nan,
                                                 np.float32), self.after])
            self.first_tick, self.length = tick, self.length + shift
            self.dirty_from = 0
        i = tick - self.first_tick
        self.dirty_from = min(self.dirty_from, i)
        if i >= len(self.pis):
            cap = max(1024, 2 * len(self.pis), i + 1)
            self.pis = _grow(self.pis, cap, np.nan)
            self.actions = _grow(self.actions, cap, -1)
            self.after = _grow(self.after, cap, np.nan)
        self.length = max(self.length, i + 1)
        return i

    def current_values(self) -> np.ndarray:
        """The parameters' values after the newest recorded action (else defaults)."""
        for i in range(self.length - 1, max(self.length - 4, -1), -1):
            if not np.isnan(self.after[i]).all():    # the usual case: one of the last
                return self.after[i].copy()           # ticks (not a scan of the session)
        acted = np.flatnonzero(~np.isnan(self.after[:self.length]).all(axis=1))
        return self.after[acted[-1]].copy() if len(acted) else self.defaults.copy()

    def values_in_effect(self, start: int = 0, before: np.ndarray | None = None
                         ) -> np.ndarray:
        """Each tick's parameter values from ``start`` on: the values after the last
        action strictly before that tick (the session's defaults before any action).
        ``before``: the values in effect at tick ``start`` − 1, when the caller has
        them; then only the ticks from ``start`` − 1 on are read, not the whole session."""
        lo = start - 1 if before is not None and start > 0 else 0
        after = self.after[:self.length]
        acted = np.where(~np.isnan(after[lo:]).all(axis=1), np.arange(lo, len(after)), -1)
        last_before = np.maximum.accumulate(np.concatenate([[-1], acted[:-1]]))[start - lo:]
        base = before if lo > 0 else self.defaults
        # np.empty and a broadcast assignment: broadcast_to(...).copy() costs more in
        # Python than the copy itself, and this runs on every tick's refresh
        out = np.empty((len(last_before), len(self.defaults)), base.dtype)
        out[:] = base
        have = last_before >= 0
        out[have] = after[last_before[have]]
        return out


def index_of(names) -> dict[str, int]:
    """name -> position (the first, should a name repeat)."""
    out: dict[str, int] = {}
    for i, n in enumerate(names):
        out.setdefault(n, i)
    return out


def _grow(arr: np.ndarray, cap: int, fill) -> np.ndarray:
    out = np.full((cap,) + arr.shape[1:], fill, arr.dtype)
    out[:len(arr)] = arr
    return out


class ReplayReader:
    """Read-only view of a replay DB with an incrementally refreshed in-memory cache.

    ``grow_nodes``: a node that a session appends to its layout (a node joining
    mid-session, :meth:`ReplayWriter.update_layout`) is appended to the reader's layout
    too, every session's arrays widened, instead of being left out. For consumers whose
    model does not depend on the node count (the cluster engine); the single-node
    engine's network has one input per node, so it reads a fixed layout."""

    # rows fetched per round trip: bounds the memory a big first load needs beside
    # the cache itself (Python row objects cost about twice the float32 they carry)
    FETCH_ROWS = 20_000
    # new rows of one session past which a refresh sizes its arrays in one allocation
    RESERVE_ROWS = 1024

    def __init__(self, path: str | Path, layout: Layout | None = None,
                 max_gap: int | None = None, grow_nodes: bool = False):
        self.path = Path(path)
        self.conn = connect(self.path, readonly=True)
        _check_schema(self.conn, self.path)
        self.layout = layout
        self.grow_nodes = grow_nodes
        self.max_gap = max_gap    # None: sized by memory (see SessionData.GAP_BYTES)
        self.sessions: dict[int, SessionData] = {}
        self._last_pis_rowid = 0
        self._last_action_rowid = 0
        self._session_rows: list[tuple] | None = None   # as last read (_read_sessions)
        self._session_infos: list[SessionInfo] = []
        self.refresh()

    def _reserve(self, table: str, last_rowid: int) -> None:
        """Size each session's arrays for the rows past ``last_rowid`` before loading.

        ``NOT INDEXED``: without it SQLite answers the GROUP BY by scanning the whole
        covering index ``(session, tick, node)`` (``SCAN ... USING COVERING INDEX``), so
        every refresh cost O(rows stored) — ~50 ms a tick after 600 ticks at 1,000 nodes
        and growing; with it the query is a rowid range search over the new rows only
        (``SEARCH ... USING INTEGER PRIMARY KEY (rowid>?)``), and a refresh costs the
        same at any DB size (``benchmarks/bench_cluster_engine.py --part replay``)."""
        if len(self.sessions) == 0:
            return
        rows = self.conn.execute(f"SELECT session, MIN(tick), MAX(tick), COUNT(*) FROM {table}"
                                 f" NOT INDEXED WHERE rowid > ? GROUP BY session",
                                 (last_rowid,))
        for sid, lo, hi, count in rows:
            data = self.sessions.get(sid)
            # only when the rows fill the span: a stray far tick must not size the arrays
            if data is not None and count > self.RESERVE_ROWS and hi - lo < 2 * count and \
                    data.plausible(lo) and data.plausible(hi):
                data.reserve(lo, hi)

    def _anchor(self, data: SessionData) -> None:
        """Anchor a new session at its median PI tick (action tick if it has no PIs), so
        that one stray first row cannot decide which rows are plausible."""
        for table in ("pis", "actions"):
            row = self.conn.execute(
                f"SELECT tick FROM {table} WHERE session=? ORDER BY tick LIMIT 1 OFFSET "
                f"(SELECT COUNT(*) / 2 FROM {table} WHERE session=?)",
                (data.info.id, data.info.id)).fetchone()
            if row is not None:
                data.anchor = row[0]
                return

    def refresh(self) -> int:
        """Load rows written since the last refresh; return how many. A row of the
        wrong type or shape (a damaged or crafted DB) is a ReplayDBError naming the
        table, not a TypeError from deep inside."""
        try:
            return self._load_new_rows()
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
            raise ReplayDBError(f"{self.path}: damaged replay DB ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None

    def _read_sessions(self) -> list[SessionInfo]:
        """The sessions table, parsed again only when a row of it changed (the
        checks and JSON of every row cost more than the rest of a small refresh)."""
        rows = self.conn.execute(f"SELECT {SESSION_COLUMNS} FROM sessions "
                                 f"ORDER BY id").fetchall()
        if rows != self._session_rows:
            self._session_infos = [_session_from_row(r) for r in rows]
            self._session_rows = rows
        return self._session_infos

    def _load_new_rows(self) -> int:
        conn = self.conn
        for info in self._read_sessions():
            if self.layout is None:
                self.layout = Layout.of(info)
            if self.grow_nodes:
                self._add_nodes(info.node_names)
            known = self.sessions.get(info.id)
            if known is None:
                known = self.sessions[info.id] = SessionData(info, self.layout, self.max_gap)
                self._anchor(known)
            elif (known.info.pi_names, known.info.node_names) != (info.pi_names,
                                                                  info.node_names):
                known.info = info
                known._remap(self.layout)
        n = 0
        cur = conn.execute("SELECT rowid, session, tick, node, vec FROM pis WHERE rowid > ? "
                           "ORDER BY rowid", (self._last_pis_rowid,))
        rows = cur.fetchmany(self.FETCH_ROWS)
        # a session reserves only past RESERVE_ROWS new rows: a refresh that brings fewer
        # (every tick's) skips the sizing query, which is a hint only (a row that lands
        # between the two reads is loaded by the same amortised growth as without it)
        if len(rows) > self.RESERVE_ROWS:
            self._reserve("pis", self._last_pis_rowid)
        touched: dict[int, list[int]] = {}       # session -> [lowest, highest] tick loaded
        while rows:
            for rowid, sid, tick, node, blob in rows:
                data = self.sessions[sid]
                i = data._ensure(tick)
                if i is None or node >= len(data.node_map) or data.node_map[node] < 0:
                    continue
                span = touched.get(sid)
                if span is None:
                    touched[sid] = [tick, tick]
                elif not span[0] <= tick <= span[1]:
                    span[0], span[1] = min(span[0], tick), max(span[1], tick)
                vec = decode_vec(blob)
                dst = data.pis[i, data.node_map[node]]
                if data.identity_pis and len(vec) == dst.shape[0]:
                    dst[:] = vec
                else:
                    keep = data.pi_src < len(vec)
                    dst[:] = np.nan
                    dst[data.pi_dst[keep]] = vec[data.pi_src[keep]]
            self._last_pis_rowid = rows[-1][0]
            n += len(rows)
            rows = cur.fetchmany(self.FETCH_ROWS)
        for sid, (lo, hi) in touched.items():
            # an infinite PI is no measurement: missing (NaN), like a PI not sent, so
            # that none reaches a consumer's sum, scale or statistic (issue 38). Once
            # over the ticks this refresh loaded, not per row (a tick of 1,000 rows)
            data = self.sessions[sid]
            seg = data.pis[lo - data.first_tick:hi - data.first_tick + 1]
            np.copyto(seg, np.nan, where=np.isinf(seg))
        cur = conn.execute("SELECT rowid, session, tick, action, vals FROM actions "
                           "WHERE rowid > ? ORDER BY rowid", (self._last_action_rowid,))
        while rows := cur.fetchmany(self.FETCH_ROWS):
            for rowid, sid, tick, action, blob in rows:
                data = self.sessions[sid]
                i = data._ensure(tick)
                if i is None:
                    continue
                vals = np.frombuffer(blob, "<f4")
                data.actions[i] = action if self._action_maps(data) else -1
                data.after[i] = [vals[j] if j >= 0 else np.nan for j in data.param_map]
            self._last_action_rowid = rows[-1][0]
            n += len(rows)
        return n

    def _add_nodes(self, names: list[str]) -> None:
        """Append the nodes of ``names`` that the layout lacks (NaN in every tick so far)."""
        have = set(self.layout.node_names)
        new = tuple(n for n in names if n not in have)
        if not new:
            return
        self.layout = replace(self.layout, node_names=self.layout.node_names + new)
        for data in self.sessions.values():
            t, _, p = data.pis.shape
            data.pis = np.concatenate([data.pis, np.full((t, len(new), p), np.nan,
                                                         np.float32)], axis=1)
            data._remap(self.layout)

    def _action_maps(self, data: SessionData) -> bool:
        """Actions index parameters; they mean the same only if the order matches."""
        return data.param_map == list(range(len(data.param_map)))

    @property
    def skipped(self) -> int:
        """Rows not loaded because their tick lay far from the others."""
        return sum(d.skipped for d in self.sessions.values())

    def close(self) -> None:
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
