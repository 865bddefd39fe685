"""PIs from any program: runs a configured argv that prints ``name value`` lines.

The generic exec collector for sources no built-in collector knows (``lctl get_param``
wrappers, vendor tools). The program runs without a shell, under a timeout, once per
tick, in a process group of its own that is killed whole when it is done (a hanging
wrapper leaves no child behind); at most ``max_output_bytes`` of its output are read
(default 1 MiB; more is a failure). It should be quick. PI names are fixed at start: given as ``names``, or taken
from what the program prints on a first run. A name the program stops printing, a
value that is not a finite number (``inf``, ``nan``, ``1e999``), a non-zero exit or a timeout gives NaN for that tick.
"""
from __future__ import annotations

import logging
import math

from capes.common.bounded_run import MAX_OUTPUT, program_problem, run_bounded
from monitor_agent.collectors.base import Collector, register

log = logging.getLogger(__name__)
NAN = float("nan")


def parse_lines(text: str) -> dict[str, float]:
    """``name value`` per line; blank lines and ``#`` comments skipped, other junk ignored."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0].startswith("#"):
            continue
        try:
            value = float(parts[1])
        except ValueError:
            continue
        # "inf", "nan", 1e999: no reading (NaN), but the name is kept (a PI whose first
        # value is missing is still learned)
        out[parts[0]] = value if math.isfinite(value) else math.nan
    return out


@register("command")
class CommandCollector(Collector):
    def __init__(self, argv: list[str], names: list[str] | None = None,
                 timeout_s: float = 2.0, max_output_bytes: int = MAX_OUTPUT):
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv: must be a non-empty list of strings")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 (got {timeout_s})")
        if not isinstance(max_output_bytes, int) or max_output_bytes < 1:
            raise ValueError(f"max_output_bytes: must be an integer >= 1 "
                             f"(got {max_output_bytes!r})")
        self._argv, self._timeout = list(argv), float(timeout_s)
        self._max_output = max_output_bytes
        self.failures = 0
        if names is not None and (not isinstance(names, list) or
                                  not all(isinstance(n, str) and n for n in names)):
            raise ValueError("names: must be a list of PI names")
        self._names = list(names) if names is not None else None

    def check(self) -> list[str]:
        """The program exists and may be run (it is not run: a check runs nothing)."""
        why = program_problem(self._argv[0])
        return [f"argv: {why}"] if why else []

    def effects(self) -> list[str]:
        return [f"runs {self._argv[0]} every tick"
                + ("" if self._names is not None else ", and once at start for its names")]

    def start(self) -> None:
        """Without ``names``: run the program once and take the names it prints."""
        if self._names is not None:
            return
        first = self._run()
        if first is None:
            raise ValueError(f"argv: {self._argv[0]!r} failed on its first run, so its "
                             f"PI names are unknown (give them as 'names')")
        if not first:
            raise ValueError(f"argv: {self._argv[0]!r} printed no 'name value' lines")
        self._names = sorted(first)

    def _run(self) -> dict[str, float] | None:
        try:
            done = run_bounded(self._argv, self._timeout, self._max_output)
        except OSError as exc:
            reason = str(exc)
        else:
            if done.ok:
                return parse_lines(done.stdout)
            reason = done.why(self._timeout, self._max_output)
        self.failures += 1
        if self.failures == 1 or math.log2(self.failures).is_integer():
            log.warning("command collector %s: %s (%d failures)", self._argv[0], reason,
                        self.failures)
        return None

    def names(self) -> list[str]:
        self.start()
        return list(self._names)

    def collect(self) -> dict[str, float]:
        values = self._run() or {}
        return {n: values.get(n, NAN) for n in self._names}
