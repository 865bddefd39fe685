"""What an application does, from ``/proc``: the processes of one cgroup (a systemd
service, a container, a job), summed.

A tuner must tell workloads apart by something its own knobs do not move: an
application's throughput moves with a readahead window, but whether it reads or writes,
how large its requests are, whether it reads through ``mmap`` page faults or ``read()``
calls, and how many files it holds open do not. This collector reports both kinds for
the processes listed in ``<cgroup>/cgroup.procs`` (cgroup v1 or v2), each tick:

* rates over the tick (from ``/proc/<pid>/io`` and ``/proc/<pid>/stat``):
  ``read_kib_s``, ``write_kib_s`` (``rchar``/``wchar``: what the processes moved through
  read/write calls, page cache included), ``read_calls_s``, ``write_calls_s``
  (``syscr``/``syscw``), ``major_faults_s`` (``majflt``: pages read in through
  ``mmap``);
* the workload's shape, independent of how fast it runs: ``read_share`` (the share of
  the bytes moved, a major fault counted as one 4 KiB page), ``fault_share`` (the share of
  the bytes read that came in through major faults: ~1 for an ``mmap`` reader, 0 for
  one that calls ``read()``), ``kib_per_op`` (bytes
  per operation, faults included), ``open_files`` (open regular files, under ``under``
  when it is given: the files on the tuned file system), ``file_kib`` (the median size
  of those files: a small-file storm and a stream can both read in 4 KiB ``read()``
  calls, and only their files' sizes tell them apart);
* ``procs``: the number of processes.

A process is known by its pid and start time; one that started during the tick counts
from zero, one that was there at the first tick from where it stood then; what a process
did between the last tick and its exit is not seen (its counters go with it). The rates
count every process. The shape is taken from the processes that were already there at
the tick before (a process's first tick is its start-up: loading, reading its
configuration); in a tick with none (a job between two runs, one just started) the
shape of the last tick that had one is held for ``hold_ticks`` ticks, then it is 0 (an
idle node): a job that restarts every few seconds stays one workload. ``file_kib`` is
that of the last tick that saw a file open, for as long as the shape is not idle: a
reader of 64 KiB files at 10 MB/s holds each open ~6 ms, and about half the ticks see
none open (measured on the GlusterFS test cluster). Options:
``cgroup`` (a cgroup directory: required), ``under`` (a path prefix for
``open_files``), ``hold_ticks`` (3), ``root`` (default ``/proc``; a fixture tree in
tests), ``page_kib`` (4). Reading another user's ``/proc/<pid>/io`` needs root (or
the same user); an unreadable process is skipped.
"""
from __future__ import annotations

import os
import stat
import statistics
import time
from typing import Callable

from monitor_agent.collectors.base import Collector, read_text, register

NAN = float("nan")
RATES = ("read_kib_s", "write_kib_s", "read_calls_s", "write_calls_s", "major_faults_s")
SHAPE = ("read_share", "fault_share", "kib_per_op", "open_files", "file_kib", "procs")
FIELDS = RATES + SHAPE


def parse_io(text: str) -> dict[str, int]:
    """``/proc/<pid>/io``: ``rchar: 123`` lines -> {"rchar": 123}."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            try:
                out[key.strip()] = int(value)
            except ValueError:
                pass
    return out


def parse_stat(text: str) -> tuple[int, int] | None:
    """``/proc/<pid>/stat`` -> (major faults, start time in clock ticks): fields 12 and
    22, counted after the command's closing parenthesis (a name may hold spaces)."""
    rest = text.rpartition(")")[2].split()
    try:
        return int(rest[9]), int(rest[19])     # majflt, starttime (fields 12 and 22)
    except (IndexError, ValueError):
        return None


