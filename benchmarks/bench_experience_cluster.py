"""Experience on the cluster simulator: the per-node engine's memory of earlier sessions
(issue 37, build item 3, the cluster case; ``drl_engine/row_experience.py``).

The protocol, on ``configs/recurring-workloads-cluster.toml``'s three workload classes
(checkpoint, analysis, mixed writers + readers; idle nodes in analysis), each phase
``--phase-ticks`` long, ``--nodes`` nodes:

1. Record two sessions (seeds of their own, never played again): checkpoint → analysis
   and checkpoint → mixed, and merge them (``capes replay merge``): the experience DB.
   Record the same on *another target* (a cluster whose servers are twice as fast and
   whose RPCs thrash later: the same classes and signatures, other best settings): the
   misleading DB.
2. Play checkpoint → analysis → mixed, paired by seed (seed s: the same cluster noise
   in every arm): ``fresh`` (no experience), ``memory`` (the experience DB: every
   recorded workload a known context of every row), ``misleading`` (the misleading DB).

Per run and phase: time to band (the phase's ``recover_ticks``: first tick from which
the noise-free objective stays within ±``win_band`` of the phase's best static setting
for ``win_hold_ticks`` + 1 ticks; a phase that never gets there counts as its length,
censored); per run the mean objective / best static over the run (``run_relative``) and
the worst 10 s of it. Differences are arm − fresh per seed, CI a paired bootstrap.

    python benchmarks/bench_experience_cluster.py --seeds 8 --json out.json
    python benchmarks/bench_experience_cluster.py --quick        # a smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from capes.common.one_core import use_one_core  # noqa: E402
from capes.experiments.cluster_test import load_config, run_one, write_json  # noqa: E402
from capes.experiments.replay_merge import merge  # noqa: E402
from drl_engine.row_experience import RowExperience  # noqa: E402
from paired_arms import add_run_options, paired_figure, work_dir  # noqa: E402

CONFIG = ROOT / "configs" / "recurring-workloads-cluster.toml"
RECORD_SEED = 10_000
ARMS = ("fresh", "memory", "misleading")
OTHER_TARGET = {"server_capacity": 4000.0, "thrash_rpcs": 900.0}   # the misleading DB's


def schedule(cfg, names: list[str], phase_ticks: int, **cluster):
    """``cfg`` playing the recurring config's classes ``names`` in order, each
    ``phase_ticks`` long (the first one is the config's opening workload)."""
    c = cfg.cluster
    by_name = {ph.name: ph for ph in c.phases}
    phases = [dataclasses.replace(by_name[n], at_tick=i * phase_ticks)
              for i, n in enumerate(names) if i > 0]
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        c, phases=phases, time_limit_ticks=phase_ticks * len(names), **cluster))


def record(cfg, phase_ticks: int, workdir: Path, name: str, **cluster) -> Path:
    """Two recorded sessions (checkpoint → analysis, checkpoint → mixed), merged."""
    dbs = []
    for i, second in enumerate(("analysis", "mixed")):
        db = workdir / f"{name}-{i}.db"
        run_one(schedule(cfg, ["checkpoint", second], phase_ticks, **cluster),
                RECORD_SEED + i, db_path=str(db))
        dbs.append(db)
    merged = workdir / f"{name}-merged.db"
    merge(dbs, merged)
    return merged


def metrics(run: dict) -> dict:
    rel = np.asarray(run["trace"]["relative"], float)
    return {"seed": run["seed"],
            "time_to_band": [float(p["recover_ticks"]) if p["recover_ticks"] is not None
                             else float(p["ticks"]) for p in run["per_phase"]],
            "won": [p["recover_ticks"] is not None for p in run["per_phase"]],
            "phases": [p["name"] for p in run["per_phase"]],
            "run_relative": float(run["mean_relative"]),
            "worst_10s": float(np.convolve(rel, np.ones(10) / 10, "valid").min()),
            "returns": run.get("context_returns"), "news": run.get("context_news"),
            "wall_s": run["wall_s"]}


