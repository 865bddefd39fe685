"""The knobs' step grid (capes.common.step_grid), shared by both engines' guides, the
search baselines and the cluster simulator's best-static search."""
import numpy as np

from capes.common.params import ParameterSpec
from capes.common.step_grid import StepGrid, local_draw, sweep_order


def spec(lo, hi, step):
    s = ParameterSpec(min=lo, max=hi, step=step, default=lo, name="k")
    s.validate()
    return s


def test_an_off_grid_max_is_the_last_setting_and_values_never_leave_the_range():
    g = StepGrid.of([spec(0, 10, 3), spec(1, 100, 1)])
    assert g.n_steps.tolist() == [4, 99]
    assert g.knob_values(0).tolist() == [0, 3, 6, 9, 10]          # every value is valid
    assert all(spec(0, 10, 3).check_value(float(v)) is None for v in g.knob_values(0))
    assert g.index([10, 50]).tolist() == [4, 49] and g.index([9.4, 1]).tolist() == [3, 0]
    assert g.values([4, 99]).tolist() == [10, 100]


def test_values_clamp_to_the_ends_and_rows_of_knobs_index_alike():
    g = StepGrid.of([spec(10, 200, 10), spec(1, 100, 1)])
    assert g.index([-50, 1e9]).tolist() == [0, 99]                 # clamped, never off
    rows = np.array([[10, 1], [200, 100], [55, 50.4]])
    np.testing.assert_array_equal(g.index(rows), [[0, 0], [19, 99], [4, 49]])
    np.testing.assert_array_equal(g.values(g.index(rows)), [[10, 1], [200, 100], [50, 50]])


def test_float_steps_land_on_the_max_exactly():
    g = StepGrid.of([spec(0.1, 1.0, 0.1)])
    assert g.n_steps.tolist() == [9] and g.values([9]).tolist() == [1.0]
    assert g.index([1.0]).tolist() == [9]


def test_moves_cross_forbidden_values_as_next_value_does():
    """``apply`` (an action on values) and ``move`` (steps on indices) land where
    repeated ``ParameterSpec.next_value`` lands: the one step rule of every engine and of
    the daemon, forbidden values crossed (or no move where only forbidden ones lie)."""
    from capes.common import actions
    a, b = spec(0, 20, 2), spec(1, 9, 1)
    b.forbidden = [4.0, 5.0, 9.0]
    specs = [a, b]
    g = StepGrid.of(specs)
    assert g.forbids.tolist() == [False, True]
    rng = np.random.default_rng(0)
    cur = np.column_stack([rng.integers(0, 11, 200) * 2.0,
                           rng.choice([1, 2, 3, 6, 7, 8], 200).astype(float)])
    acts = rng.integers(0, actions.count(2, 3), 200)
    out = g.apply(cur, acts)
    idx = g.move(g.index(cur), *actions.decode_rows(acts, 2))
    for r in range(200):
        want = cur[r].tolist()
        if (m := actions.decode(int(acts[r]), 2)) is not None:
            want[m[0]] = actions.moved(specs[m[0]], want[m[0]], m[1])
        assert out[r].tolist() == want and g.values(idx[r]).tolist() == want
    assert g.apply([0.0, 3.0], actions.encode(1, 1, 2)).tolist() == [0, 6]   # over 4 and 5
    assert g.apply([0.0, 8.0], actions.encode(1, 1, 2)).tolist() == [0, 8]   # only 9 above
    assert not set(out[:, 1]) & {4.0, 5.0, 9.0}


def test_one_walk_for_rows_a_row_and_a_straight_path():
    """The one walk (recall, rollback, probes, the trust region's step back, the
    demonstrations): the knob farthest from the target relative to its range, by up to
    ``most`` steps; only ``cells``; ``straight`` stops where another knob would lead."""
    from capes.common.step_grid import walk, walk_action
    n = np.array([19, 99])
    knob, steps = walk(np.array([[13, 78], [4, 50], [4, 50]]),
                       np.array([[11, 22], [4, 50], [10, 50]]), n, 8,
                       cells=np.array([[True, True], [True, True], [False, True]]))
    assert knob.tolist()[:1] == [1] and steps.tolist() == [-8, 0, 0]
    assert walk(np.array([13, 78]), np.array([11, 22]), n, 8) == (1, -8)
    # straight: the window leads while its relative distance is the largest
    assert walk(np.array([13, 30]), np.array([11, 22]), n, 8, straight=True) == (0, -1)
    assert walk_action(np.array([4, 50]), np.array([4, 50]), n, 8) == 0


def test_a_sweep_visits_the_nearer_ends_side_first_and_its_own_point_only_when_asked():
    # 12 rungs, 5 points: 0, 3, 6, 8, 11 (linspace, rounded); from rung 3 the low end is
    # nearer, so the points below first (nearest first), then those above
    assert sweep_order(11, 3, 5, with_at=True) == [3, 0, 6, 8, 11]       # per-node: origin kept
    assert sweep_order(11, 3, 5, with_at=False) == [0, 6, 8, 11]         # one-row: best left out
    assert sweep_order(11, 9, 5, with_at=False) == [11, 8, 6, 3, 0]      # high end nearer
    assert sweep_order(4, 2, 5, with_at=True) == [2, 1, 0, 3, 4]         # a tie: below first
    assert sweep_order(3, 0, 0, with_at=False) == [3]                    # at least both ends


def test_a_local_probe_stays_in_the_range_and_the_trust_region_and_moves_when_asked():
    # both modes' proposal: a Gaussian jump around a center, never past the range's ends
    # nor more than `guard` steps from the best-known setting
    rng = np.random.default_rng(0)
    n, best, guard = 11, 2, 3
    t = local_draw(rng, np.full(20000, 4), 2.0, n, best=np.full(20000, best), guard=guard)
    assert t.min() == 0 and t.max() == best + guard          # both bounds bind
    free = local_draw(rng, np.full(20000, 5), 2.0, n)
    assert abs(np.std(free - 5) - 2.0) < 0.15 and (free == 5).mean() > 0.15
    moved = local_draw(rng, np.full(20000, 5), 2.0, n, nonzero=True)
    assert (moved != 5).all()                                 # a row's probe always moves
    grid = local_draw(rng, np.zeros((3, 2), np.int64), np.array([1.0, 0.0]), [4, 4])
    assert grid.shape == (3, 2) and (grid[:, 1] == 0).all()  # per knob; spread 0 holds
