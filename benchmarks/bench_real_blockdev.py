"""Baselines on a real block device, judged by `capes evaluate`.

Creates a loop device over a zero-filled file in a temporary directory (``losetup
--direct-io=on``, so the backing file's page cache is bypassed and every read or write
of the loop device reaches the host's disk), and measures with the same code as
``capes evaluate`` (randomised interleaved repetitions, MSER warm-up removal, subsession
analysis, t-intervals, Fieller's CI of the relative difference, Welch's test):

1. sequential buffered 16 KiB reads (``configs/workloads/seqread.fio``) over a grid of
   read_ahead_kb values against the device's original value, on the loop device as it
   is (the host's disk underneath) and capped at ``--read-iops`` read requests per
   second by a throttled cgroup (a slow device whose every request costs a fixed time,
   like a disk or an IOPS-capped cloud volume: where readahead should matter);
2. sequential buffered 1 MiB writes (``seqwrite.fio``) under a few vm.dirty_* writeback
   settings against the host's original ones (sync and caches dropped between
   repetitions).

Optionally ``--device /dev/sdX``: the read grid on a real device too (read-only: only
buffered reads of the raw device; its read_ahead_kb is restored at the end).

Prints one table per part: mean MB/s with its 95 % CI, the relative difference to the
original with its CI, Welch's p, and the best static setting, or that nothing beats the
original. Root only; every knob, the loop device and the cgroup are restored or removed
at the end, also on Ctrl-C. About 20 minutes with the defaults.

    sudo .venv/bin/python benchmarks/bench_real_blockdev.py [--reps 4] [--duration 12] \
        [--grid 128,512,1024,4096,8192] [--read-iops 100] [--device /dev/sdb] [--json OUT]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from capes.common.atomic import write_json
from capes.common.deployment import load_deployment
from capes.common.stop_signal import StopSignal
from capes.experiments import evaluate as ev
from capes.experiments import workload_driver as wd

WRITE_SETS = [
    "dirty_ratio=5,dirty_background_ratio=2",
    "dirty_ratio=40,dirty_background_ratio=10",
    "dirty_expire_centisecs=500",
]


def deployment_toml(path: Path, dev: str) -> Path:
    name = os.path.basename(dev)
    path.write_text(f"""tick_seconds = 1.0
[control.appliers.read_ahead_kb]
name = "file"
options = {{ path = "/sys/block/{name}/queue/read_ahead_kb" }}
[control.appliers.dirty_ratio]
name = "file"
options = {{ path = "/proc/sys/vm/dirty_ratio" }}
[control.appliers.dirty_background_ratio]
name = "file"
options = {{ path = "/proc/sys/vm/dirty_background_ratio" }}
[control.appliers.dirty_expire_centisecs]
name = "file"
options = {{ path = "/proc/sys/vm/dirty_expire_centisecs" }}
[parameters.read_ahead_kb]
min = 0
max = 16384
step = 128
default = 128
[parameters.dirty_ratio]
min = 1
max = 80
step = 1
default = 20
[parameters.dirty_background_ratio]
min = 1
max = 50
step = 1
default = 10
[parameters.dirty_expire_centisecs]
min = 100
max = 6000
step = 100
default = 3000
""")
    return path


def compare_sets(toml: Path, sets: list[str], meter, args, stop, title: str,
                 workload: str, target: str, label_width: int = 44,
                 prepare=ev.drop_caches, settle_s: float = 0.0) -> dict:
    """The original values against ``sets`` with ``capes evaluate``'s code (the
    deployment's appliers, ``meter`` per repetition, ``args.reps`` x ``args.duration``),
    each repetition's mean MB/s printed; the report, saying what was measured."""
    cfg = load_deployment(toml)
    configs = [ev.ConfigSet.parse(s) for s in ["original", *sets]]
    names = sorted({n for c in configs for n in (c.values or {})})
    knobs = ev.Knobs(cfg, names)

    def on_rep(rep, i, total):
        x = rep.samples
        print(f"  {i:>2}/{total} {configs[rep.config].label:<{label_width}} "
              f"{(sum(x) / len(x) / 1e6 if x else float('nan')):8.1f} MB/s", flush=True)
    print(f"\n== {title}", flush=True)
    try:
        report = ev.evaluate(knobs, configs, meter, args.reps, args.seed, stop,
                             prepare=prepare, settle_s=settle_s, on_rep=on_rep)
    finally:
        knobs.close()
    report.update(title=title, unit="bytes/s", metric=meter.describe(),
                  workload=workload, target=target, duration_s=args.duration)
    return report


