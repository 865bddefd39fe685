"""The ``processes`` collector against a fixture /proc tree and cgroup: rates over the
tick, the workload's shape (read share, fault share, size per op, files open under a
path), processes that come and go, and bad options."""
from __future__ import annotations

import math
import os

import pytest

from monitor_agent.collectors.base import build_collector


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeProcs:
    """``root/<pid>/{io,stat,fd/}`` and a cgroup whose cgroup.procs lists the pids."""

    def __init__(self, tmp_path):
        self.root, self.cgroup = tmp_path / "proc", tmp_path / "cg"
        self.root.mkdir()
        self.cgroup.mkdir()
        self.procs: dict[int, dict] = {}

    def set(self, pid, start=1000, rchar=0, wchar=0, syscr=0, syscw=0, majflt=0,
            files=()):
        self.procs[pid] = dict(start=start, rchar=rchar, wchar=wchar, syscr=syscr,
                               syscw=syscw, majflt=majflt, files=files)
        self.write()

    def drop(self, pid):
        del self.procs[pid]
        self.write()

    def write(self):
        for d in self.root.iterdir():
            for sub in sorted(d.rglob("*"), reverse=True):
                sub.unlink() if not sub.is_dir() or sub.is_symlink() else sub.rmdir()
            d.rmdir()
        for pid, p in self.procs.items():
            d = self.root / str(pid)
            (d / "fd").mkdir(parents=True)
            (d / "io").write_text(
                f"rchar: {p['rchar']}\nwchar: {p['wchar']}\nsyscr: {p['syscr']}\n"
                f"syscw: {p['syscw']}\nread_bytes: 0\nwrite_bytes: 0\n")
            # a command with a space and parentheses: fields are counted after the last ')'
            rest = ["S"] + ["0"] * 8 + [str(p["majflt"])] + ["0"] * 9 + [str(p["start"])]
            (d / "stat").write_text(f"{pid} (fio (job) x) " + " ".join(rest) + " 0 0\n")
            for i, target in enumerate(p["files"]):
                os.symlink(target, d / "fd" / str(i))
        (self.cgroup / "cgroup.procs").write_text("".join(f"{p}\n" for p in self.procs))


def test_rates_and_shape_of_a_cgroups_processes(tmp_path):
    fp, clock = FakeProcs(tmp_path), FakeClock()
    fp.set(11, rchar=10 << 20, syscr=100, files=("/mnt/g/data", "/tmp/out", "pipe:[1]"))
    col = build_collector("processes", {"cgroup": str(fp.cgroup), "under": "/mnt/g",
                                        "root": str(fp.root), "clock": clock})
    names = col.names()
    assert "procs.read_share" in names and "procs.open_files" in names
    first = col.collect()                       # no tick before: no rates, nothing counted
    assert len(first) == len(names)
    assert math.isnan(first["procs.read_kib_s"]) and first["procs.open_files"] == 1
    # a reader through read(): 8 MiB in 2048 calls over 2 s, and a writer that started:
    # the rates count both, the shape the reader only (a process's first tick is its
    # start-up)
    clock.t += 2.0
    fp.set(11, rchar=18 << 20, syscr=2148, files=("/mnt/g/data", "/tmp/out"))
    fp.set(12, start=2000, wchar=2 << 20, syscw=2, files=("/mnt/g/ckpt",))
    v = col.collect()
    assert v["procs.read_kib_s"] == 4096 and v["procs.read_calls_s"] == 1024
    assert v["procs.write_kib_s"] == 1024 and v["procs.write_calls_s"] == 1
    assert v["procs.read_share"] == 1 and v["procs.kib_per_op"] == 4
    assert v["procs.open_files"] == 2 and v["procs.procs"] == 2
    # both settled: 8 MiB read, 2 MiB written
    clock.t += 1.0
    fp.set(11, rchar=26 << 20, syscr=4196)
    fp.set(12, start=2000, wchar=4 << 20, syscw=4)
    v = col.collect()
    assert v["procs.read_share"] == pytest.approx(0.8) and v["procs.fault_share"] == 0
    assert v["procs.kib_per_op"] == pytest.approx(10240 / 2050)
    # an mmap reader: page faults, no read() calls; the writer gone
    clock.t += 1.0
    fp.drop(12)
    fp.set(11, rchar=26 << 20, syscr=4196, majflt=1000, files=("/mnt/g/data",))
    v = col.collect()
    assert v["procs.major_faults_s"] == 1000 and v["procs.read_kib_s"] == 0
    assert v["procs.fault_share"] == 1 and v["procs.read_share"] == 1
    assert v["procs.kib_per_op"] == 4
    # the job restarts: a tick with no process, then one with a new process (the pid
    # reused, another start time) reading its start-up files: the mmap shape is held
    # and the rates are true
    clock.t += 1.0
    fp.drop(11)
    v = col.collect()
    assert v["procs.procs"] == 0 and v["procs.read_kib_s"] == 0
    assert v["procs.fault_share"] == 1
    clock.t += 1.0
    fp.set(11, start=5000, rchar=1 << 20, syscr=256)
    v = col.collect()
    assert v["procs.read_kib_s"] == 1024 and v["procs.major_faults_s"] == 0
    assert v["procs.fault_share"] == 1
    clock.t += 1.0
    fp.set(11, start=5000, rchar=1 << 20, syscr=256, majflt=500)
    assert col.collect()["procs.fault_share"] == 1          # settled, mmap again
    # nothing running past the hold: zero rates and a zero shape, not NaN (an idle
    # node is a workload)
    fp.drop(11)
    for _ in range(4):
        clock.t += 1.0
        v = col.collect()
    assert v["procs.procs"] == 0 and v["procs.read_kib_s"] == 0
    assert v["procs.read_share"] == 0 and v["procs.kib_per_op"] == 0


