"""A live deployment of per-node knobs (``<node>/<knob>``): the one engine's per-node mode
as the daemon builds it (``Engine.for_deployment``), on a replay DB that fills while it
runs. The daemon's whole path is in tests/test_engine_daemon.py; this is the engine."""
from __future__ import annotations

import numpy as np
import pytest

from capes.common.config import build
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayWriter, SessionInfo
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.config import DQNConfig, RewardConfig, with_preset
from drl_engine.engine import Engine
from drl_engine.per_node import rows_of

PIS = ["throughput", "window"]
FAST = NodeModelConfig(stats_ticks=8, learn_start=4, replay_mb=8, cold_start="per_node")


def knob(node: str) -> ParameterSpec:
    return ParameterSpec(name=f"{node}/window", min=1, max=64, step=1, default=8)


def dqn() -> DQNConfig:
    return build(DQNConfig, with_preset({"preset": "default", "stack": 2}))


def test_a_deployment_engine_waits_for_its_nodes_resumes_then_speaks_its_order(tmp_path):
    # the deployment lists n2 before n1; the replay DB meets n1 first
    rows = rows_of([knob("n2"), knob("n1")])
    trained = Engine.over_rows(dqn(), RewardConfig(), PIS, rows.knobs, 2, model=FAST)
    trained.action_ticks = 7
    trained.save(tmp_path / "ckpt.pt")

    w = ReplayWriter(tmp_path / "r.db")
    w.begin_session(SessionInfo(pi_names=PIS, node_names=["n1"], params=[knob("n1")]))
    w.add_pis(0, 0, np.array([50.0, 20.0], np.float32))
    w.commit()
    eng = Engine.for_deployment(dqn(), RewardConfig(), tmp_path / "r.db", rows, FAST,
                                device="cpu")
    eng.load(tmp_path / "ckpt.pt")               # before its nodes are in: kept for later
    assert eng.update() == 0 and eng.act() is None and eng.dqn is None
    assert eng.param_names() == ["n2/window", "n1/window"] and eng.best_values() is None

    w.update_layout(PIS, ["n1", "n2"])
    for t in range(1, 12):                       # n1 holds window 20, n2 window 40
        w.add_pis(t, 0, np.array([50.0, 20.0], np.float32))
        w.add_pis(t, 1, np.array([60.0, 40.0], np.float32))
        w.commit()
    eng.update()
    assert eng.per_node and eng.dqn is not None and eng.restore_error is None
    assert eng.action_ticks == 7                 # resumed from the checkpoint
    d = eng.act(current=[41.0, 21.0])            # the daemon's values, deployment order
    assert d is not None and len(d.values) == 2 and d.row_actions.shape == (2,)
    # each value is its own node's, moved at most one step
    assert d.values[0] == pytest.approx(41.0, abs=1.0)
    assert d.values[1] == pytest.approx(21.0, abs=1.0)
    assert eng.action_ticks == 8
    eng.close()
