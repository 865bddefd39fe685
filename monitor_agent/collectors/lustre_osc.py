"""Lustre client PIs, one set per OSC (thesis §3.1.3 and §5.2.1).

A Lustre client keeps one Object Storage Client (OSC) per OST it talks to, and the
thesis computes every OSC's congestion indicators separately: the congestion window
``max_rpcs_in_flight``; the ack EWMA (gaps between server replies) and send EWMA (gaps
between the send times of the replied requests), both in µs; and the process-time ratio
(current / shortest process time seen). The three congestion indicators exist only in
ASCAR's patched client, which prints them in the OSC's ``import`` file
(``ack_ewma: N usec``, ``sent_ewma: N usec``, ``rtt_ratio100: N`` = ratio × 100); a
client that exposes them as files of their own names them in ``ascar_files``. On a stock
client those fields are simply absent, and the collector reports what every Lustre has:

* ``max_rpcs_in_flight``, ``max_dirty_mb``, ``cur_dirty_bytes``: the files of those names;
* ``read_rpcs_in_flight``, ``write_rpcs_in_flight``, ``pending_read_pages``,
  ``pending_write_pages``: the header lines of ``rpc_stats``;
* ``read_bytes_s``, ``write_bytes_s``: RATES of the ``read_bytes`` / ``write_bytes``
  sums of the ``stats`` file (a counter never seen is 0: the kernel omits idle ones),
  and ``req_wait_us``: the mean ``req_waittime`` of the requests completed during the
  tick (0 when none completed), an RTT-like congestion signal.

Files are looked up in each of ``root`` in order (Lustre ≥ 2.12 splits them between
/proc/fs/lustre/osc, /sys/fs/lustre/osc and debugfs). OSC directories (``pattern``) and
fields are chosen once, at start, so the PI vector never changes; with ``fields`` unset,
every field that at least one OSC provides. PI names are ``osc.<fsname>-OST<idx>.<field>``
(the per-mount suffix ``-osc-<uuid>`` dropped, so every client of a file system reports
the same names) plus ``osc.total.read_bytes_s`` / ``osc.total.write_bytes_s``, the
client's throughput, which a reward can name without knowing the file system.
"""
from __future__ import annotations

import fnmatch
import os
import re
import time
from typing import Callable

from monitor_agent.collectors.base import Collector, register

NAN = float("nan")

DEFAULT_ROOTS = ("/proc/fs/lustre/osc", "/sys/fs/lustre/osc", "/sys/kernel/debug/lustre/osc")
DEFAULT_PATTERN = "*-osc-*"
READ_LIMIT = 1 << 16            # bytes read of any one file: procfs files are small

# field -> file holding just that number
GAUGE_FILES = {"max_rpcs_in_flight": "max_rpcs_in_flight", "max_dirty_mb": "max_dirty_mb",
               "cur_dirty_bytes": "cur_dirty_bytes"}
# field -> label of its line in the rpc_stats header (lower case)
RPC_STATS_LINES = {"read_rpcs_in_flight": "read rpcs in flight",
                   "write_rpcs_in_flight": "write rpcs in flight",
                   "pending_read_pages": "pending read pages",
                   "pending_write_pages": "pending write pages"}
# field -> (key in ASCAR's import file, scale to the field's unit)
ASCAR_IMPORT_KEYS = {"ack_ewma": ("ack_ewma", 1.0), "send_ewma": ("sent_ewma", 1.0),
                     "pt_ratio": ("rtt_ratio100", 0.01)}
DEFAULT_ASCAR_FILES = {"ack_ewma": "ack_ewma", "send_ewma": "sent_ewma", "pt_ratio": "pt_ratio"}
# field -> counter of the stats file whose sum it is the rate of
STATS_RATES = {"read_bytes_s": "read_bytes", "write_bytes_s": "write_bytes"}
WAIT_COUNTER = "req_waittime"
STATS_FIELDS = (*STATS_RATES, "req_wait_us")

FIELDS = ("max_rpcs_in_flight", "ack_ewma", "send_ewma", "pt_ratio",
          *RPC_STATS_LINES, "max_dirty_mb", "cur_dirty_bytes", *STATS_FIELDS)
TOTALS = ("read_bytes_s", "write_bytes_s")

_HEADER_LINE = re.compile(r"^\s*([A-Za-z][A-Za-z ]*?)\s*:\s*([-+0-9.eE]+)\s*$")
_KEY_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([-+0-9.eE]+)(?:\s+\S+)?\s*$")
_OSC_SUFFIX = re.compile(r"^(.*)-osc-[^-]+$")


# -- parsers of the kernel's formats (pure functions) -------------------------------------

