"""``capes train``: train a model offline on a (merged) replay DB, no target system.

The engine's hyperparameters and reward come from the deployment config, by default
``configs/simulator.toml`` (the deployment ``capes demo`` runs, whose replay DBs are the
usual first training data): pass the config your live engine runs with, so that the
model fits it. The first line says which config was used.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from capes.cli import common_config_args
from capes.common.shipped_configs import config_path

DEFAULT_CONFIG = config_path("simulator")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p, default=str(DEFAULT_CONFIG))
    p.add_argument("--replay", required=True, metavar="DB", help="the replay DB to learn from")
    p.add_argument("--steps", type=int, required=True, metavar="N", help="minibatch updates")
    p.add_argument("--out", required=True, metavar="CKPT", help="checkpoint to write")
    p.add_argument("--preset", choices=["default", "paper"], default=None,
                   help="engine preset (default: the config's engine.preset)")
    p.add_argument("--init-model", metavar="CKPT", help="continue from this model's networks")
    p.add_argument("--chunk", type=int, default=100, metavar="K",
                   help="steps per progress line and loss-curve point (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initialisation and of the minibatch sampling "
                        "(default: %(default)s)")
    p.add_argument("--plot", metavar="LOSS.png", help="write the loss curve as a PNG")
    p.add_argument("--json", metavar="OUT", help="write the training report as JSON")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, about 20 lines elsewhere)")
    p.add_argument("--sampling", choices=["auto", "device", "host"], default="auto",
                   help="where minibatches are drawn: auto (on the device where it is "
                        "CUDA: the fast path; on the host elsewhere), device or host "
                        "(default: %(default)s)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                   help="force the fast path (CUDA: minibatches drawn on the device inside "
                        "the step's CUDA graph; an error without a CUDA device) or, with "
                        "--no-fast, the plain one (host sampling, the step as written); "
                        "default: the fast path where a CUDA device is, else the plain")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write the loss curve as TensorBoard scalars here (needs: pip "
                        "install 'capes[tensorboard]')")


def run(args) -> int:
    from capes.common.progress import Progress
    from capes.experiments.offline_training import (FastPathUnavailable,
                                                    NotEnoughExperience, describe_path,
                                                    format_point, load_training_config,
                                                    plot_loss, resolve_device,
                                                    train_offline)
    import sqlite3
    from capes.common.replay_db import ReplayDBError
    from drl_engine.device import DeviceUnavailable
    if args.steps < 1 or args.chunk < 1:
        print("capes train: --steps and --chunk must be >= 1", file=sys.stderr)
        return 2
    try:                                  # before the config and the DB are read
        device = resolve_device(args.device, args.fast, args.sampling)
    except (DeviceUnavailable, FastPathUnavailable, ValueError) as exc:
        print(f"capes train: {exc}", file=sys.stderr)
        return 2
    cfg = load_training_config(args.config, args.overrides, args.preset)
    default = args.config and Path(args.config).resolve() == DEFAULT_CONFIG
    print(f"config: {Path(args.config).resolve() if args.config else '(built-in defaults)'}"
          + (" (the default; --config for your deployment's)" if default else ""),
          file=sys.stderr)
    writer = None
    if args.tensorboard:
        from capes.common.metrics import tensorboard_writer
        try:
            writer = tensorboard_writer(args.tensorboard)
        except RuntimeError as exc:
            print(f"capes train: {exc}", file=sys.stderr)
            return 2
    bar = Progress(args.steps, sys.stderr, quiet=args.quiet)

    def progress(point):
        if writer is not None:
            writer.add_scalar("train/loss", point["loss"], point["step"])
            writer.add_scalar("train/steps_per_s", point["steps_per_s"], point["step"])
        bar.update(point["step"], format_point(point))

    print(f"offline training on {args.replay}: {args.steps} steps, preset "
          f"{cfg.engine.preset}, reward {cfg.reward.type} of {cfg.reward.objective}",
          file=sys.stderr)
    try:
        report = train_offline(args.replay, args.out, args.steps, cfg, chunk=args.chunk,
                               device=device, seed=args.seed,
                               init_model=args.init_model, progress=progress,
                               sampling=args.sampling, fast=args.fast)
    except FastPathUnavailable as exc:   # the config turns a part of it off
        print(f"capes train: {exc}", file=sys.stderr)
        return 2
    except (ReplayDBError, NotEnoughExperience, FloatingPointError, ValueError) as exc:
        print(f"capes train: {exc}", file=sys.stderr)
        return 1
    except sqlite3.Error as exc:
        print(f"capes train: cannot read {args.replay} ({exc})", file=sys.stderr)
        return 1
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    print(f"wrote {report.checkpoint}: {report.steps} steps on {report.sessions} session(s) "
          f"({report.candidate_transitions:,} transitions) in {report.wall_s:.1f} s, "
          f"{report.steps_per_s:.0f} steps/s on {describe_path(report)}; loss "
          f"{report.first_loss:.4g} -> {report.last_loss:.4g}")
    if args.plot:
        plot_loss(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if writer is not None:
        print(f"TensorBoard scalars in {args.tensorboard} (tensorboard --logdir "
              f"{args.tensorboard})", file=sys.stderr)
    if args.json:
        from capes.experiments.converge_test import write_json
        write_json(report.to_json(), args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
