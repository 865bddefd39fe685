"""The action set, shared by the engine, the replay DB and the daemon's action checker.

Action 0 is NULL. Action a > 0 moves one parameter k by m steps up or down:

    j = a − 1;   m = 1 + j // (2P);   k, down = divmod(j mod 2P, 2)     (P parameters)

so actions 1..2P are the paper's moves of one step (1 + 2k raises parameter k, 2 + 2k
lowers it), actions 2P+1..4P the same moves by two steps, and so on. The replay DB
records, and the daemon checks, the move that was made; the Q-network keeps the
thesis' 2P + 1 outputs and learns a larger move (the guide's probe walks,
``engine.action_steps``) as its ``direction``.
"""
from __future__ import annotations

import numpy as np

MAX_STEPS = 8        # the largest move one action may make, in steps (any engine)

# Per-node knobs (``docs/deploying-per-node.md``): parameters named ``<node>/<knob>``, one
# row of knobs per node. The engine then moves every row at once, each by one move of one
# of its knobs, and labels the action ROWS (the daemon checks it row by row).
ROWS = 32767
ROW_SEP = "/"


def row_of(param_name: str) -> str | None:
    """The node a per-node parameter ``<node>/<knob>`` belongs to (None: a global one)."""
    node, sep, knob = param_name.rpartition(ROW_SEP)
    return node if sep and node and knob else None


def count(n_params: int, steps: int = 1) -> int:
    """Actions of moves of 1..``steps`` steps (NULL included); ``count(P)`` = 2P + 1."""
    return 1 + 2 * n_params * steps


def valid(action, n_params: int) -> bool:
    """``action`` is an int naming NULL or a move of at most ``MAX_STEPS`` steps."""
    return (isinstance(action, int) and not isinstance(action, bool)
            and (0 <= action < count(n_params, MAX_STEPS) or action == ROWS))


def decode(action: int, n_params: int) -> tuple[int, int] | None:
    """(parameter index, signed steps) that ``action`` moves; None for NULL."""
    if action == 0:
        return None
    size, rest = divmod(action - 1, 2 * n_params)
    k, down = divmod(rest, 2)
    return k, -(size + 1) if down else size + 1


def decode_rows(acts, n_params: int):
    """:func:`decode` over an array of actions: (knob, signed steps) arrays, (0, 0) for
    NULL."""
    acts = np.asarray(acts, np.int64)
    size, rest = np.divmod(np.maximum(acts - 1, 0), 2 * n_params)
    knob, down = np.divmod(rest, 2)
    return knob, np.where(acts == 0, 0, np.where(down == 1, -(size + 1), size + 1))


def encode(k: int, steps: int, n_params: int) -> int:
    """The action moving parameter ``k`` by ``steps`` (signed, non-zero) steps."""
    size = abs(steps) - 1
    return 1 + 2 * n_params * size + 2 * k + (1 if steps < 0 else 0)


def encode_rows(knob, steps, n_params: int):
    """:func:`encode` over arrays (knob, signed steps); NULL where ``steps`` is 0."""
    knob, steps = np.asarray(knob, np.int64), np.asarray(steps)
    size = np.maximum(np.abs(steps).astype(np.int64) - 1, 0)
    return np.where(steps == 0, 0, 1 + 2 * n_params * size + 2 * knob + (steps < 0))


def direction(action, n_params: int):
    """The one-step action with the same parameter and sign (NULL stays NULL): what a
    Q-network of one-step actions learns a larger move as. Works on numpy arrays."""
    return (action > 0) * (1 + (action - 1) % (2 * n_params))


def name(action: int, param_names) -> str:
    """``null``, ``window+``, ``window-``, ``window+2`` … (the one-step moves keep the
    thesis' names)."""
    if action == ROWS:
        return "rows"
    move = decode(action, len(param_names))
    if move is None:
        return "null"
    k, steps = move
    if k >= len(param_names):
        return str(action)
    sign = "+" if steps > 0 else "-"
    return f"{param_names[k]}{sign}{abs(steps) if abs(steps) > 1 else ''}"


def moved(spec, value: float, steps: int, forbidden=()) -> float:
    """Where ``steps`` (signed) one-step moves from ``value`` land (each as
    ``ParameterSpec.next_value``: clamped, over forbidden values)."""
    for _ in range(abs(steps)):
        value = spec.next_value(value, 1 if steps > 0 else -1, forbidden)
    return value
