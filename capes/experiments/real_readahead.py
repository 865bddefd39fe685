"""Live readahead sessions on a real Linux block device: the device, the workload
schedule, the tuners, and the statistics the real benches report.

A session tunes one knob, a loop device's ``read_ahead_kb``, while fio reads from the
device, and measures **what the application gets**: fio's own bytes per second, read
from its ``--status-interval=1`` terse status as it runs (not device bytes: with mmap
random reads and a large readahead the device moves its full bandwidth while the
application starves). A new ``read_ahead_kb`` reaches a reader only when it opens the
device, so the workload is fio in short segments (``segment_s``) back to back, every
segment a new fio that reopens it.

Pieces (each reusable; issue 24's benches and the workload-recall tests use them):

* :class:`ReadaheadDevice` — a loop device over a sparse image in a tmpfs (``backing
  = "tmpfs"``), capped by a blkio cgroup (read IOPS, read bytes/s) and optionally a
  memory cgroup; or over the emulated seek disk (``backing = "seekdisk"``,
  ``tools/seekdisk``: one request at a time, a bandwidth, a seek cost). Everything it
  sets up is removed on ``close()``.
* :class:`Phase`, :func:`alternating_schedule` — the workload schedule: sequential and
  mmap random phases alternating (``configs/workloads/seqread4.fio``,
  ``mmaprand.fio``).
* :class:`SessionRunner` — plays a schedule on a device, one row per fio second
  (time, bytes/s, read_ahead_kb when the segment opened, phase, workload), and writes
  the latest figure to a file the stack's ``command`` collector reads (``app_bytes_s``).
* :func:`static_grid` — ``capes evaluate``'s machinery per workload: every value of a
  grid in randomised interleaved repetitions, 95 % CIs; gives the original's, the best
  static setting's and the per-workload best throughput.
* :func:`run_tuner` — the stack as real processes (interface daemon, monitoring agent,
  control agent, and the DRL engine or a baseline tuner via
  :mod:`capes.experiments.live_tuner`) on ``configs/linux-readahead-app.toml``, tuning
  while the schedule plays; the original comes back when the stack stops (checked).
* :func:`score` — a session's throughput with each workload normalised by its own best
  static throughput (``relative``), its difference from the best static setting's with
  a 95 % interval, per phase and overall; the worst 10 s against the original.

Root only (losetup, cgroups, sysfs, FUSE).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from capes.common.stats import mean_ci
from capes.experiments import evaluate as ev
from capes.experiments import workload_driver as wd
from capes.experiments.process_group import ProcessGroup, kill_session

REPO = Path(__file__).resolve().parents[2]
APP_CONFIG = REPO / "configs" / "linux-readahead-app.toml"
SEEKDISK_DIR = REPO / "tools" / "seekdisk"
LADDER = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]   # the config's values
PI_NAME = "app_bytes_s"
SIGNATURE_PI = "app_io_kib"     # the application's mean request size: what it does, not
                                # how fast, so read_ahead_kb does not move it (the signature
                                # of configs/linux-readahead-app.toml's workload contexts)


class RealTargetError(RuntimeError):
    """The real target cannot be set up here (no root, no fio, no FUSE, ...)."""


def missing_requirements(backing: str = "tmpfs") -> str | None:
    """Why a real session cannot run on this host (None: it can)."""
    why = wd.missing_on_host("losetup, cgroups, sysfs", ("losetup", "fio"))
    if why:
        return why
    if not os.path.isdir("/sys/fs/cgroup"):
        return "no cgroup file system"
    if backing == "seekdisk":
        if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
            return "no FUSE (/dev/fuse, fusermount3: apt-get install fuse3)"
        if seekdisk_binary() is None:
            return ("the seek disk cannot be built (make -C tools/seekdisk: needs gcc, "
                    "pkg-config, libfuse3-dev)")
    return None


def seekdisk_binary() -> Path | None:
    """tools/seekdisk/seekdisk, built with make when absent (None when it cannot be)."""
    exe = SEEKDISK_DIR / "seekdisk"
    if not exe.exists() or exe.stat().st_mtime < (SEEKDISK_DIR / "seekdisk.c").stat().st_mtime:
        try:
            subprocess.run(["make", "-s", "-C", str(SEEKDISK_DIR)], check=True,
                           capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
    return exe if exe.exists() else None


# -- the device ---------------------------------------------------------------------------

class MemoryCgroup:
    """A memory cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) so that the
    page cache of the readers stays a fraction of the data, as on a real host."""

    def __init__(self, limit_bytes: int, name: str):
        for root, key in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                          ("/sys/fs/cgroup", "memory.max")):
            if os.path.isfile(os.path.join(root, key)) or (
                    root == "/sys/fs/cgroup" and "memory" in
                    wd._read_words("/sys/fs/cgroup/cgroup.subtree_control")):
                self.path = os.path.join(root, name)
                os.makedirs(self.path, exist_ok=True)
                with open(os.path.join(self.path, key), "w") as fh:
                    fh.write(f"{int(limit_bytes)}\n")
                return
        raise RealTargetError("no memory cgroup controller")

    remove = wd.ThrottledCgroup.remove        # rmdir, retried while members exit


@dataclass
class DeviceSpec:
    backing: str = "tmpfs"          # tmpfs | seekdisk
    size_gib: float = 4.0
    read_iops: int = 0              # blkio cap (0: none)
    read_bps: int = 0
    memory_mib: int = 512           # page cache of the readers (0: no memory cgroup)
    seek_ms: float = 4.0            # seekdisk only
    bandwidth_mbs: float = 100.0    # seekdisk only
    original: int | None = 128      # read_ahead_kb set at the start (None: the device's)

    def describe(self) -> str:
        if self.backing == "seekdisk":
            dev = (f"emulated seek disk ({self.bandwidth_mbs:g} MB/s, +{self.seek_ms:g} ms "
                   f"per non-contiguous request, one request at a time)")
        else:
            dev = "loop device over a sparse file in a tmpfs"
        caps = [f"{self.read_iops} read IOPS" if self.read_iops else "",
                f"{self.read_bps / 1e6:g} MB/s" if self.read_bps else ""]
        caps = " + ".join(c for c in caps if c)
        return (f"{dev}, {self.size_gib:g} GiB{', capped at ' + caps if caps else ''}"
                f"{f', memory cgroup {self.memory_mib} MiB' if self.memory_mib else ''}")


def add_seekdisk_args(ap) -> None:
    """The emulated seek disk's options of a bench (``--size-gib``, ``--bandwidth-mbs``,
    ``--seek-ms``, ``--memory-mib``); :func:`seekdisk_spec` reads them back."""
    ap.add_argument("--size-gib", type=float, default=4)
    ap.add_argument("--bandwidth-mbs", type=float, default=100)
    ap.add_argument("--seek-ms", type=float, default=4)
    ap.add_argument("--memory-mib", type=int, default=512)


def seekdisk_spec(args, original: int | None) -> DeviceSpec:
    """The :class:`DeviceSpec` of :func:`add_seekdisk_args`'s options."""
    return DeviceSpec(backing="seekdisk", size_gib=args.size_gib,
                      memory_mib=args.memory_mib, seek_ms=args.seek_ms,
                      bandwidth_mbs=args.bandwidth_mbs, original=original)


