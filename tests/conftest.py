import numpy as np
import pytest
import zmq

from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayWriter, SessionInfo


def two_params():
    return [ParameterSpec(min=1, max=100, step=1, default=10, name="a"),
            ParameterSpec(min=0, max=10, step=2, default=4, name="b")]


@pytest.fixture
def make_session():
    """Write a session of ``ticks`` ticks: PI 0 = tick, PI 1 = 2 * tick (per node)."""
    def make(path, ticks=50, nodes=("n0", "n1"), first_tick=0, missing=(), label="s",
             pi_names=("tp", "x"), action_every=1, params=None):
        w = ReplayWriter(path)
        info = w.begin_session(SessionInfo(pi_names=list(pi_names), node_names=list(nodes),
                                           params=params or two_params(), label=label))
        for t in range(first_tick, first_tick + ticks):
            for n in range(len(nodes)):
                if (t, n) in missing:
                    continue
                w.add_pis(t, n, np.array([t, 2 * t, 3 * t][:len(pi_names)], np.float32) + n)
            if action_every and t % action_every == 0:
                w.add_action(t, t % 5, [10 + t % 3, 4])
        w.commit()
        return w, info
    return make


@pytest.fixture
def ctx():
    """A ZeroMQ context for a test's sockets, destroyed (linger 0) at its end."""
    c = zmq.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)
