"""The engine's actions tick by tick against a golden trace (issue 39): a refactor of the
engine moves no result. Five short seeded runs, both modes (stationary game in the
default and paper presets, a recurring game with a new workload and a return, the
cluster game at 8 nodes with a workload change, its recurring variant), each compared
with ``tests/fixtures/engine_trace.json`` tick by tick: action(s), values, ε, loss.

A deliberate change of behaviour regenerates the fixture with
``python tools/engine_trace.py`` (and says so in its commit)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
try:
    import engine_trace
finally:
    sys.path.pop(0)

FIXTURE = json.loads(engine_trace.FIXTURE.read_text())


@pytest.mark.parametrize("name", list(engine_trace.CASES))
def test_the_engine_acts_as_recorded(name):
    if FIXTURE["versions"] != engine_trace.versions():
        pytest.skip(f"the fixture was recorded under {FIXTURE['versions']}, this is "
                    f"{engine_trace.versions()}: float arithmetic may differ "
                    f"(regenerate: python tools/engine_trace.py)")
    diff = engine_trace.first_difference(FIXTURE["cases"][name], engine_trace.trace(name))
    assert diff is None, f"{name}: the engine acts otherwise than recorded at {diff}"


def test_a_moved_action_is_found():
    """The comparison names the first tick that differs (and does not pass a change)."""
    want = FIXTURE["cases"]["stationary"]
    got = [list(t) for t in want]
    got[57][1] = [got[57][1][0] + 1.0, got[57][1][1]]
    diff = engine_trace.first_difference(want, got)
    assert diff is not None and diff.startswith("tick 57: values")
    assert engine_trace.first_difference(want, want[:-1]).endswith("now")
