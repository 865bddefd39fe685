"""CAPES online on a real device from a wrong default: the original, CAPES during
tuning, its last 2 minutes, its worst 10 s, and the best static setting found by
``capes evaluate`` on the same device in the same run, with 95 % CIs.

The device is a loop device over a sparse file in a tmpfs, capped by a blkio cgroup at
``--read-iops`` read requests and ``--read-bps`` bytes per second (a slow device whose
every request costs the same, where readahead decides throughput), with the readers in
a ``--memory-mib`` memory cgroup; or (``--backing seekdisk``) the emulated seek disk.
``read_ahead_kb`` starts at ``--original`` (the wrong default: 128, the kernel's).
The workload (``--workload``: ``seqread-plain`` 16 KiB sequential buffered reads with ``fadvise_hint=0``,
``mmaprand`` random 4 KiB reads through mmap with ``fadvise_hint=0``, ``seqread4``, or
any fio job file) runs in back-to-back fio segments of ``--segment`` s, each reopening
the device, since a new read_ahead_kb reaches a reader only when it opens the device.
The objective is what the application gets: fio's own per-second bytes, fed to the
stack through the ``command`` collector (``configs/linux-readahead-app.toml``).

1. **static grid** (``capes evaluate``'s machinery): the original and each ``--grid``
   value, ``--grid-reps`` randomised interleaved repetitions of ``--grid-duration`` s;
2. **tuning**: the stack (interface daemon, monitoring agent, control agent, DRL
   engine with the ``default`` preset; ``--tuners capes,hill,bo`` adds the baselines
   live, ``--variant poll:engine.tick_poll_s=0.1`` with ``capes-poll`` in ``--tuners``
   a CAPES variant beside CAPES on the same grid) for ``--tuning`` s each; the original
   comes back when it stops (checked).

    sudo .venv/bin/python benchmarks/bench_real_online.py --workload seqread-plain \\
        --read-iops 200 --read-bps 104857600 --json seq.json
    sudo .venv/bin/python benchmarks/bench_real_online.py --workload mmaprand \\
        --read-iops 300 --read-bps 12500000 --json mmap.json
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capes.experiments import real_readahead as rr  # noqa: E402

SKIP = 77


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="seqread-plain",
                    help="seqread-plain, mmaprand, seqread4, seqread or a fio job file")
    ap.add_argument("--original", type=int, default=128,
                    help="read_ahead_kb at the start (the wrong default)")
    ap.add_argument("--read-iops", type=int, default=200, help="read IOPS cap (0: none)")
    ap.add_argument("--read-bps", type=int, default=100 << 20,
                    help="read bytes/s cap (0: none)")
    ap.add_argument("--backing", choices=["tmpfs", "seekdisk"], default="tmpfs")
    ap.add_argument("--size-gib", type=float, default=4)
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--tuning", type=float, default=600, help="seconds of online tuning")
    ap.add_argument("--tuners", default="capes",
                    help="of capes, hill, bo and capes-NAME for each --variant, in order")
    ap.add_argument("--variant", dest="variants", action="append", default=[],
                    help="NAME:key=value[;key=value]: a CAPES tuner capes-NAME with these "
                    "settings too, run in the same bench (e.g. poll:engine.tick_poll_s=0.1)")
    ap.add_argument("--exploration-ticks", type=int, default=None,
                    help="ε anneals 1 → 0.05 over this many ticks (default: --tuning / 2)")
    ap.add_argument("--segment", type=float, default=2.0)
    ap.add_argument("--grid", default="4,16,64,128,512,1024,4096")
    ap.add_argument("--grid-reps", type=int, default=3)
    ap.add_argument("--grid-duration", type=float, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true",
                    help="a small run (≤ 60 s): 25 s of tuning, a 2-value grid")
    args = ap.parse_args(argv)
    if args.quick:
        args.tuning, args.grid, args.grid_reps, args.grid_duration = 25, "128,1024", 1, 4
        args.size_gib = 1
    if args.exploration_ticks is None:
        args.exploration_ticks = max(1, int(args.tuning / 2))
    return args


def online_table(result: dict) -> str:
    """Absolute figures against the original and the best static setting."""
    w = result["schedule"][0][0]
    st = result["static"]
    orig = st["original"]["means"][w]
    best = st["best"][w]
    grid = result["grid_reports"][w]

    def ci_of(value):
        for c in grid["configs"]:
            v = result["original_read_ahead_kb"] if c["name"] == "original" else \
                int(round(c["values"]["read_ahead_kb"]))
            if v == value:
                return c.get("ci_low"), c.get("ci_high")
        return None, None

    def fmt(m, ci):
        lo, hi = (ci or (None, None))
        band = (f" [{lo / 1e6:.2f}, {hi / 1e6:.2f}]" if lo is not None and
                math.isfinite(lo) else "")
        return f"{m / 1e6:.2f}{band}"
    bv = st["per_workload_best_setting"][w]
    rows = ["| what | read_ahead_kb | MB/s [95 % CI] | ÷ original | ÷ best static |",
            "|---|---|---:|---:|---:|",
            f"| original (grid) | {result['original_read_ahead_kb']} | "
            f"{fmt(orig, ci_of(result['original_read_ahead_kb']))} | 1.00 | "
            f"{orig / best:.2f} |",
            f"| best static (grid) | {bv} | {fmt(best, ci_of(bv))} | {best / orig:.2f} | 1.00 |"]
    for name, sc in result["tuners"].items():
        if not sc:
            continue
        p = sc["phases"][0]
        rows += [f"| {name} during tuning ({p['seconds']} s) | {sc['applied_min']}.."
                 f"{sc['applied_max']} | {fmt(p['mean'], p['ci95'])} | "
                 f"{p['mean'] / orig:.2f} | {p['mean'] / best:.2f} |",
                 f"| {name}, last 120 s | | {fmt(p['last_120s_mean'], p['last_120s_ci95'])} | "
                 f"{p['last_120s_mean'] / orig:.2f} | {p['last_120s_mean'] / best:.2f} |",
                 f"| {name}, worst 10 s | | | {p['worst_10s_vs_original']:.2f} | |"]
        rows.append(f"| {name}: original restored at the end | {sc['restored']} | | | |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    why = rr.missing_requirements(args.backing)
    if why:
        print(f"skip: {why}")
        return SKIP
    spec = rr.DeviceSpec(backing=args.backing, size_gib=args.size_gib,
                         read_iops=args.read_iops, read_bps=args.read_bps,
                         memory_mib=args.memory_mib, original=args.original)
    opts = rr.BenchOptions(
        device=spec, schedule=[rr.Phase(args.workload, args.tuning)],
        tuners=[t for t in args.tuners.split(",") if t],
        grid=[int(v) for v in args.grid.split(",")], grid_reps=args.grid_reps,
        grid_duration=args.grid_duration, segment_s=args.segment,
        exploration_ticks=args.exploration_ticks, seed=args.seed,
        extra_sets=tuple(args.sets), variants=rr.parse_variants(args.variants))
    return rr.run_and_report(opts, "bench_real_online", online_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
