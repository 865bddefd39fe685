"""The daemon's counters: what it received, wrote, refused and dropped (and why).

Only the daemon's loop thread changes them; the gRPC threads read a :meth:`snapshot`
taken through the loop, so no lock is needed.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


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
