"""Every benchmark runs: each ``benchmarks/bench_*.py --quick`` as shipped, in a subprocess.

Figures are not judged here (timing goals live in the benchmarks themselves); this only
makes sure that a change which breaks a benchmark is seen the day it lands: the quick run
exits 0 and prints its figure. Exit 77 with ``skip: <reason>`` means the benchmark
cannot run on this machine (no root, fio, FUSE, ...) and becomes a skip. The convention
(HELPERS.md, docs): ``--quick`` finishes in <= 60 s on an idle 2-core machine.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted((ROOT / "benchmarks").glob("bench_*.py"))
TIMEOUT_S = 600           # a shared CI machine can be several times slower than idle
SKIP = 77

# what each quick run prints as its figure (a new benchmark adds its own line here)
FIGURES = {
    "bench_action_latency.py": r"action latency.*p50 [\d.]+ ms",
    "bench_cluster_engine.py": r"train_step [\d.]+ ms",
    "bench_cluster_sim.py": r"(?s)wall s per simulated hour.*\n\s+8\s+\d+\s+[\d.]+",
    "bench_costs.py": r"drl-engine\s+1\s+[\d.]+ /",
    "bench_converge_grid.py": r"\d+%\s+diff_ewma\s+\d+%",
    "bench_daemon_ingest.py": r"sustained with nothing dropped: \d+ messages/s",
    "bench_message_size.py": r"busy\s+23\s+[\d.]+",
    "bench_monitor_agent.py": r"CPU [\d.]+ % of a core, RSS [\d.]+ MB",
    "bench_experience.py": r"memory\s+inside\s+\d+",
    "bench_experience_cluster.py": r"memory\s+time to band s: .*\n\s+run relative [\d.]+",
    "bench_pretrained_merge.py": r"pretrained\s+[\d.]+\s+\d+/\d+",
    "bench_real_alternating.py": r"\| capes \| [\d.]+ \(",
    "bench_real_blockdev.py": r"MB/s",
    "bench_real_experience.py": r"\| median \| [\d.]+ \| [\d.]+ \|",
    "bench_real_cluster.py": r"\| capes \(live\) \| [\d.]+\.\.[\d.]+ \| [\d.]+ \|",
    "bench_real_gluster.py": r"MB/s",
    "bench_real_online.py": r"MB/s",
    "bench_recall.py": r"recurring\s+\d+%\s+default\s+\d+",
    "bench_replay_storage.py": r"disk\s+[\d.]+ GB",
    "bench_sim_hour.py": r"default / paper, wall time, paired by seed: [\d.]+ / [\d.]+",
    "bench_soak.py": r"daemon drops",
    "bench_train_offline.py": r"device / host: [\d.]+",
    "bench_train_step.py": r"DQN.train_step \(ready tensors\)\s+median\s+[\d.]+ ms",
    "bench_tuners.py": r"wall \d+ s for 1 games",
}


def test_every_benchmark_has_a_figure_to_check():
    assert BENCHES, "no benchmarks found"
    missing = [b.name for b in BENCHES if b.name not in FIGURES]
    assert not missing, f"add the figure each quick run prints to FIGURES: {missing}"


@pytest.mark.parametrize("bench", BENCHES, ids=[b.stem for b in BENCHES])
def test_quick_mode_runs_and_prints_its_figure(bench: Path):
    try:
        run = subprocess.run([sys.executable, str(bench), "--quick"], cwd=ROOT,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{bench.name} --quick ran over {TIMEOUT_S} s")
    out = run.stdout + run.stderr
    if run.returncode == SKIP:
        reason = next((line for line in out.splitlines() if line.startswith("skip:")),
                      "skip: (no reason printed)")
        pytest.skip(f"{bench.name}: {reason[5:].strip()}")
    assert run.returncode == 0, f"{bench.name} --quick exited {run.returncode}:\n{out[-3000:]}"
    pattern = FIGURES.get(bench.name)
    assert pattern is not None, f"{bench.name}: no figure pattern in FIGURES"
    assert re.search(pattern, run.stdout), \
        f"{bench.name} --quick printed no figure matching {pattern!r}:\n{run.stdout[-3000:]}"
