"""Per-node knobs on a live cluster: the rows of a deployment's ``<node>/<knob>`` parameters.

A deployment whose parameters are named ``<node>/<knob>`` (``docs/deploying-per-node.md``)
has one row of knobs per node: every node holds its own ``max_rpcs_in_flight``, say, and
one value for the whole cluster would leave most of the gain behind. The engine's one-row
mode takes every node's PIs × the stack as its input, and its network as wide (refused
beyond ~45 nodes of 44 PIs by ``engine.max_inputs``); its per-node mode
(:meth:`Engine.for_deployment <drl_engine.engine.Engine.for_deployment>`) shares one
per-node network over the rows, whatever their number, and moves every row each tick.

:func:`rows_of` reads the rows from the deployment's parameters; the daemon
(``drl_engine.daemon``) hands them to the engine, whose decisions' values are then the
flat ``<node>/<knob>`` list, labelled ``actions.ROWS`` (the interface daemon checks it
row by row). Each node's monitoring agent must report each knob's value as a PI of the
knob's name (the engine reads each node's action back from them); the rows' nodes are
the replay DB's node names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from capes.common import actions
from capes.common.params import ParameterSpec


@dataclass
class Rows:
    """The per-node layout of a deployment's parameters."""
    nodes: list[str]                  # in the order of their first parameter
    knobs: list[ParameterSpec]        # one row's knobs, named by the knob
    names: list[str]                  # every parameter, in the deployment's order
    cells: list[tuple[int, int]]      # ... each one's (row, knob)


def rows_of(specs: list[ParameterSpec]) -> Rows | None:
    """The rows of per-node parameters (None when they are global ones); ValueError when
    only some are per-node, or the nodes' rows differ (other knobs, ranges or steps)."""
    rows = [actions.row_of(s.name) for s in specs]
    if not specs or all(r is None for r in rows):
        return None
    if any(r is None for r in rows):
        glob = [s.name for s, r in zip(specs, rows) if r is None]
        raise ValueError(f"parameters {glob} are global while others are per-node "
                         f"(<node>/<knob>): a deployment tunes one kind")
    by_node: dict[str, dict[str, ParameterSpec]] = {}
    for s, node in zip(specs, rows):
        knob = s.name[len(node) + 1:]
        by_node.setdefault(node, {})[knob] = dataclasses.replace(s, name=knob, nodes=[])
    nodes = list(by_node)
    first = by_node[nodes[0]]
    knobs = list(first)
    def alike(row: dict) -> str:       # NaN-safe: repr, not ==
        return repr([(k, s.min, s.max, s.step, s.default, s.values, s.cost, s.forbidden)
                     for k, s in row.items()])
    for node in nodes[1:]:
        if alike(by_node[node]) != alike(first):
            raise ValueError(f"node {node!r} has other knobs (or ranges, steps) than "
                             f"{nodes[0]!r}: every row must be alike")
    cells = [(nodes.index(node), knobs.index(s.name[len(node) + 1:]))
             for s, node in zip(specs, rows)]
    return Rows(nodes, list(first.values()), [s.name for s in specs], cells)


__all__ = ["Rows", "rows_of"]
