"""Alternating workloads on the emulated seek disk: the original, the best static
read_ahead_kb, the per-phase best, and the hill climber, BO and CAPES run live.

The device is a loop device over ``tools/seekdisk`` (one request at a time,
``--bandwidth-mbs``, +``--seek-ms`` per non-contiguous request; built with make when
absent, mounted and removed by the bench). The schedule alternates sequential reads
(4 readers, ``configs/workloads/seqread4.fio``) and random 4 KiB reads through mmap
(``mmaprand.fio``, ``fadvise_hint=0``): ``--phases`` phases of ``--phase-s`` seconds,
fio reopening the device every ``--segment`` seconds. The throughput is what fio reads
(the application's figure), normalised per workload by that workload's best static
throughput (``relative``).

1. **static grid** (``capes evaluate``'s machinery): per workload, the original and
   each ``--grid`` value in ``--grid-reps`` randomised interleaved repetitions of
   ``--grid-duration`` s; gives the best single static value over the schedule, the
   original's and the per-phase best (relative 1 by construction).
2. **tuners live**, one after the other over the whole schedule, each through the
   stack (daemon, monitoring agent, control agent; the DRL engine for ``capes``, the
   baseline tuner process for ``hill`` and ``bo``) on ``configs/linux-readahead-app.toml``.

Writes (``--json``) ``best_static {setting, relative}``, ``original``,
``per_phase_best``, ``tuners.{capes,hill,bo}.{relative, diff_vs_best_static, ci95,
phases, worst_10s_vs_original, restored}``. About 40 minutes with the defaults.

    sudo .venv/bin/python benchmarks/bench_real_alternating.py --json out.json
    sudo .venv/bin/python benchmarks/bench_real_alternating.py --quick
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capes.experiments import real_readahead as rr  # noqa: E402

SKIP = 77


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=120)
    ap.add_argument("--segment", type=float, default=2.0,
                    help="seconds per fio run (each reopens the device)")
    ap.add_argument("--tuners", default="capes,hill,bo")
    ap.add_argument("--grid", default="4,16,64,128,512,4096")
    ap.add_argument("--grid-reps", type=int, default=3)
    ap.add_argument("--grid-duration", type=float, default=8)
    ap.add_argument("--exploration-ticks", type=int, default=None,
                    help="CAPES's ε anneals 1 → 0.05 over this many ticks (default: "
                    "half of the first phase)")
    ap.add_argument("--original", type=int, default=128)
    rr.add_seekdisk_args(ap)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="a --set for every process of the stack (e.g. engine.probe_dwell=5)")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true",
                    help="a small run (≤ 60 s): 2 phases of 10 s, a 2-value grid, CAPES")
    args = ap.parse_args(argv)
    if args.quick:
        args.phases, args.phase_s, args.grid, args.grid_reps = 2, 10, "4,4096", 1
        args.grid_duration, args.tuners, args.size_gib = 3, "capes", 1
    if args.exploration_ticks is None:
        args.exploration_ticks = max(1, int(args.phase_s / 2))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    why = rr.missing_requirements("seekdisk")
    if why:
        print(f"skip: {why}")
        return SKIP
    spec = rr.seekdisk_spec(args, args.original)
    opts = rr.BenchOptions(
        device=spec, schedule=rr.alternating_schedule(args.phases, args.phase_s),
        tuners=[t for t in args.tuners.split(",") if t],
        grid=[int(v) for v in args.grid.split(",")], grid_reps=args.grid_reps,
        grid_duration=args.grid_duration, segment_s=args.segment,
        exploration_ticks=args.exploration_ticks, seed=args.seed,
        extra_sets=tuple(args.sets))
    return rr.run_and_report(opts, "bench_real_alternating", rr.report_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
