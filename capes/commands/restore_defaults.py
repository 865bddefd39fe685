"""``capes restore-defaults``: put every parameter of this node back to the value the
host had before CAPES changed it (the original the control agent recorded in its state
file, ``control.state_file``), or to the config's ``default`` where nothing was
recorded; through the same appliers as the control agent, no daemon needed. Use it
after a control agent was killed (kill -9, OOM, power loss): a clean stop restores by
itself."""
from __future__ import annotations

import argparse
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="only print what would be restored")


def run(args) -> int:
    from capes.settings import load_settings
    from control_agent.agent import ControlAgent

    cfg = load_settings(args.config, args.overrides)
    agent = ControlAgent(cfg, dry_run=args.dry_run, source=args.config or "<defaults>")
    try:
        if agent.dry_run:
            for name, (value, source) in agent.restore_plan(fallback=True).items():
                spec = agent.specs[name]
                now = agent.current.get(name)
                print(f"would restore {name} = {spec.describe(value)} "
                      f"({'the recorded original' if source == 'original' else 'the default: no original recorded'}; "
                      f"now {spec.describe(now)})")
            return 0
        plan = agent.restore_plan(fallback=True)
        restored, failed = agent.restore_defaults("capes restore-defaults", fallback=True)
    finally:
        agent.close()
    for name, value in restored.items():
        print(f"{name} = {agent.specs[name].describe(value)} ({plan[name][1]})")
    for name in failed:
        print(f"{name}: FAILED (see above)", file=sys.stderr)
    return 1 if failed else 0
