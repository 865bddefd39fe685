"""The interface daemon: the only writer of the replay DB and the hub of every agent.

One process, one loop thread that owns all state: a zmq poll over the ingest ROUTER
(monitoring agents' indicator frames in, FullRequests out), the control ROUTER (control
agents' Acks in, Actions out) and a wake-up pipe through which the gRPC threads hand
work to the loop (``call``). Rows go to the DB in one WAL transaction every
``commit_every_s``; SIGTERM/SIGINT commit and exit cleanly, and a SIGKILL loses at most
the uncommitted batch of indicator rows.

Recording comes before acting: an accepted action is committed to the replay DB before
any control agent sees it, and while the DB cannot be written (disk full, read-only) the
daemon keeps running on a bounded row buffer, reports NOT_SERVING on the gRPC health
service, refuses actions (no tuning without recording), and resumes by itself once a
commit succeeds again. SIGHUP re-reads the CURVE allow-list.

Prometheus metrics (``daemon.metrics``, loopback by default; ``docs/metrics.md``) are
served from a thread of their own; each scrape takes one snapshot on the loop thread.
A clean stop commits, checkpoints the WAL into the DB file (no ``-wal`` left when no
reader holds the DB open) and removes the lock file.
"""
from __future__ import annotations

import bisect
import fcntl
import json
import logging
import math
import os
import queue
import signal
import sqlite3
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import zmq

from capes.common import curve
from capes.common.deployment import DeploymentConfig
from capes.common.metrics import registry_for, serve_metrics
from capes.common.protocol import REFUSED, Action, FullRequest, encode
from capes.common.replay_db import Committed, ReplayDBError, ReplayWriter, SessionInfo
from interface_daemon.action_checker import ActionChecker, Verdict
from interface_daemon import control_service
from interface_daemon.action_plane import ActionPlane
from interface_daemon.counters import DAEMON_METRICS, Counters
from interface_daemon.node_streams import Ingest, Rows, tick_in_range

log = logging.getLogger("capes.interface_daemon")

DRAIN_BATCH = 2000          # messages taken from one socket before looking at the others
DRAIN_BYTES = 256 << 10     # ... or this many payload bytes (a flood of big frames)
CALL_TIMEOUT_S = 10.0
COMMIT_CHUNK = 5000         # rows per transaction: a nearly full disk still takes the oldest
DB_ERRORS = (sqlite3.Error, ReplayDBError, OSError)     # a write that failed, not a bug
REFUSAL_LOG_S = 60.0        # a refused (key, node) is named at most this often
RESUME_LOOKBACK_S = 600.0   # a restart looks this far back for the ticks already stored
STARTUP_ERRORS = DB_ERRORS + (ValueError, OverflowError, curve.KeysMissing, zmq.ZMQError)


class StartupError(OSError):
    """The daemon cannot start; the message is the one line to show the operator."""


def _lock_db(db: str):
    """Hold an exclusive lock next to the DB for the daemon's lifetime: one writer only.
    The kernel drops it when the process dies, SIGKILL included; a clean stop removes
    the file (:func:`_unlock_db`), so a lock taken on a file that was removed meanwhile
    is taken again on the new one."""
    path = Path(str(db) + ".lock")
    for _ in range(10):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(path, "a+")
        except OSError as exc:
            raise OSError(f"{db}: cannot create its lock file {path} ({exc.strerror})") from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            other = fh.read().strip() or "?"
            fh.close()
            raise OSError(f"{db}: another interface daemon (pid {other}) writes this replay DB")
        try:
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()                      # its holder removed it as we opened it: again
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _unlock_db(fh, db: str) -> None:
    """Remove the lock file while still holding the lock, then release it."""
    try:
        os.unlink(str(db) + ".lock")
    except OSError:
        pass
    fh.close()


