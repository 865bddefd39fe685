"""The daemon's counters: what it received, wrote, refused and dropped (and why).

Only the daemon's loop thread changes them; the gRPC and metrics threads read a
:meth:`snapshot` taken through the loop, so no lock is needed. ``DAEMON_METRICS`` names
what ``/metrics`` shows (``InterfaceDaemon.metrics_snapshot`` fills it; the names are
documented in ``docs/metrics.md``).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from capes.common.metrics import Histogram
from capes.common.metrics import metric as _m


@dataclass
class Counters:
    messages: int = 0                 # indicator messages received (valid or not)
    bytes: int = 0                    # their bytes
    frames_applied: int = 0           # indicator frames that produced a row
    control_messages: int = 0         # messages received from control agents
    drops: Counter = field(default_factory=Counter)     # reason -> messages dropped
    actions: Counter = field(default_factory=Counter)   # submitted, accepted, refused, ...
    full_requests: int = 0            # FullRequests sent
    rows_written: int = 0             # (tick, node) rows committed
    ticks_written: int = 0            # distinct ticks committed
    commits: int = 0                  # WAL transactions
    commit_seconds: Histogram = field(default_factory=Histogram)   # their latency
    started: float = field(default_factory=time.monotonic)

    def drop(self, reason: str) -> None:
        self.drops[reason] += 1

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    def snapshot(self) -> dict:
        """A plain copy, safe to hand to another thread."""
        return {"messages": self.messages, "bytes": self.bytes,
                "frames_applied": self.frames_applied,
                "control_messages": self.control_messages, "drops": dict(self.drops),
                "actions": dict(self.actions), "full_requests": self.full_requests,
                "rows_written": self.rows_written, "ticks_written": self.ticks_written,
                "commits": self.commits, "uptime_s": self.uptime_s}


DAEMON_METRICS = [
    _m("capes_daemon_up", "gauge", "1 while the daemon's loop answers"),
    _m("capes_daemon_uptime_seconds", "gauge", "seconds since the daemon started"),
    _m("capes_daemon_tick_seconds", "gauge", "length of one sampling/action tick (config)"),
    _m("capes_daemon_messages_total", "counter",
       "indicator messages received from monitoring agents (valid or not)"),
    _m("capes_daemon_received_bytes_total", "counter", "bytes of those messages"),
    _m("capes_daemon_frames_applied_total", "counter", "indicator frames that produced a row"),
    _m("capes_daemon_dropped_total", "counter",
       "messages and rows dropped, by reason (malformed, type, tick_range, auth, "
       "too_many_pis, replayed, db_error, db_buffer_full, ...)", "reason"),
    _m("capes_daemon_full_requests_total", "counter",
       "FullRequests sent to monitoring agents (resynchronisation)"),
    _m("capes_daemon_auth_denied_total", "counter", "connections refused by CURVE"),
    _m("capes_daemon_db_healthy", "gauge",
       "1 while the replay DB takes writes; 0: actions are refused until it does"),
    _m("capes_daemon_db_rows_written_total", "counter", "(tick, node) PI rows committed"),
    _m("capes_daemon_db_ticks_written_total", "counter", "distinct ticks committed"),
    _m("capes_daemon_db_commits_total", "counter", "replay DB transactions"),
    _m("capes_daemon_db_commit_seconds", "histogram",
       "latency of one replay DB transaction (batched PIs, or one durable action)"),
    _m("capes_daemon_db_buffered_rows", "gauge", "rows waiting for the next commit"),
    _m("capes_daemon_db_size_bytes", "gauge", "replay DB file plus its WAL, bytes"),
    _m("capes_daemon_session_id", "gauge", "the replay DB session being written (0: none)"),
    _m("capes_daemon_actions_total", "counter",
       "the engine's actions by event: submitted (proposed), accepted, refused, "
       "tuning_off, sent, resent, acked (applied by a control agent), send_failed, ...",
       "event"),
    _m("capes_daemon_actions_refused_total", "counter",
       "actions refused by the daemon, by reason (step, range, forbidden, tick, db, ...)",
       "reason"),
    _m("capes_daemon_tuning", "gauge", "1 while tuning is on (capes tuning on|off)"),
    _m("capes_daemon_training", "gauge", "1 while training is on (capes training on|off)"),
    _m("capes_daemon_workload_epoch", "gauge",
       "workload changes announced so far (capes workload-changed)"),
    _m("capes_daemon_nodes", "gauge", "nodes known (monitoring or control)"),
    _m("capes_daemon_pis", "gauge", "PI names of the session"),
    _m("capes_daemon_latest_tick", "gauge", "newest tick received from any node"),
    _m("capes_daemon_latest_tick_timestamp_seconds", "gauge",
       "that tick as unix time (tick x tick_seconds)"),
    _m("capes_daemon_parameter_value", "gauge",
       "value in effect of each tuned parameter (the last one accepted)", "parameter"),
    _m("capes_daemon_node_last_tick", "gauge",
       "newest tick received from each monitoring agent", "node"),
    _m("capes_daemon_node_last_tick_timestamp_seconds", "gauge",
       "that tick as unix time (tick x tick_seconds)", "node"),
    _m("capes_daemon_node_idle_seconds", "gauge",
       "seconds since each node (monitoring or control agent) was last heard", "node"),
    _m("capes_daemon_node_messages_total", "counter",
       "messages received from each node", "node"),
    _m("capes_daemon_node_applied_value", "gauge",
       "parameter value each control agent acknowledged as applied", "node", "parameter"),
]