def test_without_under_every_open_file_counts(tmp_path):
    fp, clock = FakeProcs(tmp_path), FakeClock()
    fp.set(7, files=("/a", "/b/c", "socket:[9]"))
    col = build_collector("processes", {"cgroup": str(fp.cgroup), "root": str(fp.root),
                                        "clock": clock})
    assert col.collect()["procs.open_files"] == 2


def test_bad_options_and_a_missing_cgroup_are_clear(tmp_path):
    with pytest.raises(ValueError, match="cgroup: required"):
        build_collector("processes", {})
    with pytest.raises(ValueError, match="under: must be an absolute"):
        build_collector("processes", {"cgroup": "/x", "under": "rel"})
    with pytest.raises(ValueError, match="hold_ticks"):
        build_collector("processes", {"cgroup": "/x", "hold_ticks": -1})
    with pytest.raises(ValueError, match="page_kib"):
        build_collector("processes", {"cgroup": "/x", "page_kib": 0})
    col = build_collector("processes", {"cgroup": str(tmp_path / "nope")})
    assert "no " in col.check()[0] and "cgroup.procs" in col.check()[0]
    v = col.collect()                          # an unreadable cgroup: no processes
    assert v["procs.procs"] == 0


def test_file_size_tells_small_files_from_a_stream_and_is_held_between_files(tmp_path):
    """Both read in 4 KiB calls (same read share, fault share and size per op); only the
    sizes of the files they hold open differ. A tick that catches no file open keeps the
    last size while the job runs; once the node is idle past the hold it is 0."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    big, small = mnt / "data", mnt / "f.0"
    with open(big, "wb") as f:
        f.truncate(256 << 20)                       # sparse: its size is what counts
    small.write_bytes(b"x" * (64 << 10))
    fp, clock = FakeProcs(tmp_path), FakeClock()
    col = build_collector("processes", {"cgroup": str(fp.cgroup), "under": str(mnt),
                                        "root": str(fp.root), "clock": clock,
                                        "hold_ticks": 1})
    assert col.collect()["procs.file_kib"] == 0     # nothing running yet: as idle
    fp.set(5, rchar=0, syscr=0, files=(str(big),))
    clock.t += 1.0
    assert col.collect()["procs.file_kib"] == 256 << 10
    fp.set(5, rchar=4 << 20, syscr=1024, files=(str(big),))
    clock.t += 1.0
    stream = col.collect()
    fp.set(5, rchar=8 << 20, syscr=2048, files=(str(small), str(small), str(big)))
    clock.t += 1.0
    mixed = col.collect()
    assert mixed["procs.file_kib"] == 64                  # the median of the files open
    fp.set(5, rchar=12 << 20, syscr=3072, files=())       # between two small files
    clock.t += 1.0
    storm = col.collect()
    for k in ("procs.read_share", "procs.fault_share", "procs.kib_per_op"):
        assert storm[k] == stream[k]
    assert storm["procs.open_files"] == 0 and storm["procs.file_kib"] == 64
    fp.set(5, rchar=12 << 20, syscr=3072, files=(str(mnt / "gone"),))   # unreadable
    clock.t += 1.0
    assert col.collect()["procs.file_kib"] == 64
    fp.drop(5)                                            # the job ends: held, then idle
    clock.t += 1.0
    assert col.collect()["procs.file_kib"] == 64
    clock.t += 1.0
    assert col.collect()["procs.file_kib"] == 0