class ReadaheadDevice:
    """The loop device a session tunes; ``open()`` / ``close()`` (or ``with``)."""

    def __init__(self, spec: DeviceSpec, workdir: Path):
        self.spec, self.workdir = spec, Path(workdir)
        self.dev: str | None = None
        self.image: Path | None = None
        self.mount: Path | None = None
        self.fuse: subprocess.Popen | None = None
        self.cgroups: list = []
        self.kernel_read_ahead: int | None = None
        self.original: int | None = None

    @property
    def name(self) -> str:
        return Path(self.dev).name

    @property
    def ra_file(self) -> Path:
        return Path("/sys/block") / self.name / "queue" / "read_ahead_kb"

    def read_ahead(self) -> int:
        return int(self.ra_file.read_text().split()[0])

    def set_read_ahead(self, kb: int) -> None:
        self.ra_file.write_text(f"{int(kb)}\n")

    @property
    def cgroup_paths(self) -> list[str]:
        return [c.path for c in self.cgroups if c.path]

    def open(self) -> "ReadaheadDevice":
        why = missing_requirements(self.spec.backing)
        if why:
            raise RealTargetError(why)
        shm = Path("/dev/shm") if os.path.isdir("/dev/shm") else self.workdir
        fd, name = tempfile.mkstemp(prefix="capes-real-", suffix=".img", dir=shm)
        os.close(fd)
        self.image = Path(name)
        os.truncate(self.image, int(self.spec.size_gib * (1 << 30)))
        target = self.image
        if self.spec.backing == "seekdisk":
            target = self._start_seekdisk()
        self.dev = subprocess.run(["losetup", "--find", "--show", str(target)],
                                  capture_output=True, text=True, check=True).stdout.strip()
        self.kernel_read_ahead = self.read_ahead()
        if self.spec.original is not None:
            self.set_read_ahead(self.spec.original)
        self.original = self.read_ahead()
        tag = f"capes-real-{os.getpid()}-{os.minor(os.stat(self.dev).st_rdev)}"
        if self.spec.read_iops or self.spec.read_bps:
            self.cgroups.append(wd.ThrottledCgroup(self.dev, read_iops=self.spec.read_iops,
                                                   read_bps=self.spec.read_bps, name=tag))
        if self.spec.memory_mib:
            self.cgroups.append(MemoryCgroup(self.spec.memory_mib << 20, tag))
        return self

    def _start_seekdisk(self) -> Path:
        exe = seekdisk_binary()
        if exe is None:
            raise RealTargetError("the seek disk cannot be built (make -C tools/seekdisk)")
        self.mount = self.workdir / "seekdisk"
        self.mount.mkdir(parents=True, exist_ok=True)
        self.fuse = subprocess.Popen(
            [str(exe), "--bandwidth-mbs", f"{self.spec.bandwidth_mbs:g}", "--seek-ms",
             f"{self.spec.seek_ms:g}", str(self.image), str(self.mount), "-f"],
            stdout=subprocess.DEVNULL, stderr=open(self.workdir / "seekdisk.log", "w"),
            start_new_session=True)
        disk = self.mount / "disk"
        for _ in range(100):
            if os.path.ismount(self.mount) and disk.exists():
                return disk
            if self.fuse.poll() is not None:
                break
            time.sleep(0.1)
        raise RealTargetError(f"the seek disk did not mount: "
                              f"{(self.workdir / 'seekdisk.log').read_text()[-300:]}")

    def close(self) -> None:
        """Remove everything ``open`` made (each step runs even if one before failed)."""
        if self.dev and self.original is not None:
            try:
                if self.read_ahead() != self.original:
                    self.set_read_ahead(self.original)
            except OSError:
                pass
        for c in self.cgroups:
            c.remove()
        self.cgroups = []
        if self.dev:
            subprocess.run(["losetup", "-d", self.dev], check=False)
            self.dev = None
        if self.fuse is not None:
            subprocess.run(["fusermount3", "-u", str(self.mount)], check=False,
                           capture_output=True)
            try:
                self.fuse.wait(5)
            except subprocess.TimeoutExpired:
                self.fuse.kill()
                self.fuse.wait()
            self.fuse = None
        if self.image is not None:
            self.image.unlink(missing_ok=True)
            self.image = None

    def __enter__(self) -> "ReadaheadDevice":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


# -- the workload -------------------------------------------------------------------------

@dataclass
class Phase:
    workload: str         # a job file name under configs/workloads (or a path)
    seconds: float


WORKLOAD_LABELS = {"seqread4": "sequential, 4 readers", "seqread": "sequential",
                   "mmaprand": "mmap random 4 KiB"}


def alternating_schedule(phases: int = 4, seconds: float = 120,
                         workloads: tuple[str, ...] = ("seqread4", "mmaprand")
                         ) -> list[Phase]:
    """Sequential and mmap random phases alternating (the issue-24 schedule)."""
    if phases < 1 or seconds <= 0:
        raise ValueError("phases >= 1 and seconds > 0")
    return [Phase(workloads[i % len(workloads)], float(seconds)) for i in range(phases)]


def parse_terse_status(line: str) -> tuple[float, float] | None:
    """One line of fio's terse (v3) status: (read KiB so far, read runtime ms), or None."""
    parts = line.split(";")
    if len(parts) < 9 or parts[0] != "3":
        return None
    try:
        return float(parts[5]), float(parts[8])
    except ValueError:
        return None


def terse_io_kib(line: str) -> float | None:
    """The mean read size so far (KiB) of one terse (v3) status line: its bandwidth
    (KiB/s) over its IOPS; None without reads. Sequential 16 KiB reads give ~16 whatever
    the readahead, random 4 KiB page faults ~4."""
    parts = line.split(";")
    if len(parts) < 9 or parts[0] != "3":
        return None
    try:
        bw, iops = float(parts[6]), float(parts[7])
    except ValueError:
        return None
    return bw / iops if bw > 0 and iops > 0 else None


@dataclass
class Row:
    t: float              # wall time at the end of the second
    bytes_s: float        # what fio read in it, per second
    read_ahead_kb: int    # in effect for the segment (read when it opened the device)
    phase: int
    workload: str
    label: str
    io_kib: float = math.nan   # the application's mean read size so far in the segment


