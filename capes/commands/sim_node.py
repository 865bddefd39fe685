"""``capes sim-node``: StorageGameSim as a node of its own, knobs and PIs as files in
``--dir`` (see ``storagegamesim/node.py``), one simulated second per ``--tick-seconds``."""
from __future__ import annotations

import argparse
import sys

from capes.cli import common_config_args


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, metavar="DIR",
                   help="directory of the node's PI and knob files (created if missing)")
    p.add_argument("--tick-seconds", type=_positive, default=1.0, metavar="S",
                   help="wall-clock seconds per simulated second (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="noise seed")
    p.add_argument("--keep-running", action="store_true",
                   help="keep playing after a win, until the time limit (shows the hold)")
    common_config_args(p)
    p.epilog = "The game is the config's [game] table (the whole file is validated)."


def run(args) -> int:
    from capes.common.stop_signal import StopSignal
    from storagegamesim.node import SimNode

    from capes.settings import load_settings
    game_cfg = load_settings(args.config, args.overrides).game
    node = SimNode(args.dir, game_cfg, seed=args.seed, keep_running=args.keep_running)
    with StopSignal() as stop:
        outcome = node.run(args.tick_seconds, stop)
    game = node.game
    print(f"sim-node: {outcome} after {game.ticks} ticks (won: {game.won}, throughput "
          f"{game.throughput:.1f}, window {game.window:g}, rate_limit {game.rate_limit:g}, "
          f"{node.bad_knob_values} bad knob values)", file=sys.stderr)
    return 0
