"""``capes keys generate``: make the CURVE keys of a deployment (server, clients,
control-plane token). Existing keys are kept, so adding a client is safe."""
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


def run(args) -> int:
    from capes.common import curve
    try:
        written = curve.generate(args.dir, args.client or ["agent"], overwrite=args.force)
    except (OSError, ValueError) as exc:
        print(f"capes keys: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if not written:
        print(f"capes keys: every key already exists in {args.dir} (use --force to replace)",
              file=sys.stderr)
    return 0
