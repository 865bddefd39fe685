"""Wall time of one full simulated hour of the converge test on one CPU core.

    .venv/bin/python benchmarks/bench_sim_hour.py [--preset default] [--runs 3]

The win is switched off (the hold time is longer than the game) so every run plays all
3,600 simulated seconds through the real data path: SQLite writes and reads, the
engine's action and its training step(s) every second. Goal: <= 10 s per hour.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from capes.common.one_core import use_one_core
from capes.experiments.converge_test import load_config, run_one


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--quick", action="store_true", help="CI: one run")
    args = p.parse_args()
    if args.quick:
        args.runs = 1
    use_one_core()
    cfg = load_config(None, [f"game.noise={args.noise}", "game.win_hold_ticks=100000"],
                      args.preset)
    walls = []
    for seed in range(args.runs):
        r = run_one(cfg, seed)
        walls.append(r.wall_s / r.ticks * 3600)
        print(f"seed {seed}: {r.ticks} simulated s, {r.train_steps} training steps, "
              f"{r.wall_s:.2f} s wall", flush=True)
    print(f"preset {args.preset}: median {statistics.median(walls):.2f} s wall per simulated "
          f"hour on one core ({cfg.engine.train_steps_per_tick} training step(s) per "
          f"simulated second); goal <= 10 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