class SessionRunner:
    """Plays a schedule on a device: fio in segments, one row per fio second."""

    def __init__(self, device: ReadaheadDevice, workdir: Path, segment_s: float = 2.0,
                 pi_file: Path | None = None):
        self.device, self.workdir, self.segment_s = device, Path(workdir), segment_s
        self.pi_file = pi_file
        self.rows: list[Row] = []
        self.n = 0
        self.io_kib = math.nan

    def publish(self, value: float, io_kib: float | None = None) -> None:
        """The latest application figures, for the stack's ``command`` collector: its
        bytes/s (the objective) and its mean read size (the workload's signature; kept
        from before when the second has none)."""
        if self.pi_file is None:
            return
        if io_kib is not None:
            self.io_kib = io_kib
        tmp = self.pi_file.with_suffix(".tmp")
        tmp.write_text(f"{PI_NAME} {value:.1f}\n{SIGNATURE_PI} {self.io_kib:.3f}\n")
        os.replace(tmp, self.pi_file)

    def segment(self, workload: str, seconds: float, stop=None, phase: int = -1,
                label: str = "") -> list[float]:
        """One fio run of ``seconds`` (it opens the device afresh): bytes/s per second."""
        self.n += 1
        ra = self.device.read_ahead()
        seg = self.workdir / f"seg{self.n}"
        seg.mkdir(parents=True, exist_ok=True)
        out = seg / "status"
        env = wd.fio_env(self.device.dev, None, seconds, "100%")
        cmd = [wd.fio_binary() or "fio", "--output-format=terse", "--status-interval=1",
               f"--output={out}", str(wd.resolve_workload(workload))]
        cgroups = self.device.cgroup_paths

        def enter() -> None:
            for path in cgroups:
                with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                    fh.write(str(os.getpid()))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                stderr=open(seg / "stderr", "w"), start_new_session=True,
                                preexec_fn=enter if cgroups else None)
        values: list[float] = []
        last = (0.0, 0.0)
        seen = 0
        deadline = time.monotonic() + seconds + 30
        try:
            while True:
                done = proc.poll() is not None
                if stop is not None and stop.is_set() or time.monotonic() > deadline:
                    break
                try:
                    text = out.read_text()
                except OSError:
                    text = ""
                lines = text.splitlines()
                # a line is complete once its newline is written: publish it at once (the
                # application reports each second when it ends; holding the last line
                # back until the next one came delayed every figure by a second)
                complete = lines if done or text.endswith("\n") else lines[:-1]
                for line in complete[seen:]:
                    s = parse_terse_status(line)
                    if s is None:
                        continue
                    kib, ms = s
                    if ms - last[1] >= 500:            # the closing summary repeats
                        rate = (kib - last[0]) * 1024 / ((ms - last[1]) / 1000)
                        values.append(rate)
                        io = terse_io_kib(line)
                        self.rows.append(Row(time.time(), rate, ra, phase, workload, label,
                                             math.nan if io is None else io))
                        self.publish(rate, io)
                        last = (kib, ms)
                seen = len(complete)
                if done:
                    break
                time.sleep(0.2)
        finally:
            kill_session(proc)
            shutil.rmtree(seg, ignore_errors=True)
        if proc.returncode not in (0, -9) and not values and not (stop and stop.is_set()):
            raise wd.WorkloadError(f"fio {workload} failed (exit {proc.returncode})")
        return values

    def play(self, schedule: list[Phase], label: str, stop=None, tick=None) -> None:
        """Every phase in turn, in segments; ``tick()`` after each segment."""
        for i, ph in enumerate(schedule):
            end = time.monotonic() + ph.seconds
            while not (stop is not None and stop.is_set()):
                left = end - time.monotonic()
                if left < 1:
                    break
                self.segment(ph.workload, min(self.segment_s, left), stop, i, label)
                if tick is not None:
                    tick()

    def series(self, label: str, workload: str | None = None) -> np.ndarray:
        return np.array([r.bytes_s for r in self.rows if r.label == label and
                         (workload is None or r.workload == workload)])


# -- static settings ----------------------------------------------------------------------

def _knobs(device: ReadaheadDevice, workdir: Path) -> ev.Knobs:
    from capes.common.deployment import load_deployment
    workdir.mkdir(parents=True, exist_ok=True)
    toml = workdir / "static.toml"
    toml.write_text(f"""tick_seconds = 1.0
[control.appliers.read_ahead_kb]
name = "file"
options = {{ path = "{device.ra_file}" }}
[parameters.read_ahead_kb]
min = 4
max = 4096
step = 4
default = {device.original}
""")
    return ev.Knobs(load_deployment(toml), ["read_ahead_kb"])


def in_segments(runner, workload: str, duration: float, label: str):
    """A ``capes evaluate`` measurement: ``workload`` for ``duration`` s in the runner's
    segments, as long as the live sessions' (each reopens the files), so that static and
    live figures carry the same per-open cost; the samples, one a second."""
    def measure(stop_) -> list[float]:
        out: list[float] = []
        end = time.monotonic() + duration
        while time.monotonic() < end - 0.5 and not (stop_ and stop_.is_set()):
            out += runner.segment(workload, min(runner.segment_s,
                                                max(1.0, end - time.monotonic())),
                                  stop_, label=label)
        return out
    return measure


def static_grid(runner: SessionRunner, workloads: list[str], values: list[int],
                reps: int, duration: float, seed: int, stop=None, log=print) -> dict:
    """``capes evaluate`` per workload: the original and every value, ``reps``
    randomised interleaved repetitions of ``duration`` s each, played in the runner's
    segments (the same reopening as a live session). Returns
    {workload: report}; each report's configs carry mean and CI (bytes/s)."""
    configs = [ev.ConfigSet.parse("original")] + [
        ev.ConfigSet.parse(f"read_ahead_kb={v}") for v in values
        if v != runner.device.original]
    return grid_per_workload(runner, _knobs(runner.device, runner.workdir), configs,
                             workloads, reps, duration, seed, stop, log,
                             label=lambda c: f"{c.label:<22}", digits=3)


def grid_per_workload(runner, knobs: ev.Knobs, configs: list, workloads: list[str],
                      reps: int, duration: float, seed: int, stop=None, log=print,
                      label=lambda c: c.label, digits: int = 3) -> dict:
    """``capes evaluate`` of ``configs`` on ``knobs`` for each workload in turn, measured
    in the runner's segments (:func:`in_segments`), a line logged per repetition
    (``label(config)``, MB/s with ``digits``); ``knobs`` closed at the end (their
    original values back). {workload: report}."""
    out = {}
    try:
        for w in workloads:
            measure = in_segments(runner, w, duration, f"grid:{w}")

            def on_rep(r, i, total, w=w):
                x = r.samples
                log(f"  grid {w} {i:>3}/{total} {label(configs[r.config])} "
                    f"{(np.mean(x) / 1e6 if x else math.nan):8.{digits}f} MB/s")
            out[w] = ev.evaluate(knobs, configs, measure, reps, seed, stop, on_rep=on_rep)
    finally:
        knobs.close()
    return out


