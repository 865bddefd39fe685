"""``capes replay info|merge|export|plot``: replay DBs of past sessions as an asset."""
from __future__ import annotations

import argparse
import json
import signal
import struct
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="replay_command", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="sessions, ticks, gaps, missing entries, names, size",
                          description="What a replay DB holds.")
    info.add_argument("db", metavar="DB", help="a replay DB (SQLite file)")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")

    merge = sub.add_parser("merge", help="merge the sessions of several DBs into one",
                           description="Copy every session of the sources into OUT; each "
                           "stays a session of its own, and sessions already in OUT (same "
                           "uuid) are not copied again. OUT is replaced atomically.")
    merge.add_argument("sources", nargs="+", metavar="DB", help="the DBs to merge")
    merge.add_argument("-o", "--out", required=True, metavar="OUT.db",
                       help="the merged DB (merged into when it exists)")
    merge.add_argument("--allow-partial", action="store_true",
                       help="merge sessions whose PIs, parameters or nodes differ from "
                            "OUT's layout (mapped by name; what is missing reads as missing)")
    merge.add_argument("--json", action="store_true", help="print the report as JSON")

    export = sub.add_parser("export", help="write a DB as CSV or NPZ for other tools",
                            description="CSV: one row per session, tick and node, a column "
                            "per PI, the action and the parameter values. NPZ: dense "
                            "arrays per session plus their names.")
    export.add_argument("db", metavar="DB", help="a replay DB (SQLite file)")
    export.add_argument("--format", choices=["csv", "npz"], required=True,
                        help="csv (one row per session, tick and node) or npz (arrays)")
    export.add_argument("-o", "--out", required=True, metavar="OUT", help="the file to write")
    export.add_argument("--max-bytes", type=int, default=None, metavar="N",
                        help="NPZ: the most one session's dense arrays may take "
                             "(default: 1 GiB); a session spanning more ticks is refused")

    plot = sub.add_parser("plot", help="PIs, parameters, reward and actions of a session "
                          "over time, as a PNG",
                          description="One session of a replay DB over time: the "
                          "objective, chosen PIs (summed over nodes), the parameters' values "
                          "in effect, the reward and the actions taken.")
    plot.add_argument("db", metavar="DB", help="a replay DB (SQLite file)")
    plot.add_argument("-o", "--out", default="replay.png", metavar="OUT.png",
                      help="default: %(default)s")
    plot.add_argument("--session", type=int, metavar="ID", help="default: the newest")
    plot.add_argument("--pis", metavar="A,B,...",
                      help="PIs to plot, one panel each, up to 4 (default: the objective's "
                           "PIs when it has several)")
    from capes.cli import config_file
    plot.add_argument("--config", metavar="TOML", type=config_file,
                      help="take the objective and reward from this config's [reward] (a "
                           "file, or a shipped config's name; default: the [reward] the "
                           "daemon recorded with the session)")
    plot.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="override one config value (repeatable)")
    from capes.cli import action_logging_args
    for sp in sub.choices.values():        # --log-level after the action works too
        action_logging_args(sp)


# what a damaged or crafted DB can raise in the tools' own queries (a wrong type in a
# column, an orphan row): reported in one line like any ReplayDBError
DAMAGE = (TypeError, KeyError, IndexError, OverflowError, struct.error)
_interrupted = False


def run(args) -> int:
    import logging
    import sqlite3
    from capes.common.replay_db import ReplayDBError
    name = f"capes replay {args.replay_command}"
    try:
        return {"info": _info, "merge": _merge, "export": _export,
                "plot": _plot}[args.replay_command](args)
    except (ReplayDBError, ValueError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, sqlite3.Error, *DAMAGE) as exc:
        if isinstance(exc, KeyboardInterrupt) or _interrupted:
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        logging.getLogger("capes.replay").debug("damaged DB", exc_info=True)
        what = "cannot read the DB" if isinstance(exc, sqlite3.Error) else "damaged replay DB"
        print(f"{name}: {what} ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
        return 1


def _info(args) -> int:
    from capes.experiments.replay_info import describe, format_summary
    summary = describe(args.db)
    print(json.dumps(summary.to_json(), indent=1) if args.json else format_summary(summary))
    return 0


def _merge(args) -> int:
    from capes.experiments.replay_merge import merge
    # SIGTERM unwinds like Ctrl-C, so the temp file is removed and OUT left untouched
    signal.signal(signal.SIGTERM, _raise_interrupt)
    say = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = merge(args.sources, args.out, allow_partial=args.allow_partial, progress=say)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        partial = sum(1 for s in report.sessions if s.differences)
        print(f"{report.out}: {report.count('added')} session(s) added, "
              f"{report.count('extended')} extended, {report.count('present')} already "
              f"present{f', {partial} partial' if partial else ''}; "
              f"{report.total_sessions} in all ({report.wall_s:.1f} s)")
    return 0


def _export(args) -> int:
    from capes.experiments.replay_export import export_csv, export_npz
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.format == "csv":
        n = export_csv(args.db, args.out, progress=say)
        print(f"wrote {args.out}: {n} rows")
    else:
        extra = {} if args.max_bytes is None else {"max_bytes": args.max_bytes}
        names = export_npz(args.db, args.out, progress=say, **extra)
        print(f"wrote {args.out}: {len(names)} arrays")
    return 0


def _plot(args) -> int:
    from capes.experiments.replay_plot import plot_session
    reward = None
    if args.config or args.overrides:
        from capes.settings import load_settings
        reward = load_settings(args.config, args.overrides).reward
    pis = [p.strip() for p in args.pis.split(",") if p.strip()] if args.pis else None
    report = plot_session(args.db, args.out, args.session, pis, reward)
    print(f"wrote {report.out}: session {report.session}, {report.ticks} ticks, "
          f"{report.actions} actions"
          + (f", PIs {', '.join(report.pis)}" if report.pis else "")
          + (f" ({report.note})" if report.note else ""))
    return 0


def _raise_interrupt(signum, frame):
    global _interrupted
    _interrupted = True      # inside a query this surfaces as sqlite3 "interrupted"
    raise KeyboardInterrupt
