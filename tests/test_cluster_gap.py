"""tools/cluster_gap.py: a cluster bench's gap recomputed from its own static grid."""
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs/results/real-cluster/bench-seed2-pooled.json"


def _tool():
    spec = importlib.util.spec_from_file_location("cluster_gap", REPO / "tools/cluster_gap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_over_its_own_schedule_the_gap_is_the_benchs(capsys):
    result = json.loads(RUN.read_text())
    own = ",".join(w for w, _ in result["schedule"])
    assert _tool().main([str(RUN), "--schedule", own]) == 0
    line = capsys.readouterr().out
    want = f"gap {result['per_phase_best_gap']:.3f}"
    assert line.count(want) == 2, line       # its own schedule and --schedule alike


def test_a_phase_the_grid_lacks_is_said_not_guessed(capsys):
    assert _tool().main([str(RUN), "--schedule", "analysis,nosuchphase"]) == 0
    assert "['nosuchphase'] not in its grid" in capsys.readouterr().out
