"""The row floor (drl_engine/row_floor.py): a row whose own objective collapses off its
best-known knobs walks back and does not go there again; noise and the rows a sweep or
a recall moves are left alone."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from drl_engine.cluster_config import NodeModelConfig
from drl_engine.row_floor import RowFloor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_row_sweep import MODEL, ladder_engine, play  # noqa: E402

SETTLE = 3
HOME = np.array([[0], [0]])                  # two rows, one knob, best-known at index 0


def run(floor: RowFloor, ticks: list[tuple[list[int], list[float]]], start: int = 0,
        judged=(True, True)) -> list[np.ndarray]:
    """Feed (indices per row, own objective per row) tick by tick; the falls per tick."""
    return [floor.observe(start + t, np.array(idx)[:, None], np.array(own, float), HOME,
                          np.array(judged)) for t, (idx, own) in enumerate(ticks)]


def at_home(floor: RowFloor, n: int = 6) -> None:
    run(floor, [([0, 0], [10.0, 10.0])] * n)


def test_a_row_collapsing_off_its_best_known_knobs_falls_after_settling():
    floor = RowFloor(2, 1, 0.5, SETTLE)
    at_home(floor)
    assert floor.level() == pytest.approx([10.0, 10.0])
    # row 0 moves to index 3 and gets 1.0: judged once settled, falls on the 2nd tick below
    falls = run(floor, [([3, 0], [1.0, 10.0])] * 6, start=6)
    first = next(i for i, f in enumerate(falls) if f.any())
    assert first == SETTLE + 1 and falls[first].tolist() == [True, False]
    assert floor.returning.tolist() == [True, False] and list(floor.falls) == [(6 + first, 0)] and floor.fall_count == 1
    # back home, no longer returning; its knob is bounded at the value it fell at
    run(floor, [([0, 0], [10.0, 10.0])], start=20)
    assert not floor.returning.any()
    idx, acts = np.array([[2], [2]]), np.array([1, 1])
    assert floor.block(idx, np.array([[3], [3]]), acts).tolist() == [0, 1]
    assert floor.block(idx, np.array([[4], [4]]), acts).tolist() == [0, 1]   # beyond
    assert floor.block(idx, np.array([[1], [1]]), acts).tolist() == [1, 1]   # other side


def test_noise_above_the_floor_and_rows_not_judged_never_fall():
    floor = RowFloor(2, 1, 0.5, SETTLE)
    at_home(floor)
    # row 0 at 0.6 of its level; row 1 (a sweep's, say) at 0.1 but not judged
    falls = run(floor, [([3, 3], [6.0, 1.0])] * 10, start=6, judged=(True, False))
    assert not any(f.any() for f in falls) and not floor.falls
    # one tick below between ticks above is not a fall either
    falls = run(floor, [([3, 0], [o, 10.0]) for o in [1.0, 9.0] * 5], start=16)
    assert not any(f.any() for f in falls)


def test_a_new_workload_forgets_levels_and_bounds_and_a_new_home_outside_them_too():
    floor = RowFloor(2, 1, 0.5, SETTLE)
    at_home(floor)
    run(floor, [([3, 0], [1.0, 10.0])] * 6, start=6)
    assert floor.hi[0, 0] == 3
    floor.reset()
    assert np.isnan(floor.level()).all() and floor.hi[0, 0] > 3 and floor.falls
    # bounds kept while the best-known setting moves inside them, dropped beyond
    at_home(floor)
    run(floor, [([3, 0], [1.0, 10.0])] * 6, start=6)
    floor.observe(20, np.array([[1], [0]]), np.array([10.0, 10.0]), np.array([[1], [0]]),
                  np.array([True, True]))
    assert floor.hi[0, 0] == 3 and np.isnan(floor.level()[0])   # level is per home
    floor.observe(21, np.array([[4], [0]]), np.array([10.0, 10.0]), np.array([[4], [0]]),
                  np.array([True, True]))
    assert floor.hi[0, 0] > 4


def test_the_engine_keeps_rows_off_the_cliff_the_floor_found():
    # mmap readers that collapse to a tenth from 32 KiB (rung 3) up, best at 4 KiB; the
    # trust region (3 steps around the best) lets probes and greedy moves reach the cliff
    def cliff(rung, kind, t):
        return np.where(rung >= 3, 1e6, 10e6 * (1 - 0.05 * rung))

    def ticks_on_cliff(row_floor: float, seed: int) -> tuple[int, object]:
        eng = ladder_engine(4, dataclasses.replace(MODEL, probe_dwell=6,
                                                   row_floor=row_floor))
        seen = np.array(play(eng, 400, np.ones(4, int), np.random.default_rng(seed), cliff))
        return int((seen[150:] >= 3).sum()), eng.control.floor

    for seed in (3, 4):
        on, floor = ticks_on_cliff(0.5, seed)
        off, unused = ticks_on_cliff(0.0, seed)
        assert floor.falls and not unused.falls
        assert on < off / 2, (seed, on, off)


def test_a_fall_is_not_taken_for_a_new_workload():
    # a client collapsing and coming back moves every client's share of the sum: the
    # change detector alarmed after the falls of a stationary game, and the alarm forgot
    # the bounds they had set; a fall restarts the detector, as a context switch does
    def run(restart: bool, seed: int):
        eng = ladder_engine(4, dataclasses.replace(
            MODEL, probe_dwell=6, floor_restarts_detector=restart))
        seen = np.array(play(eng, 400, np.ones(4, int), np.random.default_rng(seed),
                             lambda rung, kind, t: np.where(rung >= 3, 1e6,
                                                            10e6 * (1 - 0.05 * rung))))
        return eng.control, int((seen[150:] >= 3).sum())

    for seed in (4, 5):
        kept, on = run(True, seed)
        echoed, off = run(False, seed)
        assert kept.floor.falls and not kept.alarm_ticks        # stationary: no alarm
        assert any(0 < a - t <= 10 for a in echoed.alarm_ticks for t, _ in echoed.floor.falls)
        assert on < off, (seed, on, off)


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="row_floor"):
        NodeModelConfig(row_floor=1.0).validate()
