"""The ``capes`` command. Each subcommand lives in its own module under
``capes/commands/`` and is imported only when used, so ``capes monitor-agent`` never
loads torch. A command module defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "converge-test": ("capes.commands.converge", "run the engine against StorageGameSim"),
    "replay": ("capes.commands.replay", "inspect, merge or export replay DBs"),
    "train": ("capes.commands.train", "train a model offline on a replay DB"),
    "monitor-agent": ("capes.commands.monitor_agent", "stream this node's PIs to the daemon"),
    "control-agent": ("capes.commands.control_agent", "apply the daemon's parameter values"),
    "restore-defaults": ("capes.commands.restore_defaults", "set every parameter to its default"),
    "sim-node": ("capes.commands.sim_node", "run StorageGameSim as a node (files as knobs)"),
    "interface-daemon": ("capes.commands.interface_daemon", "receive PIs, write the replay DB, "
                         "check and broadcast actions"),
    "drl-engine": ("capes.commands.drl_engine", "train on the live replay DB and act every tick"),
    "demo": ("capes.commands.demo", "the whole stack on this machine against the simulator"),
    "keys": ("capes.commands.keys", "make CURVE keys: capes keys generate --dir DIR"),
    "status": ("capes.commands.status", "the interface daemon's counters and flags"),
    "tuning": ("capes.commands.status", "turn tuning on or off"),
    "training": ("capes.commands.status", "turn training on or off"),
    "workload-changed": ("capes.commands.status", "tell the engine a new workload started"),
    "nodes": ("capes.commands.status", "the nodes the interface daemon knows"),
}


def common_config_args(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--config`` and repeatable ``--set dotted.key=value`` for commands with a config."""
    parser.add_argument("--config", default=default, metavar="TOML",
                        help="configuration file (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one config value, e.g. "
                        "--set engine.gamma=0.9 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from capes import __version__
    parser = argparse.ArgumentParser(prog="capes", description="CAPES: deep-RL tuning of "
                                     "storage system parameters.")
    parser.add_argument("--version", action="version", version=f"capes {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:]
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:   # only the command being run is imported
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    parser = build_parser()
    args = parser.parse_args()
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    from capes.common.config import ConfigError
    try:
        return importlib.import_module(args._module).run(args) or 0
    except ConfigError as exc:
        print(f"capes: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capes: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
