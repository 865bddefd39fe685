"""``capes monitor-agent``: collect this node's PIs every tick and stream them to the
interface daemon (the ``[monitor]`` section of the deployment config).

``--test`` prints what the agent would send and exits, with no daemon and no keys: every
PI name and its value, as Telegraf's ``--test`` does. Collectors report rates (bytes/s,
IOPS), which need two readings, so it collects twice, one tick apart, and prints the
second. What a collector turned on to read its source (GlusterFS profiling or
per-second stat dumps) is turned off again before it exits."""
from __future__ import annotations

import argparse
import logging
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--ticks", type=int, default=None, metavar="N",
                   help="stop after N ticks (default: run until SIGTERM/Ctrl-C)")
    p.add_argument("--test", action="store_true",
                   help="collect once (two readings one tick apart, for the rates), print "
                        "every PI name and value, and exit; no daemon needed")


def run(args) -> int:
    from capes.common.curve import KeysMissing
    from capes.settings import load_settings
    from capes.common.stop_signal import StopSignal
    from monitor_agent.agent import MonitorAgent

    if args.ticks is not None and args.ticks < 1:
        print("capes monitor-agent: --ticks must be >= 1", file=sys.stderr)
        return 2
    cfg = load_settings(args.config, args.overrides)
    if args.test:
        return print_once(cfg, args.config or "<defaults>")
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


def print_once(cfg, source: str) -> int:
    """``--test``: one collection of every PI, printed as ``name value``."""
    import math
    import time
    from capes.common.config import ConfigError
    from monitor_agent.agent import Sampler, build_collectors
    collectors = build_collectors(cfg, source)
    try:
        try:
            sampler = Sampler(collectors)
        except ValueError as exc:          # a program that names the PIs failed
            raise ConfigError(source, "monitor.collectors", str(exc)) from None
        sampler.sample()
        time.sleep(min(cfg.tick_seconds, 5.0))
        values = sampler.sample()
    finally:
        for col in collectors:             # a test leaves the target as it found it
            getattr(col, "undo", lambda: None)()
            col.close()
    width = max((len(n) for n in sampler.names), default=0)
    for name, value in zip(sampler.names, values):
        print(f"{name:<{width}}  {'-' if math.isnan(value) else format(value, '.6g')}")
    failed = ", ".join(f"{k} ({v}×)" for k, v in sampler.errors.items())
    print(f"{len(sampler.names)} PIs from {len(sampler.collectors)} collector(s)"
          + (f"; failed: {failed}" if failed else ""), file=sys.stderr)
    return 1 if sampler.errors else 0
