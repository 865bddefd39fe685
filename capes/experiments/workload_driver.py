"""Play fio workloads: one run at a time, or a schedule with switches.

The job files live in ``configs/workloads/`` (``seqread``, ``randread``, ``mmaprand``
and more: ``available_workloads()``) and read their target and runtime from the environment
(``CAPES_TARGET``, ``CAPES_DIR``, ``CAPES_SIZE``, ``CAPES_RUNTIME``); ``fio_env`` fills
all of them, since fio refuses a job that names an unset variable.

``FioRun`` starts fio as a child process in its own session (optionally inside a cgroup,
e.g. one with a blkio throttle), stops it by its PID (SIGINT, so fio writes its results,
then SIGKILL to its process group if it does not stop), and reads back fio's JSON
summary and its per-second bandwidth logs (``--write_bw_log`` with
``--log_avg_msec=1000``: one line per second per job, ``msec, KiB/s, direction, ...``).

``play`` runs a schedule such as ``seqread:60,randread:60`` (workload:seconds, repeated
``repeat`` times or until stopped), calling ``on_switch`` at each workload change, e.g.
to tell the interface daemon (``capes workload-changed``) so the engine raises ε. Each
item runs as fio processes of at most ``segment`` seconds back to back (the command's
``--segment``, 5 s by default): a readahead change reaches a reader only when it opens
the device, so one fio reading for ten minutes would never see what the tuner set.

    python -m capes.experiments.workload_driver --schedule seqread:60,randread:60 \
        --target /dev/loop0 --repeat 0 --notify --config deploy.toml
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from capes.common.shipped_configs import workload_dir

log = logging.getLogger(__name__)


def missing_on_host(root_for: str, tools=("fio",)) -> str | None:
    """Why a real-target run cannot start on this host: not root (``root_for`` says what
    needs it) or a tool not installed; None when it can."""
    if os.geteuid() != 0:
        return f"needs root ({root_for})"
    return next((f"{t} is not installed" for t in tools if shutil.which(t) is None), None)


WORKLOAD_DIR = workload_dir()
DIRECTIONS = {"read": (0,), "write": (1,), "trim": (2,), "total": (0, 1, 2)}


class WorkloadError(RuntimeError):
    """fio is missing, a job file does not exist, or fio failed."""


def fio_binary() -> str | None:
    return shutil.which("fio")


def available_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.fio"))


def resolve_workload(name_or_path: str | Path) -> Path:
    """A job file: an existing path, or the name of one in ``configs/workloads``."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    q = WORKLOAD_DIR / f"{name_or_path}.fio"
    if q.is_file():
        return q
    raise WorkloadError(f"workload {name_or_path!r}: no such job file (built in: "
                        f"{', '.join(available_workloads())})")


def is_block_device(path: str | None) -> bool:
    try:
        return path is not None and stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


