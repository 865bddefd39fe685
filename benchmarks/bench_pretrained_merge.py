"""Is merged experience worth keeping? Pretrained-from-merged models against fresh ones.

1. Record K StorageGameSim converge runs (fresh engines, seeds 0..K−1), one DB each.
2. Merge them (``capes replay merge``) and train a model offline on the merged DB
   (``capes train``).
3. Play M new games (seeds from ``--first-seed`` on, none of them recorded) with that
   model as ``--init-model`` and with fresh engines, and report success rate and
   median converge time side by side with the number of seeds.

ε: a fresh engine anneals ε from ``epsilon_start`` (1.0), a pretrained one from
``pretrained_epsilon_start`` (0.3). To tell what the lower ε does apart from what the
pretraining does, each arm here is played with every ``--epsilon-start`` given
(default 1.0 and 0.3), used as the start for fresh and pretrained engines alike.

    python benchmarks/bench_pretrained_merge.py                      # K=8, M=20
    python benchmarks/bench_pretrained_merge.py --record 3 --seeds 5 --steps 1000  # quick
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from capes.common.atomic import write_json  # noqa: E402
from capes.experiments.converge_test import load_config, run_grid, run_one  # noqa: E402
from capes.experiments.offline_training import TrainingConfig, train_offline  # noqa: E402
from capes.experiments.replay_merge import merge  # noqa: E402
from paired_arms import add_run_options, work_dir  # noqa: E402


def with_epsilon(cfg, eps: float):
    return dataclasses.replace(cfg, engine=dataclasses.replace(
        cfg.engine, epsilon_start=eps, pretrained_epsilon_start=eps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="converge-test config (default: "
                    "configs/storagegamesim.toml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--preset", choices=["default", "paper"], default=None)
    ap.add_argument("--record", type=int, default=8, metavar="K", help="sessions to record")
    ap.add_argument("--steps", type=int, default=5000, help="offline minibatch steps")
    ap.add_argument("--seeds", type=int, default=20, metavar="M", help="new games per arm")
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--epsilon-start", default="1.0,0.3", metavar="LIST",
                    help="ε at the start of each new game, comma-separated")
    ap.add_argument("--jobs", type=int, default=1, help="games in parallel")
    add_run_options(ap, "CI: 2 recorded games, 100 steps, 1 new game per arm, 150 s games",
                    "keep the DBs and the model here", "write the figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.record, args.steps, args.seeds, args.epsilon_start = 2, 100, 1, "1.0"
        args.overrides.append("game.time_limit_ticks=150")
    import torch
    torch.set_num_threads(1)
    epsilons = [float(e) for e in args.epsilon_start.split(",")]
    cfg = load_config(args.config, args.overrides, args.preset)
    if args.first_seed < args.record:
        ap.error("--first-seed must be >= --record so that no new game was recorded")

    with work_dir(args.workdir, "capes-pretrain-") as work:
        t0 = time.perf_counter()
        dbs, recorded = [], []
        for seed in range(args.record):
            db = work / f"session{seed}.db"
            db.unlink(missing_ok=True)
            res = run_one(cfg, seed, db_path=db)
            dbs.append(db)
            recorded.append({"seed": seed, "won": res.won, "ticks": res.ticks})
            print(f"recorded seed {seed}: {'won at' if res.won else 'lost after'} "
                  f"{res.ticks} s", file=sys.stderr, flush=True)
        merged = work / "merged.db"
        merged.unlink(missing_ok=True)
        report = merge(dbs, merged)
        print(f"merged {report.total_sessions} sessions into {merged}", file=sys.stderr)
        model = work / "pretrained.pt"
        t_train = time.perf_counter()
        training = train_offline(merged, model, args.steps,
                                 TrainingConfig(engine=cfg.engine, reward=cfg.reward),
                                 chunk=max(1, args.steps // 10), device="cpu",
                                 progress=lambda p: print(
                                     f"  step {p['step']}/{args.steps} loss {p['loss']:.4g}",
                                     file=sys.stderr, flush=True))
        train_s = time.perf_counter() - t_train

        arms = []
        for eps in epsilons:
            for name, init in (("fresh", None), ("pretrained", str(model))):
                print(f"{name}, epsilon_start={eps:g}: {args.seeds} games", file=sys.stderr,
                      flush=True)
                grid = run_grid(with_epsilon(cfg, eps), [cfg.game.noise], [cfg.reward.type],
                                args.seeds, args.first_seed, args.jobs, init, progress=None)
                cell = grid["cells"][0]
                arms.append({"arm": name, "epsilon_start": eps, **{
                    k: cell[k] for k in ("runs", "wins", "success_rate", "success_rate_ci95",
                                         "median_converge_s", "median_ci95",
                                         "converge_times", "wall_s")}})
    result = {"record": args.record, "recorded": recorded, "offline_steps": args.steps,
              "offline_train_s": train_s, "offline_first_loss": training.first_loss,
              "offline_last_loss": training.last_loss,
              "transitions": training.candidate_transitions, "seeds": args.seeds,
              "first_seed": args.first_seed, "preset": cfg.engine.preset,
              "noise": cfg.game.noise, "reward": cfg.reward.type,
              "exploration_ticks": cfg.engine.exploration_ticks, "arms": arms,
              "wall_s": time.perf_counter() - t0}
    print(f"\n{args.record} recorded sessions ({training.candidate_transitions:,} "
          f"transitions), {args.steps} offline steps; new games: seeds {args.first_seed}.."
          f"{args.first_seed + args.seeds - 1}, noise {cfg.game.noise:g}, reward "
          f"{cfg.reward.type}, preset {cfg.engine.preset}")
    print(f"{'arm':>11} {'ε start':>7} {'wins':>7} {'success':>8} {'median s':>9} "
          f"{'95% CI':>13}")
    for a in arms:
        med = f"{a['median_converge_s']:.0f}" if a["median_converge_s"] is not None else "-"
        ci = a["median_ci95"]
        cis = f"[{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "-"
        print(f"{a['arm']:>11} {a['epsilon_start']:>7g} {a['wins']:>3}/{a['runs']:<3} "
              f"{a['success_rate']:>8.0%} {med:>9} {cis:>13}")
    print(f"total {result['wall_s']:.0f} s")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
