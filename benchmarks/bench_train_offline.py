"""``capes train``'s speed on a merged DB of many sessions: steps/s with the minibatches
sampled on the host (numpy, Algorithm 2's rejection draws, one copy to the device a
step) against drawn on the device (drl_engine/device_transitions.py; on CUDA inside
the step's CUDA graph: the fast path ``--sampling auto`` takes there).

Records ``--sessions`` converge runs of the default game (``--ticks`` each), merges them
with ``capes replay merge``'s machinery, then trains ``--steps`` minibatches per run,
the paths interleaved ``--reps`` times (alternating their order), on ``--device``
(auto: CUDA when present). On CUDA a third path, ``plain`` (``capes train --no-fast``:
host sampling, the step run eagerly, no CUDA graph; on the CPU ``host`` is that path),
shows what the whole fast path buys. Prints and writes (``--json``) per path the
median steps/s with min and max, the path's name (``fast``, ``plain``, ...), and the
load average.

    .venv/bin/python benchmarks/bench_train_offline.py --json out.json
    .venv/bin/python benchmarks/bench_train_offline.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = {"host": {"sampling": "host"}, "device": {"sampling": "device"},
         "plain": {"fast": False}}          # plain: on CUDA only (host is it on a CPU)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--ticks", type=int, default=600)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="CI: 2 sessions, 200 steps, 1 rep")
    args = ap.parse_args(argv)
    if args.quick:
        args.sessions, args.ticks, args.steps, args.reps = 2, 200, 200, 1
    import torch

    from capes.experiments.converge_test import load_config, run_one
    from capes.experiments.offline_training import (DEFAULT_CONFIG, load_training_config,
                                                    resolve_device, train_offline)
    from capes.experiments.replay_merge import merge
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="capes-train-bench-") as tmp:
        d = Path(tmp)
        game = load_config(DEFAULT_CONFIG, [f"game.time_limit_ticks={args.ticks}"])
        t0 = time.perf_counter()
        for s in range(args.sessions):
            run_one(game, s, db_path=d / f"run{s}.db")
        merge([d / f"run{s}.db" for s in range(args.sessions)], d / "merged.db")
        print(f"recorded and merged {args.sessions} sessions of {args.ticks} ticks in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        cfg = load_training_config(DEFAULT_CONFIG)
        arms = [p for p in PATHS if p != "plain" or resolve_device(args.device, None,
                                                                   "auto") != "cpu"]
        rates: dict[str, list[float]] = {p: [] for p in arms}
        names: dict[str, str] = {}
        device = None
        for rep in range(args.reps):
            for path in (arms if rep % 2 == 0 else arms[::-1]):
                r = train_offline(d / "merged.db", d / "m.pt", args.steps, cfg,
                                  device=args.device, seed=rep, **PATHS[path])
                rates[path].append(r.steps_per_s)
                names[path] = r.path
                device, transitions = r.device, r.candidate_transitions
                print(f"rep {rep} {path:>6}: {r.steps_per_s:7.0f} steps/s "
                      f"({r.steps} steps in {r.wall_s:.1f} s on {r.device}, the {r.path} "
                      f"path)", flush=True)
    load.append(os.getloadavg()[0])
    out = {"command": sys.argv, "device": device, "sessions": args.sessions,
           "ticks": args.ticks, "transitions": transitions, "steps": args.steps,
           "reps": args.reps, "threads": args.threads, "load_average": load,
           "paths": names,
           "steps_per_s": {p: {"median": statistics.median(v), "min": min(v),
                               "max": max(v), "all": v} for p, v in rates.items()}}
    med = {p: out["steps_per_s"][p]["median"] for p in arms}
    out["device_over_host"] = med["device"] / med["host"]
    if "plain" in med:
        out["device_over_plain"] = med["device"] / med["plain"]
    for p in arms:
        s = out["steps_per_s"][p]
        print(f"{p:>6}: median {s['median']:.0f} steps/s (min {s['min']:.0f}, max "
              f"{s['max']:.0f})")
    print(f"device / host: {out['device_over_host']:.2f}"
          + (f"; device / plain: {out['device_over_plain']:.2f}" if "plain" in med else "")
          + f"; load average {load[0]:.1f} → {load[1]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
