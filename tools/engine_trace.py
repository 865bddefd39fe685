#!/usr/bin/env python3
"""A short seeded trace of the engine per tick, flat and per-node: the golden fixture
``tests/fixtures/engine_trace.json`` that ``tests/test_engine_trace.py`` replays, so a
refactor that moves a single action fails at once (the converge JSONs of
``tools/engine_identity.py`` are the long check).

    python tools/engine_trace.py                 # rewrite the fixture (a deliberate change)
    python tools/engine_trace.py --check         # exit 1, naming the first differing tick

Per tick: the action(s), the values after it, ε and the loss (10 significant digits). A
per-node tick keeps its values' sum per knob and a hash of every row's action and
values (the fixture stays small). Results depend on the float arithmetic of numpy and torch: the
fixture records their versions and the test skips, saying so, under others.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "engine_trace.json"

# name: (config, overrides, preset, seed): the short runs of both modes; the recurring
# ones go A (0-300 s), B, back to A at 500 s (a new workload, then a return)
_AB_A = ('[{at_tick=300, name="analysis", active_fraction=0.5, workloads=[{name='
         '"analysis", write_fraction=0.1, request_kb=256.0, sequential=0.6}]}, '
         '{at_tick=500, name="checkpoint", workloads=[{name="checkpoint", '
         'write_fraction=0.9, request_kb=1024.0, sequential=0.9}]}]')
CASES = {
    "stationary": ("configs/storagegamesim.toml",
                   ["game.noise=0.1", "game.time_limit_ticks=300"], None, 0),
    "stationary-paper": ("configs/storagegamesim.toml",
                         ["game.noise=0.1", "game.time_limit_ticks=300"], "paper", 1),
    "recurring": ("configs/recurring-workloads.toml",
                  ["game.time_limit_ticks=700", 'game.phases=[{at_tick=300, workload='
                   '"randwrite"}, {at_tick=500, workload="seqread"}]'], None, 0),
    "cluster": ("configs/cluster-sim.toml",
                ["cluster.nodes=8", "cluster.time_limit_ticks=400",
                 f"cluster.phases={_AB_A[:_AB_A.index('}]}') + 3]}]"], None, 0),
    "recurring-cluster": ("configs/recurring-workloads-cluster.toml",
                          ["cluster.nodes=8", "cluster.time_limit_ticks=700",
                           f"cluster.phases={_AB_A}"], None, 1),
}


def cpu_id() -> str:
    """The CPU, by model and feature flags: the same wheels dispatch float32 kernels by
    the CPU's features (measured: two AVX-512 hosts' losses differ at the 7th digit from
    the first steps, and the paper preset's actions by tick 290), so a trace holds
    only where it was recorded."""
    import platform
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    field = {k.strip(): v.strip() for k, _, v in
             (line.partition(":") for line in info.split("\n\n")[0].splitlines())}
    flags = hashlib.sha1(field.get("flags", "").encode()).hexdigest()[:8]
    return f"{field.get('model name', platform.machine())} (flags {flags})"


def versions() -> dict:
    import torch
    return {"numpy": np.__version__, "torch": torch.__version__.split("+")[0],
            "cpu": cpu_id()}


def _g(x: float | None) -> float | None:
    """10 significant digits: any change a refactor could make shows, the fixture small."""
    return None if x is None else float(f"{x:.10g}")


def _tick(rec, player) -> list:
    """[action ("rows" per node, None: no decision), values (per node: their sum per
    knob), ε, loss, per node: a hash of every row's action and values]."""
    d = rec.decision
    eps, loss = _g(float(player.epsilon)), _g(rec.loss)
    if d is None:
        return [None, None, eps, loss]
    if d.rows:
        values = np.asarray(d.values, np.float64)
        h = hashlib.sha256(np.asarray(d.row_actions, np.int64).tobytes()
                           + values.tobytes()).hexdigest()[:10]
        return ["rows", [_g(v) for v in values.sum(axis=0)], eps, loss, h]
    return [int(d.action), [float(v) for v in d.values], eps, loss]


def trace(name: str) -> list:
    """One case's ticks (see the module docstring)."""
    from capes.common.one_core import use_one_core
    from capes.settings import is_cluster_config
    use_one_core()                    # as the converge test's runs (and its arithmetic)
    config, overrides, preset, seed = CASES[name]
    ticks: list = []
    if is_cluster_config(ROOT / config):
        from capes.experiments import cluster_test
        cfg = cluster_test.load_config(ROOT / config, overrides, preset)
        cluster_test.run_one(cfg, seed, feed="reader",
                             observers=[lambda rec, sim, p: ticks.append(_tick(rec, p))])
    else:
        from capes.experiments import converge_test
        cfg = converge_test.load_config(ROOT / config, overrides, preset)
        converge_test.run_one(cfg, seed,
                              observers=[lambda rec, game, e: ticks.append(_tick(rec, e))])
    return ticks


FIELDS = ("action", "values", "epsilon", "loss", "row hash")


def first_difference(want: list, got: list) -> str | None:
    """The first tick where ``got`` differs from ``want``, in words (None: identical)."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return f"tick {i}: " + ", ".join(
                f"{f} {x!r} -> {y!r}" for f, x, y in zip(FIELDS, a + [None] * 5,
                                                      b + [None] * 5) if x != y)
    if len(want) != len(got):
        return f"{len(want)} ticks recorded, {len(got)} now"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the fixture")
    args = p.parse_args(argv)
    if args.check:
        fixture = json.loads(FIXTURE.read_text())
        bad = 0
        for name in CASES:
            diff = first_difference(fixture["cases"][name], trace(name))
            print(f"{name}: {'identical' if diff is None else diff}")
            bad += diff is not None
        return 1 if bad else 0
    out = {"versions": versions(), "cases": {name: trace(name) for name in CASES}}
    FIXTURE.write_text("{\"versions\": " + json.dumps(out["versions"]) + ",\n\"cases\": {\n"
                       + ",\n".join(f"{json.dumps(n)}: [\n" + ",\n".join(
                           json.dumps(t, separators=(",", ":")) for t in ticks) + "]"
                                     for n, ticks in out["cases"].items()) + "}}\n")
    print(f"wrote {FIXTURE.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
