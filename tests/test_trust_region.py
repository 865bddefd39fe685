"""The trust region (drl_engine.trust_region): one function for the flat engine's one
row of knobs and the cluster engine's row per node."""
import numpy as np

from drl_engine.trust_region import outside


def test_a_move_past_the_limit_and_not_closer_becomes_a_step_back_per_row():
    best = np.array([[5, 5], [5, 5], [5, 5], [5, 5]])
    idx = np.array([[6, 5], [7, 5], [7, 5], [5, 5]])
    knob, steps = np.array([0, 0, 0, 1]), np.array([1, 1, -1, 0])
    out, back = outside(idx, knob, steps, best, np.array([10, 10]), limit=1)
    # row 0: 6 -> 7 is 2 steps out; row 1: 7 -> 8 further out; row 2: 7 -> 6 comes closer
    # (allowed though still outside); row 3: NULL is never guarded
    assert out.tolist() == [True, True, False, False]
    assert back[:2].tolist() == [2, 2]          # knob 0 one step down, back towards 5


def test_the_step_back_moves_the_knob_farthest_relative_to_its_range_and_skips_frozen_ones():
    best = np.array([[0, 0]])
    idx = np.array([[4, 50]])        # knob 0 is 40 % of its range away, knob 1 50 %
    n_steps = np.array([10, 100])
    _, back = outside(idx, np.array([0]), np.array([1]), best, n_steps, limit=1)
    assert back.tolist() == [4]                 # knob 1 one step down: the farthest
    frozen = np.array([True, False])            # knob 1 never moves online
    _, back = outside(idx, np.array([0]), np.array([1]), best, n_steps, limit=1,
                      movable=frozen)
    assert back.tolist() == [2]                 # knob 0 instead (40 % of its range)
    out, _ = outside(idx, np.array([0]), np.array([1]), best, n_steps, limit=5,
                     movable=frozen)
    assert out.tolist() == [False]              # 5 steps: inside once knob 1 is left out
    out, _ = outside(idx, np.array([0]), np.array([1]), best, n_steps, limit=5)
    assert out.tolist() == [True]               # ... and outside when it counts