def checkpoint_wal(db: str | Path) -> bool:
    """Copy the WAL into the DB file and truncate it; when no other connection is open
    (no reader), closing this one removes ``-wal`` and ``-shm``. True when the WAL was
    fully checkpointed."""
    try:
        conn = sqlite3.connect(str(db), timeout=2.0)
        try:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        log.warning("replay DB %s: WAL not checkpointed at exit: %s", db, exc)
        return False
    return not busy


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; ``tcp://host:0`` picks a free port. Return the endpoint actually bound."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind {endpoint}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class InterfaceDaemon:
    def __init__(self, cfg: DeploymentConfig):
        self.cfg = cfg
        d = cfg.daemon
        # [daemon.forbidden] joins each parameter's own list: the session's specs tell
        # the engine every forbidden value, so its moves step over them as the checker
        self.specs = [replace(s, forbidden=list(s.forbidden) + [
            float(f) for f in d.forbidden.get(s.name, ()) if not s.is_forbidden(f)])
            for s in cfg.param_specs()]
        self.counters = Counters()
        self.checker = ActionChecker(self.specs, d.forbidden)
        allowed = allowed_nodes(cfg)
        self.ingest = Ingest(max_nodes=d.max_nodes, max_bytes=d.max_message_bytes,
                             full_request_every_s=d.full_request_every_s,
                             tick_seconds=cfg.tick_seconds,
                             max_clock_skew_s=d.max_clock_skew_s,
                             max_pis_per_node=d.max_pis_per_node,
                             max_pi_name_bytes=d.max_pi_name_bytes,
                             max_session_pis=d.max_session_pis, allowed_nodes=allowed,
                             may_speak=self._may_speak, liveness_s=d.liveness_s,
                             peer_alive=self._monitor_alive)
        self.actions = ActionPlane(self.specs, self.checker, self.counters, self._send_control,
                                   ack_timeout_s=d.ack_timeout_s, max_nodes=d.max_nodes,
                                   max_bytes=d.max_message_bytes, allowed_nodes=allowed,
                                   may_speak=self._may_speak, liveness_s=d.liveness_s,
                                   peer_alive=self._control_alive, vouched=self._vouched)
        self.tuning = d.tuning
        self.training = d.training
        self.workload_epoch = 0
        self.curve_on = cfg.keys.enabled
        self.writer: ReplayWriter | None = None
        self.session: SessionInfo | None = None
        self.db_ok = True                # the last write succeeded
        self._committed_tick = -1
        self._reload = False             # SIGHUP: re-read the allow-list
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}   # see _refused
        self._tell: set[str] = set()     # refused nodes whose agent is told once (_refused)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = False
        self._loop_thread: int | None = None
        self.ctx: zmq.Context | None = None
        self.auth = None
        self.health = None
        self.metrics_server = None
        self.endpoints: dict[str, Any] = {}
        self.grpc_tls = False            # the control plane speaks TLS (control_service)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> dict:
        """Open the DB, bind the sockets, start the authenticator, the gRPC server and
        the metrics endpoint. Return the endpoints actually bound (ports 0 resolved). On
        any error, whatever was opened is closed again (no socket may block the context's
        termination)."""
        d = self.cfg.daemon
        try:
            self._open_db()
            ingest, control = self._open_sockets()
            port = self._start_control_plane()
            self.metrics_server = serve_metrics(
                registry_for(DAEMON_METRICS, self._scrape), d.metrics, "interface daemon")
        except BaseException:
            self._release()
            raise
        host = d.grpc.rsplit(":", 1)[0]
        if not curve.is_loopback(d.grpc) and not self.grpc_tls:
            log.warning("the gRPC control plane listens on %s without TLS "
                        "(daemon.allow_insecure_grpc): its token authenticates callers "
                        "but crosses the network in clear text", d.grpc)
        if not self.ingest.allowed_nodes:
            log.info("no daemon.nodes allow-list: an admitted key may speak for any node "
                     "its binding allows")
        if self.auth is not None and self.auth.unbound():
            log.warning("client keys bound to no node: %s; each may speak for any node no "
                        "key is bound to, and their hellos set no values (bind them: "
                        "`capes keys generate --bind KEY=NODE`, or `--any-node KEY` to "
                        "share one on purpose)", ", ".join(self.auth.unbound()[:10]))
        self.endpoints = {"ingest": ingest, "control": control, "grpc": f"{host}:{port}",
                          "db": str(Path(d.db).resolve()), "pid": os.getpid(),
                          "metrics": self.metrics_server.url if self.metrics_server else ""}
        log.info("listening: %s", self.endpoints)
        return self.endpoints

    def _open_db(self) -> None:
        d = self.cfg.daemon
        self._lock = _lock_db(d.db)
        self.writer = ReplayWriter(d.db, max_pending=d.max_buffered_rows)
        self.ingest.resume_ticks = self._stored_ticks()

    def _stored_ticks(self) -> dict[str, int]:
        """Node name -> newest tick the recent sessions (earlier lives of the daemon)
        hold for it. Agents send their last seconds again after a reconnect; what an
        earlier daemon already committed is then dropped (``replayed``), never stored
        twice. Only ticks within min(max_clock_skew_s, RESUME_LOOKBACK_S) before the
        clock are looked at (an index range, not the whole history), so a far tick
        stored before the clock rule cannot silence a node."""
        conn, out = self.writer.conn, {}
        skew, tick_s, now = self.cfg.daemon.max_clock_skew_s, self.cfg.tick_seconds, time.time()
        lo = max(-2 ** 63, int((now - min(skew, RESUME_LOOKBACK_S)) / tick_s))
        hi = min(2 ** 63 - 1, int((now + min(skew, 1e11)) / tick_s))
        try:
            for sid, nodes in conn.execute("SELECT id, node_names FROM sessions "
                                           "ORDER BY id DESC LIMIT 4").fetchall():
                names = json.loads(nodes)
                for node, tick in conn.execute(
                        "SELECT node, MAX(tick) FROM pis WHERE session = ? AND tick "
                        "BETWEEN ? AND ? GROUP BY node", (sid, lo, hi)):
                    if isinstance(node, int) and 0 <= node < len(names):
                        out[names[node]] = max(out.get(names[node], -1), int(tick))
        except (sqlite3.Error, ValueError, TypeError) as exc:
            log.warning("replay DB %s: the ticks stored by earlier sessions are unknown "
                        "(%s): an agent's resent frames may be stored twice",
                        self.cfg.daemon.db, exc)
        return out

    def _open_sockets(self) -> tuple[str, str]:
        d = self.cfg.daemon
        self.ctx = zmq.Context()
        self.auth = curve.start_authenticator(self.ctx, self.cfg.keys)
        keys = self.cfg.keys if self.curve_on else None
        self.ingest_sock = curve.server_socket(self.ctx, zmq.ROUTER, keys, d.high_water_mark)
        self.control_sock = curve.server_socket(self.ctx, zmq.ROUTER, keys, d.high_water_mark)
        for sock in (self.ingest_sock, self.control_sock):
            sock.setsockopt(zmq.MAXMSGSIZE, 4 * d.max_message_bytes)
        return _bind(self.ingest_sock, d.ingest), _bind(self.control_sock, d.control)

    def _start_control_plane(self) -> int:
        token = curve.load_token(self.cfg.keys)
        if self.curve_on and token is None:
            raise curve.KeysMissing(f"{Path(self.cfg.keys.dir) / curve.TOKEN_FILE}: no "
                                    "control-plane token (run `capes keys generate`)")
        self.grpc_server, self.health, port = control_service.start_server(
            self, self.cfg.daemon.grpc, token, reflect=self.cfg.daemon.grpc_reflection)
        return port

    def _release(self, clean: bool = False) -> None:
        """Close what a failed start() opened (safe to call on anything half-open).
        ``clean`` (a normal stop): checkpoint the WAL and remove the lock file too."""
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        self._close_sockets()
        wrote = self.writer is not None
        if self.writer is not None:
            self.writer.close(commit=False)
            self.writer = None
        lock = getattr(self, "_lock", None)
        if lock is not None:
            if clean and wrote:
                checkpoint_wal(self.cfg.daemon.db)
            if clean:
                _unlock_db(lock, self.cfg.daemon.db)
            else:
                lock.close()
            self._lock = None

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler or another thread)."""
        self._stop = True
        self._wake()

    def request_reload(self) -> None:
        """Ask the loop to re-read the allow-list (safe from a signal handler)."""
        self._reload = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        """Stop serving, commit what is buffered and release everything."""
        self._stop = True
        self._run_calls()        # answer anyone still waiting
        if getattr(self, "grpc_server", None) is not None:
            control_service.stop_server(self.grpc_server, self.health)
            self.grpc_server = None
        self._run_calls()        # answer anyone still waiting
        committed = self.writer is None or self._commit()
        if not committed:
            log.error("stopping with %d rows the replay DB could not take: they are lost",
                      self.writer.pending)
        self._release(clean=committed)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _close_sockets(self) -> None:
        """Close every socket and end the context; ``destroy`` closes any socket still
        open (linger 0), so termination can never hang."""
        for name in ("ingest_sock", "control_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
                setattr(self, name, None)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        d = self.cfg.daemon
        self._loop_thread = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self.ingest_sock, zmq.POLLIN)
        poller.register(self.control_sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_commit = time.monotonic() + d.commit_every_s
        resend_every = min(0.1, d.ack_timeout_s / 4)
        next_resend = time.monotonic() + resend_every
        while not self._stop:
            timeout = max(0.0, min(next_commit, next_resend) - time.monotonic())
            events = dict(poller.poll(timeout * 1000))
            if self.ingest_sock in events:
                self._on_indicator_batch(*self._drain(self.ingest_sock))
            if self.control_sock in events:
                for message in self._drain(self.control_sock)[0]:
                    self._on_control(*message)
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                self._run_calls()
                if self._reload:
                    self._reload = False
                    self._reload_allow_list()
            now = time.monotonic()
            if now >= next_commit:
                self._commit()
                next_commit = now + d.commit_every_s
            if now >= next_resend:
                self.actions.resend_due(now)
                next_resend = now + resend_every

    def _drain(self, sock: zmq.Socket) -> tuple[list[tuple[bytes, bytes, str | None]], int]:
        """The (identity, payload, CURVE key) of up to DRAIN_BATCH messages waiting on
        ``sock`` (the ingest path decodes them together), DRAIN_BYTES of payload at most,
        and their payload bytes.
        Two plain ``recv`` calls per message (a third of ``recv_multipart``'s cost); the
        key is read from each message's own frame, never cached by identity (a peer may
        choose its identity)."""
        batch, size = [], 0
        recv, nowait, curve_on = sock.recv, zmq.NOBLOCK, self.curve_on
        for _ in range(DRAIN_BATCH):
            if size >= DRAIN_BYTES:
                break
            try:
                identity = recv(nowait)
            except zmq.Again:
                break
            try:
                frame = recv(nowait, copy=False)   # a ROUTER message has one after it
                more = frame.more             # a DEALER sends exactly one frame per message
                while more:
                    more = recv(nowait, copy=False).more
            except zmq.Again:                 # (never seen: parts arrive together)
                frame = more = None
            if frame is None or frame.more:
                if sock is self.ingest_sock:
                    self.counters.messages += 1
                self.counters.drop("malformed")
                continue
            key = None
            if curve_on:
                try:
                    key = frame.get("User-Id")
                except zmq.ZMQError:
                    key = None
            payload = frame.bytes
            batch.append((identity, payload, key))
            size += len(payload)
        return batch, size

    def _on_indicators(self, identity: bytes, payload: bytes, key: str | None) -> None:
        self._on_indicator_batch([(identity, payload, key)], len(payload))

    def _on_indicator_batch(self, batch: list[tuple[bytes, bytes, str | None]],
                            size: int) -> None:
        """Count, apply and buffer a batch of indicator messages (``size`` payload bytes
        in all), rows in batch order."""
        c = self.counters
        c.messages += len(batch)
        c.bytes += size
        done = self.ingest.handle_many(batch)
        outcomes, o = done.outcomes, 0
        for rows in done.blocks:
            k = 0
            while k < len(rows.at):
                while o < len(outcomes) and outcomes[o][0] < rows.at[k]:
                    self._on_outcome(batch[outcomes[o][0]][0], outcomes[o][1])
                    o += 1
                end = bisect.bisect_left(rows.at, outcomes[o][0], k) if o < len(outcomes) \
                    else len(rows.at)
                self._buffer_rows(rows, k, end)
                k = end
        for pos, out in outcomes[o:]:
            self._on_outcome(batch[pos][0], out)

    def _on_outcome(self, identity: bytes, out) -> None:
        """One message applied on its own: its drop, row and FullRequest."""
        c = self.counters
        if out.drop:
            c.drop(out.drop)
            if out.node in self._tell:           # the refusal was just logged: say it
                self._tell.discard(out.node)
                self._send_refusal(identity, out.node)
        if out.row is not None:
            self._buffer_row(out.tick, out.stream.index, out.row, out.layout_grew)
        if out.full_request:
            msg = encode(FullRequest(out.stream.name, out.full_request))
            try:
                self.ingest_sock.send_multipart([identity, msg], zmq.NOBLOCK)
                c.full_requests += 1
            except zmq.ZMQError:          # peer gone (ROUTER_MANDATORY) or at its HWM
                c.actions["full_request_failed"] += 1

    def _send_refusal(self, identity: bytes, node: str) -> None:
        """Tell a refused monitoring agent why (a FullRequest whose reason starts with
        ``refused``: the agent logs it; an older agent just sends a full frame)."""
        msg = encode(FullRequest(node, f"{REFUSED} node {node!r} is not this key's "
                                       "(see the daemon's log)"))
        try:
            self.ingest_sock.send_multipart([identity, msg], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _on_control(self, identity: bytes, payload: bytes, key: str | None) -> None:
        reason = self.actions.handle(payload, identity, key)
        if reason:
            self.counters.drop(reason)

    @staticmethod
    def _connected(sock: zmq.Socket | None, identity: bytes, payload: bytes) -> bool:
        """Whether the peer ``identity`` is still connected: a send of a harmless
        ``payload`` fails with EHOSTUNREACH (ROUTER_MANDATORY) once its connection is
        gone; EAGAIN (at its high-water mark) means it is there."""
        if sock is None:
            return False
        try:
            sock.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return exc.errno == zmq.EAGAIN
        return True

    def _monitor_alive(self, stream) -> bool:
        """Probe a monitoring agent's connection with a FullRequest (it then sends one
        full frame: harmless)."""
        return self._connected(getattr(self, "ingest_sock", None), stream.identity,
                               encode(FullRequest(stream.name, "live")))

    def _control_alive(self, peer) -> bool:
        """Probe a control agent's connection with its latest Action again (it re-acks
        a repeat; absolute values: harmless)."""
        return self._connected(getattr(self, "control_sock", None), peer.identity,
                               encode(Action(peer.seq, max(peer.tick, 0), peer.desired)))

    def _send_control(self, identity: bytes, payload: bytes) -> bool:
        if not identity:
            return False
        try:
            self.control_sock.send_multipart([identity, payload], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:              # EHOSTUNREACH: agent gone; EAGAIN: its HWM
            return False

    # ------------------------------------------------------------------ the replay DB

    def _ensure_session(self) -> bool:
        """Begin the DB session on the first row; False (and NOT_SERVING) if the DB
        cannot take it now (a later row tries again)."""
        if self.session is not None:
            return True
        info = SessionInfo(pi_names=list(self.ingest.pi_names),
                           node_names=list(self.ingest.node_names), params=self.specs,
                           tick_seconds=self.cfg.tick_seconds, label=self.cfg.daemon.label,
                           provenance={"writer": "capes interface-daemon", "pid": os.getpid(),
                                       **_reward_table(self.cfg)})
        try:
            self.session = self.writer.begin_session(info)
        except DB_ERRORS as exc:
            self._db_failed(exc)
            return False
        return True

    def _buffer_row(self, tick: int, node: int, row, layout_grew: bool) -> None:
        """Buffer one PI row for the next commit (the buffer is bounded: when it is
        full, the oldest row is dropped and counted)."""
        if not self._ensure_session():
            self.counters.drop("db_unwritable")
            return
        if layout_grew:
            self.writer.update_layout(list(self.ingest.pi_names), list(self.ingest.node_names))
        if self.writer.add_pis(tick, node, row):
            self.counters.drop("db_buffer_full")
        self.counters.frames_applied += 1

    def _buffer_rows(self, rows: Rows, start: int, end: int) -> None:
        """Buffer rows ``start:end`` of a block applied together (see _buffer_row)."""
        if start >= end:
            return
        if not self._ensure_session():
            self.counters.drops["db_unwritable"] += end - start
            return
        dropped = self.writer.add_pis_many(rows.ticks[start:end], rows.nodes[start:end],
                                           rows.rows[start:end])
        if dropped:
            self.counters.drops["db_buffer_full"] += dropped
        self.counters.frames_applied += end - start

    def _commit(self) -> bool:
        """Write the buffer, oldest rows first, one chunk per transaction (so a nearly
        full disk still takes what fits). True when everything buffered is stored.
        After a failure only a real write brings SERVING back (:meth:`_probe_db`): an
        empty buffer proves nothing."""
        if self.writer is None:
            return True
        if not self.db_ok and not self.writer.pending:
            return self._probe_db()
        try:
            while True:
                t0 = time.perf_counter()
                done = self.writer.commit(COMMIT_CHUNK)
                if not done.empty:
                    self.counters.commit_seconds.observe(time.perf_counter() - t0)
                self._account(done)
                if not self.writer.pending:
                    break
        except DB_ERRORS as exc:
            self._db_failed(exc)
            return False
        self._db_writable()
        return True

    def _account(self, done: Committed) -> None:
        c = self.counters
        if done.empty:
            return
        c.commits += 1
        c.rows_written += done.rows
        if done.rows_ignored or done.actions_ignored:
            c.drops["replayed"] += done.rows_ignored + done.actions_ignored
        new = {t for t in done.ticks if t > self._committed_tick}
        c.ticks_written += len(new)
        if new:
            self._committed_tick = max(new)

    def _db_failed(self, exc: Exception) -> None:
        """A write failed: count it; on the first, log it and report NOT_SERVING."""
        self.counters.drop("db_error")
        if self.db_ok:
            self.db_ok = False
            log.error("replay DB %s cannot be written (%s): actions are refused and up to "
                      "%d rows are kept until it can", self.cfg.daemon.db, exc,
                      self.cfg.daemon.max_buffered_rows)
            control_service.set_serving(self.health, False)

    def _probe_db(self) -> bool:
        """The DB failed and nothing is buffered: write what the next row needs (the
        session, when it could not begin) or a no-op update, and serve again only if
        that succeeds."""
        if self.session is None:
            ok = self._ensure_session()          # counts and logs a failure itself
        else:
            try:
                with self.writer.conn:
                    self.writer.conn.execute("UPDATE meta SET value = value WHERE key = "
                                             "'schema_version'")
                ok = True
            except DB_ERRORS as exc:
                self._db_failed(exc)
                ok = False
        if ok:
            self._db_writable()
        return ok

    def _db_writable(self) -> None:
        """A commit succeeded: if the DB had failed, resume serving."""
        if not self.db_ok:
            self.db_ok = True
            log.info("replay DB written again (%d rows dropped from the full buffer so "
                     "far); serving", self.writer.dropped)
            control_service.set_serving(self.health, True)

    def _may_speak(self, key: str | None, node: str) -> bool:
        """Whether CURVE key ``key`` may use node name ``node`` (its binding, if any);
        a refusal is logged (see :meth:`_refused`)."""
        if self.auth is None or self.auth.may_speak_for(key, node):
            return True
        self._refused(key, node)
        return False

    def _refused(self, key: str | None, node: str, now: float | None = None) -> None:
        """Name a key refused for a node in the log: at once the first time, then at
        most once a minute per (key, node), with the count refused in between. Without
        it a wrongly bound key loses every frame in silence."""
        now = time.monotonic() if now is None else now
        pair = (key or "?", node)
        last, count = self._refusals.get(pair, (-math.inf, 0))
        if now - last < REFUSAL_LOG_S:
            self._refusals[pair] = (last, count + 1)
            return
        if len(self._refusals) >= 1024:           # a flood of made-up names: forget
            self._refusals.clear()
            self._tell.clear()
        self._refusals[pair] = (now, 0)
        self._tell.add(node)
        bound = sorted(self.auth.bindings.get(key or "", ()))
        why = (f"key {pair[0]!r} is bound to node {', '.join(map(repr, bound))}"
               if bound and curve.ANY_NODE not in bound else
               f"node {node!r} is bound to another key")
        log.warning("refused messages from key %r speaking for node %r: %s%s (bind it: "
                    "`capes keys generate --dir %s --bind %s=%s`, then SIGHUP the daemon)",
                    pair[0], node, why, f"; {count} more since the last report" if count
                    else "", self.cfg.keys.dir, pair[0], node)

    def _vouched(self, key: str | None, node: str) -> bool:
        """Whether ``node`` is a real node whose hello may set the daemon's current
        values: named by ``daemon.nodes`` or a parameter's ``nodes``, or bound to the
        key speaking for it. Keys disabled (a trusted loopback): every node."""
        if self.auth is None:
            return True
        return (node in self.ingest.allowed_nodes or any(node in s.nodes for s in self.specs)
                or self.auth.bound_to(key, node))

    def _reload_allow_list(self) -> None:
        """SIGHUP: re-read DIR/clients (on error the old allow-list stays)."""
        if self.auth is None:
            log.info("SIGHUP: keys are disabled, there is no allow-list to reload")
            return
        try:
            n = self.auth.reload()
        except curve.KeysMissing as exc:
            log.error("SIGHUP: allow-list not reloaded, the previous one stays: %s", exc)
            return
        log.info("SIGHUP: allow-list reloaded: %d client keys, %d bound to node names "
                 "(connected peers stay connected)", n, len(self.auth.bindings))

    # ------------------------------------------------------------------ control plane
    # These run on the loop thread, called through ``call`` by the gRPC handlers.

    def call(self, fn: Callable[[], Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run ``fn`` on the loop thread and return its result (thread-safe)."""
        if threading.get_ident() == self._loop_thread:
            return fn()
        if self._stop:
            raise RuntimeError("the daemon is shutting down")
        fut: Future = Future()
        self._calls.put((fn, fut))
        try:
            os.write(self._wake_w, b"c")
        except OSError:
            pass
        return fut.result(timeout)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def status(self) -> dict:
        snap = self.counters.snapshot()
        s = self.session
        known = set(self.ingest.streams) | set(self.actions.peers)
        return {
            "messages": snap["messages"], "bytes": snap["bytes"], "drops": snap["drops"],
            "nodes": len(known), "ticks_written": snap["ticks_written"],
            "rows_written": snap["rows_written"], "tuning": self.tuning,
            "training": self.training, "workload_epoch": self.workload_epoch,
            "session_id": s.id if s else 0, "session_uuid": s.uuid if s else "",
            "db_path": str(Path(self.cfg.daemon.db).resolve()),
            "latest_tick": self.ingest.latest_tick, "parameters": dict(self.actions.current),
            "actions": snap["actions"], "full_requests": snap["full_requests"],
            "uptime_s": snap["uptime_s"], "tick_seconds": self.cfg.tick_seconds,
            "commits": snap["commits"], "pis": len(self.ingest.pi_names),
            "auth_denied": self.auth.denied if self.auth else 0,
        }

    def _scrape(self) -> dict | None:
        """The metrics snapshot, taken on the loop thread (None while stopping)."""
        if self._stop:
            return None
        return self.call(self.metrics_snapshot, timeout=5.0)

    def metrics_snapshot(self) -> dict:
        """What ``/metrics`` shows (``DAEMON_METRICS``), as plain values."""
        snap = self.counters.snapshot()
        acts = snap["actions"]
        now = time.monotonic()
        tick_s = self.cfg.tick_seconds
        streams, peers = self.ingest.streams, self.actions.peers
        idle = {n: now - st.last_seen for n, st in streams.items()}
        for n, peer in peers.items():
            idle[n] = min(idle.get(n, float("inf")), now - peer.last_seen)
        latest = self.ingest.latest_tick
        size = 0
        for suffix in ("", "-wal"):
            try:
                size += os.stat(str(self.cfg.daemon.db) + suffix).st_size
            except OSError:
                pass
        return {
            "capes_daemon_up": 1, "capes_daemon_uptime_seconds": snap["uptime_s"],
            "capes_daemon_tick_seconds": tick_s,
            "capes_daemon_messages_total": snap["messages"],
            "capes_daemon_received_bytes_total": snap["bytes"],
            "capes_daemon_frames_applied_total": snap["frames_applied"],
            "capes_daemon_dropped_total": snap["drops"],
            "capes_daemon_full_requests_total": snap["full_requests"],
            "capes_daemon_auth_denied_total": self.auth.denied if self.auth else 0,
            "capes_daemon_db_healthy": int(self.db_ok),
            "capes_daemon_db_rows_written_total": snap["rows_written"],
            "capes_daemon_db_ticks_written_total": snap["ticks_written"],
            "capes_daemon_db_commits_total": snap["commits"],
            "capes_daemon_db_commit_seconds": self.counters.commit_seconds.copy(),
            "capes_daemon_db_buffered_rows": self.writer.pending if self.writer else 0,
            "capes_daemon_db_size_bytes": size,
            "capes_daemon_session_id": self.session.id if self.session else 0,
            "capes_daemon_actions_total": {k: v for k, v in acts.items()
                                           if not k.startswith("refused_")},
            "capes_daemon_actions_refused_total": {k[8:]: v for k, v in acts.items()
                                                   if k.startswith("refused_")},
            "capes_daemon_tuning": int(self.tuning),
            "capes_daemon_training": int(self.training),
            "capes_daemon_workload_epoch": self.workload_epoch,
            "capes_daemon_nodes": len(set(streams) | set(peers)),
            "capes_daemon_pis": len(self.ingest.pi_names),
            "capes_daemon_latest_tick": latest if latest >= 0 else None,
            "capes_daemon_latest_tick_timestamp_seconds":
                latest * tick_s if latest >= 0 else None,
            "capes_daemon_parameter_value": dict(self.actions.current),
            "capes_daemon_node_last_tick": {n: st.last_tick for n, st in streams.items()
                                            if st.last_tick >= 0},
            "capes_daemon_node_last_tick_timestamp_seconds": {
                n: st.last_tick * tick_s for n, st in streams.items() if st.last_tick >= 0},
            "capes_daemon_node_idle_seconds": idle,
            "capes_daemon_node_messages_total": {
                n: (streams[n].messages if n in streams else 0)
                + (peers[n].messages if n in peers else 0) for n in idle},
            "capes_daemon_node_applied_value": {
                (n, p): v for n, peer in peers.items() for p, v in peer.applied.items()},
        }

    def set_flag(self, name: str, on: bool) -> None:
        if getattr(self, name) != bool(on):
            log.info("%s %s", name, "on" if on else "off")
        setattr(self, name, bool(on))

    def workload_changed(self, note: str = "") -> int:
        self.workload_epoch += 1
        log.info("workload changed (epoch %d)%s", self.workload_epoch, f": {note}" if note else "")
        return self.workload_epoch

    def nodes(self) -> list[dict]:
        now = time.monotonic()
        out = {}
        for name, st in self.ingest.streams.items():
            out[name] = {"name": name, "monitor": True, "pis": len(st.decoder.names or ()),
                         "last_tick": st.last_tick, "idle_s": now - st.last_seen,
                         "messages": st.messages, "key": st.key or ""}
        for name, peer in self.actions.peers.items():
            n = out.setdefault(name, {"name": name, "last_tick": -1, "key": peer.key or "",
                                      "idle_s": now - peer.last_seen, "messages": 0})
            n.update(control=True, action_seq=peer.seq, acked_seq=peer.acked,
                     applied=dict(peer.applied), messages=n["messages"] + peer.messages,
                     idle_s=min(n["idle_s"], now - peer.last_seen))
        return [out[k] for k in sorted(out)]

    def submit_action(self, tick: int, action: int, values: dict[str, float]) -> dict:
        """The engine's action: checked, committed to the replay DB, and only then (tuning
        on) broadcast, so an applied action is always recorded. A refused action, or one
        while tuning is off, is recorded as NULL (0) with the values that stay in effect,
        so the DB says what really happened; so is a change that only dry-run control
        agents would make (they are sent it to log). Nothing is applied while the DB
        cannot record it."""
        early = self._refuse_early(tick)
        if early is not None:
            self.counters.actions["submitted"] += 1
            self.actions.refuse(early[0])
            return self._action_reply(Verdict(dict(self.actions.current), early[1]))
        verdict = self.actions.decide(action, values, self.tuning)
        why_not = self._record_action(tick, action if verdict.ok else 0, verdict)
        if why_not is not None and verdict.ok:
            self.actions.refuse(why_not[0])
            verdict = Verdict(dict(self.actions.current), why_not[1], why_not[0])
        if verdict.key == "dry_run" and verdict.proposed is not None:
            self.actions.preview(tick, verdict.proposed)   # they log it, set nothing
            log.debug("action %d at tick %d: %s", action, tick, verdict.reason)
            return self._action_reply(verdict)
        if not verdict.ok:
            log.info("action %d at tick %d not applied: %s", action, tick, verdict.reason)
            return self._action_reply(verdict)
        seq, sent = self.actions.broadcast(tick, verdict)
        return self._action_reply(verdict, seq, sent)

    def _refuse_early(self, tick: int) -> tuple[str, str] | None:
        """(counter key, reason) for an action refused before it is even checked."""
        d = self.cfg.daemon
        if tick < 0 or not tick_in_range(tick, self.cfg.tick_seconds, d.max_clock_skew_s):
            return "tick", (f"tick {tick} is more than {d.max_clock_skew_s:g} s from the "
                            "daemon's clock")
        if not self.db_ok:
            return "db", "the replay DB cannot be written: tuning is held until it can"
        return None

    def _record_action(self, tick: int, label: int, verdict: Verdict) -> tuple[str, str] | None:
        """Commit the action row now; (counter key, reason) when it was not recorded."""
        if not self._ensure_session():
            return "db", "the replay DB cannot be written: tuning is held until it can"
        self.writer.add_action(tick, label, [verdict.values[s.name] for s in self.specs])
        try:
            t0 = time.perf_counter()
            done = self.writer.commit(max_rows=0, durable=True)    # it is about to act
            self.counters.commit_seconds.observe(time.perf_counter() - t0)
        except DB_ERRORS as exc:
            self.writer.discard_actions()
            self._db_failed(exc)
            return "db", "the replay DB cannot record it: tuning is held until it can"
        self._account(done)
        if done.actions_ignored:
            return "replayed", f"tick {tick} already has an action (the DB is append-only)"
        return None

    def _action_reply(self, verdict: Verdict, seq: int = 0, sent: int = 0) -> dict:
        return {"accepted": verdict.ok, "reason": verdict.reason or "", "seq": seq,
                "values": dict(verdict.values), "sent_to": sent}