def fio_env(target: str | None = None, directory: str | None = None,
            runtime: float = 60, size: str | None = None,
            base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a job file; every CAPES_* variable is set (fio refuses an
    unset one). ``size`` defaults to the whole device for a block device, else 1 GiB."""
    env = dict(os.environ if base is None else base)
    if size is None:
        size = "100%" if is_block_device(target) else "1g"
    env.update(CAPES_TARGET=str(target or os.path.join(directory or ".", "capes-fio.dat")),
               CAPES_DIR=str(directory or (os.path.dirname(target) if target else ".")),
               CAPES_SIZE=str(size), CAPES_RUNTIME=str(max(1, int(round(runtime)))))
    return env


def parse_bw_log(text: str, directions=(0, 1, 2), period_ms: int = 1000
                 ) -> dict[int, float]:
    """One fio bandwidth log (``msec, KiB/s, direction, bs, offset[, prio]``) as
    {second index (1 = the first second): bytes/s}, directions summed."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            t_ms, kib_s, ddir = int(parts[0]), float(parts[1]), int(parts[2])
        except ValueError:
            continue
        if ddir not in directions:
            continue
        sec = max(1, int(round(t_ms / period_ms)))
        out[sec] = out.get(sec, 0.0) + kib_s * 1024.0
    return out


def per_second_bandwidth(paths, direction: str = "total") -> np.ndarray:
    """Bytes per second, second by second, summed over the jobs whose logs are
    ``paths``; only seconds every log covers (the last, partial one is often missing
    from some of them)."""
    dirs = DIRECTIONS[direction]
    logs = [parse_bw_log(Path(p).read_text(), dirs) for p in paths]
    logs = [lg for lg in logs if lg]
    if not logs:
        return np.zeros(0)
    last = min(max(lg) for lg in logs)
    return np.array([sum(lg.get(s, 0.0) for lg in logs) for s in range(1, last + 1)])


@dataclass
class FioResult:
    returncode: int
    bandwidth: np.ndarray          # bytes/s, one value per second
    summary: dict = field(default_factory=dict)   # fio's JSON output ({} if unreadable)
    stopped: bool = False          # stopped by us before its runtime ended
    stderr: str = ""

    def total_bw(self, direction: str = "total") -> float:
        """fio's own whole-run bandwidth in bytes/s (sum over jobs)."""
        keys = ("read", "write", "trim") if direction == "total" else (direction,)
        return float(sum(j.get(k, {}).get("bw_bytes", 0) for j in
                         self.summary.get("jobs", []) for k in keys))


class FioRun:
    """One fio process. ``start()``, then ``wait(stop)`` or ``stop()``; ``result()``."""

    def __init__(self, jobfile: str | Path, env: dict[str, str], workdir: str | Path,
                 direction: str = "total", cgroup: str | None = None,
                 extra_args: list[str] | None = None):
        if fio_binary() is None:
            raise WorkloadError("fio is not installed (apt-get install fio)")
        self.jobfile = Path(resolve_workload(jobfile))
        self.env = env
        self.workdir = Path(workdir)
        self.direction = direction
        self.cgroup = cgroup
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.stopped = False
        self.prefix = self.workdir / "fio"
        self.json_path = self.workdir / "fio.json"
        self.err_path = self.workdir / "fio.stderr"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        return [fio_binary() or "fio", "--output-format=json", f"--output={self.json_path}",
                f"--write_bw_log={self.prefix}", "--log_avg_msec=1000",
                *self.extra_args, str(self.jobfile)]

    def _enter_cgroup(self) -> None:      # runs in the child, before exec
        with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))

    def start(self) -> "FioRun":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            self.command(), env=self.env, stdout=subprocess.DEVNULL, stderr=self._err,
            start_new_session=True, preexec_fn=self._enter_cgroup if self.cgroup else None)
        log.debug("fio %s started, pid %d", self.jobfile.name, self.proc.pid)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, stop=None, timeout: float | None = None) -> int:
        """Wait for fio to finish; a set ``stop`` (StopSignal) or the timeout stops it."""
        assert self.proc is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.proc.poll() is None:
            if stop is not None and stop.is_set():
                self.stop()
                break
            if deadline is not None and time.monotonic() > deadline:
                log.warning("fio %s ran past its time limit: stopping it", self.jobfile.name)
                self.stop()
                break
            if stop is not None:
                stop.wait(0.2)
            else:
                time.sleep(0.2)
        return self.proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        """SIGINT to fio's PID (it ends its jobs and writes its output), then SIGKILL
        to its process group (fio and its job processes) if it is still there."""
        if not self.running():
            return
        self.stopped = True
        try:
            os.kill(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        except ProcessLookupError:
            pass

    def result(self) -> FioResult:
        assert self.proc is not None
        rc = self.proc.wait()
        if not self._err.closed:
            self._err.close()
        stderr = self.err_path.read_text(errors="replace") if self.err_path.exists() else ""
        try:
            summary = json.loads(_strip_to_json(self.json_path.read_text()))
        except (OSError, ValueError):
            summary = {}
        logs = sorted(self.workdir.glob("fio_bw.*.log"))
        bw = per_second_bandwidth(logs, self.direction)
        if rc != 0 and not self.stopped:
            raise WorkloadError(f"fio {self.jobfile.name} failed (exit {rc}): "
                                f"{stderr.strip()[-600:]}")
        return FioResult(rc, bw, summary, self.stopped, stderr)


def _strip_to_json(text: str) -> str:
    """fio may print notes before its JSON document."""
    i = text.find("{")
    return text[i:] if i >= 0 else text


def run_fio(jobfile, env: dict[str, str], direction: str = "total", stop=None,
            cgroup: str | None = None, workdir: str | Path | None = None,
            timeout_extra_s: float = 60.0) -> FioResult:
    """Run one job file to its end (or until ``stop``) and return its result. Its logs
    go to ``workdir`` (a temporary directory, removed afterwards, when None)."""
    runtime = float(env.get("CAPES_RUNTIME", "60"))
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="capes-fio-")
        workdir = tmp.name
    try:
        run = FioRun(jobfile, env, workdir, direction, cgroup).start()
        try:
            run.wait(stop, timeout=runtime + timeout_extra_s)
        finally:
            run.stop()
        return run.result()
    finally:
        if tmp is not None:
            tmp.cleanup()


