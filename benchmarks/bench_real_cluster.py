"""A real GlusterFS cluster tuned live: the original, the best static setting, the
per-phase best, and the hill climber, BO and CAPES run live through the same stack.

The cluster (``capes.experiments.gluster_volume``, what ``tools/gluster-test-volume run
--bricks 4 --clients 4 --brick-gib 2 --brick-mbs 10`` stands up): our own glusterd, a
distributed volume of ``--bricks`` bricks each on its own loop device throttled to
``--brick-mbs`` MB/s and ``--brick-iops`` (cgroup v1 blkio or v2 io.max, said in the
JSON), the bricks' page cache capped (``--brick-memory-mib``), ``--clients``
FUSE mounts, each a node (``client1..N``) with its own monitoring and control agent.
The knob is each client's FUSE readahead window (per-node rows
``clientK/read_ahead_kb``, ``configs/glusterfs-cluster.toml``); the workload changes by
phase across the clients (``capes.experiments.real_cluster.PHASES``: checkpoint writes
on all, reads on half, a reader/writer mix, a small-file storm, returning); the
objective is fio's own bytes/s summed over the clients, each phase normalised by its
own best static throughput (``relative``), with per-client fairness (Jain's index).

1. **static grid** (``capes evaluate``'s machinery): per phase, the original and each
   ``--grid`` value shared by every client, ``--grid-reps`` randomised interleaved
   repetitions of ``--grid-duration`` s: the best static setting, the original's, the
   per-phase best (relative 1 by construction) and the gap between them.
2. **tuners live**, one after the other over the whole schedule, each through the stack;
   ``static`` is the same stack with no tuner and every client held at the best static
   setting: the best static setting under the stack's own load on the host (on a
   loaded 2-core host the stack's processes cost the workload throughput; the grid of
   step 1 runs without them).

Writes (``--json``) ``best_static {setting, relative}``, ``per_phase_best_gap``,
``original``, ``tuners.{capes,hill,bo}.{relative, diff_vs_best_static, ci95,
worst_10s_vs_original, restored, rows_lost, fairness, recall_30s, phases, cpu_s}``
(``cpu_s``: each stack process's CPU seconds over the arm), and a
``static`` entry; with the ``static`` arm in the run, each tuner's ``vs_static_live {diff,
ci95}``: against that arm, errors stratified by phase (``real_cluster.against_static_live``);
with the ``original`` arm (the untuned cluster held live), each arm's
``worst_10s_vs_original_live`` and ``worst_10s_vs_original_worst``
(``real_cluster.against_original_live``).
About 40 minutes with the defaults (32 without ``static``; measured: 48 min with a fifth
arm); ``--quick``: 2 clients, 2 phases of 20 s, CAPES only, under 2 minutes. Exit 77 (skip) without root, GlusterFS, FUSE, fio or loop devices. The cluster runs in a network
namespace of its own, so another glusterd on the host does not stop it.

    sudo .venv/bin/python benchmarks/bench_real_cluster.py --json out.json
    sudo .venv/bin/python benchmarks/bench_real_cluster.py --quick --json q.json
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capes.experiments import gluster_volume as gv  # noqa: E402
from capes.experiments import real_cluster as rc  # noqa: E402
from capes.experiments import real_readahead as rr  # noqa: E402

SKIP = 77
TUNERS = "static,capes,hill,bo"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--bricks", type=int, default=4)
    gv.add_brick_disk_args(ap, brick_mbs=10, brick_seek_ms=0.0, brick_memory_mib=256)
    ap.add_argument("--client-memory-mib", type=int, default=64,
                    help="each client's applications in a memory cgroup (its page cache)")
    ap.add_argument("--schedule", default=",".join(rc.DEFAULT_SCHEDULE),
                    help=f"phases, of {', '.join(rc.PHASES)}")
    ap.add_argument("--phase-s", type=float, default=60)
    ap.add_argument("--tuners", default=TUNERS,
                    help="of capes, hill, bo, capes-NAME for each --variant, and the held "
                         "arms static (the best static setting) and original, in order")
    ap.add_argument("--variant", dest="variants", action="append", default=[],
                    help="NAME:key=value[;key=value]: a CAPES variant (capes-NAME in "
                         "--tuners) with its own settings, on the same grid")
    ap.add_argument("--grid", default="4,16,64,512,8192")
    ap.add_argument("--original", type=int, default=128,
                    help="every client's read_ahead_kb at the start (a wrong one: 16)")
    ap.add_argument("--grid-reps", type=int, default=2)
    ap.add_argument("--grid-duration", type=float, default=9)
    ap.add_argument("--segment", type=float, default=3.0)
    ap.add_argument("--exploration-ticks", type=int, default=None,
                    help="default: the config's (configs/glusterfs-cluster.toml)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--one-row", action="store_true",
                    help="every client's knob in the engine's one row (the thesis' layout: "
                    "one network over every client's PIs), not a per-node row each")
    ap.add_argument("--facts", action="store_true",
                    help="instead of the tuners: what each volume option does per phase "
                    "(capes evaluate's machinery) and what a `volume set` costs")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true",
                    help="≤ 3 minutes: 2 clients, 2 phases of 20 s, a 2-value grid, CAPES")
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.schedule, args.phase_s = 2, "analysis,mixed", 20
        args.grid, args.grid_reps, args.grid_duration = "4,64", 1, 4
        if args.tuners == TUNERS:                 # --quick runs CAPES unless told otherwise
            args.tuners = "capes"
        args.exploration_ticks = args.exploration_ticks or 20
    unknown = [p for p in args.schedule.split(",") if p not in rc.PHASES]
    if unknown:
        ap.error(f"--schedule: unknown phase(s) {unknown} (known: {', '.join(rc.PHASES)})")
    return args


def report_table(result: dict) -> str:
    if "best_static" not in result:
        return "(no result)"
    bs, orig = result["best_static"], result["original"]
    lines = ["| policy | setting | relative | diff vs best static [95 % CI] | "
             "worst 10 s ÷ original | fairness (Jain, per phase) | restored |",
             "|---|---|---:|---:|---:|---|---|",
             f"| original | {orig['setting']} | {orig['relative']:.3f} | "
             f"{orig['relative'] - bs['relative']:+.3f} | | | |",
             f"| best static | {bs['setting']} | {bs['relative']:.3f} | 0 | | | |",
             f"| per-phase best | {result['per_phase_best']['settings']} | 1.000 | "
             f"{result['per_phase_best_gap']:+.3f} | | | |"]
    for name, sc in result["tuners"].items():
        if sc.get("error"):
            lines.append(f"| {name} (live) | failed: {sc['error'][-120:]} | | | | | |")
            continue
        if not sc or sc.get("relative") is None:
            continue
        fair = ", ".join(f"{v:.2f}" for v in sc["fairness"].values())
        lines.append(f"| {name} (live) | {sc['applied_min']}..{sc['applied_max']} | "
                     f"{sc['relative']:.3f} | {sc['diff_vs_best_static']:+.3f} "
                     f"[{sc['ci95'][0]:+.3f}, {sc['ci95'][1]:+.3f}] | "
                     f"{sc['worst_10s_vs_original']:.2f} | {fair} | {sc['restored']} |")
    live = [(n, sc["vs_static_live"]) for n, sc in result["tuners"].items()
            if sc.get("vs_static_live")]
    if live:
        lines += ["", "Against the best static setting held live in this run (errors "
                  "stratified by phase):", ""]
        lines += [f"- {n}: {v['diff']:+.3f} [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]"
                  for n, v in live]
    worst = [(n, sc["worst_10s_vs_original_live"]) for n, sc in result["tuners"].items()
             if sc.get("worst_10s_vs_original_live") is not None]
    if worst:
        lines += ["", "Worst 10 s ÷ the original held live in this run (per phase; the "
                  "original's own is the host's noise):", ""]
        lines += [f"- {n}: {w:.2f}"
                  + (f" (÷ the original's own worst 10 s there: "
                     f"{result['tuners'][n]['worst_10s_vs_original_worst']:.2f})"
                     if "worst_10s_vs_original_worst" in result["tuners"][n] else "")
                  for n, w in worst]
    lines += ["", "Static grid (mean MB/s, summed over the clients):", ""]
    return "\n".join(lines + rr.static_grid_table(result["static"], digits=1))


def main(argv=None) -> int:
    from capes.common.atomic import write_json
    from capes.common.stop_signal import StopSignal
    from capes.experiments import evaluate as ev
    args = parse_args(argv)
    why = rc.missing_requirements()
    if why:
        print(f"skip: {why}")
        return SKIP
    opts = rc.ClusterBenchOptions(
        clients=args.clients, bricks=args.bricks,
        disk=gv.brick_disk_from_args(args, size_gib=rc.BRICK_GIB),
        client_memory_mib=args.client_memory_mib,
        schedule=[rr.Phase(p, args.phase_s) for p in args.schedule.split(",")],
        tuners=[t for t in args.tuners.split(",") if t],
        grid=[int(v) for v in args.grid.split(",")], original=args.original,
        grid_reps=args.grid_reps, grid_duration=args.grid_duration,
        segment_s=args.segment, exploration_ticks=args.exploration_ticks, seed=args.seed,
        extra_sets=tuple(args.sets), variants=rr.parse_variants(args.variants),
        facts=args.facts, one_row=args.one_row)

    class Stop(StopSignal):
        SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    print(f"command: {' '.join(sys.argv)}")
    print(f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    with Stop() as stop:
        try:
            result = rc.run_bench(opts, stop, log=lambda m: print(m, flush=True))
        except (rc.GlusterError, OSError, RuntimeError) as exc:
            print(f"bench_real_cluster: {exc}", file=sys.stderr)
            return 1
    result["command"] = sys.argv
    print()
    if args.facts:
        for w, rows in result.get("volume_options_summary", {}).items():
            print(f"{w}: " + ", ".join(f"{k} {v['mean_mb_s']:.1f} MB/s ({v['vs_original']:.2f})"
                                        for k, v in rows.items()))
    else:
        print(report_table(result))
    print(f"\ntotal {result['wall_s']:.0f} s; load average at the end "
          f"{result['load_average_end']:.2f}; teardown {result['teardown']}")
    if args.json:
        write_json(args.json, ev.jsonable(result))
    if result["teardown"]["problems"]:
        return 1
    return 130 if stop.signum is not None else 0


if __name__ == "__main__":
    sys.exit(main())