def grid_means(report: dict, original: int) -> dict[int, tuple[float, float]]:
    """{knob value: (mean bytes/s, standard error)} from one evaluate report whose
    configurations set one value (the original's: ``original``)."""
    out = {}
    for c in report["configs"]:
        v = original if c["name"] == "original" else int(round(
            next(iter(c["values"].values()))))
        if c.get("n", 0) >= 2 and math.isfinite(c["mean"]):
            half = c["ci_high"] - c["mean"]
            se = half / _t95(c["n"] - 1)
        else:
            se = math.nan
        out[v] = (float(c["mean"]), float(se))
    return out


def _t95(df: int) -> float:
    from scipy import stats as st
    return float(st.t.ppf(0.975, max(1, df)))


# -- tuners through the stack -------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_config(workdir: Path, device: ReadaheadDevice, pi_file: Path,
                 template: Path = APP_CONFIG) -> Path:
    """The shipped config with its device and application-figure file replaced."""
    name = device.name
    text = (template.read_text().replace('"sda"', f'"{name}"')
            .replace("/sys/block/sda/", f"/sys/block/{name}/")
            .replace("blockdev.sda.", f"blockdev.{name}.")
            .replace("/run/capes/app-throughput", str(pi_file)))
    path = workdir / "stack.toml"
    path.write_text(text)
    return path


@dataclass
class TunerRun:
    name: str
    status: dict = field(default_factory=dict)
    exit_codes: dict = field(default_factory=dict)
    restored: bool | None = None
    applied: list[int] = field(default_factory=list)
    noticed: list[float] = field(default_factory=list)   # wall times of alarms/switches


TUNER_DEFAULTS = {
    # continuous local search (no commit): it tracks a changing workload on its own
    "hill": "hill:dwell=6,settle=3,budget=1000000,initial_step=0.3",
    # GP BO, search then commit (as in the converge test); it has no change detection
    "bo": "bo:dwell=6,settle=3,budget=120,startup=5",
}


def is_capes(name: str) -> bool:
    """``capes`` or a variant of it (``capes-poll``: the same engine with its own
    ``--set``s, run beside it in the same bench for an ablation)."""
    return name == "capes" or name.startswith("capes-")


def stack_sets(sub: Path, extra: list[str]) -> list[str]:
    """``--set``s that give one stack its own ports, keys and replay DB under ``sub``."""
    ports = {k: free_port() for k in ("ingest", "control", "grpc", "metrics")}
    return [f"daemon.ingest=tcp://127.0.0.1:{ports['ingest']}",
            f"daemon.control=tcp://127.0.0.1:{ports['control']}",
            f"daemon.grpc=127.0.0.1:{ports['grpc']}",
            f"daemon.metrics=127.0.0.1:{ports['metrics']}",
            f"monitor.daemon=tcp://127.0.0.1:{ports['ingest']}",
            f"control.daemon=tcp://127.0.0.1:{ports['control']}",
            f'keys.dir="{sub / "keys"}"', f'daemon.db="{sub / "replay.db"}"', *extra]


def stack_keys(keys: Path, deploy) -> None:
    """The stack's keys, each agent's bound to its node as ``capes keys generate`` makes
    them (and demo.py, real_cluster.py): the daemon takes a control agent's hello (the
    knob's value on the host) as its current value only from a node it vouches for, so
    with unbound keys it kept the config's ``default`` as current and the engine's first
    action wrote it to the device (read_ahead_kb 512 -> 128 at t = 4 s, --original 512)."""
    from capes.common.curve import bind, generate
    generate(keys, ["monitor", "control", "engine"])
    bind(keys, "monitor", [deploy.monitor.node])
    bind(keys, "control", [deploy.control.node])
    bind(keys, "engine", ["engine"])             # as `capes keys generate --client`


def start_tuner(stack: ProcessGroup, name: str, cfg: list[str], seed: int, sub: Path,
                status: Path, tuner_spec: str | None = None,
                engine_args: tuple[str, ...] = ()) -> None:
    """The DRL engine (``capes`` or a variant; ``engine_args`` added to its command
    line, e.g. ``--experience DB``) or a baseline tuner, as the stack's ``tuner``
    process."""
    if is_capes(name):
        stack.start("tuner", "drl-engine", *cfg, "--set", "keys.client=engine",
                    "--seed", str(seed), "--checkpoint-dir", str(sub / "checkpoints"),
                    "--status-file", str(status), "--log-every", "30", "--metrics", "",
                    *engine_args)
    else:
        spec = tuner_spec or TUNER_DEFAULTS.get(name, name)
        stack.start("tuner", *cfg, "--set", "keys.client=engine", "--tuner", spec,
                    "--seed", str(seed), module="capes.experiments.live_tuner")


def progress_tick(stack, name: str, status: Path, log, recent, knob, digits: int = 3,
                  best: bool = False, every_s: float = 30.0):
    """A live session's tick: the stack checked alive, and every ``every_s`` a line with
    the mean of ``recent()`` (the last 30 s, bytes/s), ``knob()`` and the tuner's ε
    (and best setting, ``best``) from its status file."""
    last = [time.monotonic()]
    t0 = time.monotonic()

    def tick() -> None:
        stack.check_alive()
        if time.monotonic() - last[0] >= every_s:
            last[0] = time.monotonic()
            x = np.asarray(recent(), dtype=float)
            st = _read_json(status)
            log(f"  [{name} {time.monotonic() - t0:5.0f} s] last 30 s "
                f"{np.mean(x) / 1e6 if x.size else math.nan:8.{digits}f} MB/s, "
                f"read_ahead_kb {knob()}"
                + (f", ε {st.get('epsilon', math.nan):.2f}" if st else "")
                + (f", best {st.get('best')}" if st and best else ""))
    return tick


def adopt_static(result: dict, st: dict, log=print) -> None:
    """The static grid's summary (:func:`static_summary`) into a bench's result: the best
    static setting, the original's, the per-phase best and the gap between the per-phase
    best and the best static setting (``per_phase_best_gap``); logged in a line."""
    result.update(best_static=st["best_static"], original=st["original"],
                  per_phase_best=st["per_phase_best"], static=st,
                  per_phase_best_gap=1.0 - st["best_static"]["relative"])
    log(f"best static read_ahead_kb {st['best_static']['setting']}: relative "
        f"{st['best_static']['relative']:.3f}; original {st['original']['relative']:.3f}; "
        f"per-phase best {st['per_workload_best_setting']}; gap "
        f"{result['per_phase_best_gap']:.3f}")