class ThrottledCgroup:
    """A cgroup whose members' I/O on one block device is capped at ``read_iops`` /
    ``write_iops`` (0: no cap) and reads at ``read_bps`` bytes/s (0: no cap), to make a fast device (a loop device over a sparse file,
    tmpfs, an SSD) behave like a slow, IOPS-capped one (a disk, a cloud volume): where
    each request costs a fixed time, the request size, and so readahead, matters. cgroup
    v1 ``blkio.throttle.*_iops_device`` or v2 ``io.max``; root only. Pass ``path`` as
    ``FioRun``'s ``cgroup``; ``remove()`` once no process is left in it."""

    V1 = "/sys/fs/cgroup/blkio"
    V2 = "/sys/fs/cgroup"

    def __init__(self, device: str, read_iops: int = 0, write_iops: int = 0,
                 name: str | None = None, read_bps: int = 0):
        st = os.stat(device)
        if not stat.S_ISBLK(st.st_mode):
            raise WorkloadError(f"{device}: not a block device")
        majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        name = name or f"capes-throttle-{os.getpid()}-{os.minor(st.st_rdev)}"
        self.path = None
        if os.path.isfile(os.path.join(self.V1, "blkio.throttle.read_iops_device")):
            self.path = os.path.join(self.V1, name)
            os.makedirs(self.path, exist_ok=True)
            for key, val in (("read_iops", read_iops), ("write_iops", write_iops),
                             ("read_bps", read_bps)):
                if val:
                    with open(os.path.join(self.path, f"blkio.throttle.{key}_device"),
                              "w") as fh:
                        fh.write(f"{majmin} {int(val)}\n")
        elif "io" in _read_words(os.path.join(self.V2, "cgroup.subtree_control")):
            self.path = os.path.join(self.V2, name)
            os.makedirs(self.path, exist_ok=True)
            limits = " ".join(f"{k}={int(v)}" for k, v in (("riops", read_iops),
                                                           ("wiops", write_iops),
                                                           ("rbps", read_bps)) if v)
            with open(os.path.join(self.path, "io.max"), "w") as fh:
                fh.write(f"{majmin} {limits}\n")
        else:
            raise WorkloadError("no blkio (cgroup v1) or io (cgroup v2) controller to "
                                "throttle with")

    def remove(self) -> None:
        if self.path:
            for _ in range(50):           # the last member may still be exiting
                try:
                    os.rmdir(self.path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            self.path = None

    def __enter__(self) -> "ThrottledCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _read_words(path: str) -> list[str]:
    try:
        with open(path) as fh:
            return fh.read().split()
    except OSError:
        return []


def parse_schedule(text: str) -> list[tuple[str, float]]:
    """``seqread:60,randread:60`` -> [("seqread", 60.0), ("randread", 60.0)]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, secs = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"schedule item {item!r}: expected WORKLOAD:SECONDS")
        try:
            seconds = float(secs)
        except ValueError:
            raise ValueError(f"schedule item {item!r}: {secs!r} is not a number") from None
        if seconds < 1:
            raise ValueError(f"schedule item {item!r}: at least 1 second")
        out.append((name, seconds))
    if not out:
        raise ValueError("empty schedule")
    return out


def play(schedule: list[tuple[str, float]], target: str | None = None,
         directory: str | None = None, size: str | None = None, repeat: int = 1,
         stop=None, on_switch: Callable[[str, int], None] | None = None,
         direction: str = "total", cgroup: str | None = None,
         on_result: Callable[[str, FioResult], None] | None = None,
         segment: float = 0.0) -> list[tuple[str, FioResult]]:
    """Play ``schedule`` ``repeat`` times (0: until ``stop``); ``on_switch(name, i)``
    before each item. ``segment`` > 0: an item runs as fio processes of at most that
    many seconds back to back, each opening the target afresh. Returns (workload,
    result) for every fio run."""
    for name, _ in schedule:
        resolve_workload(name)          # fail before starting anything
    results = []
    i = 0
    rounds = 0
    while repeat == 0 or rounds < repeat:
        for name, seconds in schedule:
            if stop is not None and stop.is_set():
                return results
            if on_switch is not None:
                on_switch(name, i)
            for part in segments(seconds, segment):
                if stop is not None and stop.is_set():
                    return results
                env = fio_env(target, directory, part, size)
                res = run_fio(name, env, direction, stop, cgroup)
                results.append((name, res))
                if on_result is not None:
                    on_result(name, res)
            i += 1
        rounds += 1
    return results


def segments(seconds: float, segment: float) -> list[float]:
    """``seconds`` cut into runs of ``segment`` (0: one run); a remainder under 1 s
    joins the last run (fio's runtime is whole seconds)."""
    if segment <= 0 or seconds <= segment:
        return [seconds]
    n = int(seconds // segment)
    parts = [float(segment)] * n
    rest = seconds - n * segment
    if rest >= 1:
        parts.append(rest)
    else:
        parts[-1] += rest
    return parts


def main(argv: list[str] | None = None) -> int:
    from capes.common.stop_signal import StopSignal
    ap = argparse.ArgumentParser(prog="python -m capes.experiments.workload_driver",
                                 description="play fio workloads in a schedule")
    ap.add_argument("--schedule", required=True, help="e.g. seqread:60,randread:60 "
                    f"(built in: {', '.join(available_workloads())}, or job file paths)")
    ap.add_argument("--target", help="file or block device (CAPES_TARGET)")
    ap.add_argument("--directory", help="directory for file-set workloads (CAPES_DIR)")
    ap.add_argument("--size", help="CAPES_SIZE (default: 100%% of a device, else 1g)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; 0: until stopped")
    ap.add_argument("--segment", type=float, default=5.0, metavar="SECONDS",
                    help="run each workload as fresh fio processes of at most this long, "
                         "back to back: a reader sees a new readahead only when it "
                         "reopens the device (default: %(default)g; 0: one fio per "
                         "schedule item)")
    ap.add_argument("--cgroup", help="run fio in this cgroup directory (e.g. a throttled "
                                     "one: python -m capes.experiments.slow_device); "
                                     "empty: none")
    ap.add_argument("--notify", action="store_true",
                    help="tell the interface daemon at each switch (workload-changed)")
    ap.add_argument("--config", help="deployment TOML (for --notify: the daemon's address)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    schedule = parse_schedule(args.schedule)
    client = None
    if args.notify:
        from capes.common.control_client import ControlClient
        from capes.common.deployment import load_deployment
        client = ControlClient.from_config(load_deployment(args.config))

    def on_switch(name: str, i: int) -> None:
        log.info("workload %d: %s", i, name)
        if client is not None and i > 0:
            try:
                client.workload_changed(name)
            except Exception as exc:          # the daemon may be down; keep playing
                log.warning("workload-changed not delivered: %s", exc)

    def on_result(name: str, res: FioResult) -> None:
        bw = res.bandwidth
        log.info("%s: %.1f MB/s mean over %d s", name, bw.mean() / 1e6 if bw.size else 0,
                 bw.size)

    with StopSignal() as stop:
        play(schedule, args.target, args.directory, args.size, args.repeat, stop,
             on_switch, cgroup=args.cgroup or None, on_result=on_result,
             segment=max(args.segment, 0.0))
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
