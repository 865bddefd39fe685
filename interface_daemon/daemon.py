"""The interface daemon: the only writer of the replay DB and the hub of every agent.

One process, one loop thread that owns all state: a zmq poll over the ingest ROUTER
(monitoring agents' indicator frames in, FullRequests out), the control ROUTER (control
agents' Acks in, Actions out) and a wake-up pipe through which the gRPC threads hand
work to the loop (``call``). Rows go to the DB in one WAL transaction every
``commit_every_s``; SIGTERM/SIGINT commit and exit cleanly, and a SIGKILL loses at most
the uncommitted batch.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import zmq

from capes.common import curve
from capes.common.deployment import DeploymentConfig
from capes.common.protocol import FullRequest, encode
from capes.common.replay_db import ReplayWriter, SessionInfo
from interface_daemon.action_checker import ActionChecker
from interface_daemon import control_service
from interface_daemon.action_plane import ActionPlane
from interface_daemon.counters import Counters
from interface_daemon.node_streams import Ingest

log = logging.getLogger("capes.interface_daemon")

DRAIN_BATCH = 2000          # messages taken from one socket before looking at the others
CALL_TIMEOUT_S = 10.0


def _lock_db(db: str):
    """Hold an exclusive lock next to the DB for the daemon's lifetime: one writer only.
    The kernel drops it when the process dies, SIGKILL included."""
    path = Path(str(db) + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        other = fh.read().strip() or "?"
        fh.close()
        raise OSError(f"{db}: another interface daemon (pid {other}) writes this replay DB")
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


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
        self.specs = cfg.param_specs()
        self.counters = Counters()
        self.checker = ActionChecker(self.specs, d.forbidden)
        self.ingest = Ingest(max_nodes=d.max_nodes, max_bytes=d.max_message_bytes,
                             full_request_every_s=d.full_request_every_s,
                             tick_seconds=cfg.tick_seconds,
                             max_clock_skew_s=d.max_clock_skew_s)
        self.actions = ActionPlane(self.specs, self.checker, self.counters, self._send_control,
                                   ack_timeout_s=d.ack_timeout_s, max_nodes=d.max_nodes,
                                   max_bytes=d.max_message_bytes)
        self.tuning = d.tuning
        self.training = d.training
        self.workload_epoch = 0
        self.curve_on = cfg.keys.enabled
        self.writer: ReplayWriter | None = None
        self.session: SessionInfo | None = None
        self._pending_ticks: set[int] = set()
        self._pending_rows = 0
        self._pending_actions = 0
        self._committed_tick = -1
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = False
        self._loop_thread: int | None = None
        self.ctx: zmq.Context | None = None
        self.auth = None
        self.endpoints: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> dict:
        """Open the DB, bind the sockets, start the authenticator and the gRPC server.
        Return the endpoints actually bound (ports 0 resolved)."""
        d = self.cfg.daemon
        self._lock = _lock_db(d.db)
        self.writer = ReplayWriter(d.db)
        self.ctx = zmq.Context()
        try:
            self.auth = curve.start_authenticator(self.ctx, self.cfg.keys)
            keys = self.cfg.keys if self.curve_on else None
            self.ingest_sock = curve.server_socket(self.ctx, zmq.ROUTER, keys, d.high_water_mark)
            self.control_sock = curve.server_socket(self.ctx, zmq.ROUTER, keys, d.high_water_mark)
            for sock in (self.ingest_sock, self.control_sock):
                sock.setsockopt(zmq.MAXMSGSIZE, 4 * d.max_message_bytes)
            ingest = _bind(self.ingest_sock, d.ingest)
            control = _bind(self.control_sock, d.control)
            token = curve.load_token(self.cfg.keys)
            if self.curve_on and token is None:
                raise curve.KeysMissing(f"{Path(self.cfg.keys.dir) / curve.TOKEN_FILE}: no "
                                        "control-plane token (run `capes keys generate`)")
            self.grpc_server, self.health, port = control_service.start_server(self, d.grpc, token)
        except BaseException:
            self._close_sockets()
            self.writer.close()
            self.writer = None
            self._lock.close()
            raise
        host = d.grpc.rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            log.warning("the gRPC control plane listens on %s without TLS: its token "
                        "authenticates callers but the traffic is not encrypted", d.grpc)
        self.endpoints = {"ingest": ingest, "control": control, "grpc": f"{host}:{port}",
                          "db": str(Path(d.db).resolve()), "pid": os.getpid()}
        log.info("listening: %s", self.endpoints)
        return self.endpoints

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler or another thread)."""
        self._stop = True
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
        if self.writer is not None:
            self._commit()
            self.writer.close()
            self.writer = None
            self._lock.close()
        self._close_sockets()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _close_sockets(self) -> None:
        for name in ("ingest_sock", "control_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
                setattr(self, name, None)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self.ctx is not None:
            self.ctx.term()
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
                self._drain(self.ingest_sock, self._on_indicators)
            if self.control_sock in events:
                self._drain(self.control_sock, self._on_control)
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                self._run_calls()
            now = time.monotonic()
            if now >= next_commit:
                self._commit()
                next_commit = now + d.commit_every_s
            if now >= next_resend:
                self.actions.resend_due(now)
                next_resend = now + resend_every

    def _drain(self, sock: zmq.Socket, handle: Callable[[bytes, bytes, str | None], None]) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:          # a DEALER sends exactly one frame per message
                if sock is self.ingest_sock:
                    self.counters.messages += 1
                self.counters.drop("malformed")
                continue
            payload = frames[1]
            key = None
            if self.curve_on:
                try:
                    key = payload.get("User-Id")
                except zmq.ZMQError:
                    key = None
            handle(frames[0].bytes, payload.bytes, key)

    def _on_indicators(self, identity: bytes, payload: bytes, key: str | None) -> None:
        c = self.counters
        c.messages += 1
        c.bytes += len(payload)
        out = self.ingest.handle(payload, identity, key)
        if out.drop:
            c.drop(out.drop)
        if out.row is not None:
            self._ensure_session()
            if out.layout_grew:
                self.writer.update_layout(list(self.ingest.pi_names), list(self.ingest.node_names))
            self.writer.add_pis(out.tick, out.stream.index, out.row)
            self._pending_ticks.add(out.tick)
            self._pending_rows += 1
            c.frames_applied += 1
        if out.full_request:
            msg = encode(FullRequest(out.stream.name, out.full_request))
            try:
                self.ingest_sock.send_multipart([identity, msg], zmq.NOBLOCK)
                c.full_requests += 1
            except zmq.ZMQError:          # peer gone (ROUTER_MANDATORY) or at its HWM
                c.actions["full_request_failed"] += 1

    def _on_control(self, identity: bytes, payload: bytes, key: str | None) -> None:
        reason = self.actions.handle(payload, identity, key)
        if reason:
            self.counters.drop(reason)

    def _send_control(self, identity: bytes, payload: bytes) -> bool:
        if not identity:
            return False
        try:
            self.control_sock.send_multipart([identity, payload], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:              # EHOSTUNREACH: agent gone; EAGAIN: its HWM
            return False

    # ------------------------------------------------------------------ the replay DB

    def _ensure_session(self) -> None:
        if self.session is None:
            info = SessionInfo(pi_names=list(self.ingest.pi_names),
                               node_names=list(self.ingest.node_names), params=self.specs,
                               tick_seconds=self.cfg.tick_seconds, label=self.cfg.daemon.label,
                               provenance={"writer": "capes interface-daemon",
                                           "pid": os.getpid()})
            self.session = self.writer.begin_session(info)

    def _commit(self) -> None:
        if self.writer is None:
            return
        try:
            self.writer.commit()
        except Exception as exc:          # disk full, locked...: keep the batch, retry
            self.counters.drop("db_error")
            log.error("replay DB commit failed (will retry): %s", exc)
            return
        if self._pending_rows or self._pending_actions:
            self.counters.commits += 1
        self.counters.rows_written += self._pending_rows
        new = [t for t in self._pending_ticks if t > self._committed_tick]
        self.counters.ticks_written += len(new)
        if new:
            self._committed_tick = max(new)
        self._pending_rows = self._pending_actions = 0
        self._pending_ticks.clear()

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
        """The engine's action: check, record in the DB, and (tuning on) broadcast.
        A refused action, or one while tuning is off, is recorded as NULL (0) with the
        values that stay in effect, so the DB says what really happened."""
        if tick < 0:
            self.counters.actions["refused"] += 1
            return {"accepted": False, "reason": f"tick {tick} < 0",
                    "values": dict(self.actions.current)}
        verdict, seq, sent = self.actions.submit(tick, action, values, self.tuning)
        self._ensure_session()
        self.writer.add_action(tick, action if verdict.ok else 0,
                               [verdict.values[s.name] for s in self.specs])
        self._pending_actions += 1
        if not verdict.ok:
            log.info("action %d at tick %d not applied: %s", action, tick, verdict.reason)
        return {"accepted": verdict.ok, "reason": verdict.reason or "", "seq": seq,
                "values": dict(verdict.values), "sent_to": sent}


def serve(cfg: DeploymentConfig, ready: Callable[[dict], None] | None = None) -> int:
    """Run a daemon until SIGTERM/SIGINT; ``ready`` gets the bound endpoints."""
    daemon = InterfaceDaemon(cfg)
    daemon.start()
    previous = {s: signal.signal(s, lambda *_: daemon.stop())
                for s in (signal.SIGTERM, signal.SIGINT)}
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