def _reward_table(cfg: DeploymentConfig) -> dict:
    """``{"reward": cfg's [reward] table}`` for the session's provenance, so a plot of
    the DB finds the objective without the config (empty when it is not JSON)."""
    if not cfg.reward:
        return {}
    try:
        json.dumps(cfg.reward)
    except (TypeError, ValueError):
        return {}
    return {"reward": cfg.reward}


def allowed_nodes(cfg: DeploymentConfig) -> frozenset[str]:
    """The node names that may speak (``daemon.nodes``; empty: any). A parameter may
    only target listed nodes."""
    nodes = frozenset(cfg.daemon.nodes)
    for spec in cfg.param_specs() if nodes else ():
        stray = sorted(set(spec.nodes) - nodes)
        if stray:
            raise ValueError(f"parameters.{spec.name}.nodes: {stray[0]!r} is not in "
                             "daemon.nodes")
    return nodes


def serve(cfg: DeploymentConfig, ready: Callable[[dict], None] | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT (SIGHUP reloads the allow-list); ``ready`` gets
    the bound endpoints. Any startup problem is one :class:`StartupError`."""
    try:
        daemon = InterfaceDaemon(cfg)
        daemon.start()
    except STARTUP_ERRORS as exc:
        raise StartupError(str(exc)) from None
    handlers = {signal.SIGTERM: lambda *_: daemon.stop(),
                signal.SIGINT: lambda *_: daemon.stop(),
                signal.SIGHUP: lambda *_: daemon.request_reload()}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        if ready:
            ready(daemon.endpoints)
        daemon.run()
    finally:
        daemon.close()
        for s, h in previous.items():
            signal.signal(s, h)
    log.info("stopped; counters: %s", json.dumps(daemon.counters.snapshot()))
    return 0