def score_line(name: str, sc: dict, restored, rows_lost=None) -> str:
    """One tuner's score (:func:`score`) in a line of the bench's log."""
    return (f"{name}: relative {sc['relative']:.3f}, vs best static "
            f"{sc['diff_vs_best_static']:+.3f} [{sc['ci95'][0]:+.3f}, "
            f"{sc['ci95'][1]:+.3f}], worst 10 s {sc['worst_10s_vs_original']:.2f}x "
            f"original, restored {restored}"
            + (f", rows lost {rows_lost}" if rows_lost is not None else ""))


def run_tuner(name: str, runner: SessionRunner, schedule: list[Phase], workdir: Path,
              seed: int, stop, exploration_ticks: int, extra_sets: tuple[str, ...] = (),
              tuner_spec: str | None = None, log=print,
              engine_args: tuple[str, ...] = ()) -> TunerRun:
    """Play ``schedule`` while ``name`` (``capes`` or a ``capes-`` variant, ``hill``,
    ``bo``) tunes through the stack; the stack is stopped at the end and the original
    checked. Its replay DB stays at ``workdir/stack-NAME/replay.db``."""
    import threading

    from capes.settings import load_settings
    sub = workdir / f"stack-{name}"
    sub.mkdir(parents=True, exist_ok=True)
    config = stack_config(sub, runner.device, runner.pi_file)
    keys = sub / "keys"
    sets = stack_sets(sub, [f'control.state_file="{sub / "control-{node}.json"}"',
                            f"engine.exploration_ticks={exploration_ticks}", *extra_sets])
    deploy = load_settings(config, sets)
    if deploy.keys.enabled:
        stack_keys(keys, deploy)
    cfg = ["--config", str(config)]
    for s in sets:
        cfg += ["--set", s]
    runner.io_kib = math.nan          # no signature before the session's first second:
    runner.publish(0.0)               # a stale one (the grid's last workload) made a
    status = sub / "engine.json"      # context of its own that the next phase "returned" to
    stack = ProcessGroup(sub)
    result = TunerRun(name)
    samples: list[int] = []
    halt = threading.Event()

    seen = [0]

    def sample() -> None:             # what the control agent applied, twice a second,
        while not halt.wait(0.5):     # and when the engine noticed a workload change
            try:
                samples.append(runner.device.read_ahead())
            except (OSError, ValueError):
                pass
            st = _read_json(status)
            count = (st.get("change_alarms") or 0) + (st.get("context_switches") or 0)
            if count > seen[0]:
                result.noticed += [time.time()] * (count - seen[0])
                seen[0] = count
    thread = threading.Thread(target=sample, daemon=True)
    try:
        stack.start("interface-daemon", "interface-daemon", *cfg, "--ready-file",
                    "daemon.ready")
        stack.start("monitor-agent", "monitor-agent", *cfg, "--set", "keys.client=monitor")
        stack.start("control-agent", "control-agent", *cfg, "--set", "keys.client=control")
        start_tuner(stack, name, cfg, seed, sub, status, tuner_spec, engine_args)
        thread.start()
        tick = progress_tick(stack, name, status, log, lambda: runner.series(name)[-30:],
                             runner.device.read_ahead, digits=3, best=True)
        runner.play(schedule, name, stop, tick)
        result.status = _read_json(status)
    finally:
        halt.set()
        if thread.is_alive():
            thread.join(2)
        result.exit_codes = stack.stop(first=("tuner",))
        result.applied = samples
        try:
            result.restored = runner.device.read_ahead() == runner.device.original
        except OSError:
            result.restored = None
        if not result.restored:                     # never leave it changed
            runner.device.set_read_ahead(runner.device.original)
    return result


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


# -- statistics ---------------------------------------------------------------------------

def worst_window(x, width: int = 10) -> float:
    x = np.asarray(x, dtype=float)
    if x.size < width:
        return math.nan
    return float(np.convolve(x, np.ones(width) / width, mode="valid").min())


def _batch_ci(x, batch_s: int = 10) -> list[float] | None:
    """95 % t-interval of the mean of ``batch_s``-second batch means (None: < 3 batches)."""
    nb = np.size(x) // batch_s
    if nb < 3:
        return None
    c = mean_ci(np.asarray(x[:nb * batch_s], float).reshape(nb, batch_s).mean(1))
    return [float(c.low), float(c.high)]


def seconds_to(x, level: float, width: int = 5) -> int | None:
    """Seconds from a phase's start until its ``width``-second mean first reaches
    ``level`` (None: never): how fast a tuner got a workload back to its best."""
    x = np.asarray(x, dtype=float)
    if x.size < width:
        return None
    hit = np.flatnonzero(np.convolve(x, np.ones(width) / width, mode="valid") >= level)
    return int(hit[0]) if hit.size else None


def switches_noticed(rows: list[Row], noticed: list[float], window: float = 60) -> dict:
    """Workload switches (a phase's first second, after the first phase) the engine
    noticed within ``window`` s (a change alarm or a context switch), and how many
    notices came outside those windows (false, in the phases' steady parts)."""
    starts = [min(r.t for r in rows if r.phase == i) - 1
              for i in sorted({r.phase for r in rows if r.phase > 0})]
    found = [any(s <= t < s + window for t in noticed) for s in starts]
    begin = min(r.t for r in rows) - 1          # the first workload's context is made here
    false = sum(not any(s <= t < s + window for s in [begin, *starts]) for t in noticed)
    return {"switches": len(starts), "found": int(sum(found)), "false": false}


def normalised(rows: list[Row], best: dict[str, float]) -> np.ndarray:
    return np.array([r.bytes_s / best[r.workload] for r in rows])


def score(rows: list[Row], schedule: list[Phase], best: dict[str, float],
          static_rel: float, static_se: float, original: dict[str, float],
          batch_s: int = 10) -> dict:
    """A session against the best static setting: per phase and overall.

    ``relative`` = the mean over phases (each weighted by its seconds) of the phase's
    mean throughput ÷ its workload's best static throughput. Its standard error comes
    from ``batch_s``-second batch means of the normalised series (the phases' different
    levels are in it, so it is on the wide side); the difference from the best static
    setting's relative adds that setting's own standard error from the grid."""
    per_phase = []
    for i, ph in enumerate(schedule):
        x = np.array([r.bytes_s for r in rows if r.phase == i])
        if not x.size:
            continue
        last = x[-120:]
        visit = sum(p.workload == ph.workload for p in schedule[:i + 1])
        per_phase.append({"phase": i, "workload": ph.workload, "visit": visit,
                          "seconds_to_90": seconds_to(x, 0.9 * best[ph.workload]),
                          "seconds": int(x.size),
                          "mean": float(x.mean()), "ci95": _batch_ci(x, batch_s),
                          "last_120s_mean": float(last.mean()),
                          "last_120s_ci95": _batch_ci(last, batch_s),
                          "relative": float(x.mean() / best[ph.workload]),
                          "vs_original": float(x.mean() / original[ph.workload]),
                          "last_120s_relative": float(x[-120:].mean() / best[ph.workload]),
                          "worst_10s_vs_original": worst_window(x) / original[ph.workload]})
    if not per_phase:
        return {}
    w = np.array([p["seconds"] for p in per_phase], float)
    rel = float(np.average([p["relative"] for p in per_phase], weights=w))
    z = normalised([r for r in rows if r.phase >= 0], best)
    nb = z.size // batch_s
    se = (float(np.std(z[:nb * batch_s].reshape(nb, batch_s).mean(1), ddof=1) / math.sqrt(nb))
          if nb >= 3 else math.nan)
    diff = rel - static_rel
    half = 1.96 * math.sqrt(se ** 2 + (static_se if math.isfinite(static_se) else 0) ** 2)
    returns = [p["seconds_to_90"] for p in per_phase if p["visit"] > 1]
    fast = sum(t is not None and t <= 15 for t in returns)
    return {"relative": rel, "se": se, "diff_vs_best_static": diff,
            "ci95": [diff - half, diff + half],
            # issue 25: a return reaches 90 % of its workload's best static within 15 s
            "recall_15s": {"returns": len(returns), "within_15s": fast,
                           "share": fast / len(returns) if returns else None,
                           "seconds_to_90": returns},
            "worst_10s_vs_original": min(p["worst_10s_vs_original"] for p in per_phase),
            "phases": per_phase}