def parse_number(text: str) -> float | None:
    """The first token of a one-value procfs/sysfs file, e.g. ``8`` or ``32.5``."""
    parts = text.split()
    try:
        return float(parts[0]) if parts else None
    except ValueError:
        return None


def parse_rpc_stats_header(text: str) -> dict[str, float]:
    """``read RPCs in flight:  3`` ... -> {"read rpcs in flight": 3.0, ...}: the lines
    ``label: number`` above the histograms (``snapshot_time`` has a unit and is skipped)."""
    out = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break                    # the histograms follow the first blank line
            continue
        m = _HEADER_LINE.match(line)
        if m:
            try:
                out[m.group(1).lower()] = float(m.group(2))
            except ValueError:
                pass
    return out


def parse_stats(text: str) -> dict[str, tuple[float, float | None]]:
    """lprocfs ``stats``: ``name  COUNT samples [unit] MIN MAX SUM [SUMSQ]`` ->
    {name: (count, sum)}; sum is None for a counter without min/max/sum."""
    out: dict[str, tuple[float, float | None]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[2] != "samples":
            continue
        try:
            count = float(parts[1])
            total = float(parts[6]) if len(parts) >= 7 else None
        except ValueError:
            continue
        out[parts[0]] = (count, total)
    return out


def parse_import(text: str) -> dict[str, float]:
    """Every ``key: number [unit]`` line of an OSC's ``import`` file (nested YAML-ish);
    ASCAR's client adds ``ack_ewma``, ``sent_ewma`` and ``rtt_ratio100`` there."""
    out = {}
    for line in text.splitlines():
        m = _KEY_LINE.match(line)
        if m and m.group(1) not in out:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


def short_name(dirname: str) -> str:
    """``lustre-OST0003-osc-ffff88007a2b4000`` -> ``lustre-OST0003``."""
    m = _OSC_SUFFIX.match(dirname)
    return m.group(1) if m else dirname


def _read(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read(READ_LIMIT).decode("ascii", "replace")
    except OSError:
        return None


class _OSC:
    """One OSC directory: where each of its files lives, and its last counters."""

    def __init__(self, dirname: str, label: str, roots: list[str]):
        self.dirname, self.label = dirname, label
        self._roots = roots
        self._paths: dict[str, str | None] = {}
        self.prev: dict[str, tuple[float, float | None]] | None = None
        self.prev_t = 0.0

    def path(self, fname: str) -> str | None:
        """The first root's copy of ``fname`` (resolved once; None when in none)."""
        if fname not in self._paths:
            self._paths[fname] = next(
                (p for p in (os.path.join(r, self.dirname, fname) for r in self._roots)
                 if os.path.isfile(p)), None)
        return self._paths[fname]

    def read(self, fname: str) -> str | None:
        return _read(self.path(fname))


@register("lustre_osc")
class LustreOSCCollector(Collector):
    def __init__(self, root: str | list[str] | None = None, pattern: str = DEFAULT_PATTERN,
                 fields: list[str] | None = None, totals: bool = True,
                 ascar_files: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        roots = list(DEFAULT_ROOTS) if root is None else [root] if isinstance(root, str) else root
        if not roots or not all(isinstance(r, str) and r for r in roots):
            raise ValueError("root: must be a directory or a list of directories")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("pattern: must be a non-empty name pattern, e.g. \"*-osc-*\"")
        self._ascar_files = dict(DEFAULT_ASCAR_FILES)
        for key, fname in (ascar_files or {}).items():
            if key not in DEFAULT_ASCAR_FILES or not isinstance(fname, str) or not fname:
                raise ValueError(f"ascar_files: {key!r}: expected one of "
                                 f"{', '.join(DEFAULT_ASCAR_FILES)} -> a file name")
            self._ascar_files[key] = fname
        if fields is not None:
            unknown = [f for f in fields if f not in FIELDS]
            if unknown or not fields:
                what = f"unknown field {unknown[0]!r}" if unknown else "name at least one field"
                raise ValueError(f"fields: {what} (known: {', '.join(FIELDS)})")
        self._clock = clock
        self._oscs = self._discover(roots, pattern)
        available = [f for f in FIELDS if any(self._provides(o, f) for o in self._oscs)]
        if fields is None:
            self.fields = available
        else:
            missing = [f for f in fields if f not in available]
            if missing:
                raise ValueError(f"fields: {missing[0]!r} is provided by no OSC under "
                                 f"{', '.join(roots)}" + (
                                     " (it needs ASCAR's patched client: a file "
                                     f"{self._ascar_files[missing[0]]!r} or "
                                     f"'{ASCAR_IMPORT_KEYS[missing[0]][0]}:' in import)"
                                     if missing[0] in ASCAR_IMPORT_KEYS else ""))
            self.fields = [f for f in FIELDS if f in fields]
        self._totals = [f for f in TOTALS if totals and f in self.fields]
        self._names = [f"osc.{o.label}.{f}" for o in self._oscs for f in self.fields]
        self._names += [f"osc.total.{f}" for f in self._totals]
        self._need_stats = any(f in STATS_FIELDS for f in self.fields)
        if self._need_stats:
            now = clock()
            for osc in self._oscs:
                osc.prev, osc.prev_t = self._counters(osc), now

    @staticmethod
    def _discover(roots: list[str], pattern: str) -> list[_OSC]:
        found: set[str] = set()
        for r in roots:
            try:
                entries = os.listdir(r)
            except OSError:
                continue
            found.update(e for e in entries if fnmatch.fnmatchcase(e, pattern)
                         and os.path.isdir(os.path.join(r, e)))
        if not found:
            raise ValueError(f"pattern: no OSC directory matches {pattern!r} under "
                             f"{', '.join(roots)} (is a Lustre file system mounted?)")
        shorts: dict[str, int] = {}
        for d in found:
            shorts[short_name(d)] = shorts.get(short_name(d), 0) + 1
        # two mounts of one file system: keep the full names, which differ
        return [_OSC(d, short_name(d) if shorts[short_name(d)] == 1 else d, roots)
                for d in sorted(found)]

    def _provides(self, osc: _OSC, field: str) -> bool:
        if field in GAUGE_FILES:
            return osc.path(GAUGE_FILES[field]) is not None
        if field in RPC_STATS_LINES:
            return RPC_STATS_LINES[field] in parse_rpc_stats_header(osc.read("rpc_stats") or "")
        if field in ASCAR_IMPORT_KEYS:
            return (osc.path(self._ascar_files[field]) is not None
                    or ASCAR_IMPORT_KEYS[field][0] in parse_import(osc.read("import") or ""))
        return osc.path("stats") is not None

    def names(self) -> list[str]:
        return list(self._names)

    # -- one tick ---------------------------------------------------------------------

    @staticmethod
    def _counters(osc: _OSC) -> dict[str, tuple[float, float | None]] | None:
        text = osc.read("stats")
        return None if text is None else parse_stats(text)

    def _rates(self, osc: _OSC, now: float) -> dict[str, float]:
        cur, prev, dt = self._counters(osc), osc.prev, now - osc.prev_t
        osc.prev, osc.prev_t = cur, now
        out = dict.fromkeys(STATS_FIELDS, NAN)
        if cur is None or prev is None or dt <= 0:
            return out
        for field, counter in STATS_RATES.items():
            delta = (cur.get(counter, (0, 0))[1] or 0) - (prev.get(counter, (0, 0))[1] or 0)
            out[field] = delta / dt if delta >= 0 else NAN      # < 0: the stats were cleared
        (c1, s1), (c0, s0) = cur.get(WAIT_COUNTER, (0, 0)), prev.get(WAIT_COUNTER, (0, 0))
        dc, ds = c1 - c0, (s1 or 0) - (s0 or 0)
        out["req_wait_us"] = ds / dc if dc > 0 and ds >= 0 else 0.0 if dc == 0 else NAN
        return out

    def _osc_values(self, osc: _OSC, now: float) -> dict[str, float]:
        fields = self.fields
        out: dict[str, float] = {}
        for f in fields:
            if f in GAUGE_FILES:
                v = parse_number(osc.read(GAUGE_FILES[f]) or "")
                out[f] = NAN if v is None else v
        if any(f in RPC_STATS_LINES for f in fields):
            header = parse_rpc_stats_header(osc.read("rpc_stats") or "")
            for f, label in RPC_STATS_LINES.items():
                out[f] = header.get(label, NAN)
        imported: dict[str, float] | None = None
        for f, (key, scale) in ASCAR_IMPORT_KEYS.items():
            if f not in fields:
                continue
            own = osc.path(self._ascar_files[f])
            if own is not None:
                v = parse_number(_read(own) or "")
                out[f] = NAN if v is None else v
                continue
            if imported is None:
                imported = parse_import(osc.read("import") or "")
            out[f] = imported[key] * scale if key in imported else NAN
        if self._need_stats:
            out.update(self._rates(osc, now))
        return out

    def collect(self) -> dict[str, float]:
        now = self._clock()
        out: dict[str, float] = {}
        sums = dict.fromkeys(self._totals, 0.0)
        for osc in self._oscs:
            values = self._osc_values(osc, now)
            for f in self.fields:
                out[f"osc.{osc.label}.{f}"] = values.get(f, NAN)
            for f in self._totals:
                sums[f] += values.get(f, NAN)        # NaN if any OSC's rate is unknown
        for f, total in sums.items():
            out[f"osc.total.{f}"] = total
        return out
