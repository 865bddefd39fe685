"""``capes keys generate``: make the CURVE keys of a deployment (server, clients,
control-plane token). Existing keys are kept, so adding a client is safe.

Each client key made is bound to the node of its own name (``--client n1``: key ``n1``
speaks for node ``n1`` only, and no other key may speak for ``n1``), except the agents'
role keys of a one-host setup, ``--client monitor`` and ``--client control``: they are
bound to this host's name (``--host``; default: the name the agents speak as,
``socket.gethostname()``), since a node called ``monitor`` never speaks; ``--bind
CLIENT=NODE,...`` names other nodes; ``--any-node CLIENT`` makes a key shared on purpose
(it may speak for any node no key is bound to). A key named by ``--bind`` or
``--any-node`` is made too when it does not exist. Send the daemon SIGHUP to apply a change
while it runs."""
from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

HOST_KEYS = ("monitor", "control")   # the agents' keys of a one-host setup (the README's)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["generate"], help="what to do")
    p.add_argument("--dir", default="keys", help="key directory (default: %(default)s)")
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="a client key to make, bound to node NAME (repeatable; without "
                        "--client and --bind: one key 'agent' shared by every node)")
    p.add_argument("--force", action="store_true",
                   help="replace existing keys (every client must get its new key)")
    p.add_argument("--bind", action="append", default=[], metavar="CLIENT=NODE[,NODE...]",
                   help="the node names a client key may speak for (repeatable)")
    p.add_argument("--any-node", action="append", default=[], metavar="CLIENT",
                   help="a key shared on purpose: it may speak for any node that no key "
                        "is bound to (repeatable)")
    p.add_argument("--host", default=None, metavar="NODE",
                   help="the node --client monitor and --client control are bound to "
                        "(default: this host's name, as the agents use it: "
                        "%s)" % socket.gethostname())


def run(args) -> int:
    from capes.common import curve
    try:
        binds = [_parse_bind(text) for text in args.bind]
        binds += [(name, [curve.ANY_NODE]) for name in args.any_node]
        host = args.host or socket.gethostname()
        named = {client for client, _ in binds}
        binds += [(name, [host]) for name in dict.fromkeys(args.client)
                  if name in HOST_KEYS and name not in named]
        if not (args.client or binds):      # the quick start's one key, shared on purpose
            binds = [("agent", [curve.ANY_NODE])]
        named = {client for client, _ in binds}
        clients = list(dict.fromkeys(args.client + [c for c, _ in binds]))
        written = curve.generate(args.dir, [c for c in clients if c not in named],
                                 overwrite=args.force, bind_to_name=True)
        written += curve.generate(args.dir, [c for c in clients if c in named],
                                  overwrite=args.force)
        written += [curve.bind(args.dir, client, nodes) for client, nodes in binds]
    except (OSError, ValueError) as exc:
        print(f"capes keys: {exc}", file=sys.stderr)
        return 1
    for path in dict.fromkeys(written):
        print(path)
    bound = curve.read_bindings(Path(args.dir) / "clients")
    for client in clients:                   # who is bound to what, as the daemon reads it
        nodes = sorted(bound.get(client, ()))
        print(f"key {client!r} speaks for "
              + ("any node no key is bound to" if nodes in ([], [curve.ANY_NODE]) else
                 "node " + ", ".join(repr(n) for n in nodes))
              + (" (this host: its agents speak as it)" if nodes == [host] else ""))
    if not written:
        print(f"capes keys: every key already exists in {args.dir} (use --force to replace)",
              file=sys.stderr)
    return 0


def _parse_bind(text: str) -> tuple[str, list[str]]:
    client, sep, nodes = text.partition("=")
    if not sep or not client:
        raise ValueError(f"--bind {text!r}: expected CLIENT=NODE[,NODE...]")
    return client, nodes.split(",")
