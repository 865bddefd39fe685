"""The ``capes`` command. Each subcommand lives in its own module under
``capes/commands/`` and is imported only when used, so ``capes monitor-agent`` never
loads torch. A command module defines ``add_arguments(parser)`` (or the function named
after a colon in ``COMMANDS``) and ``run(args) -> int``. Every command takes
``--log-level`` and ``--log-format``; logging is set up here, once.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

# name -> ("module[:add_arguments function]", one-line help), in the order `capes --help`
# lists them: try it, deploy it, operate it, then the tools for stored experience
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("capes.commands.demo", "the whole stack on this machine against the simulator"),
    "converge-test": ("capes.commands.converge", "run the engine against StorageGameSim"),
    "config": ("capes.commands.config", "list, show or check configs (no daemon needed)"),
    "keys": ("capes.commands.keys", "make CURVE keys: capes keys generate --dir DIR"),
    "interface-daemon": ("capes.commands.interface_daemon", "receive PIs, write the replay DB, "
                         "check and broadcast actions"),
    "drl-engine": ("capes.commands.drl_engine", "train on the live replay DB and act every tick"),
    "monitor-agent": ("capes.commands.monitor_agent", "stream this node's PIs to the daemon "
                      "(--test: print them once)"),
    "control-agent": ("capes.commands.control_agent", "apply the daemon's parameter values"),
    "sim-node": ("capes.commands.sim_node", "run StorageGameSim as a node (files as knobs)"),
    "status": ("capes.commands.status:add_status_arguments",
               "the interface daemon's counters and flags, and the engine's state"),
    "nodes": ("capes.commands.status:add_status_arguments", "the nodes the interface daemon knows"),
    "tuning": ("capes.commands.status:add_switch_arguments", "turn tuning on or off"),
    "training": ("capes.commands.status:add_switch_arguments", "turn training on or off"),
    "workload-changed": ("capes.commands.status:add_workload_arguments",
                         "tell the engine a new workload started"),
    "restore-defaults": ("capes.commands.restore_defaults",
                         "put every parameter back to the host's original value"),
    "replay": ("capes.commands.replay", "inspect, merge, export or plot replay DBs"),
    "train": ("capes.commands.train", "train a model offline on a replay DB"),
    "evaluate": ("capes.commands.evaluate", "compare configurations on a real target"),
}


def common_config_args(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--config`` and repeatable ``--set dotted.key=value`` for commands with a config.
    ``--config`` takes a file, or the name of a shipped config (``capes config list``)."""
    shown = f"the shipped {Path(default).name}" if default else "built-in defaults"
    parser.add_argument("--config", default=default, type=config_file, metavar="TOML",
                        help=f"configuration file, or a shipped config's name (default: "
                             f"{shown})")
    example = SET_EXAMPLES.get(parser.prog.split()[-1], "engine.gamma=0.9")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=f"override one config value, e.g. "
                        f"--set {example} (repeatable)")


def experience_args(parser: argparse.ArgumentParser) -> None:
    """``--experience DB…`` and ``--experience-start`` (drl_engine/prior_experience.py)."""
    parser.add_argument("--experience", nargs="+", metavar="DB",
                        help="start from the experience of earlier sessions: their replay "
                             "DBs (one merged by `capes replay merge`, or several); each "
                             "recorded workload is known at once, a new one starts where "
                             "--experience-start proposes (the per-node engine: every node "
                             "knows every recorded workload by its signature, a new one "
                             "explores; docs/engine.md)")
    parser.add_argument("--experience-start", default=None, metavar="HOW",
                        help="where a workload never seen starts: interpolate (the "
                             "default: between the best settings of the two known "
                             "workloads whose signatures enclose the new one, else as "
                             "memory), memory (the nearest recorded workload's best "
                             "setting), gp, qnet or qnet_probes (the last two need "
                             "--init-model, a network trained on the merged DB)")


def load_experience(args, engine_cfg, reward_cfg, rows=None):
    """The ``--experience`` of ``args`` loaded (None without it); ExperienceError (a
    ValueError) with a clear message for a DB that cannot be used. ``rows``: (the
    cluster engine's config, the per-node knobs) for a per-node engine, whose experience
    is its memory of recorded workloads (drl_engine/row_experience.py)."""
    if not getattr(args, "experience", None):
        return None
    from drl_engine.prior_experience import (DEFAULT_START, NETWORK_STARTS,
                                             ExperienceError, PriorExperience)
    if rows is not None:
        if args.experience_start:
            raise ExperienceError("--experience-start: the one-row engine's; the per-node "
                                  "engine recalls recorded workloads, a new one explores")
        from drl_engine.row_experience import RowExperience
        return RowExperience.load(args.experience, engine_cfg, reward_cfg, *rows)
    start = args.experience_start or DEFAULT_START
    if start in NETWORK_STARTS and not args.init_model:
        raise ExperienceError(f"--experience-start {start}: needs --init-model, a network "
                              f"trained on the merged DB (capes train)")
    return PriorExperience.load(args.experience, engine_cfg, reward_cfg, start=start)


# each command's --set example: a key that command reads, not one example everywhere
SET_EXAMPLES = {
    "interface-daemon": "daemon.db=/var/lib/capes/replay.db",
    "monitor-agent": "keys.client=monitor", "control-agent": "keys.client=control",
    "drl-engine": "keys.client=engine", "restore-defaults": "control.node=node01",
    "status": "daemon.grpc=10.0.0.5:50051", "demo": "game.noise=0.5",
    "converge-test": "game.noise=0.1", "sim-node": "game.peak_window=40",
    "train": "engine.stack=2", "evaluate": "control.node=node01",
}


def config_file(text: str) -> str:
    """``--config``: an existing file as given; else a shipped config of that name
    (``lustre``, ``lustre.toml`` or ``configs/lustre.toml``, so that the documented
    commands work from any directory); else as given, for the loader's one-line error."""
    from capes.common.shipped_configs import find_config
    if Path(text).is_file():
        return text
    name = text.removeprefix("configs/")
    found = find_config(name) if "/" not in name else None
    return str(found) if found else text


def _logging_args(parser: argparse.ArgumentParser) -> None:
    if "--log-level" not in parser._option_string_actions:
        parser.add_argument("--log-level", default="INFO", type=str.upper,
                            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                            help="log messages at this level and above (default: INFO)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines with timestamps, or one JSON object per line")


def action_logging_args(p: argparse.ArgumentParser) -> None:
    """``capes replay|config ACTION ... --log-level X``: the command's logging options on
    its action's parser too (whose values win only when given there)."""
    p.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="as for the command")
    p.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                   help="as for the command")


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Timestamped lines (UTC, ISO 8601) on stderr, or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                      "%Y-%m-%dT%H:%M:%SZ")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=[handler], force=True)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line (and exit 2), not the usage
    block: the line names the command and points to its ``--help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` gets its arguments (and is
    imported)."""
    from capes import __version__
    parser = Parser(prog="capes", description="CAPES: deep-RL tuning of "
                                     "storage system parameters.")
    parser.add_argument("--version", action="version", version=f"capes {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (target, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:   # only the command being run is imported
            module, _, adder = target.partition(":")
            getattr(importlib.import_module(module), adder or "add_arguments")(p)
            _logging_args(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    setup_logging(args.log_level, args.log_format)
    from capes.common.config import ConfigError
    try:
        return importlib.import_module(args._module).run(args) or 0
    except ConfigError as exc:
        print(f"capes: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("capes: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # `capes config list | head`: the reader left, fine
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