def _cell(fresh: list, arm: list, key) -> dict:
    pairs = {r["seed"]: r for r in fresh}
    return paired_figure([key(pairs[r["seed"]]) for r in arm if r["seed"] in pairs],
                         [key(r) for r in arm if r["seed"] in pairs], [key(r) for r in arm])


def summarise(runs: dict) -> dict:
    """{arm: {"per_phase": {name: time to band}, "run_relative", "worst_10s"}}."""
    fresh, out = runs["fresh"], {}
    names = fresh[0]["phases"]
    for arm, rs in runs.items():
        out[arm] = {
            "per_phase": {f"{i}:{n}": {**_cell(fresh, rs, lambda r, i=i: r["time_to_band"][i]),
                                       "won": f"{sum(r['won'][i] for r in rs)}/{len(rs)}"}
                          for i, n in enumerate(names)},
            "run_relative": _cell(fresh, rs, lambda r: r["run_relative"]),
            "worst_10s": _cell(fresh, rs, lambda r: r["worst_10s"]),
            "returns_median": float(np.median([r["returns"] or 0 for r in rs]))}
    return out


def table(report: dict) -> str:
    def fmt(c, f="%.0f", d="%+.0f"):
        ci = "" if c["ci95"] is None else (" [" + d % c["ci95"][0] + ", " +
                                           d % c["ci95"][1] + "]")
        diff = "" if c["diff_vs_fresh"] is None else " " + d % c["diff_vs_fresh"] + ci
        return f % c["median"] + diff
    lines = []
    for arm, a in report["arms"].items():
        ph = "; ".join(f"{n} {fmt(c)} ({c['won']})" for n, c in a["per_phase"].items())
        lines.append(f"{arm:<10} time to band s: {ph}")
        lines.append(f"{'':<10} run relative {fmt(a['run_relative'], '%.3f', '%+.3f')}; "
                     f"worst 10 s {fmt(a['worst_10s'], '%.3f', '%+.3f')}; "
                     f"returns (median) {a['returns_median']:.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help="paired seeds (default 8)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=16, help="cluster nodes (default 16)")
    ap.add_argument("--phase-ticks", type=int, default=300,
                    help="simulated s per phase (default 300)")
    add_run_options(ap, "a smoke run: 1 seed, 8 nodes, 150 s phases", "keep the DBs here")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.nodes, args.phase_ticks = 1, 8, 150
    cfg = load_config(CONFIG, [f"cluster.nodes={args.nodes}"])
    use_one_core()
    t0 = time.perf_counter()
    with work_dir(args.workdir, "capes-bench-exp-cluster-") as work:
        params = list(cfg.cluster.param_specs().values())
        priors = {"memory": record(cfg, args.phase_ticks, work, "experience"),
                  "misleading": record(cfg, args.phase_ticks, work, "misleading",
                                       **OTHER_TARGET)}
        priors = {arm: RowExperience.load([db], cfg.engine, cfg.reward, cfg.model, params)
                  for arm, db in priors.items()}
        for arm, prior in priors.items():
            print(f"{arm}: {prior.summary()}", file=sys.stderr, flush=True)
        play = schedule(cfg, ["checkpoint", "analysis", "mixed"], args.phase_ticks)
        runs: dict = {arm: [] for arm in ARMS}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for arm in ARMS:
                run = run_one(play, seed, keep_trace=True, experience=priors.get(arm))
                runs[arm].append(metrics(run))
                print(f"seed {seed} {arm}: time to band {runs[arm][-1]['time_to_band']}, "
                      f"run {runs[arm][-1]['run_relative']:.3f} "
                      f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})",
                      file=sys.stderr, flush=True)
    report = {"arms": summarise(runs), "runs": runs, "seeds": args.seeds,
              "first_seed": args.first_seed, "nodes": args.nodes,
              "phase_ticks": args.phase_ticks, "other_target": OTHER_TARGET,
              "wall_s": time.perf_counter() - t0, "loadavg": os.getloadavg(),
              "command": "python benchmarks/bench_experience_cluster.py "
                         + " ".join(sys.argv[1:] if argv is None else argv)}
    print(table(report))
    print(f"wall {report['wall_s']:.0f} s, load average {report['loadavg'][0]:.1f}")
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