def static_summary(grids: dict[str, dict], original: int, schedule: list[Phase]) -> dict:
    """From the per-workload grids: each workload's best value and mean, the best single
    static value over the schedule (highest ``relative``), the original's."""
    return summarise_means({w: grid_means(rep, original) for w, rep in grids.items()},
                           original, schedule)


def summarise_means(means: dict[str, dict], original, schedule: list[Phase]) -> dict:
    """:func:`static_summary` from ``{workload: {setting: (mean, standard error)}}``."""
    best = {w: max(m.values(), key=lambda t: t[0])[0] for w, m in means.items()}
    best_value = {w: max(m, key=lambda v: m[v][0]) for w, m in means.items()}
    secs = {w: sum(p.seconds for p in schedule if p.workload == w) for w in means}
    total = sum(secs.values())
    common = sorted(set.intersection(*(set(m) for m in means.values())))

    def rel(v):
        r = sum(secs[w] * means[w][v][0] / best[w] for w in means) / total
        se = math.sqrt(sum((secs[w] / total * means[w][v][1] / best[w]) ** 2
                           for w in means if math.isfinite(means[w][v][1])))
        return r, se
    table = {v: rel(v) for v in common}
    v_star = max(table, key=lambda v: table[v][0])
    return {"means": {w: {str(v): m[v][0] for v in sorted(m)} for w, m in means.items()},
            "best": best, "per_workload_best_setting": best_value,
            "relative_by_setting": {str(v): table[v][0] for v in common},
            "best_static": {"setting": v_star, "relative": table[v_star][0],
                            "se": table[v_star][1]},
            "original": {"setting": original, "relative": table[original][0],
                         "se": table[original][1],
                         "means": {w: means[w][original][0] for w in means}},
            "per_phase_best": {"settings": best_value, "relative": 1.0}}


# -- the bench ----------------------------------------------------------------------------

@dataclass
class BenchOptions:
    device: DeviceSpec
    schedule: list[Phase]
    tuners: list[str]                   # of capes, hill, bo and the variants' names
    grid: list[int]                     # read_ahead_kb values for the static grid
    grid_reps: int = 3
    grid_duration: float = 10.0
    segment_s: float = 2.0
    exploration_ticks: int = 240
    seed: int = 1
    extra_sets: tuple[str, ...] = ()
    # a CAPES variant's own settings on top of extra_sets: {"capes-poll": ("engine.…=…",)}
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)


def parse_variants(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """``--variant poll:engine.tick_poll_s=0.1[;key=value…]`` → ``{"capes-poll": (…)}``."""
    out: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        label, sep, sets = spec.partition(":")
        if not sep or not label or not sets:
            raise ValueError(f"--variant {spec!r}: expected NAME:key=value[;key=value]")
        out[f"capes-{label}"] = tuple(x for x in sets.split(";") if x)
    return out


def run_bench(opts: BenchOptions, stop, log=print) -> dict:
    """Set up the device, measure the static grid, run every tuner over the schedule,
    score them; the device and everything else is removed on every exit path."""
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="capes-real-"))
    result: dict = {"device": opts.device.describe(), "seed": opts.seed,
                    "schedule": [[p.workload, p.seconds] for p in opts.schedule],
                    "segment_s": opts.segment_s, "grid": opts.grid,
                    "grid_reps": opts.grid_reps, "grid_duration_s": opts.grid_duration,
                    "exploration_ticks": opts.exploration_ticks, "tuners": {}}
    try:
        with ReadaheadDevice(opts.device, work) as dev:
            result["kernel_read_ahead_kb"] = dev.kernel_read_ahead
            result["original_read_ahead_kb"] = dev.original
            runner = SessionRunner(dev, work / "fio", opts.segment_s, work / "app-throughput")
            workloads = list(dict.fromkeys(p.workload for p in opts.schedule))
            log(f"== static grid: {workloads} x read_ahead_kb {opts.grid}, "
                f"{opts.grid_reps} x {opts.grid_duration:g} s each")
            grids = static_grid(runner, workloads, opts.grid, opts.grid_reps,
                                opts.grid_duration, opts.seed, stop, log)
            result["grid_reports"] = grids
            if stop.is_set():
                return result
            st = static_summary(grids, dev.original, opts.schedule)
            adopt_static(result, st, log)
            for name in opts.tuners:
                if stop.is_set():
                    break
                log(f"== {name}, {sum(p.seconds for p in opts.schedule):g} s")
                run = run_tuner(name, runner, opts.schedule, work, opts.seed, stop,
                                opts.exploration_ticks,
                                (*opts.extra_sets, *opts.variants.get(name, ())), log=log)
                rows = [r for r in runner.rows if r.label == name]
                sc = score(rows, opts.schedule, st["best"],
                           st["best_static"]["relative"], st["best_static"]["se"],
                           st["original"]["means"])
                applied = run.applied
                sc.update(restored=run.restored, exit_codes=run.exit_codes,
                          applied_min=min(applied, default=None),
                          applied_max=max(applied, default=None),
                          outside_safe_range=sum(v not in LADDER for v in applied
                                                 if v != dev.original),
                          best_known=run.status.get("best"),
                          noticed=switches_noticed(rows, run.noticed) if rows else None,
                          series=[[r.t, r.bytes_s, r.read_ahead_kb, r.phase, r.io_kib]
                                  for r in rows])
                result["tuners"][name] = sc
                if sc:
                    log(score_line(name, sc, run.restored))
    finally:
        _keep_stacks(work)
        shutil.rmtree(work, ignore_errors=True)
        result["wall_s"] = time.time() - t0
    return result


