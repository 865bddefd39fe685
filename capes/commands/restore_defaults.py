"""``capes restore-defaults``: put every parameter of this node back to the value the
host had before CAPES changed it (the original the control agent recorded in its state
file, ``control.state_file``), through the same appliers as the control agent, no daemon
needed. Use it after a control agent was killed (kill -9, OOM, power loss): a clean stop
restores by itself.

A knob with no recorded original is left as it is, and the command says so: CAPES never
changed it (a dry-run agent, a knob never tuned, a clean stop that already restored), or
its original is lost, and the config's ``default`` is a guess about this host, not its
value. ``--to-config-default`` asks for that guess on purpose."""
from __future__ import annotations

import argparse
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="only print what would be restored")
    p.add_argument("--to-config-default", action="store_true",
                   help="set a knob with no recorded original to the config's default "
                        "(without it such a knob is left as it is)")


def run(args) -> int:
    from capes.settings import load_settings
    from control_agent.agent import ControlAgent

    cfg = load_settings(args.config, args.overrides)
    agent = ControlAgent(cfg, dry_run=args.dry_run, source=args.config or "<defaults>")
    fallback = args.to_config_default
    try:
        plan = agent.restore_plan(fallback=fallback)
        if agent.dry_run:
            for name, (value, source) in plan.items():
                spec = agent.specs[name]
                print(f"would restore {name} = {spec.describe(value)} "
                      f"({_source(source)}; now {spec.describe(agent.current.get(name))})")
            restored, failed = {}, []
        else:
            restored, failed = agent.restore_defaults("capes restore-defaults",
                                                      fallback=fallback)
    finally:
        agent.close()
    for name, value in restored.items():
        print(f"{name} = {agent.specs[name].describe(value)} ({plan[name][1]})")
    for name in failed:
        print(f"{name}: FAILED (see above)", file=sys.stderr)
    for name, spec in agent.specs.items():
        if name not in plan:
            print(f"{name}: left at {spec.describe(agent.current.get(name))} (no original "
                  "recorded: CAPES has not changed it; --to-config-default sets "
                  f"{spec.describe(spec.default)})")
    return 1 if failed else 0


def _source(source: str) -> str:
    return "the recorded original" if source == "original" else \
        "the config's default: no original recorded"