def compare(toml: Path, sets: list[str], workload: str, target: str, args, stop,
            cgroup: str | None = None, direction: str = "total", title: str = "") -> dict:
    meter = ev.FioMeter(workload, args.duration, target, direction=direction, cgroup=cgroup)
    return compare_sets(toml, sets, meter, args, stop, title, workload, target)


def table(report: dict) -> str:
    conf = report["confidence"] * 100
    cmps = {c["config"]: c for c in report["comparisons"]}
    rows = [f"### {report['title']}", "",
            f"| configuration | mean MB/s | {conf:g}% CI | vs original | CI of the difference "
            "| Welch p | unit (n) |", "|---|---:|---:|---:|---:|---:|---|"]
    for c in report["configs"]:
        name = c["name"]
        if name == "original":
            name = "original (" + ", ".join(f"{k}={ev._fmt(v)}"
                                            for k, v in c["values"].items()) + ")"
        ci = (f"[{c['ci_low'] / 1e6:.1f}, {c['ci_high'] / 1e6:.1f}]"
              if math.isfinite(c.get("ci_low", math.nan)) else "-")
        unit = (f"{c['subsession_s']} s batches ({c['n']})" if c.get("unit") == "subsession"
                else f"repetitions ({c['n']})")
        cmp_ = cmps.get(c["name"])
        if cmp_ and "rel_diff" in cmp_:
            lo, hi = cmp_["rel_ci_low"], cmp_["rel_ci_high"]
            rel = f"{cmp_['rel_diff'] * 100:+.1f}%"
            rci = (f"[{lo * 100:+.1f}%, {hi * 100:+.1f}%]" if math.isfinite(lo)
                   else "unbounded")
            p = f"{cmp_['p_welch']:.2g}"
        else:
            rel = rci = p = ""
        rows.append(f"| {name} | {c['mean'] / 1e6:.1f} | {ci} | {rel} | {rci} | {p} | {unit} |")
    rows.append("")
    rows.append(verdict(report))
    return "\n".join(rows)


def verdict(report: dict) -> str:
    better = [c for c in report["comparisons"]
              if c.get("significant") and c["rel_diff"] > 0]
    worse = [c for c in report["comparisons"]
             if c.get("significant") and c["rel_diff"] < 0]
    best = max(report["configs"], key=lambda c: c["mean"] if c["n"] else -math.inf)
    parts = [f"Highest mean: {best['name']}."]
    if better:
        b = max(better, key=lambda c: c["rel_diff"])
        parts.append(f"Best static setting that beats the original with a CI excluding "
                     f"zero: {b['config']} ({b['rel_diff'] * 100:+.1f}% "
                     f"[{b['rel_ci_low'] * 100:+.1f}%, {b['rel_ci_high'] * 100:+.1f}%]).")
    else:
        parts.append("Nothing beats the original with a CI excluding zero.")
    if worse:
        parts.append("Significantly worse than the original: "
                     + ", ".join(c["config"] for c in worse) + ".")
    n = len(report["comparisons"])
    if n > 1:
        parts.append(f"({n} comparisons at {report['confidence'] * 100:g}% each; "
                     f"Bonferroni would ask for p < {0.05 / n:.2g}.)")
    more = [f"{c['name']}: {c['more_reps']}" for c in report["configs"]
            if c.get("more_reps")]
    if more:
        parts.append(f"More repetitions for ±{report['precision'] * 100:g}% on each mean: "
                     + ", ".join(more) + ".")
    return " ".join(parts)


def hardware() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo")
               if line.startswith("MemTotal")) / 2 ** 20
    fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, kernel "
            f"{platform.release()}, {fio}")


