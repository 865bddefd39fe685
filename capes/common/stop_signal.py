"""SIGTERM/SIGINT as a flag that a sleeping loop notices at once.

Python runs signal handlers only between bytecodes, so a process blocked in a ZeroMQ
poll or a long sleep would react to Ctrl-C late. ``StopSignal`` installs handlers that
set a flag and, through ``signal.set_wakeup_fd``, make a socket readable: a loop that
polls that socket (``fileno()``) together with its own sockets, or sleeps with
``wait(timeout)``, wakes as soon as a stop is asked for. Agents and the simulator node
use it to restore defaults and write their last state before exiting.
"""
from __future__ import annotations

import select
import signal
import socket


class StopSignal:
    """Install with ``with StopSignal() as stop:``; ``stop.is_set()`` after a signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup = -1

    def __enter__(self) -> "StopSignal":
        self._old_wakeup = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        for sig in self.SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_wakeup)
        self._r.close()
        self._w.close()

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def set(self) -> None:
        """Ask for a stop from inside the process (tests, time limits)."""
        self.signum = self.signum or 0
        try:
            self._w.send(b"\0")
        except OSError:
            pass

    def is_set(self) -> bool:
        return self.signum is not None

    def fileno(self) -> int:
        """Readable once a signal has arrived: register it in a poller."""
        return self._r.fileno()

    def drain(self) -> None:
        try:
            while self._r.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds or until a stop is asked; return is_set()."""
        if not self.is_set() and timeout > 0:
            select.select([self._r], [], [], timeout)
            self.drain()
        return self.is_set()
