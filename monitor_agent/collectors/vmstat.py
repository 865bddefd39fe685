"""Linux page cache and writeback PIs: ``/proc/vmstat``, ``/proc/meminfo`` and the
``vm.dirty_*`` sysctls, what a writeback tuner needs to see.

* ``/proc/vmstat`` gauges, as they are (pages): ``nr_dirty``, ``nr_writeback``,
  ``nr_dirty_threshold``, ``nr_dirty_background_threshold``;
* ``/proc/vmstat`` counters as RATES over the tick, never cumulative: ``pgpgin_kb_s``,
  ``pgpgout_kb_s`` (KiB/s read from and written to block devices), ``nr_dirtied_s``,
  ``nr_written_s`` (pages dirtied / written back per second), ``pswpin_s``,
  ``pswpout_s``, ``pgmajfault_s``, ``pgscan_kswapd_s``, ``pgscan_direct_s``,
  ``pgsteal_kswapd_s``, ``pgsteal_direct_s``; a counter that went backwards gives NaN;
* ``/proc/meminfo`` gauges (KiB): ``mem_dirty_kb``, ``mem_writeback_kb``,
  ``mem_cached_kb``, ``mem_buffers_kb``, ``mem_free_kb``, ``mem_available_kb``;
* the writeback sysctls, so the engine sees the knobs it turns (``<root>/sys/vm/``):
  ``dirty_ratio``, ``dirty_background_ratio``, ``dirty_expire_centisecs``,
  ``dirty_writeback_centisecs``, ``dirty_bytes``, ``dirty_background_bytes``.

PI names: ``vmstat.<field>``. The fields are chosen once, at start: ``fields`` (default:
every field above that this kernel has), so the PI vector never changes; a value that
cannot be read in a tick is NaN. Options: ``root`` (default ``/proc``: reads
``root/vmstat``, ``root/meminfo``, ``root/sys/vm/*``; a fixture tree in tests),
``fields``.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from monitor_agent.collectors.base import Collector, read_text, register

NAN = float("nan")
DEFAULT_ROOT = "/proc"

VMSTAT_GAUGES = ("nr_dirty", "nr_writeback", "nr_dirty_threshold",
                 "nr_dirty_background_threshold")
# PI name -> /proc/vmstat counter
VMSTAT_RATES = {"pgpgin_kb_s": "pgpgin", "pgpgout_kb_s": "pgpgout",
                "nr_dirtied_s": "nr_dirtied", "nr_written_s": "nr_written",
                "pswpin_s": "pswpin", "pswpout_s": "pswpout", "pgmajfault_s": "pgmajfault",
                "pgscan_kswapd_s": "pgscan_kswapd", "pgscan_direct_s": "pgscan_direct",
                "pgsteal_kswapd_s": "pgsteal_kswapd", "pgsteal_direct_s": "pgsteal_direct"}
# PI name -> /proc/meminfo key
MEMINFO = {"mem_dirty_kb": "Dirty", "mem_writeback_kb": "Writeback",
           "mem_cached_kb": "Cached", "mem_buffers_kb": "Buffers",
           "mem_free_kb": "MemFree", "mem_available_kb": "MemAvailable"}
SYSCTLS = ("dirty_ratio", "dirty_background_ratio", "dirty_expire_centisecs",
           "dirty_writeback_centisecs", "dirty_bytes", "dirty_background_bytes")
FIELDS = (*VMSTAT_GAUGES, *VMSTAT_RATES, *MEMINFO, *SYSCTLS)


def parse_vmstat(text: str) -> dict[str, float]:
    """``name value`` lines -> {name: value}; malformed lines are skipped."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


def parse_meminfo(text: str) -> dict[str, float]:
    """``Dirty:     1234 kB`` lines -> {"Dirty": 1234.0} (KiB, as the file gives them)."""
    out = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts:
            try:
                out[key.strip()] = float(parts[0])
            except ValueError:
                pass
    return out


@register("vmstat")
class VMStatCollector(Collector):
    def __init__(self, root: str = DEFAULT_ROOT, fields: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if fields is not None:
            if not isinstance(fields, list) or not fields or \
                    not all(isinstance(f, str) for f in fields):
                raise ValueError("fields: must be a non-empty list of field names")
            unknown = [f for f in fields if f not in FIELDS]
            if unknown:
                raise ValueError(f"fields: unknown field {unknown[0]!r} "
                                 f"(known: {', '.join(FIELDS)})")
        self._root, self._clock = root, clock
        vm, mem = self._vmstat(), self._meminfo()
        if vm is None and mem is None:
            raise ValueError(f"root: cannot read {root}/vmstat nor {root}/meminfo")
        have = self._read_all(vm or {}, mem or {})
        if fields is None:
            self.fields = [f for f in FIELDS if f in have]
        else:
            missing = [f for f in fields if f not in have]
            if missing:
                raise ValueError(f"fields: {missing[0]!r} cannot be read under {root} on "
                                 f"this kernel")
            self.fields = [f for f in FIELDS if f in fields]
        self._names = [f"vmstat.{f}" for f in self.fields]
        self._want_vm = any(f in VMSTAT_GAUGES or f in VMSTAT_RATES for f in self.fields)
        self._want_mem = any(f in MEMINFO for f in self.fields)
        self._sysctls = [f for f in self.fields if f in SYSCTLS]
        self._prev = vm or {}
        self._prev_t = clock()

    def _vmstat(self) -> dict[str, float] | None:
        text = read_text(os.path.join(self._root, "vmstat"))
        return None if text is None else parse_vmstat(text)

    def _meminfo(self) -> dict[str, float] | None:
        text = read_text(os.path.join(self._root, "meminfo"))
        return None if text is None else parse_meminfo(text)

    def _sysctl(self, name: str) -> float:
        text = read_text(os.path.join(self._root, "sys/vm", name))
        try:
            return float(text.split()[0]) if text and text.split() else NAN
        except ValueError:
            return NAN

    def _read_all(self, vm: dict, mem: dict) -> set[str]:
        """The fields this host can report."""
        have = {f for f in VMSTAT_GAUGES if f in vm}
        have |= {f for f, c in VMSTAT_RATES.items() if c in vm}
        have |= {f for f, k in MEMINFO.items() if k in mem}
        have |= {f for f in SYSCTLS if self._sysctl(f) == self._sysctl(f)}   # not NaN
        return have

    def names(self) -> list[str]:
        return list(self._names)

    def collect(self) -> dict[str, float]:
        now = self._clock()
        dt = now - self._prev_t            # since the last good read of /proc/vmstat
        values: dict[str, float] = {}
        if self._want_vm:
            vm = self._vmstat() or {}
            for f in VMSTAT_GAUGES:
                values[f] = vm.get(f, NAN)
            for f, counter in VMSTAT_RATES.items():
                cur, prev = vm.get(counter), self._prev.get(counter)
                if cur is None or prev is None or dt <= 0 or cur < prev:
                    values[f] = NAN
                else:
                    values[f] = (cur - prev) / dt
            if vm:
                self._prev, self._prev_t = vm, now
        if self._want_mem:
            mem = self._meminfo() or {}
            for f, key in MEMINFO.items():
                values[f] = mem.get(key, NAN)
        for f in self._sysctls:
            values[f] = self._sysctl(f)
        return {f"vmstat.{f}": values.get(f, NAN) for f in self.fields}
