"""Per-node knobs on a live cluster: the node-count-independent engine behind the daemon.

A deployment whose parameters are named ``<node>/<knob>`` (``docs/deploying-per-node.md``)
has one row of knobs per node: every node holds its own ``max_rpcs_in_flight``, say, and
one value for the whole cluster would leave most of the gain behind. The flat engine's
input is every node's PIs × the stack, and its network as wide (refused beyond ~45 nodes
of 44 PIs by ``engine.max_inputs``); the cluster engine
(:meth:`Engine.over_rows <drl_engine.engine.Engine.over_rows>`) shares one per-node network over
the rows, whatever their number, and moves every row each tick.

:class:`PerNodeEngine` gives the daemon (``drl_engine.daemon``) that engine behind the
surface it drives: ``update``/``act``/``train``/``save``/``load``, the engine's
:class:`~drl_engine.decision.Decision` of rows, whose values are the flat ``<node>/<knob>``
list, labelled ``actions.ROWS`` (the interface daemon checks it row by row). Each node's
monitoring agent must report each knob's value as a PI of the knob's name (the engine
reads each node's action back from them); the rows' nodes are the replay DB's node
names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capes.common import actions
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.decision import Decision


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


class PerNodeEngine:
    """The cluster engine on a live replay DB, for a deployment of per-node knobs."""

    def __init__(self, dqn: DQNConfig, reward: RewardConfig, db: str | Path, rows: Rows,
                 model: NodeModelConfig | None = None, device: str = "auto", seed: int = 0):
        from drl_engine.dqn import pick_device
        self.cfg, self.reward_cfg, self.rows, self.model = dqn, reward, rows, model
        self.device, self.seed = pick_device(device), seed
        self.reader = ReplayReader(db, grow_nodes=True)
        self.engine = None                 # the per-node Engine, once every row's node is in
        self.restore_error: str | None = None
        self._pending: tuple[Path, bool] | None = None
        self.update()

    # -- the daemon's surface -------------------------------------------------------------
    @property
    def dqn(self):
        return None if self.engine is None else self.engine.dqn

    def __getattr__(self, name):
        """Counters (ε, action ticks, training steps, loss): the engine's, 0 before it."""
        if name in ("epsilon", "action_ticks", "train_steps", "last_loss"):
            engine = self.__dict__.get("engine")
            if engine is not None:
                return getattr(engine, name)
            return 1.0 if name == "epsilon" else None if name == "last_loss" else 0
        raise AttributeError(name)

    def param_names(self) -> list[str]:
        return list(self.rows.names)

    def update(self) -> int:
        if self.engine is None:
            self.reader.refresh()
            layout = self.reader.layout
            if layout is None or not self.reader.sessions or \
                    not set(self.rows.nodes) <= set(layout.node_names):
                return 0
            missing = [k.name for k in self.rows.knobs if k.name not in layout.pi_names]
            if missing:
                raise ValueError(f"per-node knobs {missing} are not among the PIs the "
                                 f"nodes report ({list(layout.pi_names)}): each node's "
                                 f"monitoring agent must report each knob's value")
            from drl_engine.engine import Engine
            self.engine = Engine.over_rows(self.cfg, self.reward_cfg, list(layout.pi_names),
                                           self.rows.knobs, len(layout.node_names),
                                           model=self.model, reader=self.reader,
                                           device=str(self.device), seed=self.seed)
            if self._pending is not None:
                path, weights_only = self._pending
                self._pending = None
                try:
                    self.engine.load(path, weights_only)
                except ValueError as exc:      # another layout: start afresh, say why
                    self.restore_error = str(exc)
        return self.engine.update()

    def _row_index(self) -> np.ndarray:
        """Each row's node index in the engine (the replay DB's node order)."""
        order = list(self.reader.layout.node_names)
        return np.array([order.index(n) for n in self.rows.nodes])

    def act(self, session: int, after_tick: int | None = None,
            current: list[float] | None = None) -> Decision | None:
        if self.engine is None:
            return None
        rep, idx = self.engine.replay, self._row_index()
        if rep.last is None:
            return None
        now = rep.knobs[rep.slot(rep.last)].astype(np.float64)    # (nodes, knobs)
        if current is not None:           # the daemon's values: newer than the PIs
            for (i, j), v in zip(self.rows.cells, current):
                now[idx[i], j] = v
        d = self.engine.act(after_tick=after_tick, current=now)
        if d is None:
            return None
        values = [float(d.values[idx[i], j]) for i, j in self.rows.cells]
        return dataclasses.replace(d, values=values, explored=bool(d.row_explored[idx].any()),
                                   row_actions=d.row_actions[idx],
                                   row_explored=d.row_explored[idx])

    def train(self, steps: int | None = None) -> float | None:
        return None if self.engine is None else self.engine.train(steps)

    def workload_changed(self) -> None:
        if self.engine is not None:
            self.engine.workload_changed()

    def best_values(self) -> dict[str, float] | None:
        """The best-known setting, per ``<node>/<knob>`` (None: none yet)."""
        e = self.engine
        if e is None or e.control.best.best_idx is None:
            return None
        vals, idx = e.control.grid.values(e.control.best.best_idx), self._row_index()
        return {n: float(vals[idx[i], j]) for n, (i, j) in zip(self.rows.names, self.rows.cells)}

    def save(self, path: str | Path) -> Path:
        return self.engine.save(path)

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        if self.engine is None:
            self._pending = (Path(path), weights_only)
        else:
            self.engine.load(path, weights_only)

    def close(self) -> None:
        self.reader.close()
