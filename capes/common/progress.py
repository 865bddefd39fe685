"""A long loop's progress on stderr: a bar redrawn in place on a terminal, plain lines
elsewhere (a log file, a pipe, CI), nothing when quiet (``capes train``).

Why both: a bar's carriage returns make a log unreadable, and a log's twenty lines
scroll a terminal for nothing; the stream says which it is (``isatty``).
"""
from __future__ import annotations

import sys
import time


class Progress:
    """``update(step, text)`` as a loop runs, ``close()`` at the end. On a terminal: one
    line, ``[#####-----]  step/total  pct  text  ETA``, redrawn at most every
    ``redraw_s``; elsewhere ``step step/total  text`` about ``lines`` times in all and at
    the last step; ``quiet``: nothing."""

    WIDTH = 24

    def __init__(self, total: int, stream=None, quiet: bool = False, tty: bool | None = None,
                 lines: int = 20, redraw_s: float = 0.1, clock=time.monotonic):
        self.total = max(1, int(total))
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.tty = _isatty(self.stream) if tty is None else tty
        self.every = max(1, self.total // max(1, lines))
        self.redraw_s, self.clock = redraw_s, clock
        self.start = clock()
        self._first: tuple[float, int] | None = None   # (time, step) of the first update
        self._drawn_at = -1e9
        self._next_line = self.every
        self._open = False           # a bar line is on the terminal, not yet ended

    def update(self, step: int, text: str = "") -> None:
        if self.quiet:
            return
        if self._first is None:
            self._first = (self.clock(), step)
        last = step >= self.total
        if self.tty:
            now = self.clock()
            if last or now - self._drawn_at >= self.redraw_s:
                self._drawn_at = now
                self.stream.write("\r" + self.bar(step, text, now) + "\033[K")
                self.stream.flush()
                self._open = True
            return
        if last or step >= self._next_line:
            while self._next_line <= step:
                self._next_line += self.every
            self.stream.write(f"step {step:>{len(str(self.total))}}/{self.total}  {text}\n")
            self.stream.flush()

    def bar(self, step: int, text: str, now: float) -> str:
        """The terminal line at ``step``."""
        frac = min(1.0, max(0.0, step / self.total))
        full = int(round(frac * self.WIDTH))
        elapsed = now - self.start
        t0, s0 = self._first or (now, step)     # the rate since the first update: the
        left = ((self.total - step) * (now - t0) / (step - s0)   # set-up before it is
                if step > s0 and now > t0 else float("nan"))     # not the loop's pace
        eta = f"ETA {_clock(left)}" if step < self.total else f"{_clock(elapsed)}"
        return (f"[{'#' * full}{'-' * (self.WIDTH - full)}] {step:>{len(str(self.total))}}"
                f"/{self.total} {frac:4.0%}  {text}  {eta}")

    def close(self) -> None:
        """End the bar's line (so the next output starts on its own)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _clock(seconds: float) -> str:
    if not seconds == seconds:           # NaN: nothing to go by yet
        return "--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60:02d}:{s % 60:02d}"


__all__ = ["Progress"]
