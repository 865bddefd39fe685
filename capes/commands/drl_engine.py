"""``capes drl-engine``: train continuously on the live replay DB and act every tick."""
from __future__ import annotations

import argparse
import sys

from capes.cli import common_config_args, experience_args, load_experience


def add_arguments(p: argparse.ArgumentParser) -> None:
    from capes.common.metrics import DEFAULT_ENGINE_METRICS
    common_config_args(p)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="PyTorch's threads for the engine's arithmetic on CPU: its networks "
                        "are small and extra threads spin for cores the tuned host's "
                        "applications need (0: PyTorch's default, one per core; default: "
                        "the config's engine.cpu_threads, else 1)")
    p.add_argument("--preset", choices=["default", "paper"], default=None,
                   help="engine preset (default: the config's engine.preset)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where checkpoints go; the latest one is resumed at start "
                        "(default: capes-checkpoints/ beside the replay DB)")
    p.add_argument("--checkpoint-every", type=float, default=60.0, metavar="SECONDS",
                   help="write a checkpoint (model, optimiser, counters) this often "
                        "(default: %(default)s)")
    p.add_argument("--init-model", metavar="CKPT",
                   help="start from this model's networks when there is no checkpoint")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the network's initialisation, sampling and ε-greedy "
                        "choices (default: %(default)s)")
    p.add_argument("--max-ticks", type=int, default=0, help="stop after N ticks (0: never)")
    p.add_argument("--log-every", type=float, default=5.0, metavar="SECONDS",
                   help="a progress log line this often (default: %(default)s)")
    p.add_argument("--status-file", metavar="PATH",
                   help="rewrite this JSON file (tick, ε, loss, values, ...) every action "
                        "tick; `capes status --engine-status PATH` shows it")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics here (docs/metrics.md); \"\" turns them "
                        "off, port 0 picks a free one (default: the config's engine.metrics, "
                        f"else {DEFAULT_ENGINE_METRICS})")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard scalars here (needs: pip install "
                        "'capes[tensorboard]')")
    experience_args(p)


def run(args) -> int:
    from capes.common.config import ConfigError
    from capes.common.metrics import parse_address
    from capes.settings import load_settings
    from drl_engine.daemon import EngineDaemonOptions
    from drl_engine.daemon import run as run_daemon

    settings = load_settings(args.config, args.overrides, args.preset)
    metrics = settings.engine_metrics if args.metrics is None else args.metrics
    try:
        parse_address(metrics)
    except ValueError as exc:
        raise ConfigError("--metrics", "", str(exc)) from None
    try:
        from drl_engine.per_node import rows_of
        rows = rows_of(settings.param_specs())      # per-node knobs: the per-node engine
        experience = load_experience(args, settings.engine, settings.reward, None
                                     if rows is None else (settings.cluster_engine,
                                                           rows.knobs))
    except ValueError as exc:
        print(f"capes drl-engine: {exc}", file=sys.stderr)
        return 2
    threads = settings.engine_cpu_threads if args.cpu_threads is None else args.cpu_threads
    if threads < 0:
        print("capes drl-engine: --cpu-threads must be >= 0 (0: PyTorch's default)",
              file=sys.stderr)
        return 2
    opts = EngineDaemonOptions(device=args.device, cpu_threads=threads,
                               checkpoint_dir=args.checkpoint_dir,
                               checkpoint_every_s=args.checkpoint_every,
                               init_model=args.init_model, seed=args.seed,
                               log_every_s=args.log_every, max_ticks=args.max_ticks,
                               status_file=args.status_file, metrics=metrics,
                               tensorboard=args.tensorboard, experience=experience)
    return run_daemon(settings, settings.engine, settings.reward, opts)