def cannot_run(prog: str, why: str, quick: bool) -> int:
    """A quick run (CI) that cannot run here is a skip (77); a full run, an error (2)."""
    if quick:
        print(f"skip: {why}")
        return 77
    print(f"{prog}: {why}", file=sys.stderr)
    return 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4, help="repetitions per configuration")
    ap.add_argument("--duration", type=float, default=12, help="seconds per repetition")
    ap.add_argument("--grid", default="128,512,1024,4096,8192",
                    help="read_ahead_kb values compared with the original")
    ap.add_argument("--read-iops", type=int, default=100,
                    help="read request cap of the slow device (0: skip that part)")
    ap.add_argument("--size-gib", type=int, default=8, help="size of the loop device")
    ap.add_argument("--device", help="also run the read grid on this real block device")
    ap.add_argument("--skip-write", action="store_true", help="no writeback part")
    ap.add_argument("--skip-uncapped", action="store_true",
                    help="no read grid on the uncapped loop device")
    ap.add_argument("--dir", help="directory for the backing file (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write every report here")
    ap.add_argument("--quick", action="store_true",
                    help="a small run (CI): 1 GiB device, 2 values, 2 × 3 s, reads only")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.duration, args.grid, args.size_gib = 2, 3, "128,4096", 1
        args.skip_write = args.skip_uncapped = True
    missing = wd.missing_on_host("losetup, sysfs and sysctl knobs", ("losetup", "fio"))
    if missing:
        return cannot_run("bench_real_blockdev", missing, args.quick)
    grid = [f"read_ahead_kb={int(v)}" for v in args.grid.split(",") if v.strip()]
    print(f"hardware: {hardware()}")
    print(f"command: {' '.join(sys.argv)}")
    reports = []
    tmp = tempfile.TemporaryDirectory(prefix="capes-bench-blockdev-", dir=args.dir)
    dev = cgroup = None
    t0 = time.time()
    with StopSignal() as stop:
        try:
            back = Path(tmp.name) / "disk.img"
            print(f"writing {args.size_gib} GiB of zeros to {back} ...", flush=True)
            subprocess.run(["dd", "if=/dev/zero", f"of={back}", "bs=4M",
                            f"count={args.size_gib * 256}", "oflag=direct", "status=none"],
                           check=True)
            dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on",
                                  str(back)], capture_output=True, text=True,
                                 check=True).stdout.strip()
            toml = deployment_toml(Path(tmp.name) / "bench.toml", dev)
            what = (f"{dev}: loop device (direct I/O) over a {args.size_gib} GiB file on "
                    f"the host's disk")
            if not args.skip_uncapped and not stop.is_set():
                reports.append(compare(
                    toml, grid, "seqread", dev, args, stop, direction="read",
                    title=f"Sequential buffered 16 KiB reads, {what}, uncapped; "
                    f"{args.reps} x {args.duration:g} s per configuration"))
                print(table(reports[-1]), flush=True)
            if args.read_iops and not stop.is_set():
                try:
                    cgroup = wd.ThrottledCgroup(dev, read_iops=args.read_iops)
                except (wd.WorkloadError, OSError) as exc:
                    print(f"no throttled device: {exc}", file=sys.stderr)
                if cgroup is not None:
                    reports.append(compare(
                        toml, grid, "seqread", dev, args, stop, cgroup.path, "read",
                        title=f"Sequential buffered 16 KiB reads, {what}, capped at "
                        f"{args.read_iops} read IOPS (a slow device); "
                        f"{args.reps} x {args.duration:g} s per configuration"))
                    print(table(reports[-1]), flush=True)
            if args.device and not stop.is_set():
                real_toml = deployment_toml(Path(tmp.name) / "real.toml", args.device)
                reports.append(compare(
                    real_toml, grid, "seqread", args.device, args, stop, direction="read",
                    title=f"Sequential buffered 16 KiB reads, {args.device} (real device, "
                    f"read-only); {args.reps} x {args.duration:g} s per configuration"))
                print(table(reports[-1]), flush=True)
            if not args.skip_write and not stop.is_set():
                reports.append(compare(
                    toml, WRITE_SETS, "seqwrite", dev, args, stop, direction="write",
                    title=f"Sequential buffered 1 MiB writes, {what}, vm.dirty_* "
                    f"writeback; {args.reps} x {args.duration:g} s per configuration "
                    "(sync + drop caches between repetitions)"))
                print(table(reports[-1]), flush=True)
        finally:
            if cgroup is not None:
                cgroup.remove()
            if dev:
                subprocess.run(["losetup", "-d", dev], check=False)
            tmp.cleanup()
    print(f"\ntotal {time.time() - t0:.0f} s")
    if not all(r["restored"] for r in reports):
        print("WARNING: some original values were not restored", file=sys.stderr)
    if args.json:
        write_json(args.json, ev.jsonable({"hardware": hardware(), "command": sys.argv,
                                           "reports": reports}))
    return 130 if stop.signum else 0


if __name__ == "__main__":
    sys.exit(main())
