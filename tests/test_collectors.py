"""Collectors: what a monitoring agent's PIs mean, against fake sources and fixture trees."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from collections import namedtuple

import pytest

from monitor_agent.collectors import COLLECTORS, build_collector

DiskIO = namedtuple("DiskIO", "read_count write_count read_bytes write_bytes busy_time")
NetIO = namedtuple("NetIO", "bytes_sent bytes_recv")
CpuTimes = namedtuple("CpuTimes", "user system idle iowait")
Mem = namedtuple("Mem", "percent")


class FakePsutil:
    """psutil's counters, advanced by hand."""

    def __init__(self):
        self.disks = {"sda": DiskIO(0, 0, 0, 0, 0), "nvme0n1": DiskIO(0, 0, 0, 0, 0),
                      "loop0": DiskIO(0, 0, 0, 0, 0)}
        self.nics = {"lo": NetIO(0, 0), "eth0": NetIO(0, 0), "ib0": NetIO(0, 0)}
        self.cpu = CpuTimes(20.0, 10.0, 65.0, 5.0)
        self.mem = 42.5

    def cpu_times_percent(self, interval=None):
        return self.cpu

    def virtual_memory(self):
        return Mem(self.mem)

    def disk_io_counters(self, perdisk=True):
        return dict(self.disks)

    def net_io_counters(self, pernic=True):
        return dict(self.nics)

    def add_disk(self, dev, reads=0, writes=0, rbytes=0, wbytes=0, busy_ms=0):
        d = self.disks[dev]
        self.disks[dev] = DiskIO(d.read_count + reads, d.write_count + writes,
                                 d.read_bytes + rbytes, d.write_bytes + wbytes,
                                 d.busy_time + busy_ms)

    def add_net(self, nic, sent=0, recv=0):
        n = self.nics[nic]
        self.nics[nic] = NetIO(n.bytes_sent + sent, n.bytes_recv + recv)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def host():
    ps, clock = FakePsutil(), FakeClock()
    return ps, clock, build_collector("host", {"source": ps, "clock": clock})


def test_builtin_collectors_are_registered_by_name():
    build_collector("timeofday")
    COLLECTORS.load_builtin()             # every built-in module registers itself
    assert {"host", "timeofday", "simulator", "command", "blockdev", "vmstat"} <= set(COLLECTORS)
    with pytest.raises(ValueError, match="unknown collector 'nope'"):
        build_collector("nope")


def test_host_reports_rates_not_cumulative_counters(host):
    ps, clock, col = host
    clock.t += 2.0
    ps.add_disk("sda", reads=100, writes=50, rbytes=4_000_000, wbytes=1_000_000, busy_ms=500)
    ps.add_net("eth0", sent=2_000, recv=10_000)
    v = col.collect()
    assert v["disk.sda.read_bytes_s"] == pytest.approx(2_000_000)
    assert v["disk.sda.write_bytes_s"] == pytest.approx(500_000)
    assert v["disk.sda.read_iops"] == pytest.approx(50)
    assert v["disk.sda.write_iops"] == pytest.approx(25)
    assert v["disk.sda.busy_percent"] == pytest.approx(25)     # 500 ms busy in 2 s
    assert v["net.eth0.rx_bytes_s"] == pytest.approx(5_000)
    assert v["net.eth0.tx_bytes_s"] == pytest.approx(1_000)
    assert v["disk.nvme0n1.read_bytes_s"] == 0
    # the same totals one second later: no traffic, so every rate is zero again
    clock.t += 1.0
    v = col.collect()
    assert all(v[n] == 0 for n in col.names() if n.startswith(("disk.", "net.")))


def test_host_cpu_and_memory(host):
    ps, clock, col = host
    v = col.collect()
    assert v["cpu_percent"] == pytest.approx(30.0)       # 100 − idle − iowait
    assert v["cpu_iowait_percent"] == pytest.approx(5.0)
    assert v["mem_used_percent"] == pytest.approx(42.5)


def test_host_default_filter_and_fixed_names(host):
    ps, clock, col = host
    names = col.names()
    assert not any(".loop0." in n or ".lo." in n for n in names)
    assert "disk.sda.read_bytes_s" in names and "net.ib0.rx_bytes_s" in names
    ps.disks["sdb"] = DiskIO(0, 0, 0, 0, 0)      # hot-plugged after start: not added
    clock.t += 1
    assert set(col.collect()) == set(names) and col.names() == names


def test_host_device_and_interface_filters():
    ps, clock = FakePsutil(), FakeClock()
    col = build_collector("host", {"source": ps, "clock": clock, "cpu": False,
                                   "memory": False, "disks": ["nvme*"],
                                   "interfaces": ["eth*", "lo"], "exclude_interfaces": []})
    assert col.names() == [
        "disk.nvme0n1.read_bytes_s", "disk.nvme0n1.write_bytes_s", "disk.nvme0n1.read_iops",
        "disk.nvme0n1.write_iops", "disk.nvme0n1.busy_percent",
        "net.eth0.rx_bytes_s", "net.eth0.tx_bytes_s", "net.lo.rx_bytes_s", "net.lo.tx_bytes_s"]


