"""``capes restore-defaults``: set every parameter of this node back to its configured
default, through the same appliers as the control agent; no daemon needed."""
from __future__ import annotations

import argparse
import logging
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="only print what would be restored")


def run(args) -> int:
    from capes.common.deployment import load_deployment
    from control_agent.agent import ControlAgent

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s",
                        stream=sys.stderr)
    cfg = load_deployment(args.config, args.overrides)
    agent = ControlAgent(cfg, dry_run=args.dry_run, source=args.config or "<defaults>")
    try:
        if agent.dry_run:
            for name, spec in agent.specs.items():
                now = agent.current.get(name)
                print(f"would restore {name} = {spec.default:g} "
                      f"(now {'unknown' if now is None else format(now, 'g')})")
            return 0
        restored, failed = agent.restore_defaults("capes restore-defaults")
    finally:
        agent.close()
    for name, value in restored.items():
        print(f"{name} = {value:g}")
    for name in failed:
        print(f"{name}: FAILED (see above)", file=sys.stderr)
    return 1 if failed else 0
