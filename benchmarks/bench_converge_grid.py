"""Table 5.1 of the thesis, reproduced: success rate within one simulated hour for every
noise level × reward type, for the ``default`` and ``paper`` presets.

    .venv/bin/python benchmarks/bench_converge_grid.py --seeds 30 --jobs 2 --json out.json

Prints each cell's success rate next to the paper's, the median converge time with its
95 % CI, and the wall time per simulated hour (one core per run).
"""
from __future__ import annotations

import argparse
import sys

from capes.experiments.converge_test import format_table, load_config, run_grid, write_json

PAPER = {  # thesis Table 5.1: success rate within one hour
    (0.01, "diff"): 1.00, (0.01, "diff_avg"): 1.00, (0.01, "diff_ewma"): 0.97,
    (0.10, "diff"): 0.76, (0.10, "diff_avg"): 1.00, (0.10, "diff_ewma"): 0.94,
    (0.50, "diff"): 0.94, (0.50, "diff_avg"): 0.56, (0.50, "diff_ewma"): 0.82,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=30)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--presets", default="default,paper")
    p.add_argument("--json", default=None, help="write all reports to this file")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--quick", action="store_true",
                   help="CI: the default preset, one seed per cell, games of 120 simulated s")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.presets = 1, "default"
        args.overrides.append("game.time_limit_ticks=120")
    noises = [0.01, 0.10, 0.50]
    rewards = ["diff", "diff_avg", "diff_ewma"]
    reports = {}
    for preset in args.presets.split(","):
        cfg = load_config(None, args.overrides, preset)
        print(f"== preset {preset}: {args.seeds} seeds × 9 cells", file=sys.stderr)
        report = run_grid(cfg, noises, rewards, args.seeds, jobs=args.jobs, progress=None)
        reports[preset] = report
        print(format_table(report))
        print(f"{'noise':>6} {'reward':>10} {'ours':>6} {'paper':>6} {'vs paper':>9} "
              f"{'vs 99%':>7}")
        for c in report["cells"]:
            ours, paper = c["success_rate"], PAPER[(c["noise"], c["reward"])]
            print(f"{c['noise'] * 100:>5.0f}% {c['reward']:>10} {ours * 100:>5.0f}% "
                  f"{paper * 100:>5.0f}% {'>=' if ours >= paper else '< ':>9} "
                  f"{'>=' if ours >= 0.99 else '< ':>7}")
        sys.stdout.flush()
        if args.json:
            write_json(reports, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
