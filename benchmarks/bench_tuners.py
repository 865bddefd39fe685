"""CAPES against search-then-commit baselines, side by side, in the same harness.

Every tuner plays the same StorageGameSim games (same seeds, same delayed noisy PIs,
same tick loop, same metrics) for the full simulated hour (play-on):

    .venv/bin/python benchmarks/bench_tuners.py --seeds 20 --jobs 2 --json tuners.json

Games: the default game at 1 / 10 / 50 % noise, and three variants at ``--variant-noise``
(10 % unless given): a narrow peak (curve width 8), a wide range with a longer delay
(window 1..400, peak at 250, width 60, delay 5) and a rate limit that must climb (τ starts
at 10 in steps of 5, peak throughput 150). Tuners: ``capes`` (the engine with the
config's preset) and the baselines of ``capes/experiments/baselines.py`` by name, with
options as ``name:key=value,...`` (e.g. ``bo:dwell=3,settle=2``). The baselines use their
defaults everywhere (dwell 5, settle 3, budget 500): no per-game tuning, as for CAPES.

Columns: success = the paper's win rule within the hour; 1st win = median simulated s to
the first win (won runs); in-band = share of ticks 1,800–3,600 s whose noise-free
throughput is within the win band (median, mean over runs); tp hour / tp late = mean
noise-free throughput as a fraction of ideal over the hour / over 1,800–3,600 s (mean over
runs); min tp = lowest throughput fraction after tick 300 (median over runs); s/run =
wall seconds per run (one core each). Under each table, with ``capes`` among the tuners:
CAPES minus each baseline, paired by seed, for tp hour and tp late (mean and 95 % t
interval; an interval that holds 0 is a tie at this number of seeds).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from capes.experiments.baselines import have_cmaes, parse_tuner
from capes.experiments.converge_test import (load_config, paired_difference, run_grid,
                                             write_json)

VARIANTS = {
    "narrow": ["game.curve_width=8"],
    "wide-delay": ["game.window.max=400", "game.peak_window=250", "game.curve_width=60",
                   "game.delay_ticks=5"],
    "climb": ["game.rate_limit.default=10", "game.rate_limit.step=5",
              "game.peak_throughput=150", "game.rate_limit.max=200"],
}
DEFAULT_TUNERS = ["capes", "random", "hill", "bo", "bo:dwell=3,settle=2", "tpe", "cma"]


def games(variant_noise: float, only: list[str] | None):
    """(label, noise, overrides) of every game to play."""
    out = [(f"default {n * 100:g}%", n, []) for n in (0.01, 0.10, 0.50)]
    out += [(f"{name} {variant_noise * 100:g}%", variant_noise, over)
            for name, over in VARIANTS.items()]
    if only:
        out = [g for g in out if any(o in g[0] for o in only)]
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _f(value, spec, width):
    return f"{'-' if value is None else format(value, spec):>{width}}"


def row(tuner: str, report: dict) -> dict:
    cell, runs = report["cells"][0], report["runs"]
    return {"tuner": tuner, "runs": cell["runs"], "wins": cell["wins"],
            "success_rate": cell["success_rate"],
            "median_first_win_s": cell["median_converge_s"],
            "median_in_band_late": cell.get("median_in_band_late"),
            "mean_in_band_late": _mean(r.get("in_band_late") for r in runs),
            "mean_tp_frac_hour": _mean(r.get("tp_frac_hour") for r in runs),
            "mean_tp_frac_late": _mean(r.get("tp_frac_late") for r in runs),
            "median_min_tp_frac_after_300": cell.get("median_min_tp_frac_after_300"),
            "wall_s_per_run": cell["wall_s"] / max(1, cell["runs"])}


def format_rows(title: str, rows: list[dict]) -> str:
    w = max([22] + [len(r["tuner"]) + 1 for r in rows])
    lines = [title,
             f"{'tuner':<{w}} {'success':>9} {'1st win':>8} {'in-band':>7} {'in-band':>7} "
             f"{'tp hour':>7} {'tp late':>7} {'min tp':>6} {'s/run':>6}",
             f"{'':<{w}} {'':>9} {'med s':>8} {'med':>7} {'mean':>7} "
             f"{'mean':>7} {'mean':>7} {'>300s':>6} {'':>6}"]
    for r in rows:
        lines.append(
            f"{r['tuner']:<{w}} {r['wins']:>3}/{r['runs']:<2} {r['success_rate'] * 100:>3.0f}%"
            f"{_f(r['median_first_win_s'], '.0f', 8)} {_f(r['median_in_band_late'], '.2f', 7)} "
            f"{_f(r['mean_in_band_late'], '.2f', 7)} {_f(r['mean_tp_frac_hour'], '.3f', 7)} "
            f"{_f(r['mean_tp_frac_late'], '.3f', 7)} "
            f"{_f(r['median_min_tp_frac_after_300'], '.2f', 6)} "
            f"{_f(r['wall_s_per_run'], '.1f', 6)}")
    return "\n".join(lines)


PAIRED_KEYS = ("tp_frac_hour", "tp_frac_late")


def paired_rows(reports: dict, base: str = "capes") -> dict:
    """{baseline: {metric: paired difference}}: ``base`` minus each other tuner."""
    if base not in reports:
        return {}
    return {t: {k: paired_difference(rep["runs"], reports[base]["runs"], k)
                for k in PAIRED_KEYS}
            for t, rep in reports.items() if t != base}


def format_paired(paired: dict, base: str = "capes") -> str:
    lines = []
    for tuner, metrics in paired.items():
        parts, n = [], None
        for k, d in metrics.items():
            name = k.replace("tp_frac_", "tp ")
            if d is None:
                parts.append(f"{name} -")
                continue
            n = d["n"]
            parts.append(f"{name} {d['mean']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]")
        lines.append(f"  {base} - {tuner}: " + ", ".join(parts)
                     + (f" (n={n})" if n is not None else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20, help="runs per game and tuner")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="parallel runs (one core each)")
    p.add_argument("--tuners", nargs="+", default=DEFAULT_TUNERS,
                   help="capes and/or baseline names, options as name:key=value,...")
    p.add_argument("--games", nargs="+", default=None,
                   help="only the games whose label contains one of these "
                        "(e.g. default narrow '50%%')")
    p.add_argument("--variant-noise", type=float, default=0.10)
    p.add_argument("--config", default=None, help="converge-test config (default: "
                                                  "configs/storagegamesim.toml)")
    p.add_argument("--preset", default=None, help="the engine preset for capes")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="a config override for every game, e.g. --set game.time_limit_ticks=1800")
    p.add_argument("--json", default=None, help="write every report to this file")
    p.add_argument("--quick", action="store_true",
                   help="CI: capes, random and hill on the default game at 10 %% noise, one "
                        "seed, 300 simulated s")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.games, args.tuners = 1, ["default 10%"], ["capes", "random", "hill"]
        args.overrides.append("game.time_limit_ticks=300")

    tuners = []
    for t in args.tuners:
        if parse_tuner(t)[0] == "cma" and not have_cmaes():
            print(f"skipping {t}: the cma tuner needs the cmaes package (pip install cmaes)",
                  file=sys.stderr)
            continue
        tuners.append(t)
    plan = games(args.variant_noise, args.games)
    if not plan:
        p.error(f"no game matches {args.games}")
    t0 = time.perf_counter()
    out = {"seeds": args.seeds, "first_seed": args.first_seed, "tuners": tuners, "games": []}
    for label, noise, overrides in plan:
        base = load_config(args.config, [*args.overrides, *overrides, f"game.noise={noise}"],
                           args.preset)
        g = base.game
        start_tp = min(g.curve(g.window.default), g.rate_limit.default)
        assert g.ideal_throughput > start_tp, f"{label}: the game starts at its ideal"
        rows, reports = [], {}
        for tuner in tuners:
            t1 = time.perf_counter()
            report = run_grid(base, [noise], [base.reward.type], args.seeds,
                              first_seed=args.first_seed, jobs=args.jobs, progress=None,
                              tuner=tuner)
            rows.append(row(tuner, report))
            reports[tuner] = report
            print(f"  {label}: {tuner} done in {time.perf_counter() - t1:.0f} s",
                  file=sys.stderr, flush=True)
        title = (f"== {label}: ideal {g.ideal_throughput:g}, start {start_tp:.3g}, "
                 f"{args.seeds} seeds from {args.first_seed}, reward {base.reward.type}, "
                 f"capes preset {base.engine.preset}"
                 + (f", {' '.join(overrides)}" if overrides else ""))
        paired = paired_rows(reports)
        print(format_rows(title, rows), flush=True)
        if paired:
            print("paired by seed, 95 % t interval:\n" + format_paired(paired), flush=True)
        print(flush=True)
        out["games"].append({"game": label, "noise": noise, "overrides": overrides,
                             "ideal": g.ideal_throughput, "rows": rows,
                             "paired": paired, "reports": reports})
    wall = time.perf_counter() - t0
    out["wall_s"] = wall
    print(f"wall {wall:.0f} s for {len(plan)} games x {len(tuners)} tuners x "
          f"{args.seeds} seeds, --jobs {args.jobs}")
    if args.json:
        write_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
