"""``capes config list|show|check``: the shipped example configs, and a check of a
config file before it is trusted.

``list`` names the configs that ship with CAPES (``configs/`` in the repository, package
data in a wheel); ``show NAME`` prints one, to start your own from
(``capes config show linux-readahead > my.toml``); only a shipped config's name, never a
path. ``check FILE`` validates the whole file as every command would (typed sections,
ranges, unknown keys), builds each plug-in it names (collectors, appliers) and asks each,
read-only, what is wrong with its target on this host (a sysfs or procfs path that does
not exist, a program not on PATH, a glusterd that does not answer, an option the volume
does not have): one line ``ok`` and exit 0, or one line per problem and exit 2.
``--offline`` checks the file alone. A check changes nothing and runs no program the
config names (a ``command`` collector's argv is looked up on PATH, not run; a GlusterFS
config is only queried). What a host really collects is ``capes monitor-agent --test``'s
job.
"""
from __future__ import annotations

import argparse
import re
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
    check.add_argument("--offline", action="store_true",
                       help="check the file, not this host's targets: no applier path "
                            "looked up, no glusterd asked (a config for another host; "
                            "collectors that name their PIs after the host's devices still "
                            "look for them)")
    check.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override one value, e.g. --set "
                       "vars.device=nvme0n1 (repeatable)")
    from capes.cli import action_logging_args
    for sp in sub.choices.values():        # --log-level after the action works too
        action_logging_args(sp)


def run(args) -> int:
    from capes.common import shipped_configs as shipped
    if args.action == "list":
        names = shipped.config_names()
        wide = max(map(len, names), default=0)
        for name in names:
            print(f"{name:<{wide}}  {_first_line(shipped.config_path(name))}")
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
        problems = (check_file(str(path), args.overrides, not args.offline) if path else
                    [f"{name}: file not found (and no shipped config of that name)"])
        failed |= bool(problems)
        prefix = f"{name}: " if len(args.files) > 1 else ""
        for line in problems or ["ok"]:
            print(f"{prefix}{line}")
    return 2 if failed else 0


MAX_PROBLEMS = 50
MAX_CHECK_S = 10.0        # a hostile file of 250,000 bad keys: say the first, stop


def check_file(path: str, overrides: list[str] = (), host: bool = True) -> list[str]:
    """Every problem of the config at ``path`` as one line each ([] when it is fine).

    The loader stops at the first bad value, so each bad key is taken out in turn and
    the file loaded again, until it loads; then every collector and applier is built
    and asked, read-only, what is wrong on this host (``host``). Nothing here acts: a
    plug-in's ``__init__`` and ``check`` run no program the config names and change no
    target (``monitor_agent.collectors.base.Collector``)."""
    import time

    from capes.common.config import ConfigError, copy_tree, read_toml
    from capes.common.deployment import resolve_config_paths
    from capes.settings import settings_from_table
    problems: list[str] = []
    dropped: list[str] = []
    cfg = None
    try:
        table = resolve_config_paths(read_toml(path), path)      # read once
    except ConfigError as exc:
        return [str(exc)]
    deadline = time.monotonic() + MAX_CHECK_S
    while True:
        if len(problems) >= MAX_PROBLEMS or time.monotonic() > deadline:
            return problems + [f"{path}: ... and maybe more: the check stops after "
                               f"{len(problems)} problems"]
        try:
            cfg = settings_from_table(copy_tree(table), path, overrides, without=dropped)
            break
        except ConfigError as exc:
            if any(exc.key == k or exc.key.startswith(k + ".") for k in dropped):
                return problems                # taking it out did not help: stop here
            problems.append(str(exc))
            if not exc.key:
                return problems                # no key to take out: nothing further
            dropped.append(exc.key)
    if cfg is None:
        return problems
    source = f"{path} (with --set)" if overrides else path
    return problems + plugin_problems(cfg, source, host)


def plugin_problems(cfg, source: str, host: bool = True) -> list[str]:
    """Each collector and each parameter's applier built alone (one line per one that
    cannot be), then, with ``host``, asked what is wrong with its target here."""
    from capes.common.config import ConfigError
    from capes.common.registry import PluginError
    from control_agent.agent import node_parameters
    from control_agent.appliers import build_applier
    from monitor_agent.collectors import build_collector
    problems = []
    said: set[str] = set()

    def note(key: str, plugin: str, why: str) -> None:
        """One line per problem: the same cause (glusterd down for nine knobs) once."""
        if why not in said:
            said.add(why)
            problems.append(f"{source}: {key}: {plugin}: {why}")

    def fail(key: str, exc: Exception) -> None:
        if isinstance(exc, PluginError):
            exc = exc.config_error(source, key)
        problems.append(str(exc) if isinstance(exc, ConfigError) else
                        f"{source}: {key}: {exc}")

    for i, c in enumerate(cfg.monitor.collectors):
        key = f"monitor.collectors[{i}]"
        try:
            col = build_collector(c.name, c.options)
        except (PluginError, ValueError, TypeError, OSError) as exc:
            fail(key, exc if isinstance(exc, PluginError) else
                 ValueError(f"{c.name}: {exc}"))
            continue
        if host:
            for why in col.check():
                note(key, c.name, why)
        col.close()
    params = node_parameters(cfg)
    for name in sorted(cfg.control.appliers):
        if name not in cfg.parameters:
            problems.append(f"{source}: control.appliers.{name}: no parameter {name!r} "
                            f"in [parameters]")
    for name, spec in params.items():
        key = f"control.appliers.{name}"
        ac = cfg.control.appliers.get(name)
        if ac is None:
            problems.append(f"{source}: {key}: no applier configured for parameter "
                            f"{name!r}")
            continue
        try:
            applier = build_applier(ac.name, ac.options)
        except (PluginError, ValueError, TypeError, OSError) as exc:
            fail(f"{key}.options" if isinstance(exc, TypeError) else key,
                 exc if isinstance(exc, PluginError) else ValueError(f"{ac.name}: {exc}"))
            continue
        why = applier.supports(name, spec.categorical) or (
            applier.check(name) if host else None)
        if why:
            note(key, ac.name, why)
        applier.close()
    return problems


def _first_line(path, width: int = 90) -> str:
    """What a config is for: the first sentence of its header comment, whole; cut at a
    word only where it runs past ``width`` (each shipped config's is a short line)."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or not line.strip("# "):
            if words:
                break
            continue
        words += line.lstrip("# ").split()
    text = " ".join(words)
    text = re.split(r"(?<=[a-z)`])\. ", text, maxsplit=1)[0].rstrip(".")
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0] + " …"