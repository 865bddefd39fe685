"""``capes config list|show|check``: the shipped example configs, and a check of a
config file before it is trusted.

``list`` names the configs that ship with CAPES (``configs/`` in the repository, package
data in a wheel); ``show NAME`` prints one, to start your own from
(``capes config show linux-readahead > my.toml``). ``check FILE`` validates the whole
file as every command would (typed sections, ranges, unknown keys), then builds each
plug-in it names (collectors, appliers, objective and reward type) without starting
anything or needing a daemon: one line ``ok`` and exit 0, or one line per problem and
exit 2. The loader stops at the first bad value of the file; the plug-in stages after
it each report their own. What a host really collects is ``capes monitor-agent
--test``'s job: a check does not read the host.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="the shipped example configs, one per line",
                   description="the shipped example configs, one per line")
    show = sub.add_parser("show", help="print a shipped config (start your own from it)",
                          description="print a shipped config: capes config show NAME > my.toml")
    show.add_argument("name", metavar="NAME", help="e.g. linux-readahead (see `capes config list`)")
    check = sub.add_parser("check", help="validate a config and build every plug-in it names",
                           description="validate a whole config and build every plug-in it "
                                       "names (no daemon needed): 'ok' and exit 0, or one "
                                       "line per problem and exit 2")
    check.add_argument("files", nargs="+", metavar="FILE",
                       help="a config file, or the name of a shipped one")
    check.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override one value, e.g. --set "
                       "vars.device=nvme0n1 (repeatable)")
    from capes.cli import action_logging_args
    for sp in sub.choices.values():        # --log-level after the action works too
        action_logging_args(sp)


def run(args) -> int:
    from capes.common import shipped_configs as shipped
    if args.action == "list":
        for name in shipped.config_names():
            print(f"{name:<18} {_first_line(shipped.config_path(name))}")
        return 0
    if args.action == "show":
        path = shipped.config_path(args.name) if shipped.is_name(args.name) else None
        if path is None or not path.is_file() or path.parent != shipped.config_dir():
            print(f"capes config show: no shipped config {args.name!r} (shipped: "
                  f"{', '.join(shipped.config_names())})", file=sys.stderr)
            return 2
        sys.stdout.write(path.read_text())
        return 0
    failed = False
    for name in args.files:
        path = shipped.find_config(name)
        problems = (check_file(str(path), args.overrides) if path else
                    [f"{name}: file not found (and no shipped config of that name)"])
        failed |= bool(problems)
        prefix = f"{name}: " if len(args.files) > 1 else ""
        for line in problems or ["ok"]:
            print(f"{prefix}{line}")
    return 2 if failed else 0


def check_file(path: str, overrides: list[str] = ()) -> list[str]:
    """Every problem of the config at ``path`` as one line each ([] when it is fine)."""
    from capes.common.config import ConfigError
    from capes.common.registry import PluginError
    from capes.settings import load_settings
    try:
        cfg = load_settings(path, overrides)
    except ConfigError as exc:
        return [str(exc)]
    source = f"{path} (with --set)" if overrides else path
    problems = []
    stages = []
    if cfg.monitor.collectors:
        from monitor_agent.agent import build_collectors
        stages.append(("monitor", lambda: build_collectors(cfg, source)))
    if cfg.parameters or cfg.control.appliers:
        from control_agent.agent import build_appliers
        stages.append(("control", lambda: build_appliers(cfg, source)))
    for what, build in stages:
        try:
            build()
        except (ConfigError, PluginError, ValueError, TypeError, OSError) as exc:
            problems.append(str(exc) if isinstance(exc, ConfigError) else
                            f"{source}: {what}: {exc}")
    return problems


def _first_line(path, width: int = 90) -> str:
    """What a config is for: its first comment sentence, cut to ``width``."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or not line.strip("# "):
            if words:
                break
            continue
        words += line.lstrip("# ").split()
    text = " ".join(words)
    text = text.split(". ", 1)[0].split(": ", 1)[0].rstrip(".")
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0] + " …"
