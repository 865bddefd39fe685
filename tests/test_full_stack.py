"""The whole stack as real processes on loopback (`capes demo`): it must tune the
simulator node to its peak, then stop every process it started."""
import json
import subprocess
import sys

import psutil
import pytest


@pytest.mark.slow
def test_demo_tunes_the_simulator_to_its_peak_and_leaves_no_process(tmp_path):
    out = tmp_path / "demo.json"
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "capes", "demo", "--timeout", "240", "--workdir", str(work),
         "--json", str(out), "--plot", str(tmp_path / "demo.png")],
        capture_output=True, text=True, timeout=400)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["won"], proc.stderr[-3000:]
    final = result["final"]
    assert final["true_throughput"] >= 90 and 40 <= final["window"] <= 60
    assert all(code == 0 for code in result["exit_codes"].values()), result["exit_codes"]
    daemon = result["daemon"]
    assert daemon["ticks_written"] > 100 and not daemon["drops"]
    assert daemon["actions"].get("acked", 0) > 0          # control agent applied actions
    assert "throughput" in proc.stderr and "ε" in proc.stderr     # live progress
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert (work / "replay.db").exists() and (work / "checkpoints" / "engine-latest.pt").exists()
    assert not [p for p in psutil.process_iter() if _cwd(p) == str(work)]


def _cwd(p):
    try:
        return p.cwd()
    except (psutil.Error, OSError):
        return None
