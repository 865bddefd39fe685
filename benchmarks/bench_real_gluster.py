"""Baselines on a real distributed file system (GlusterFS), judged by `capes evaluate`.

Stands up the local test volume (``capes.experiments.gluster_volume``, what
``tools/gluster-test-volume`` runs: our own glusterd, 3 bricks on local directories,
FUSE-mounted, all on loopback), lays out two 1 GiB files through the mount (one read, one overwritten), and
compares the volume's original option values with a few settings of the knobs that
plausibly matter, each on a workload where it plausibly matters, with the same code as
``capes evaluate`` (randomised interleaved repetitions, MSER warm-up removal,
subsession analysis, t-intervals, Fieller's CI of the relative difference, Welch's
test, repetitions needed):

1. 4 KiB sequential writes (``configs/workloads/seqwrite4k.fio``): write-behind off,
   and larger write-behind windows (GlusterFS 10: on, 1 MB);
2. 4 KiB sequential reads (``seqread4k.fio``): the read-ahead and io-cache translators
   on (GlusterFS 10: both off);
3. 4 KiB random reads from 4 threads (``randread.fio``): the bricks' io-thread count
   (GlusterFS 10: 16).

Options are set live with ``gluster volume set`` through the ``gluster`` applier, and
the test waits ``--settle`` seconds before each repetition (switching a translator on or
off makes the client build a new graph). Prints one markdown table per workload (mean
MB/s with its 95 % CI, the relative difference to the original with its CI, Welch's p,
the unit of the samples) and which setting, if any, beats the original.

The volume is torn down on every exit path (the end, an error, Ctrl-C, SIGTERM,
SIGHUP): our processes are stopped by PID, the mount and the directory removed, and
what gluster wrote to its fixed system paths deleted. After a ``kill -9`` of this
script, ``tools/gluster-test-volume down --dir DIR`` (printed at the start) cleans up.
Root, GlusterFS (glusterd, glusterfs, gluster) and fio needed. About 15 minutes with the
defaults.

    sudo .venv/bin/python benchmarks/bench_real_gluster.py [--reps 4] [--duration 15] \
        [--only seqwrite4k,seqread4k,randread] [--dir DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real_blockdev import cannot_run, compare_sets, hardware, table  # noqa: E402

from capes.common.atomic import write_json  # noqa: E402
from capes.common.stop_signal import StopSignal  # noqa: E402
from capes.experiments import evaluate as ev  # noqa: E402
from capes.experiments import workload_driver as wd  # noqa: E402
from capes.experiments.gluster_volume import (  # noqa: E402
    GlusterError, GlusterTestVolume, glusterd_pids)

# parameter -> (gluster option, unit, min, max, step); ranges are this benchmark's own
KNOBS = {
    "write_behind": ("performance.write-behind", "bool", 0, 1, 1),
    "write_behind_window_mb": ("performance.write-behind-window-size", "MB", 1, 64, 1),
    "read_ahead": ("performance.read-ahead", "bool", 0, 1, 1),
    "io_cache": ("performance.io-cache", "bool", 0, 1, 1),
    "io_thread_count": ("performance.io-thread-count", "", 1, 64, 1),
}

# name -> (job file, what, fio direction, target file, configuration sets)
WORKLOADS = {
    "seqwrite4k": ("seqwrite4k", "Sequential 4 KiB writes, one stream", "write",
                   "write.bin", ["write_behind=0", "write_behind_window_mb=4",
                                 "write_behind_window_mb=16"]),
    "seqread4k": ("seqread4k", "Sequential 4 KiB reads, one stream", "read", "data.bin",
                  ["read_ahead=1", "io_cache=1", "read_ahead=1,io_cache=1"]),
    "randread": ("randread", "Random 4 KiB reads, 4 threads", "read", "data.bin",
                 ["io_thread_count=4", "io_thread_count=64"]),
}


class Stop(StopSignal):
    """Ctrl-C, SIGTERM and a hang-up all stop the run (and tear the volume down)."""
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def deployment_toml(path: Path, vol: GlusterTestVolume) -> Path:
    lines = ["tick_seconds = 1.0"]
    for name, (key, unit, lo, hi, step) in KNOBS.items():
        lines += [f"[control.appliers.{name}]", 'name = "gluster"',
                  f'options = {{ volume = "{vol.volume}", key = "{key}", unit = "{unit}", '
                  f'glusterd_sock = "{vol.socket_path}" }}']
    for name, (key, unit, lo, hi, step) in KNOBS.items():
        lines += [f"[parameters.{name}]", f"min = {lo}", f"max = {hi}", f"step = {step}",
                  f"default = {lo}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def compare(toml: Path, name: str, mount: Path, args, stop) -> dict:
    job, what, direction, fname, sets = WORKLOADS[name]
    meter = ev.FioMeter(job, args.duration, str(mount / fname), size="1g",
                        direction=direction)
    title = (f"{what} (`{job}.fio`), GlusterFS 3-brick distributed volume over FUSE; "
             f"{args.reps} x {args.duration:g} s per configuration")
    return compare_sets(toml, sets, meter, args, stop, title, job, str(mount / fname),
                        label_width=40, prepare=ev.drop_caches if args.drop_caches else None,
                        settle_s=args.settle)


def client_rss_mb(vol: GlusterTestVolume) -> float | None:
    pid = vol.state.client_pid if vol.state else None
    try:
        with open(f"/proc/{pid}/status") as fh:
            kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
        return kb / 1024
    except (OSError, StopIteration, TypeError, ValueError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4, help="repetitions per configuration")
    ap.add_argument("--duration", type=float, default=15, help="seconds per repetition")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds between setting a configuration and starting fio")
    ap.add_argument("--only", default=",".join(WORKLOADS),
                    help=f"workloads to run (default: {','.join(WORKLOADS)})")
    ap.add_argument("--drop-caches", action="store_true",
                    help="sync and drop the host's page cache before each repetition "
                    "(default: the bricks' data stays in the servers' page cache, as on "
                    "a server with RAM to spare; fio invalidates the client's)")
    ap.add_argument("--dir", help="volume directory (absent or empty; default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write every report here")
    ap.add_argument("--quick", action="store_true",
                    help="a small run (CI): one workload, 2 × 3 s per configuration")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.duration, args.settle = 2, 3, 1.0
        args.only = next(iter(WORKLOADS))
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown or not only:
        ap.error(f"--only: unknown workload(s) {unknown} (known: {', '.join(WORKLOADS)})")
    missing = wd.missing_on_host("glusterd, FUSE mount", ("fio", "glusterd", "gluster"))
    if missing:
        return cannot_run("bench_real_gluster", missing, args.quick)
    if glusterd_pids():
        return cannot_run("bench_real_gluster", f"a glusterd already runs here (pids "
                          f"{glusterd_pids()}); this bench runs only its own", args.quick)
    print(f"hardware: {hardware()}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    reports: list[dict] = []
    t0 = time.time()
    problems: list[str] = []
    rc = 0
    with Stop() as stop:
        vol = GlusterTestVolume(args.dir)
        try:
            vol.up()
            print(f"volume {vol.volume} up in {vol.state.timings_s.get('up')} s, mounted at "
                  f"{vol.mount} (after a kill -9 of this script: "
                  f"tools/gluster-test-volume down --dir {vol.dir})", flush=True)
            toml = deployment_toml(vol.dir / "bench.toml", vol)
            if not stop.is_set():
                t1 = time.monotonic()
                for fname in sorted({WORKLOADS[w][3] for w in only}):
                    subprocess.run(["dd", "if=/dev/zero", f"of={vol.mount / fname}",
                                    "bs=1M", "count=1024", "conv=fsync", "status=none"],
                                   check=True)
                print(f"laid out the 1 GiB files in {time.monotonic() - t1:.1f} s "
                      "(writes overwrite one, reads read the other)", flush=True)
            for name in only:
                if stop.is_set():
                    break
                reports.append(compare(toml, name, vol.mount, args, stop))
                reports[-1]["client_rss_mb"] = client_rss_mb(vol)
                reports[-1]["load_avg"] = os.getloadavg()
                print(table(reports[-1]), flush=True)
                print(f"(FUSE client RSS {reports[-1]['client_rss_mb'] or float('nan'):.0f} MB, "
                      f"load average {reports[-1]['load_avg'][0]:.2f})", flush=True)
        except (GlusterError, subprocess.CalledProcessError, ValueError,
                RuntimeError) as exc:
            print(f"bench_real_gluster: {exc}", file=sys.stderr)
            rc = 1
        finally:
            t_down = time.monotonic()
            problems = vol.down()
            print(f"volume torn down in {time.monotonic() - t_down:.1f} s"
                  + (": left behind " + "; ".join(problems) if problems else ", nothing left"),
                  flush=True)
    print(f"\ntotal {time.time() - t0:.0f} s, load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, ev.jsonable({"hardware": hardware(), "command": sys.argv,
                                           "reports": reports, "teardown": problems}))
    if problems:
        return 1
    return 130 if stop.signum is not None else rc


if __name__ == "__main__":
    sys.exit(main())
