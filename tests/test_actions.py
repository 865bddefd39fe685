"""The action set (capes.common.actions): one encoding for the engine, the replay DB and
the daemon's checker, whose one-step actions are the thesis' 2P + 1."""
from __future__ import annotations

import pytest

from capes.common import actions


def test_one_step_actions_keep_the_thesis_numbering():
    # 1 + 2k raises parameter k, 2 + 2k lowers it, 0 is NULL
    assert [actions.decode(a, 2) for a in range(5)] == [None, (0, 1), (0, -1), (1, 1), (1, -1)]
    assert actions.count(2) == 5 and actions.count(2, steps=3) == 13
    assert [actions.name(a, ["a", "b"]) for a in range(5)] == ["null", "a+", "a-", "b+", "b-"]


@pytest.mark.parametrize("n_params", [1, 2, 5])
def test_encode_and_decode_are_inverse_over_every_action(n_params):
    seen = set()
    for action in range(1, actions.count(n_params, actions.MAX_STEPS)):
        k, steps = actions.decode(action, n_params)
        assert 0 <= k < n_params and 1 <= abs(steps) <= actions.MAX_STEPS
        assert actions.encode(k, steps, n_params) == action
        seen.add((k, steps))
    assert len(seen) == 2 * n_params * actions.MAX_STEPS      # every move exactly once


def test_a_larger_move_is_learned_as_its_direction():
    import numpy as np
    moves = [actions.encode(k, s, 2) for k in (0, 1) for s in (1, -1, 2, -2, 8, -8)]
    got = actions.direction(np.array([0] + moves), 2).tolist()
    assert got == [0] + [1, 2] * 3 + [3, 4] * 3
    assert actions.direction(0, 2) == 0 and actions.direction(7, 2) == 3


def test_larger_moves_are_named_with_their_steps():
    assert actions.name(actions.encode(1, 2, 2), ["a", "b"]) == "b+2"
    assert actions.name(actions.encode(0, -3, 2), ["a", "b"]) == "a-3"


@pytest.mark.parametrize("action,ok", [(0, True), (16, True), (17, False), (-1, False),
                                       (True, False), (2.0, False), ("1", False)])
def test_valid_bounds_the_index_and_its_type(action, ok):
    assert actions.valid(action, 1) is ok      # one parameter: 0..16 with MAX_STEPS 8


def test_a_move_clamps_at_the_range_and_steps_over_forbidden_values():
    from capes.common.params import ParameterSpec
    spec = ParameterSpec(min=1, max=10, step=1, default=5, forbidden=[7], name="w")
    assert actions.moved(spec, 5.0, 2) == 8.0          # 6, then over 7 to 8
    assert actions.moved(spec, 9.0, 3) == 10.0         # clamped at max
    assert actions.moved(spec, 2.0, -2) == 1.0
