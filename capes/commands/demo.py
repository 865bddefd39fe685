"""``capes demo``: the whole stack on this machine, tuning the simulator node."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from capes.cli import common_config_args
    from capes.experiments.demo import DEFAULT_CONFIG
    common_config_args(p, default=str(DEFAULT_CONFIG))
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the simulator's noise and of the engine (default: "
                        "%(default)s)")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="simulator nodes, each with its own agents; N > 1 tunes each node's "
                        "knobs (sim0/window, ...) with the per-node engine "
                        "(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS",
                   help="wall-clock limit (default: %(default)s)")
    p.add_argument("--hold", type=float, default=0.0, metavar="SECONDS",
                   help="keep tuning this long after the win")
    p.add_argument("--plot", default="capes-demo.png", metavar="OUT.png",
                   help="PNG of throughput, parameters and ε over the run; a relative path "
                        "goes into --workdir when one is given, else the current directory "
                        "(default: %(default)s; \"\": none)")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="write the summary and every tick's series as JSON")
    p.add_argument("--workdir", default=None,
                   help="run here instead of a temp dir, and keep it: logs/, the replay DB, "
                        "checkpoints/, keys/, engine.json and capes-demo.json (what "
                        "`capes status --workdir DIR` reads while the demo runs)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, DB, keys)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="the engine writes TensorBoard scalars here (needs: pip install "
                        "'capes[tensorboard]')")


def _interrupt(signum, frame):
    raise KeyboardInterrupt     # SIGTERM stops the demo as Ctrl-C does: summary, then exit


def run(args) -> int:
    import signal
    signal.signal(signal.SIGTERM, _interrupt)
    from capes.experiments.demo import DemoOptions
    from capes.experiments.demo import run as run_demo
    opts = DemoOptions(config=Path(args.config), overrides=list(args.overrides),
                       seed=args.seed, timeout_s=args.timeout, workdir=args.workdir,
                       keep=args.keep, plot=args.plot, json_out=args.json, hold_s=args.hold,
                       tensorboard=args.tensorboard, nodes=args.nodes)
    try:
        result = run_demo(opts)
    except RuntimeError as exc:
        print(f"capes demo: {exc}")
        return 1
    if result.get("interrupted"):
        return 130
    return 0 if result["won"] else 1
