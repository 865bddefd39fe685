"""Time of one simulated hour of the converge test on one core, the default preset
beside the paper preset in the same run, and the start-up time of a converge-test process.

    .venv/bin/python benchmarks/bench_sim_hour.py [--runs 3] [--noise 0.1] [--startup 5]
    .venv/bin/python benchmarks/bench_sim_hour.py --quick     # CI: one pair, 600 s each

Each run plays one simulated hour with the win switched off (the hold time is longer
than the game), so every run goes through the real data path for all 3,600 simulated
seconds: SQLite writes and reads, the engine's action and its training step(s) every
second. A 30-tick run of each arm first takes the process's one-time costs (not
reported). The arms alternate (default, paper, ablation, then ablation, paper, default,
...) on the same seeds, so all see the same load; the ratio default / paper is taken per
seed and shown as min / median / max. The third arm is the default preset with its
speed setting switched off (``engine.train_every = 1``: a training step every tick, as
the paper's; the default trains a k-times larger minibatch every k-th tick), so what
that setting saves is shown in the same run. Each run reports wall time and CPU time
(``time.process_time``): on a shared machine the CPU time is the steadier measure, but
not a clean one (caches and a busy sibling hyperthread still slow a run down), so the
load average is printed too; the goals are for an idle core.

Start-up: a fresh ``capes converge-test --seeds 1 --set game.time_limit_ticks=1
--quiet`` process (the CLI's own ``main``, with a probe that notes the clock when the
first tick's action is applied): wall time from the spawn to the end of the first tick
(interpreter, imports, config, replay DB, engine, one tick) and the child's CPU time
then; and the whole one-tick process (the report and exit too). Torch is not in either:
the engine imports it when its network is first needed (drl_engine/dqn.py), a ~2 s
one-time cost that a run pays about 15 ticks in (in the warm-up here, not in the hours).

Goals (issue 23): default <= 1.1 x paper; <= 3 s per simulated hour on an idle core;
start-up <= 1.5 s before the first tick. ``--quick`` runs 600 simulated seconds per
preset (scaled to an hour, which over-weights the exploration period: not a goal figure).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from capes.common.one_core import use_one_core
from capes.experiments.converge_test import load_config, run_one

PRESETS = ("default", "paper")
# the arms timed: each preset, and the default preset without its speed setting
# (engine.train_every = 1: a training step every tick, as the paper), its ablation
ABLATION = "default, train_every=1"
ARMS = {"default": ("default", []), "paper": ("paper", []),
        ABLATION: ("default", ["engine.train_every=1"])}
STARTUP_ARGS = ["converge-test", "--seeds", "1", "--set", "game.time_limit_ticks=1",
                "--quiet"]
# the child: the CLI, with the first applied action noted (monotonic clock, own CPU)
STARTUP_PROBE = f"""
import resource, sys, time
from capes.experiments import converge_test
apply = converge_test.GameSource.apply
def first(self, decision):
    apply(self, decision)
    if not getattr(first, "seen", False):
        first.seen = True
        r = resource.getrusage(resource.RUSAGE_SELF)
        print("FIRST_TICK", time.monotonic(), r.ru_utime + r.ru_stime, flush=True)
converge_test.GameSource.apply = first
from capes.cli import main
sys.exit(main({STARTUP_ARGS!r}))
"""


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def one_hour(arm: str, seed: int, noise: float, ticks: int) -> tuple[float, float]:
    """(wall s, CPU s) per simulated hour of one run of ``arm`` (a key of ARMS)."""
    preset, sets = ARMS[arm]
    cfg = load_config(None, [f"game.noise={noise}", "game.win_hold_ticks=100000",
                             f"game.time_limit_ticks={ticks}", *sets], preset)
    cpu = time.process_time()
    r = run_one(cfg, seed)
    cpu = time.process_time() - cpu
    return r.wall_s / r.ticks * 3600, cpu / r.ticks * 3600


def startup() -> tuple[float, float, float, float]:
    """(wall s, CPU s) to the end of the first tick, then (wall s, CPU s) of the whole
    one-tick converge-test process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", STARTUP_PROBE], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    stamp, cpu_first = (float(v) for v in next(
        line for line in out.splitlines() if line.startswith("FIRST_TICK")).split()[1:])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return stamp - t, cpu_first, wall, cpu


def spread(xs) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="seeds; each plays both presets")
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--ticks", type=int, default=3600, help="simulated seconds per run")
    p.add_argument("--startup", type=int, default=5, help="start-up processes timed")
    p.add_argument("--quick", action="store_true", help="CI: one pair of 600 s runs, "
                   "one start-up")
    args = p.parse_args()
    if args.quick:
        args.runs, args.ticks, args.startup = 1, 600, 1
    use_one_core()
    print(f"load average at start {load()} (1/5/15 min); one core per run; "
          f"{args.ticks} simulated s per run, noise {args.noise:g}", flush=True)
    arms = list(ARMS)
    for name in arms:              # warm-up, not reported: the process's one-time costs
        one_hour(name, 1000, args.noise, 30)          # (lazy imports, first torch calls)
    times = {name: {"wall": [], "cpu": []} for name in arms}
    for seed in range(args.runs):
        order = arms if seed % 2 == 0 else arms[::-1]
        for name in order:
            wall, cpu = one_hour(name, seed, args.noise, args.ticks)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
            print(f"seed {seed} {name:>22}: {wall:6.2f} s wall, {cpu:6.2f} s CPU per "
                  f"simulated hour", flush=True)
    print(f"\n{'arm':>22} {'wall s/h min / median / max':>30} "
          f"{'CPU s/h min / median / max':>30}")
    for name in arms:
        print(f"{name:>22} {spread(times[name]['wall']):>30} "
              f"{spread(times[name]['cpu']):>30}")
    for kind in ("wall", "cpu"):
        for name, goal in (("default", "; goal <= 1.1"), (ABLATION, "")):
            ratios = [d / q for d, q in zip(times[name][kind], times["paper"][kind])]
            label = "default" if name == "default" else f"({name})"
            print(f"{label} / paper, {kind:>4} time, paired by seed: {spread(ratios)} "
                  f"(min / median / max of {len(ratios)}{goal})")
    if args.startup:
        runs = [startup() for _ in range(args.startup)]
        print(f"start-up of `capes {' '.join(STARTUP_ARGS)}` (min / median / max of "
              f"{len(runs)}):\n  to the end of the first tick: wall "
              f"{spread([r[0] for r in runs])} s, CPU {spread([r[1] for r in runs])} s "
              f"(goal <= 1.5 s)\n  the whole one-tick process:   wall "
              f"{spread([r[2] for r in runs])} s, CPU {spread([r[3] for r in runs])} s")
    print(f"load average at end {load()}; goals are for an idle core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