@register("processes")
class ProcessesCollector(Collector):
    def __init__(self, cgroup: str = "", under: str | None = None, hold_ticks: int = 3,
                 root: str = "/proc", page_kib: float = 4.0,
                 clock: Callable[[], float] = time.monotonic):
        if not isinstance(cgroup, str) or not cgroup:
            raise ValueError("cgroup: required, a cgroup directory (its cgroup.procs "
                             "lists the application's processes)")
        if under is not None and (not isinstance(under, str) or not under.startswith("/")):
            raise ValueError("under: must be an absolute path prefix")
        if not isinstance(hold_ticks, int) or isinstance(hold_ticks, bool) or hold_ticks < 0:
            raise ValueError(f"hold_ticks: must be an integer >= 0 (got {hold_ticks!r})")
        self._hold, self._held = hold_ticks, 0
        self._shape: dict[str, float] | None = None      # the last established shape
        self._file_kib = 0.0        # the last files' median size (none seen yet: 0, as idle)
        if not page_kib > 0:
            raise ValueError(f"page_kib: must be > 0 (got {page_kib})")
        self._cgroup, self._root, self._clock = cgroup, root, clock
        self._under = under.rstrip("/") + "/" if under else None
        self._page_kib = float(page_kib)
        self._prev: dict[tuple[int, int], tuple[int, ...]] | None = None   # None: first tick
        self._prev_t = clock()

    def check(self) -> list[str]:
        if not os.path.exists(os.path.join(self._cgroup, "cgroup.procs")):
            return [f"cgroup: no {self._cgroup}/cgroup.procs (not a cgroup directory, or "
                    f"not mounted here)"]
        return []

    def names(self) -> list[str]:
        return [f"procs.{f}" for f in FIELDS]

    def _pids(self) -> list[int]:
        text = read_text(os.path.join(self._cgroup, "cgroup.procs")) or ""
        return [int(t) for t in text.split() if t.isdigit()]

    def _open_files(self, pid: int) -> tuple[int, list[int]]:
        """The files process ``pid`` has open (under ``under``), and the sizes in bytes
        of those that are regular files (``stat`` through the fd: a file renamed or
        deleted since it was opened is still the one read)."""
        d = os.path.join(self._root, str(pid), "fd")
        try:
            fds = os.listdir(d)
        except OSError:
            return 0, []
        n, sizes = 0, []
        for fd in fds:
            try:
                target = os.readlink(os.path.join(d, fd))
            except OSError:
                continue
            if target.startswith("/") and (self._under is None or
                                           target.startswith(self._under)):
                n += 1
                try:
                    st = os.stat(os.path.join(d, fd))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    sizes.append(st.st_size)
        return n, sizes

    def _sample(self) -> tuple[dict[tuple[int, int], tuple[int, ...]], int, list[int]]:
        """{(pid, start time): (rchar, wchar, syscr, syscw, majflt)}, open files, and
        the sizes of the regular ones."""
        now, files, sizes = {}, 0, []
        for pid in self._pids():
            base = os.path.join(self._root, str(pid))
            io, st = read_text(os.path.join(base, "io")), read_text(os.path.join(base, "stat"))
            s = parse_stat(st) if st else None
            if io is None or s is None:
                continue                       # gone, or not ours to read
            c = parse_io(io)
            now[(pid, s[1])] = (c.get("rchar", 0), c.get("wchar", 0), c.get("syscr", 0),
                                c.get("syscw", 0), s[0])
            n, sz = self._open_files(pid)
            files += n
            sizes += sz
        return now, files, sizes

    def collect(self) -> dict[str, float]:
        t = self._clock()
        cur, files, sizes = self._sample()
        dt, first = t - self._prev_t, self._prev is None
        prev = self._prev or {}
        self._prev, self._prev_t = cur, t
        out = dict.fromkeys(self.names(), NAN)
        out["procs.open_files"], out["procs.procs"] = float(files), float(len(cur))
        if sizes:
            self._file_kib = statistics.median(sizes) / 1024
        out["procs.file_kib"] = self._file_kib
        if first or dt <= 0:
            return out
        every, settled = [0] * 5, [0] * 5            # all processes; those seen before
        for key, c in cur.items():
            p = prev.get(key)
            for i in range(5):
                moved = max(0, c[i] - (p[i] if p else 0))   # new since the last tick: from 0
                every[i] += moved
                if p is not None:
                    settled[i] += moved
        for name, v, k in zip(RATES, every, (1024, 1024, 1, 1, 1)):
            out[f"procs.{name}"] = v / k / dt
        if any(key in prev for key in cur):
            self._shape, self._held = self._shape_of(*settled), 0
        elif self._shape is not None and self._held < self._hold:
            self._held += 1                          # between two runs of a job: held
        else:
            self._shape = {k: 0.0 for k in ("procs.read_share", "procs.fault_share",
                                             "procs.kib_per_op")}
            if not sizes:                            # idle: no file, no size
                self._file_kib = 0.0
        out.update(self._shape)
        out["procs.file_kib"] = self._file_kib
        return out

    def _shape_of(self, rchar, wchar, syscr, syscw, majflt) -> dict[str, float]:
        """The read share, fault share and KiB per operation of one tick's counts."""
        fault_kib = majflt * self._page_kib
        read_kib = rchar / 1024 + fault_kib
        kib, ops = read_kib + wchar / 1024, syscr + syscw + majflt
        return {"procs.read_share": read_kib / kib if kib else 0.0,
                "procs.fault_share": fault_kib / read_kib if read_kib else 0.0,
                "procs.kib_per_op": kib / ops if ops else 0.0}
