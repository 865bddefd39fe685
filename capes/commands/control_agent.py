"""``capes control-agent``: apply the parameter values the interface daemon sends to
this node (the ``[control]`` and ``[parameters]`` sections of the deployment config).
It records each knob's original value before changing it (``control.state_file``) and
puts the originals back when it stops; after a kill, ``capes restore-defaults`` does."""
from __future__ import annotations

import argparse
import logging
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="log what would be applied and apply nothing (shadow tuning)")


def run(args) -> int:
    from capes.common.curve import KeysMissing
    from capes.settings import load_settings
    from capes.common.stop_signal import StopSignal
    from control_agent.agent import ControlAgent

    cfg = load_settings(args.config, args.overrides)
    agent = ControlAgent(cfg, dry_run=args.dry_run, source=args.config or "<defaults>")
    if not agent.specs:
        print(f"capes control-agent: no parameter in [parameters] is set on node "
              f"{agent.node!r}", file=sys.stderr)
        return 2
    why = None if agent.dry_run else agent.originals.check_writable()
    if why is not None:
        print(f"capes control-agent: control.state_file: {why}; the host's original values "
              f"could not be kept (set control.state_file to a writable path)",
              file=sys.stderr)
        agent.close()
        return 2
    try:
        with StopSignal() as stop:
            agent.connect()
            code = agent.run(stop)
    except KeysMissing as exc:
        print(f"capes control-agent: {exc}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("capes.control_agent").info("stopping: %s", agent.summary())
        agent.close()
    return code
