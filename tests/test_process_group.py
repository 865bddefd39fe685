"""What a bench's stack costs the host: ProcessGroup.cpu_seconds reads each running
child's CPU time, so a live arm can report its tuner's share beside its throughput."""
import textwrap
import time

from capes.experiments.process_group import ProcessGroup

BURN = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    want = float(sys.argv[1])
    while time.process_time() < want:     # busy until this much CPU is spent
        pass
    Path(sys.argv[2]).write_text("ok")
    time.sleep(60)
""")


def test_cpu_seconds_tells_a_busy_child_from_an_idle_one(tmp_path):
    (tmp_path / "burn.py").write_text(BURN)
    group = ProcessGroup(tmp_path)
    try:
        group.start("busy", "0.6", str(tmp_path / "busy.ready"), module="burn")
        group.start("idle", "0", str(tmp_path / "idle.ready"), module="burn")
        end = time.monotonic() + 30
        while not ((tmp_path / "busy.ready").exists() and (tmp_path / "idle.ready").exists()):
            assert time.monotonic() < end, "the children never got ready"
            time.sleep(0.05)
        cpu = group.cpu_seconds()
        assert set(cpu) == {"busy", "idle"}
        assert 0.55 <= cpu["busy"] < 5.0, cpu
        assert cpu["idle"] < cpu["busy"] - 0.3, cpu
    finally:
        group.stop(timeout=3)
    assert group.cpu_seconds() == {}          # gone: nothing left to read
