"""``capes converge-test``: the engine against StorageGameSim, grid of noise × reward."""
from __future__ import annotations

import argparse
import sys

from capes.cli import common_config_args, experience_args, load_experience


def _floats(text: str) -> list[float]:
    """Noise levels as fractions: ``10%`` or ``0.1``. A bare number above 1 is refused
    rather than read as a fraction (``--noise 10`` would be 1,000 % noise)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a noise level: {part!r} (write 10% "
                                             "or 0.1)") from None
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"noise must be >= 0: {part}")
        if value > 1 and not part.endswith("%"):
            raise argparse.ArgumentTypeError(
                f"noise {part} would be {value * 100:g} % of the throughput; write "
                f"{part}% for {part} %, or a fraction <= 1 (0.1 is 10 %)")
        out.append(value)
    return out


def _tuners(text: str) -> str:
    """``--tuner``: capes, a baseline (``bo``, ``bo:budget=300``) or, for the cluster
    game, a comma list (``capes,bo,hill``); unknown names are refused here."""
    if text == "capes":                 # the default: no need to import the baselines
        return text
    from capes.experiments.baselines import tuner_names
    known = ["capes", *tuner_names()]
    for part in text.split(","):
        name = part.partition(":")[0].strip()
        if "=" in name and ":" not in part:      # an option of the previous tuner
            continue
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown tuner {name!r} (known: "
                                             f"{', '.join(known)})")
    return text


def _names(text: str) -> list[str]:
    from drl_engine.rewards import REWARD_TYPES
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in REWARD_TYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown reward type {bad[0]!r} "
                                         f"(known: {', '.join(REWARD_TYPES)})")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from capes.experiments.converge_test import DEFAULT_CONFIG
    common_config_args(p, default=str(DEFAULT_CONFIG))
    p.add_argument("--noise", type=_floats, default=None, metavar="LIST",
                   help="noise levels as fractions or percentages, e.g. 0.01,0.1,0.5 or "
                        "1%%,10%%,50%%; a bare number must be <= 1 (10 is refused, not "
                        "read as 1000 %%) (default: the config's game.noise)")
    p.add_argument("--reward", type=_names, default=None, metavar="LIST",
                   help="reward types, e.g. diff,diff_avg,diff_ewma "
                        "(default: the config's reward.type)")
    p.add_argument("--seeds", type=int, default=1, metavar="N", help="runs per cell")
    p.add_argument("--first-seed", type=int, default=0, metavar="S",
                   help="seeds are S, S+1, ..., S+N-1 (default: %(default)s)")
    p.add_argument("--preset", choices=["default", "paper"], default=None,
                   help="engine preset (default: the config's engine.preset)")
    p.add_argument("--jobs", type=int, default=1, metavar="J",
                   help="runs in parallel, one process and one core each")
    p.add_argument("--device", default="cpu",
                   help="cpu (default: the game's network is tiny, a core per run is "
                        "fastest), cuda, or auto (CUDA when present)")
    p.add_argument("--init-model", metavar="CKPT",
                   help="start every run from this checkpoint's networks")
    p.add_argument("--json", metavar="OUT", help="write every run and cell summary as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG of the runs")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    p.add_argument("--play-on", action=argparse.BooleanOptionalAction, default=True,
                   help="keep playing after the win to the time limit, so that holding the "
                        "optimum is measured (default: on; --no-play-on stops at the win, "
                        "as the paper's test)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write per-tick scalars of every run (throughput, parameters, ε, "
                        "loss) for TensorBoard (needs the tensorboard extra)")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="where the runs go: local (--jobs processes here) or ray (Ray "
                        "tasks; needs the ray extra)")
    p.add_argument("--ray-address", metavar="ADDR", default=None,
                   help="with --backend ray: an existing Ray cluster (auto, "
                        "ray://host:10001); default: a local Ray of --jobs CPUs")
    p.add_argument("--tuner", default="capes", metavar="NAME", type=_tuners,
                   help="capes (the DRL engine) or a baseline in the same harness: "
                        "random, hill, bo, tpe, cma (bo, tpe and cma need the tune "
                        "extra: pip install 'capes[tune]'); the cluster game takes a "
                        "comma list (default: capes)")
    experience_args(p)


def run(args) -> int:
    from capes.experiments.converge_test import format_table, load_config, run_grid, write_json
    if args.seeds < 1 or args.jobs < 1:
        print("capes converge-test: --seeds and --jobs must be >= 1", file=sys.stderr)
        return 2
    for name in args.tuner.split(","):
        if name.strip() and name.strip() != "capes" and "=" not in name.partition(":")[0]:
            from capes.experiments.baselines import missing_dependency
            if problem := missing_dependency(name.strip()):
                print(f"capes converge-test: {problem}", file=sys.stderr)
                return 2
    from capes.settings import is_cluster_config
    if is_cluster_config(args.config):            # a [cluster] table: the cluster game
        if getattr(args, "experience_start", None):
            print("capes converge-test: --experience-start is for the single-node game (the "
                  "cluster game's per-node engine recalls recorded workloads; a new one "
                  "explores)", file=sys.stderr)
            return 2
        from capes.experiments.cluster_test import main as cluster_main
        return cluster_main(args)
    backend = getattr(args, "backend", "local")
    if backend == "ray":
        from capes.experiments.ray_backend import RAY_MISSING, ray_available
        if not ray_available():
            print(f"capes converge-test: {RAY_MISSING}", file=sys.stderr)
            return 2
    from drl_engine.device import device_name
    try:
        device = device_name(args.device)
    except RuntimeError as exc:
        print(f"capes converge-test: {exc}", file=sys.stderr)
        return 2
    if args.tensorboard:
        from capes.common.metrics import TENSORBOARD_MISSING, tensorboard_available
        if not tensorboard_available():
            print(f"capes converge-test: {TENSORBOARD_MISSING}", file=sys.stderr)
            return 2
    cfg = load_config(args.config, args.overrides, args.preset)
    try:
        experience = load_experience(args, cfg.engine, cfg.reward)
    except ValueError as exc:
        print(f"capes converge-test: {exc}", file=sys.stderr)
        return 2
    if experience is not None:
        try:
            specs = cfg.game.param_specs()
            experience.check_layout(cfg.game.pi_names(), list(specs))
        except ValueError as exc:
            print(f"capes converge-test: {exc}", file=sys.stderr)
            return 2
        print(experience.summary(), file=sys.stderr)
    if args.init_model:                 # a file that is no checkpoint: one line, not a
        from drl_engine.checkpoint import read     # traceback from every run's worker
        try:
            read(args.init_model)
        except ValueError as exc:
            print(f"capes converge-test: --init-model {exc}", file=sys.stderr)
            return 2
    noises = args.noise or [cfg.game.noise]
    rewards = args.reward or [cfg.reward.type]
    print(f"converge test: {len(noises)} noise × {len(rewards)} reward cells × "
          f"{args.seeds} seeds, preset {cfg.engine.preset}, "
          f"{cfg.engine.train_steps_per_tick} training step(s) per simulated second",
          file=sys.stderr)
    report = run_grid(cfg, noises, rewards, args.seeds, args.first_seed, args.jobs,
                      args.init_model, keep_traces=1 if args.plot else 0,
                      progress=None if args.quiet else sys.stderr, device=device,
                      play_on=args.play_on, tuner=args.tuner, tensorboard=args.tensorboard,
                      backend=backend, ray_address=getattr(args, "ray_address", None),
                      experience=experience)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from capes.experiments.plots import plot_converge
        plot_converge(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