def test_host_counter_reset_and_vanished_device_give_nan(host):
    ps, clock, col = host
    ps.add_disk("sda", rbytes=10_000)
    clock.t += 1
    col.collect()
    ps.disks["sda"] = DiskIO(0, 0, 0, 0, 0)      # counters reset
    del ps.nics["eth0"]                          # interface gone
    clock.t += 1
    v = col.collect()
    assert math.isnan(v["disk.sda.read_bytes_s"])
    assert math.isnan(v["net.eth0.rx_bytes_s"])
    ps.add_disk("sda", rbytes=3_000)             # after the reset, rates resume
    clock.t += 1
    assert col.collect()["disk.sda.read_bytes_s"] == pytest.approx(3_000)


def test_host_against_real_psutil():
    col = build_collector("host")
    time.sleep(0.05)
    v = col.collect()
    assert set(v) == set(col.names())
    assert 0 <= v["mem_used_percent"] <= 100
    rates = [v[n] for n in v if n.startswith(("disk.", "net."))]
    # a rate over 50 ms is nowhere near a since-boot total of a busy host; just sanity
    assert all(math.isnan(r) or r >= 0 for r in rates)


def test_timeofday_separate_features():
    # 2024-03-15 (a Friday) 13:07:30 UTC
    ts = 1710508050.0
    col = build_collector("timeofday", {"utc": True, "clock": lambda: ts})
    assert col.names() == ["month", "weekday", "hour", "minute"]
    assert col.collect() == {"month": 3.0, "weekday": 4.0, "hour": 13.0, "minute": 7.0}
    local = build_collector("timeofday", {"clock": lambda: ts}).collect()
    lt = time.localtime(ts)
    assert local["hour"] == lt.tm_hour and local["minute"] == lt.tm_min


def test_simulator_collector_reads_the_node_files(tmp_path):
    (tmp_path / "throughput").write_text("87.5\n")
    (tmp_path / "window").write_text("42\n")
    (tmp_path / "rate_limit").write_text("150\n")
    col = build_collector("simulator", {"dir": str(tmp_path)})
    assert col.collect() == {"throughput": 87.5, "window": 42.0, "rate_limit": 150.0}
    (tmp_path / "window").write_text("")              # caught mid-rewrite: last value
    (tmp_path / "rate_limit").write_text("garbage")   # unparsable: NaN
    (tmp_path / "throughput").unlink()                # missing: NaN
    v = col.collect()
    assert v["window"] == 42.0
    assert math.isnan(v["rate_limit"]) and math.isnan(v["throughput"])


def test_simulator_collector_names_match_the_game():
    from monitor_agent.collectors.simulator import SIM_PI_NAMES
    from storagegamesim.game import PI_NAMES
    assert tuple(SIM_PI_NAMES) == tuple(PI_NAMES)


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "pis.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_command_collector_parses_name_value_lines(tmp_path):
    argv = _script(tmp_path, """
        print("# a comment")
        print("osc.rpcs 8")
        print("osc.ewma 0.25")
        print("not a pair at all")
        print("bad notanumber")
    """)
    col = build_collector("command", {"argv": argv})
    assert col.names() == ["osc.ewma", "osc.rpcs"]
    v = col.collect()
    assert v["osc.rpcs"] == 8.0 and v["osc.ewma"] == 0.25


def test_command_collector_never_uses_a_shell(tmp_path):
    marker = tmp_path / "pwned"
    argv = _script(tmp_path, """
        import sys
        print("args", len(sys.argv) - 1)
    """) + [f"; touch {marker}"]
    col = build_collector("command", {"argv": argv, "names": ["args"]})
    assert col.collect() == {"args": 1.0}
    assert not marker.exists()


def test_command_collector_timeout_and_failure_give_nan(tmp_path):
    slow = _script(tmp_path, "import time; time.sleep(5); print('x 1')")
    col = build_collector("command", {"argv": slow, "names": ["x"], "timeout_s": 0.3})
    t0 = time.monotonic()
    assert math.isnan(col.collect()["x"])
    assert time.monotonic() - t0 < 3
    failing = [sys.executable, "-c", "import sys; print('x 1'); sys.exit(3)"]
    col = build_collector("command", {"argv": failing, "names": ["x"]})
    assert math.isnan(col.collect()["x"]) and col.failures == 1
    unnamed = build_collector("command", {"argv": failing})     # building runs nothing
    with pytest.raises(ValueError, match="first run"):
        unnamed.start()                                         # the agent starts it


def test_monitor_agent_never_imports_torch():
    code = ("import sys, monitor_agent.agent\n"
            "from monitor_agent.collectors.base import COLLECTORS\n"
            "COLLECTORS.load_builtin()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'numpy' not in sys.modules, 'numpy imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)), timeout=60)
    assert done.returncode == 0, done.stderr


def test_host_rejects_bad_filters():
    with pytest.raises(ValueError, match="disks: must be a list"):
        build_collector("host", {"source": FakePsutil(), "disks": "sda"})
