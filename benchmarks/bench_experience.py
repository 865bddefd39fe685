"""Does experience from earlier sessions make a new session faster? (issue 37)

The protocol, on the workload family of ``configs/workload-family.toml`` (the write
fraction x moves the best window and rate limit, and the signature PIs):

1. Record one fresh session at each of ``RECORDED`` (x = 0.2 … 0.8) and merge them
   (``capes replay merge``): the experience DB. Record the same on *another target*
   (the family mirrored: readers want the writers' window and the other way round; the
   same PIs, the same signatures): the misleading DB. Train a Q-network offline on each
   merged DB (``capes train``) for the network's arms.
2. Play held-out workloads, paired by seed (seed s plays the same member with the same
   game noise in every arm): ``inside`` (x between recorded ones), ``outside`` (x beyond
   them), ``misleading`` (inside values, the misleading DB).
3. Arms: ``fresh`` (no experience); ``memory`` (the nearest recorded workload's best
   setting as the start, then the normal search); ``interpolate`` (between the best
   settings of the two recorded workloads whose signatures enclose the new one, else as
   ``memory``; the default start); ``gp`` (a GP over (signature, knobs)
   fitted on the merged data proposes the start); ``qnet`` (the network trained on the
   merged DB walks from the start: ``engine.context_infer``); ``qnet_probes`` (the
   setting the network values most is the start). Every experience arm also seeds the
   per-workload memory and checks the start's promise (``drl_engine/prior_experience.py``);
   they differ only in the start proposed for the unseen workload, so a difference
   between them is that proposal's.

Per arm and case: time to band (simulated s to the game's win: noise-free throughput
within ±10 % of the member's ideal for 21 s; a session that never gets there counts as
its length, censored), regret over the first 10 minutes (mean 1 − tp/ideal),
``hour_relative`` (mean tp/ideal over the played session: ``--ticks``, 1,200 s by
default, 3,600 for a whole hour), worst 10 s (lowest 10-s mean of tp/ideal). Differences
are arm − fresh per seed; the CI is a paired bootstrap (capes.common.stats).

    python benchmarks/bench_experience.py --json out.json            # 20 seeds
    python benchmarks/bench_experience.py --quick                    # CI: well under 60 s
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from capes.common.atomic import write_json  # noqa: E402
from capes.common.one_core import use_one_core  # noqa: E402
from capes.experiments.converge_test import load_config, run_one  # noqa: E402
from capes.experiments.offline_training import TrainingConfig, train_offline  # noqa: E402
from capes.experiments.replay_merge import merge  # noqa: E402
from drl_engine.prior_experience import DEFAULT_START, PriorExperience  # noqa: E402
from paired_arms import add_run_options, paired_figure, work_dir  # noqa: E402

CONFIG = ROOT / "configs" / "workload-family.toml"
RECORDED = (0.2, 0.35, 0.5, 0.65, 0.8)
INSIDE = (0.275, 0.425, 0.575, 0.725)
OUTSIDE = (0.0, 0.05, 0.95, 1.0)
ARMS = ("fresh", "memory", "interpolate", "gp", "qnet", "qnet_probes")
CASES = ("inside", "outside", "misleading")
NETWORK_ARMS = ("qnet", "qnet_probes")
RECORD_SEED = 10_000         # recorded sessions' seeds: none of them is played again


def mirrored(family):
    """Another target: the same signatures, the optimum of the other end."""
    return dataclasses.replace(family, reader_window=family.writer_window,
                               writer_window=family.reader_window)


def member(cfg, x: float, ticks: int, family=None):
    game = dataclasses.replace(cfg.game, write_fraction=x, time_limit_ticks=ticks,
                               family=family or cfg.game.family)
    return dataclasses.replace(cfg, game=game)


def record(cfg, family, ticks: int, steps: int, workdir: Path, name: str,
           values=RECORDED):
    """Record a session per value, merge them, train a network on the merge."""
    dbs = []
    for i, x in enumerate(values):
        db = workdir / f"{name}-{i}.db"
        run_one(member(cfg, x, ticks, family), seed=RECORD_SEED + i, db_path=db)
        dbs.append(db)
    merged = workdir / f"{name}-merged.db"
    merge(dbs, merged)
    model = workdir / f"{name}-model.pt"
    train_offline(merged, model, steps, TrainingConfig(engine=cfg.engine, reward=cfg.reward),
                  device="cpu", seed=0)
    return merged, model


def metrics(run) -> dict:
    tp = np.asarray(run.trace["true_throughput"], float)
    ideal = run.ideal
    rel = tp / ideal
    ttb = run.first_win_s if run.first_win_s is not None else len(rel)
    k = 10
    worst = float(np.convolve(rel, np.ones(k) / k, "valid").min()) if len(rel) >= k else \
        float(rel.min())
    return {"seed": run.seed, "time_to_band": float(ttb), "won": run.first_win_s is not None,
            "regret_10min": float(np.mean(1.0 - rel[:600])),
            "hour_relative": float(rel.mean()), "worst_10s": worst}


def _play(job):
    cfg, seed, model, prior = job
    use_one_core()
    run = run_one(cfg, seed, init_model=model, keep_trace=True, experience=prior)
    run.ideal = member_ideal(cfg)
    return metrics(run)


def member_ideal(cfg) -> float:
    return cfg.game.phase_configs()[0].ideal_throughput


def jobs_for(cfg, case: str, arm: str, seeds: range, ticks: int, sources: dict,
             inside=INSIDE):
    values = OUTSIDE if case == "outside" else inside
    db, model = sources["misleading" if case == "misleading" else "experience"]
    prior = None
    if arm != "fresh":
        prior = PriorExperience.load([db], cfg.engine, cfg.reward, start=arm)
    return [(member(cfg, values[s % len(values)], ticks), s, model if arm in NETWORK_ARMS
             else None, prior) for s in seeds]


def summarise(runs: dict) -> dict:
    """{arm: {case: figures}} from {(arm, case): [per-seed metrics]}; fresh of the
    misleading case is fresh of the inside case (the same members and seeds)."""
    out: dict = {}
    for (arm, case), rs in runs.items():
        fresh = {r["seed"]: r for r in runs[("fresh", "inside" if case == "misleading"
                                             else case)]}
        pairs = [(fresh[r["seed"]], r) for r in rs if r["seed"] in fresh]
        cell = {key: paired_figure([a[key] for a, _ in pairs], [b[key] for _, b in pairs],
                                   [r[key] for r in rs])
                for key in ("time_to_band", "regret_10min", "hour_relative", "worst_10s")}
        cell["won"] = f"{sum(r['won'] for r in rs)}/{len(rs)}"
        tt = cell["time_to_band"]
        out.setdefault(arm, {})[case] = {
            "time_to_band": tt, "regret_10min": cell["regret_10min"]["median"],
            "hour_relative": cell["hour_relative"]["median"],
            "worst_10s": cell["worst_10s"]["median"], "won": cell["won"],
            "diffs": {k: {"diff_vs_fresh": cell[k]["diff_vs_fresh"], "ci95": cell[k]["ci95"]}
                      for k in ("regret_10min", "hour_relative", "worst_10s")}}
    return out


def winner(arms: dict) -> str:
    """Among the arms never worse than fresh outside and with the misleading DB (time to
    band's CI reaching 0 or below) and faster inside (its CI below 0), the one whose
    paired median differences in time to band, summed over the three cases, are the
    lowest; ``fresh`` when none qualifies."""
    def ci(a, c):
        return arms[a][c]["time_to_band"]["ci95"] or [0.0, 0.0]
    ok = [a for a in arms if a != "fresh" and ci(a, "inside")[1] < 0
          and all(ci(a, c)[0] <= 0 for c in ("outside", "misleading"))]
    if not ok:
        return "fresh"
    return min(ok, key=lambda a: sum(arms[a][c]["time_to_band"]["diff_vs_fresh"] or 0.0
                                     for c in CASES))


def table(report: dict) -> str:
    lines = [f"{'arm':<12} {'case':<11} {'t-band s':>8} {'diff':>7} {'95% CI':>16} "
             f"{'won':>6} {'regret10':>8} {'hour rel':>8} {'worst10s':>8}"]
    for arm, cases in report["arms"].items():
        for case, c in cases.items():
            t = c["time_to_band"]
            diff = "-" if t["diff_vs_fresh"] is None else f"{t['diff_vs_fresh']:+.0f}"
            ci = "-" if t["ci95"] is None else "[%+.0f, %+.0f]" % tuple(t["ci95"])
            lines.append(f"{arm:<12} {case:<11} {t['median']:>8.0f} {diff:>7} {ci:>16} "
                         f"{c['won']:>6} "
                         f"{c['regret_10min']:>8.3f} {c['hour_relative']:>8.3f} "
                         f"{c['worst_10s']:>8.3f}")
    lines.append(f"default arm (faster inside, never worse outside or misleading, the "
                 f"lowest summed median difference): "
                 f"{report['default_arm']}; shipped default start: {report['shipped_start']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="paired seeds per case (default 20)")
    ap.add_argument("--ticks", type=int, default=1200,
                    help="simulated s per played session (default 1200)")
    ap.add_argument("--record-ticks", type=int, default=3600,
                    help="simulated s per recorded session (default 3600)")
    ap.add_argument("--steps", type=int, default=3000,
                    help="offline minibatch steps of the network arms' training")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated (fresh always)")
    ap.add_argument("--recorded", help="write fractions recorded, comma-separated (default "
                    + ",".join(map(str, RECORDED)) + "): sparser ones leave the inside "
                    "members new workloads rather than returns of the nearest")
    ap.add_argument("--inside", help="held-out inside write fractions (default "
                    + ",".join(map(str, INSIDE)) + ")")
    ap.add_argument("--jobs", type=int, default=2, help="sessions in parallel")
    add_run_options(ap, "CI: 1 seed, 150 s sessions, 3 recordings of 200 s, 50 steps",
                    "keep the DBs and models here")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.ticks, args.record_ticks, args.steps = 1, 150, 200, 50
    arms = ["fresh"] + [a for a in args.arms.split(",") if a and a != "fresh"]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {', '.join(bad)} (known: {', '.join(ARMS)})")
    cfg = load_config(CONFIG)
    recorded = (0.2, 0.5, 0.8) if args.quick else RECORDED
    if args.recorded:
        recorded = tuple(float(v) for v in args.recorded.split(","))
    inside = tuple(float(v) for v in args.inside.split(",")) if args.inside else INSIDE
    use_one_core()
    t0 = time.perf_counter()
    with work_dir(args.workdir, "capes-bench-exp-") as work:
        sources = {"experience": record(cfg, cfg.game.family, args.record_ticks, args.steps,
                                        work, "experience", recorded),
                   "misleading": record(cfg, mirrored(cfg.game.family), args.record_ticks,
                                        args.steps, work, "misleading", recorded)}
        recorded_s = time.perf_counter() - t0
        print(f"recorded and trained in {recorded_s:.0f} s", file=sys.stderr, flush=True)
        plan = [(arm, case) for case in CASES for arm in arms
                if not (arm == "fresh" and case == "misleading")]
        jobs, keys = [], []
        for arm, case in plan:
            for job in jobs_for(cfg, case, arm, range(args.seeds), args.ticks, sources,
                                inside):
                jobs.append(job)
                keys.append((arm, case))
        runs: dict = {k: [] for k in plan}
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for i, (key, res) in enumerate(zip(keys, pool.map(_play, jobs))):
                runs[key].append(res)
                if (i + 1) % 20 == 0:
                    print(f"[{i + 1}/{len(jobs)}] {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)
    out = summarise(runs)
    report = {"default_arm": winner(out), "shipped_start": DEFAULT_START, "arms": out,
              "seeds": args.seeds, "ticks": args.ticks, "record_ticks": args.record_ticks,
              "steps": args.steps, "recorded": list(recorded), "inside": list(inside),
              "outside": list(OUTSIDE), "wall_s": time.perf_counter() - t0,
              "loadavg": os.getloadavg()[0],
              "command": "python benchmarks/bench_experience.py " + " ".join(argv or sys.argv[1:])}
    print(table(report))
    print(f"wall {report['wall_s']:.0f} s, load average {report['loadavg']:.1f}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
