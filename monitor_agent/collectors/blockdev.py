"""Linux block device PIs from sysfs: queue settings, requests in flight, and I/O rates.

What a readahead or queue tuner needs to see (KML, seed 003, feeds its model the current
knob value beside the I/O statistics): per device ``/sys/block/<dev>/``

* ``queue/read_ahead_kb``, ``queue/nr_requests``, ``queue/max_sectors_kb``,
  ``queue/rotational`` and ``queue/scheduler`` (the bracketed one, as its index in
  ``schedulers``; −1 for one not listed there);
* ``inflight``: reads and writes in flight now;
* ``stat`` (Documentation/block/stat.rst: read I/Os, merges, sectors, ticks; the same
  for writes; in flight; io_ticks; time_in_queue; then discard and flush fields) turned
  into RATES over the tick, never cumulative counters: I/Os and merges per second, bytes
  per second (sectors are always 512 bytes), mean latency of the I/Os completed in the
  tick (``await_ms``, 0 when none), ``busy_percent`` (io_ticks) and ``avg_queue_depth``
  (time_in_queue), as iostat computes them. A counter that went backwards gives NaN.

Devices are chosen once, at start, from ``root`` (default /sys/block) by shell-style
patterns ``devices`` (default: all) minus ``exclude`` (default: loop, ram, zram, optical,
floppy), so the PI vector never changes. Exclusions only thin out what a pattern picks:
a device named literally in ``devices`` (``loop3``) is always reported, and a default
exclusion is lifted for a pattern that asks for that kind of device (``loop*``,
``loop1?``); an ``exclude`` the config gives is applied as written. PI names:
``blockdev.<dev>.<field>``.

``schedulers`` (default ``SCHEDULERS``) is the list the ``scheduler`` PI indexes into:
give it the same list as a categorical ``scheduler`` parameter's ``values`` so that the
PI is the parameter's value, as the engine sees it.
"""
from __future__ import annotations

import os
import time
from fnmatch import fnmatchcase
from typing import Callable

from monitor_agent.collectors.base import Collector, read_text, register

NAN = float("nan")
DEFAULT_ROOT = "/sys/block"
DEFAULT_EXCLUDE = ["loop*", "ram*", "zram*", "sr*", "fd*"]
SECTOR_BYTES = 512
SCHEDULERS = ("none", "mq-deadline", "kyber", "bfq", "noop", "deadline", "cfq")

QUEUE_FILES = {"read_ahead_kb": "queue/read_ahead_kb", "nr_requests": "queue/nr_requests",
               "max_sectors_kb": "queue/max_sectors_kb", "rotational": "queue/rotational"}
# stat field indexes (0-based)
READ_IOS, READ_MERGES, READ_SECTORS, READ_TICKS = 0, 1, 2, 3
WRITE_IOS, WRITE_MERGES, WRITE_SECTORS, WRITE_TICKS = 4, 5, 6, 7
IO_TICKS, TIME_IN_QUEUE = 9, 10
STAT_MIN_FIELDS = 11

GAUGES = (*QUEUE_FILES, "scheduler", "inflight_reads", "inflight_writes")
RATES = ("read_iops", "read_merges_s", "read_bytes_s", "read_await_ms",
         "write_iops", "write_merges_s", "write_bytes_s", "write_await_ms",
         "busy_percent", "avg_queue_depth")
FIELDS = (*GAUGES, *RATES)


def parse_scheduler(text: str, schedulers=SCHEDULERS) -> float:
    """``mq-deadline kyber [bfq] none`` -> index of ``bfq`` in ``schedulers``; −1 when the
    active scheduler is not listed there; NaN when the text names none."""
    tokens = text.split()
    active = next((t[1:-1] for t in tokens if t.startswith("[") and t.endswith("]")),
                  tokens[0] if len(tokens) == 1 else None)
    if active is None:
        return NAN
    return float(schedulers.index(active)) if active in schedulers else -1.0


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _literal(pattern: str) -> str:
    """The part of a name pattern before its first wildcard: ``loop*`` -> ``loop``."""
    for i, c in enumerate(pattern):
        if c in "*?[":
            return pattern[:i]
    return pattern


def parse_stat(text: str) -> list[float] | None:
    """The numbers of a ``stat`` file; None when it has fewer than the 11 classic ones."""
    try:
        values = [float(v) for v in text.split()]
    except ValueError:
        return None
    return values if len(values) >= STAT_MIN_FIELDS else None


