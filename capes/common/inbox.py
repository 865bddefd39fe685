"""The messages waiting on an agent's socket from the daemon, decoded.

Both agents drain their DEALER socket the same way: every waiting message, without
blocking, through :func:`capes.common.protocol.decode`; a malformed one is handed to the
caller to count and is dropped, so hostile bytes never stop an agent.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import zmq

from capes.common.protocol import DecodeError, Message, decode


def drain(sock: zmq.Socket, max_bytes: int,
          malformed: Callable[[DecodeError], None]) -> Iterator[Message]:
    """Yield every message waiting on ``sock`` (decoded, at most ``max_bytes`` each);
    ``malformed(exc)`` for each one that does not decode, which is skipped."""
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = decode(data, max_bytes)
        except DecodeError as exc:
            malformed(exc)
            continue
        yield msg
