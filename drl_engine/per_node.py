"""Per-node knobs on a live cluster: the rows of a deployment's ``<node>/<knob>`` parameters.

A deployment whose parameters are named ``<node>/<knob>`` (``docs/deploying-per-node.md``)
has one row of knobs per node: every node holds its own ``max_rpcs_in_flight``, say, and
one value for the whole cluster would leave most of the gain behind. The engine's one-row
mode takes every node's PIs × the stack as its input, and its network as wide (refused
beyond ~45 nodes of 44 PIs by ``engine.max_inputs``); its per-node mode
(:meth:`Engine.for_deployment <drl_engine.engine.Engine.for_deployment>`,
:class:`DeploymentEngine` below) shares one per-node network over the rows, whatever
their number, and moves every row each tick.

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
from pathlib import Path

import numpy as np

from capes.common import actions
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader
from drl_engine import checkpoint
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.decision import Decision
from drl_engine.engine import Engine
from drl_engine.row_engine import RowEngine, RowShape, per_node_settings


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


class DeploymentEngine(RowEngine):
    """The engine's per-node mode behind the daemon, over a deployment's ``rows``
    (:meth:`Engine.for_deployment <drl_engine.engine.Engine.for_deployment>`): built
    once every row's node is in the replay DB (as the one-row mode builds its network
    once the layout is known; a checkpoint given before is loaded then); a decision's
    values are the flat ``<node>/<knob>`` list in the deployment's order."""

    def __init__(self, dqn: DQNConfig, reward: RewardConfig,
                 reader: ReplayReader | None = None, device: str = "auto", seed: int = 0,
                 *, model: NodeModelConfig | None = None, deployment: Rows):
        Engine.__init__(self, per_node_settings(dqn), reward, device, seed)   # rows: _build
        self.deployment = deployment
        self.mcfg = model or NodeModelConfig()
        self.reader, self.data = reader, None
        self._pending_load: tuple[Path, bool] | None = None
        self._pending_experience = None     # taken once built (take_experience)
        self.update()

    def update(self) -> int:
        if self.data is None and (self.reader is None or not self._build()):
            return 0
        return super().update()

    def _build(self) -> bool:
        """Build the per-node mode once every deployment row's node is in the replay DB
        (False: not yet); then resume a checkpoint ``load`` was given before."""
        self.reader.refresh()
        layout, rows = self.reader.layout, self.deployment
        if layout is None or not self.reader.sessions or \
                not set(rows.nodes) <= set(layout.node_names):
            return False
        missing = [k.name for k in rows.knobs if k.name not in layout.pi_names]
        if missing:
            raise ValueError(f"per-node knobs {missing} are not among the PIs the "
                             f"nodes report ({list(layout.pi_names)}): each node's "
                             f"monitoring agent must report each knob's value")
        self._init_rows(RowShape(list(layout.pi_names), rows.knobs, len(layout.node_names)),
                        self.mcfg, self.reader)
        if self._pending_load is not None:
            path, weights_only = self._pending_load
            self._pending_load = None
            try:
                self.load(path, weights_only)
            except checkpoint.UNUSABLE as exc:   # another layout or config: afresh, say why
                self.restore_error = checkpoint.why(exc)
                self._init_rows(RowShape(list(layout.pi_names), rows.knobs,
                                         len(layout.node_names)), self.mcfg, self.reader)
                self.action_ticks = self.train_steps = 0      # (validated first: a part's
                self.exploration.reset()                      # own load may have failed
                self.rng = np.random.default_rng(self.seed)   # after these were set)
        if self._pending_experience is not None:
            experience, self._pending_experience = self._pending_experience, None
            super().take_experience(experience)
        return True

    def take_experience(self, experience) -> bool:
        """As the per-node mode's, once built (True: taken or to be taken then)."""
        if self.data is None:
            self._pending_experience = experience
            return True
        return super().take_experience(experience)

    def param_names(self) -> list[str]:
        """Every ``<node>/<knob>``, in the deployment's order."""
        return list(self.deployment.names)

    def workload_changed(self) -> None:
        if self.data is not None:
            super().workload_changed()

    def _row_index(self) -> np.ndarray:
        """Each deployment row's node index in the engine (the replay DB's node order)."""
        order = list(self.reader.layout.node_names)
        return np.array([order.index(n) for n in self.deployment.nodes])

    def act(self, session: int | None = None, after_tick: int | None = None,
            current=None) -> Decision | None:
        """A per-node decision in the deployment's terms: ``current`` and the values are
        the flat ``<node>/<knob>`` lists, the rows in the deployment's order."""
        if self.data is None or self.data.replay.last is None:
            return None
        rep, idx, cells = self.data.replay, self._row_index(), self.deployment.cells
        now = rep.knobs[rep.slot(rep.last)].astype(np.float64)    # (nodes, knobs)
        if current is not None:           # the daemon's values: newer than the PIs
            for (i, j), v in zip(cells, current):
                now[idx[i], j] = v
        d = self._act_rows(after_tick, now)
        if d is None:
            return None
        values = [float(d.values[idx[i], j]) for i, j in cells]
        return dataclasses.replace(d, values=values, explored=bool(d.row_explored[idx].any()),
                                   row_actions=d.row_actions[idx],
                                   row_explored=d.row_explored[idx])

    def best_values(self) -> dict[str, float] | None:
        """The per-node best-known setting, per ``<node>/<knob>`` (None: none yet)."""
        if self.data is None:
            return None
        best = self.control.best.best_idx
        if best is None:
            return None
        vals, idx = self.control.grid.values(best), self._row_index()
        return {n: float(vals[idx[i], j])
                for n, (i, j) in zip(self.deployment.names, self.deployment.cells)}

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        """:meth:`Engine.load`, once the engine is built (its nodes all in the DB)."""
        if self.data is None:                        # built later: loaded then
            self._pending_load = (Path(path), weights_only)
            return
        super().load(path, weights_only)


__all__ = ["DeploymentEngine", "Rows", "rows_of"]