def stat_rates(cur: list[float] | None, prev: list[float] | None, dt: float) -> dict[str, float]:
    """The RATES fields between two ``stat`` readings ``dt`` seconds apart."""
    out = dict.fromkeys(RATES, NAN)
    if cur is None or prev is None or dt <= 0:
        return out
    d = [c - p for c, p in zip(cur, prev)]

    def rate(i: int, scale: float = 1.0) -> float:
        return d[i] * scale / dt if d[i] >= 0 else NAN

    def await_ms(ios: int, ticks: int) -> float:
        if d[ios] < 0 or d[ticks] < 0:
            return NAN
        return d[ticks] / d[ios] if d[ios] > 0 else 0.0

    out.update(read_iops=rate(READ_IOS), read_merges_s=rate(READ_MERGES),
               read_bytes_s=rate(READ_SECTORS, SECTOR_BYTES),
               read_await_ms=await_ms(READ_IOS, READ_TICKS),
               write_iops=rate(WRITE_IOS), write_merges_s=rate(WRITE_MERGES),
               write_bytes_s=rate(WRITE_SECTORS, SECTOR_BYTES),
               write_await_ms=await_ms(WRITE_IOS, WRITE_TICKS),
               busy_percent=rate(IO_TICKS, 0.1),          # ms busy per s × 0.1 = percent
               avg_queue_depth=rate(TIME_IN_QUEUE, 0.001))  # ms of requests per ms
    return out


LIMIT = 4096                      # a block device's sysfs files are short


def _number(text: str | None) -> float:
    try:
        return float(text.split()[0]) if text and text.split() else NAN
    except ValueError:
        return NAN


@register("blockdev")
class BlockDevCollector(Collector):
    def __init__(self, root: str = DEFAULT_ROOT, devices: list[str] | None = None,
                 exclude: list[str] | None = None, fields: list[str] | None = None,
                 schedulers: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        for key, value in (("devices", devices), ("exclude", exclude)):
            if value is not None and (not isinstance(value, list)
                                      or not all(isinstance(p, str) for p in value)):
                raise ValueError(f"{key}: must be a list of device name patterns, "
                                 f"e.g. [\"sd*\", \"nvme*\"]")
        if schedulers is not None and (not isinstance(schedulers, list) or not schedulers
                                       or not all(isinstance(x, str) and x for x in schedulers)
                                       or len(set(schedulers)) != len(schedulers)):
            raise ValueError("schedulers: must be a list of distinct scheduler names")
        self.schedulers = tuple(schedulers) if schedulers is not None else SCHEDULERS
        if fields is not None:
            unknown = [f for f in fields if f not in FIELDS]
            if unknown or not fields:
                what = f"unknown field {unknown[0]!r}" if unknown else "name at least one field"
                raise ValueError(f"fields: {what} (known: {', '.join(FIELDS)})")
        self._root, self._clock = root, clock
        self.fields = [f for f in FIELDS if fields is None or f in fields]
        self.devices = self._select(root, devices, exclude)
        self._names = [f"blockdev.{d}.{f}" for d in self.devices for f in self.fields]
        self._want_rates = any(f in RATES for f in self.fields)
        self._want_inflight = any(f.startswith("inflight_") for f in self.fields)
        self._prev = {d: self._stat(d) for d in self.devices}
        self._prev_t = clock()

    @staticmethod
    def _select(root: str, include: list[str] | None, exclude: list[str] | None) -> list[str]:
        try:
            entries = sorted(os.listdir(root))
        except OSError as exc:
            raise ValueError(f"root: cannot list {root}: {exc.strerror or exc}") from None
        if exclude is None:           # default exclusions, lifted where devices asks
            exclude = [x for x in DEFAULT_EXCLUDE
                       if not any(_literal(p).startswith(_literal(x)) for p in include or ())]
        named = {p for p in include or () if not _has_magic(p)}
        chosen = [d for d in entries
                  if (include is None or any(fnmatchcase(d, p) for p in include))
                  and (d in named or not any(fnmatchcase(d, p) for p in exclude))
                  and os.path.isdir(os.path.join(root, d))]
        if not chosen:
            raise ValueError(f"devices: no block device under {root} matches "
                             f"{include or ['*']} (excluding {exclude})")
        return chosen

    def _stat(self, dev: str) -> list[float] | None:
        text = read_text(os.path.join(self._root, dev, "stat"), LIMIT)
        return None if text is None else parse_stat(text)

    def names(self) -> list[str]:
        return list(self._names)

    def _device(self, dev: str, dt: float) -> dict[str, float]:
        base = os.path.join(self._root, dev)
        out: dict[str, float] = {}
        for f, rel in QUEUE_FILES.items():
            if f in self.fields:
                out[f] = _number(read_text(os.path.join(base, rel), LIMIT))
        if "scheduler" in self.fields:
            text = read_text(os.path.join(base, "queue/scheduler"), LIMIT)
            out["scheduler"] = NAN if text is None else parse_scheduler(text, self.schedulers)
        if self._want_inflight:
            parts = (read_text(os.path.join(base, "inflight"), LIMIT) or "").split()
            try:
                out["inflight_reads"], out["inflight_writes"] = (float(parts[0]),
                                                                 float(parts[1]))
            except (IndexError, ValueError):
                out["inflight_reads"] = out["inflight_writes"] = NAN
        if self._want_rates:
            cur = self._stat(dev)
            out.update(stat_rates(cur, self._prev[dev], dt))
            self._prev[dev] = cur
        return out

    def collect(self) -> dict[str, float]:
        now = self._clock()
        dt, self._prev_t = now - self._prev_t, now
        out: dict[str, float] = {}
        for dev in self.devices:
            values = self._device(dev, dt)
            for f in self.fields:
                out[f"blockdev.{dev}.{f}"] = values.get(f, NAN)
        return out