def _keep_stacks(work: Path) -> None:
    """``CAPES_REAL_KEEP=DIR``: copy each tuner's replay DB and process logs there
    before the work directory goes (what the engine saw, tick by tick, for a replay of
    its detector on the live stream)."""
    keep = os.environ.get("CAPES_REAL_KEEP")
    if not keep:
        return
    for sub in work.glob("stack-*"):
        dest = Path(keep) / sub.name
        dest.mkdir(parents=True, exist_ok=True)
        for f in [*sub.glob("*.db*"), sub / "engine.json", *sub.glob("logs/*.log")]:
            if f.is_file():
                shutil.copy2(f, dest / f.name)


def report_table(result: dict) -> str:
    """The real table: original, best static, per-phase best, and every tuner."""
    if "best_static" not in result:
        return "(no result)"
    bs = result["best_static"]
    lines = ["| policy | setting | relative (each workload ÷ its best static) | "
             "diff vs best static [95 % CI] | worst 10 s ÷ original |",
             "|---|---|---:|---:|---:|",
             f"| original | {result['original']['setting']} | "
             f"{result['original']['relative']:.3f} | "
             f"{result['original']['relative'] - bs['relative']:+.3f} | |",
             f"| best static | {bs['setting']} | {bs['relative']:.3f} | 0 | |",
             f"| per-phase best | {result['per_phase_best']['settings']} | 1.000 | "
             f"{1 - bs['relative']:+.3f} | |"]
    for name, sc in result["tuners"].items():
        if not sc:
            continue
        lines.append(f"| {name} (live) | {sc['applied_min']}..{sc['applied_max']} | "
                     f"{sc['relative']:.3f} | {sc['diff_vs_best_static']:+.3f} "
                     f"[{sc['ci95'][0]:+.3f}, {sc['ci95'][1]:+.3f}] | "
                     f"{sc['worst_10s_vs_original']:.2f} |")
    lines += ["", "Per phase (mean MB/s; relative to the workload's best static; the last "
              "120 s of the phase):", "",
              "| policy | " + " | ".join(f"{i}: {w}" for i, (w, _) in
                                       enumerate(result["schedule"])) + " |",
              "|---|" + "---:|" * len(result["schedule"])]
    for name, sc in result["tuners"].items():
        if sc:
            lines.append(f"| {name} | " + " | ".join(
                f"{p['mean'] / 1e6:.2f} ({p['relative']:.2f}; {p['last_120s_relative']:.2f})"
                for p in sc["phases"]) + " |")
    lines += ["", "Returns (issue 25: a workload's later phases at 90 % of its best static "
              "within 15 s) and workload switches noticed within 60 s (alarm or context "
              "switch; notices outside those windows):", ""]
    for name, sc in result["tuners"].items():
        rc, nt = (sc or {}).get("recall_15s"), (sc or {}).get("noticed")
        if rc:
            lines.append(f"- {name}: {rc['within_15s']}/{rc['returns']} returns within 15 s "
                         f"(seconds to 90 %: {rc['seconds_to_90']})"
                         + (f"; switches noticed {nt['found']}/{nt['switches']}, "
                            f"{nt['false']} other notices" if nt and is_capes(name) else ""))
    lines += ["", "Static grid (mean MB/s per workload; relative over the schedule):", ""]
    return "\n".join(lines + static_grid_table(result["static"], digits=3))


def static_grid_table(st: dict, digits: int) -> list[str]:
    """A static summary's grid as a Markdown table: per value, each workload's mean
    MB/s (``digits``) and the value's relative over the schedule."""
    lines = ["| read_ahead_kb | " + " | ".join(st["means"]) + " | relative |",
             "|---:|" + "---:|" * (len(st["means"]) + 1)]
    for v, rel in st["relative_by_setting"].items():
        lines.append(f"| {v} | " + " | ".join(f"{st['means'][w][v] / 1e6:.{digits}f}"
                                                for w in st["means"]) + f" | {rel:.3f} |")
    return lines


