#!/usr/bin/env python3
"""Did a refactor of the engine move a result? Runs a fixed set of converge tests and
compares their JSON reports with those of another tree, wall times left out.

    python tools/engine_identity.py run OUT_DIR            # every run of the set
    python tools/engine_identity.py run OUT_DIR --only stationary-10
    python tools/engine_identity.py compare BEFORE_DIR AFTER_DIR

Run it from the tree to measure (``PYTHONPATH=$PWD``), once before the change (e.g. from
``git archive`` of the base commit) and once after. ``compare`` exits 1 and names the
first differing field of each report that moved. The per-tick trace test
(tests/test_engine_trace.py, fixture from tools/engine_trace.py) is the quick check; this
is the long one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# name: (config, extra arguments); seeds 0-3 unless the name says otherwise
RUNS = {
    "stationary-1": ("configs/storagegamesim.toml", ["--noise", "0.01", "--seeds", "4"]),
    "stationary-10": ("configs/storagegamesim.toml", ["--noise", "0.1", "--seeds", "4"]),
    "stationary-50": ("configs/storagegamesim.toml", ["--noise", "0.5", "--seeds", "4"]),
    "stationary-10-paper": ("configs/storagegamesim.toml",
                            ["--noise", "0.1", "--seeds", "2", "--preset", "paper"]),
    "recurring": ("configs/recurring-workloads.toml", ["--seeds", "4"]),
    "recurring-mixes": ("configs/recurring-workloads-mixes.toml", ["--seeds", "2"]),
    "cluster-8": ("configs/cluster-sim.toml", ["--set", "cluster.nodes=8", "--seeds", "4"]),
    "cluster-64": ("configs/cluster-sim.toml", ["--seeds", "2"]),
    "recurring-cluster-16": ("configs/recurring-workloads-cluster.toml",
                             ["--set", "cluster.nodes=16", "--seeds", "4"]),
}
TIMING = {"wall_s", "write_s", "wall_s_per_sim_hour", "wall_s_per_run", "writer_cpu_s"}


def run(out: Path, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, (config, extra) in RUNS.items():
        if only and name not in only:
            continue
        cmd = [sys.executable, "-m", "capes", "converge-test", "--config", config,
               "--quiet", "--json", str(out / f"{name}.json"), *extra]
        print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
        if subprocess.run(cmd, stdout=subprocess.DEVNULL, env=dict(os.environ)).returncode:
            print(f"{name}: failed", file=sys.stderr)
            return 1
    return 0


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _first_difference(a, b, path="") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'after' if k in b else 'before'}"
            if (d := _first_difference(a[k], b[k], f"{path}.{k}")) is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items before, {len(b)} after"
        for i, (x, y) in enumerate(zip(a, b)):
            if (d := _first_difference(x, y, f"{path}[{i}]")) is not None:
                return d
        return None
    return None if a == b else f"{path}: {a!r} before, {b!r} after"


def compare(before: Path, after: Path) -> int:
    moved = 0
    for f in sorted(before.glob("*.json")):
        g = after / f.name
        if not g.exists():
            print(f"{f.stem}: missing after")
            moved += 1
            continue
        d = _first_difference(_strip(json.loads(f.read_text())),
                              _strip(json.loads(g.read_text())))
        print(f"{f.stem}: {'identical' if d is None else 'MOVED ' + d}")
        moved += d is not None
    return 1 if moved else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--only", action="append", default=[], choices=list(RUNS))
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args(argv)
    return run(args.out, args.only) if args.cmd == "run" else compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
