"""``capes keys generate``: make the CURVE keys of a deployment (server, clients,
control-plane token). Existing keys are kept, so adding a client is safe. ``--bind
CLIENT=NODE,...`` restricts a client key to those node names (the daemon refuses any
other name from it; send the daemon SIGHUP to apply a change while it runs)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["generate"], help="what to do")
    p.add_argument("--dir", default="keys", help="key directory (default: %(default)s)")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="a client key to make (repeatable; default: agent)")
    p.add_argument("--force", action="store_true",
                   help="replace existing keys (every client must get its new key)")
    p.add_argument("--bind", action="append", default=[], metavar="CLIENT=NODE[,NODE...]",
                   help="the node names a client key may speak for (repeatable)")


def run(args) -> int:
    from capes.common import curve
    try:
        binds = [_parse_bind(text) for text in args.bind]
        clients = args.client or ([] if binds else ["agent"])
        written = curve.generate(args.dir, clients, overwrite=args.force)
        written += [curve.bind(args.dir, client, nodes) for client, nodes in binds]
    except (OSError, ValueError) as exc:
        print(f"capes keys: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if not written:
        print(f"capes keys: every key already exists in {args.dir} (use --force to replace)",
              file=sys.stderr)
    return 0


def _parse_bind(text: str) -> tuple[str, list[str]]:
    client, sep, nodes = text.partition("=")
    if not sep or not client:
        raise ValueError(f"--bind {text!r}: expected CLIENT=NODE[,NODE...]")
    return client, nodes.split(",")
