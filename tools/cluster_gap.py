#!/usr/bin/env python3
"""The gap between the per-phase best and the best static setting of a real cluster
bench's static grid, over another schedule: is a gap ≥ 0.10 a property of the cluster
or of the schedule? The grid (``grid_reports`` in ``bench_real_cluster.py --json``)
measures each phase once; how often each phase comes in a session weighs it.

    python tools/cluster_gap.py docs/results/real-cluster/bench-seed*.json \\
        --schedule checkpoint,analysis,mixed,smallfiles,checkpoint,analysis,mixed,smallfiles

Prints, per file, the best static setting, its relative throughput and the gap (with
the 5th-95th percentile when each (phase, value)'s repetitions are drawn again,
``real_cluster.gap_interval``), over the run's own schedule and over ``--schedule``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capes.experiments import real_cluster as rc  # noqa: E402
from capes.experiments import real_readahead as rr  # noqa: E402


def gap(result: dict, phases: list[str]) -> str:
    schedule = [rr.Phase(p, 60.0) for p in phases]
    original = int(result["original"]["setting"])
    sm = rc.static_summary(result["grid_reports"], original, schedule)
    lo, _, hi = rc.gap_interval(result["grid_reports"], original, schedule, n=500)
    bs = sm["best_static"]
    return (f"best static {bs['setting']} {bs['relative']:.3f}, "
            f"gap {1 - bs['relative']:.3f} [{lo:.3f}, {hi:.3f}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--schedule", default=",".join(rc.DEFAULT_SCHEDULE))
    args = ap.parse_args(argv)
    other = args.schedule.split(",")
    for f in args.files:
        result = json.loads(f.read_text())
        if "grid_reports" not in result:
            print(f"{f}: no static grid (grid_reports)")
            continue
        own = [w for w, _ in result["schedule"]]
        missing = sorted(set(other) - set(result["grid_reports"]))
        print(f"{f.name}: own schedule: {gap(result, own)}; --schedule: "
              + (f"phases {missing} not in its grid" if missing else gap(result, other)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
