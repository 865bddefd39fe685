"""``capes monitor-agent``: collect this node's PIs every tick and stream them to the
interface daemon (the ``[monitor]`` section of the deployment config)."""
from __future__ import annotations

import argparse
import logging
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--ticks", type=int, default=None, metavar="N",
                   help="stop after N ticks (default: run until SIGTERM/Ctrl-C)")


def run(args) -> int:
    from capes.common.curve import KeysMissing
    from capes.settings import load_settings
    from capes.common.stop_signal import StopSignal
    from monitor_agent.agent import MonitorAgent

    if args.ticks is not None and args.ticks < 1:
        print("capes monitor-agent: --ticks must be >= 1", file=sys.stderr)
        return 2
    cfg = load_settings(args.config, args.overrides)
    try:
        agent = MonitorAgent(cfg, source=args.config or "<defaults>")
    except KeysMissing as exc:
        print(f"capes monitor-agent: {exc}", file=sys.stderr)
        return 2
    try:
        with StopSignal() as stop:
            agent.run(stop, max_ticks=args.ticks)
    finally:
        logging.getLogger("capes.monitor_agent").info("stopping: %s", agent.summary())
        agent.close()
    return 0
