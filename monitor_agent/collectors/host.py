"""Host PIs from psutil: CPU, memory, and per-device disk and per-interface network rates.

The thesis (§5.1.1) asks for rates, never cumulative totals: how many bytes a disk has
read since boot says nothing about the best setting now. Every disk and network PI is
therefore the difference of two successive counter readings divided by the time between
them. A counter that went backwards (device reset, hot-plug) or a device that vanished
gives NaN for that tick rather than a huge bogus rate.

PI names: ``cpu_percent``, ``cpu_iowait_percent``, ``mem_used_percent``,
``disk.<dev>.{read_bytes_s, write_bytes_s, read_iops, write_iops, busy_percent}`` and
``net.<iface>.{rx_bytes_s, tx_bytes_s}``. Devices and interfaces are chosen once, at
start (shell-style patterns in ``disks`` / ``interfaces``; by default every device but
loop/ram/zram/optical and every interface but ``lo``), so the PI vector never changes.
"""
from __future__ import annotations

import time
from fnmatch import fnmatchcase
from typing import Any, Callable

from monitor_agent.collectors.base import Collector, register

NAN = float("nan")
DEFAULT_EXCLUDE_DISKS = ["loop*", "ram*", "zram*", "sr*", "fd*"]
DEFAULT_EXCLUDE_INTERFACES = ["lo"]

# PI suffix -> (counter field, scale to a per-second rate)
DISK_RATES = (
    ("read_bytes_s", "read_bytes", 1.0),
    ("write_bytes_s", "write_bytes", 1.0),
    ("read_iops", "read_count", 1.0),
    ("write_iops", "write_count", 1.0),
    ("busy_percent", "busy_time", 0.1),     # busy_time is in ms: ms/s × 0.1 = percent
)
NET_RATES = (
    ("rx_bytes_s", "bytes_recv", 1.0),
    ("tx_bytes_s", "bytes_sent", 1.0),
)


def _select(available, include: list[str] | None, exclude: list[str]) -> list[str]:
    chosen = []
    for name in sorted(available):
        if include is not None and not any(fnmatchcase(name, p) for p in include):
            continue
        if any(fnmatchcase(name, p) for p in exclude):
            continue
        chosen.append(name)
    return chosen


class _RateSet:
    """Per-second rates of the counters of a set of devices between successive reads."""

    def __init__(self, prefix: str, devices: list[str], fields, first: dict, now: float):
        self.devices = devices
        self.fields = [(suffix, attr, scale) for suffix, attr, scale in fields
                       if all(hasattr(first[d], attr) for d in devices)]
        self.names = [f"{prefix}.{d}.{suffix}" for d in devices for suffix, _, _ in self.fields]
        self._prev = {d: first[d] for d in devices}
        self._prev_t = now

    def rates(self, counters: dict, now: float, out: dict[str, float]) -> None:
        dt = now - self._prev_t
        names = iter(self.names)
        for dev in self.devices:
            cur, prev = counters.get(dev), self._prev.get(dev)
            for _, attr, scale in self.fields:
                name = next(names)
                if cur is None or prev is None or dt <= 0:
                    out[name] = NAN
                    continue
                delta = getattr(cur, attr) - getattr(prev, attr)
                out[name] = delta * scale / dt if delta >= 0 else NAN
            if cur is not None:
                self._prev[dev] = cur
        self._prev_t = now


@register("host")
class HostCollector(Collector):
    """CPU, memory, disk and network PIs of this host (psutil)."""

    def __init__(self, cpu: bool = True, memory: bool = True,
                 disks: list[str] | None = None,
                 exclude_disks: list[str] | None = None,
                 interfaces: list[str] | None = None,
                 exclude_interfaces: list[str] | None = None,
                 source: Any = None, clock: Callable[[], float] = time.monotonic):
        for key, value in (("disks", disks), ("exclude_disks", exclude_disks),
                           ("interfaces", interfaces),
                           ("exclude_interfaces", exclude_interfaces)):
            if value is not None and (not isinstance(value, list)
                                      or not all(isinstance(p, str) for p in value)):
                raise ValueError(f"{key}: must be a list of name patterns, e.g. [\"sd*\"]")
        if source is None:
            import psutil
            source = psutil
        self._ps, self._clock = source, clock
        self._cpu, self._memory = bool(cpu), bool(memory)
        now = clock()
        if self._cpu:
            source.cpu_times_percent(interval=None)     # primes psutil's "since last call"
        disk_counters = self._disk_counters()
        net_counters = self._net_counters()
        self._disks = _RateSet(
            "disk", _select(disk_counters, disks,
                            DEFAULT_EXCLUDE_DISKS if exclude_disks is None else exclude_disks),
            DISK_RATES, disk_counters, now)
        self._nets = _RateSet(
            "net", _select(net_counters, interfaces,
                           DEFAULT_EXCLUDE_INTERFACES if exclude_interfaces is None
                           else exclude_interfaces),
            NET_RATES, net_counters, now)
        self._names = ((["cpu_percent", "cpu_iowait_percent"] if self._cpu else [])
                       + (["mem_used_percent"] if self._memory else [])
                       + self._disks.names + self._nets.names)

    def _disk_counters(self) -> dict:
        try:
            return self._ps.disk_io_counters(perdisk=True) or {}
        except (OSError, RuntimeError):     # no /proc/diskstats (containers)
            return {}

    def _net_counters(self) -> dict:
        try:
            return self._ps.net_io_counters(pernic=True) or {}
        except (OSError, RuntimeError):
            return {}

    def names(self) -> list[str]:
        return list(self._names)

    def collect(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._cpu:
            t = self._ps.cpu_times_percent(interval=None)
            iowait = getattr(t, "iowait", 0.0)
            out["cpu_percent"] = max(0.0, 100.0 - t.idle - iowait)
            out["cpu_iowait_percent"] = iowait
        if self._memory:
            out["mem_used_percent"] = float(self._ps.virtual_memory().percent)
        now = self._clock()
        if self._disks.devices:
            self._disks.rates(self._disk_counters(), now, out)
        if self._nets.devices:
            self._nets.rates(self._net_counters(), now, out)
        return out