def run_and_report(opts: BenchOptions, name: str, table, json_path: str | None) -> int:
    """The benches' main: run, print ``table(result)``, write the JSON; 130 when
    interrupted (everything is cleaned up either way)."""
    import signal

    from capes.common.atomic import write_json
    from capes.common.stop_signal import StopSignal

    class Stop(StopSignal):
        SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    print(f"command: {' '.join(sys.argv)}")
    print(f"device: {opts.device.describe()}; schedule "
          f"{[(p.workload, p.seconds) for p in opts.schedule]}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    with Stop() as stop:
        try:
            result = run_bench(opts, stop, log=lambda m: print(m, flush=True))
        except (RealTargetError, OSError) as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 1
    result["command"] = sys.argv
    result["load_average_end"] = os.getloadavg()[0]
    if "static" in result:
        print()
        print(table(result))
    print(f"\ntotal {result['wall_s']:.0f} s; load average at the end "
          f"{result['load_average_end']:.2f}")
    if json_path:
        write_json(json_path, ev.jsonable(result))
    return 130 if stop.signum is not None else 0


# -- recorded traces (the change detector's real test) ------------------------------------

def detector_traces(result: dict, source: str) -> list[dict]:
    """A bench result's per-second application throughput as replayable traces: each
    ``{name, p (bytes/s), key (read_ahead_kb in effect), phase, workloads, stationary}``.
    The grid's repetitions (one workload, the setting changing every repetition) and
    every tuner session; a session with several phases has workload switches where
    ``phase`` changes. Rounded to whole KiB/s: small enough for tests/fixtures."""
    out = []
    for w, rep in (result.get("grid_reports") or {}).items():
        p, key = [], []
        for run in rep.get("runs", []):
            v = run["values"]["read_ahead_kb"]
            p += run["samples"]
            key += [int(round(v))] * len(run["samples"])
        if p:
            out.append({"name": f"{source}:grid:{w}", "p": p, "key": key,
                        "phase": [0] * len(p), "workloads": [w], "stationary": True})
    sched = [w for w, _ in result.get("schedule", [])]
    for name, sc in (result.get("tuners") or {}).items():
        rows = sc.get("series") or []
        if not rows:
            continue
        phases = [int(r[3]) for r in rows]
        out.append({"name": f"{source}:{name}", "p": [r[1] for r in rows],
                    "key": [int(r[2]) for r in rows], "phase": phases,
                    "workloads": [sched[i] for i in sorted(set(phases))],
                    "stationary": len(set(sched[i] for i in set(phases))) == 1})
        if all(len(r) > 4 for r in rows):      # the workload's signature (app_io_kib)
            out[-1]["sig"] = [None if r[4] is None or not math.isfinite(r[4])
                              else round(r[4], 2) for r in rows]
    for t in out:
        t["p"] = [int(round(x / 1024)) for x in t["p"]]
    return out


def replay_detector(trace: dict, config=None, window: int = 60, held: int = 3,
                    fresh_only: bool = False) -> dict:
    """Replay one trace through the engine's change detector
    (:class:`drl_engine.change_detection.SettingResidualDetector`, keyed by the
    read_ahead_kb in effect), as the engine's guide feeds it: only seconds whose setting
    held over the ``held`` seconds before. Returns the alarms, the switches found within
    ``window`` seconds, and the false alarms (any alarm not within ``window`` s after a
    switch) over the trace's hours outside those windows. ``fresh_only``: a second equal
    to the one before is not heard (``engine.detect_fresh_only``)."""
    from drl_engine.change_detection import SettingResidualDetector
    det = SettingResidualDetector(config)
    p, key = trace["p"], trace["key"]
    alarms = [i for i in range(len(p))
              if i >= held and all(key[j] == key[i] for j in range(i - held, i))
              and not (fresh_only and p[i] == p[i - 1])
              and det.update(float(p[i]), key[i])]
    ph = trace["phase"]
    switches = [i for i in range(1, len(ph)) if ph[i] != ph[i - 1]]
    found = [any(s <= a < s + window for a in alarms) for s in switches]
    near = [a for a in alarms if any(s <= a < s + window for s in switches)]
    quiet_s = len(ph) - sum(min(window, len(ph) - s) for s in switches)
    return {"alarms": alarms, "switches": switches, "found": found,
            "false": len(alarms) - len(near), "quiet_hours": quiet_s / 3600}


def as_ticks(series: list, offset: float, tick_s: float = 1.0) -> dict:
    """A session's recorded seconds (a bench JSON's ``series``: publication time, bytes/s,
    read_ahead_kb, phase, ...) as a monitoring agent reading the published figure every
    ``tick_s`` from ``offset`` s after the first one sees them: the figure last
    published before each tick, so a figure not yet renewed is read again and one
    renewed twice within a tick is missed. A trace for :func:`replay_detector`."""
    rows = [r for r in series if math.isfinite(r[1])]
    t = np.array([r[0] for r in rows])
    idx = np.searchsorted(t, np.arange(t[0] + offset, t[-1], tick_s), side="right") - 1
    return {"p": [rows[i][1] for i in idx], "key": [int(rows[i][2]) for i in idx],
            "phase": [int(rows[i][3]) for i in idx]}


def live_alarms(result: dict, offsets: int = 10) -> dict:
    """Per tuner session of a bench result: the detector's alarms replayed on its
    recorded seconds (each once, as ``traces`` does) and on the same seconds read as a
    1 s monitor reads them (mean over ``offsets`` phases of its clock), without and with
    ``fresh_only``; each with the switches found (within 60 s) and the false alarms."""
    out = {}
    for name, sc in (result.get("tuners") or {}).items():
        rows = [r for r in sc.get("series") or [] if math.isfinite(r[1])]
        if len(rows) < 20:
            continue
        seconds = {"p": [r[1] for r in rows], "key": [int(r[2]) for r in rows],
                   "phase": [int(r[3]) for r in rows]}
        one = replay_detector(seconds)
        entry = {"seconds": {"found": sum(one["found"]), "false": one["false"],
                             "switches": len(one["switches"])}}
        for label, fresh in (("ticks", False), ("ticks_fresh_only", True)):
            runs = [replay_detector(as_ticks(rows, k / offsets), fresh_only=fresh)
                    for k in range(offsets)]
            entry[label] = {"found": float(np.mean([sum(r["found"]) for r in runs])),
                            "false": float(np.mean([r["false"] for r in runs])),
                            "repeats": float(np.mean([np.mean(np.diff(as_ticks(
                                rows, k / offsets)["p"]) == 0) for k in range(offsets)]))}
        out[name] = entry
    return out


def replay_contexts(trace: dict, window: int = 60) -> dict | None:
    """Replay a trace's workload signature (``sig``: the application's mean read size,
    recorded since the contexts used it) through the engine's workload contexts
    (:class:`drl_engine.context.SignatureClusters`, the shipped config's settings), as
    :func:`replay_detector` does the change detector: the context switches (after the
    first context), the workload switches found within ``window`` s, the false ones.
    None for a trace recorded without a signature."""
    from capes.settings import load_settings
    from drl_engine.context import SignatureClusters
    sig = trace.get("sig")
    if not sig:
        return None
    e = load_settings(APP_CONFIG).engine
    clusters = SignatureClusters(e.context_window, e.context_threshold, e.context_floor,
                                 e.context_confirm, e.context_floor_strict)
    moves = [i for i, v in enumerate(sig)
             if clusters.update(np.array([math.nan if v is None else float(v)])) is not None]
    moves = moves[1:]                         # the first one makes the first context
    ph = trace["phase"]
    switches = [i for i in range(1, len(ph)) if ph[i] != ph[i - 1]]
    found = [any(s <= a < s + window for a in moves) for s in switches]
    false = sum(not any(s <= a < s + window for s in switches) for a in moves)
    return {"alarms": moves, "switches": switches, "found": found, "false": false,
            "contexts": clusters.count}


__all__ = ["DeviceSpec", "ReadaheadDevice", "add_seekdisk_args", "seekdisk_spec", "Phase",
           "alternating_schedule",
           "SessionRunner", "static_grid", "grid_per_workload", "grid_means",
           "static_grid_table", "static_summary", "run_tuner", "score",
           "missing_requirements", "RealTargetError", "LADDER", "TUNER_DEFAULTS",
           "BenchOptions", "run_bench", "report_table", "run_and_report", "detector_traces",
           "replay_detector", "replay_contexts", "as_ticks", "live_alarms"]


def main(argv: list[str] | None = None) -> int:
    """``python -m capes.experiments.real_readahead traces OUT.json BENCH.json...``:
    the detector traces of bench results, for tests/fixtures; ``live BENCH.json...``:
    :func:`live_alarms` of each (why live alarms differ from the replay)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "live":
        for path in argv[1:]:
            for name, entry in live_alarms(json.loads(Path(path).read_text())).items():
                print(f"{Path(path).stem} {name}: " + "; ".join(
                    f"{k} " + ", ".join(f"{f} {v:.2f}" if isinstance(v, float) else f"{f} {v}"
                                        for f, v in e.items()) for k, e in entry.items()))
        return 0
    if len(argv) < 3 or argv[0] != "traces":
        print("usage: python -m capes.experiments.real_readahead traces OUT.json "
              "BENCH.json...", file=sys.stderr)
        return 2
    traces = []
    for path in argv[2:]:
        traces += detector_traces(json.loads(Path(path).read_text()), Path(path).stem)
    Path(argv[1]).write_text(json.dumps({"traces": traces}, separators=(",", ":")))
    print(f"{len(traces)} traces, {sum(len(t['p']) for t in traces)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
