"""``capes interface-daemon``: receive the agents' PIs, write the replay DB, check and
broadcast the engine's actions, serve the gRPC control plane."""
from __future__ import annotations

import argparse
import json
import sys

from capes.cli import common_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    common_config_args(p)
    p.add_argument("--ready-file", metavar="PATH",
                   help="write the bound endpoints as JSON here once serving "
                        "(ports given as 0 are resolved)")
    p.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics here (docs/metrics.md); \"\" turns them "
                        "off, port 0 picks a free one (default: the config's daemon.metrics)")


def run(args) -> int:
    from capes.common.curve import KeysMissing
    from capes.settings import load_settings
    from capes.common.replay_db import ReplayDBError
    from interface_daemon.daemon import serve

    overrides = list(args.overrides)
    if args.metrics is not None:          # the flag wins over the file, as --set does
        overrides.append(f'daemon.metrics="{args.metrics}"')
    cfg = load_settings(args.config, overrides)

    def ready(endpoints: dict) -> None:
        line = json.dumps({"event": "ready", **endpoints})
        print(line, flush=True)
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as fh:
                fh.write(line + "\n")
            import os
            os.replace(args.ready_file + ".tmp", args.ready_file)

    try:
        return serve(cfg, ready)
    except (KeysMissing, OSError, ReplayDBError) as exc:
        print(f"capes interface-daemon: {exc}", file=sys.stderr)
        return 1
