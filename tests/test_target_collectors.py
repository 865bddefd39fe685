"""The target collectors (Lustre OSC, Linux block devices) against fixture trees that
mirror the real file systems: the kernel's directory layout and file formats, under a
temporary directory that stands for ``/``."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from monitor_agent.collectors import build_collector
from monitor_agent.collectors import blockdev, lustre_osc

MiB = 1 << 20
OSC_DIRS = ("lustre-OST0000-osc-ffff88007a2b4000", "lustre-OST0001-osc-ffff88007a2b4000")


class FakeClock:
    def __init__(self):
        self.t = 500.0

    def __call__(self):
        return self.t


def _histogram(title: str, labels, rows) -> str:
    """An rpc_stats histogram as lproc_osc.c prints it."""
    out = f"\n\t\t\tread\t\t\twrite\n{title:<22}rpcs   % cum % |       rpcs   % cum %\n"
    for label, (r, w) in zip(labels, rows):
        out += f"{label}:\t\t{r:10d} {0:3d} {0:3d}   | {w:10d} {0:3d} {0:3d}\n"
    return out


def rpc_stats_text(read_rif=0, write_rif=0, pending_w=0, pending_r=0) -> str:
    return (f"snapshot_time:         1372786692.389858 (secs.usecs)\n"
            f"read RPCs in flight:  {read_rif}\n"
            f"write RPCs in flight: {write_rif}\n"
            f"pending write pages:  {pending_w}\n"
            f"pending read pages:   {pending_r}\n"
            + _histogram("pages per rpc", [1, 2, 4], [(0, 3), (0, 0), (1, 250)])
            + _histogram("rpcs in flight", [0, 1, 2], [(1, 10), (0, 80), (0, 163)])
            + _histogram("offset", [0, 1, 2], [(1, 253), (0, 0), (0, 0)]))


def stats_text(counters: dict[str, tuple[int, int]]) -> str:
    """lprocfs stats: idle counters (count 0) are not printed at all."""
    units = {"req_waittime": "usec", "read_bytes": "bytes", "write_bytes": "bytes"}
    out = f"{'snapshot_time':<25} 1409760133.606489 secs.usecs\n"
    for name, (count, total) in counters.items():
        if count:
            out += (f"{name:<25} {count} samples [{units.get(name, 'reqs')}] "
                    f"1 {max(1, total)} {total} {total * 7}\n")
    out += f"{'req_active':<25} 9 samples [reqs] 1 8 43 64\n"
    return out


def import_text(name: str, ascar: dict | None = None) -> str:
    ascar_rpcs = ascar_tail = ""
    if ascar:
        ascar_rpcs = (f"       ack_ewma: {ascar['ack_ewma']} usec\n"
                      f"       sent_ewma: {ascar['sent_ewma']} usec\n"
                      f"       rtt_ratio100: {ascar['rtt_ratio100']}\n")
        ascar_tail = "    read_throughput: 0\n    write_throughput: 52428800\n"
    return ("import:\n"
            f"    name: {name}\n"
            f"    target: {name.split('-osc-')[0]}_UUID\n"
            "    state: FULL\n"
            "    connect_flags: [ write_grant, server_lock, version, request_portal ]\n"
            "    connect_data:\n"
            "       flags: 0x2040401443000066\n"
            "       instance: 1\n"
            "       target_version: 2.9.0.0\n"
            "       max_brw_size: 4194304\n"
            "    import_flags: [ replayable, pingable, connect_tried ]\n"
            "    connection:\n"
            "       failover_nids: [ 10.0.0.1@tcp ]\n"
            "       current_connection: 10.0.0.1@tcp\n"
            "       connection_attempts: 1\n"
            "       generation: 1\n"
            "       in-progress_invalidations: 0\n"
            "    rpcs:\n"
            "       inflight: 3\n"
            "       unregistering: 0\n"
            "       timeouts: 0\n"
            "       avg_waittime: 1754 usec\n"
            + ascar_rpcs +
            "    service_estimates:\n"
            "       services: 1 sec\n"
            "       network: 1 sec\n"
            "    write_data_averages:\n"
            "       bytes_per_rpc: 1048576\n"
            "       usec_per_rpc: 23423\n"
            "       MB_per_sec: 44.76\n"
            + ascar_tail)


class FakeLustreClient:
    """A Lustre client's OSC directories under ``base`` (which stands for ``/``). With
    ``split``, files sit where Lustre >= 2.12 puts them: tunables in /sys/fs/lustre/osc,
    stats in debugfs, import and rpc_stats in /proc/fs/lustre/osc."""

    def __init__(self, base: Path, oscs=OSC_DIRS, ascar: bool = False, split: bool = False):
        self.base, self.oscs, self.split = Path(base), list(oscs), split
        self.proc = self.base / "proc/fs/lustre/osc"
        self.sys = self.base / "sys/fs/lustre/osc"
        self.debug = self.base / "sys/kernel/debug/lustre/osc"
        self.counters = {o: {} for o in self.oscs}
        for i, osc in enumerate(self.oscs):
            self.write(osc, "max_rpcs_in_flight", "8\n")
            self.write(osc, "max_dirty_mb", "32\n")
            self.write(osc, "cur_dirty_bytes", f"{i * 4096}\n")
            self.write(osc, "rpc_stats", rpc_stats_text())
            self.write(osc, "import", import_text(osc, {"ack_ewma": 45, "sent_ewma": 60,
                                                        "rtt_ratio100": 320} if ascar else None))
            self.write(osc, "stats", stats_text({}))
            self.write(osc, "uuid", f"{osc}_UUID\n")

    @property
    def roots(self) -> list[str]:
        """The collector's default roots, re-rooted under ``base``."""
        return [str(self.base / r.lstrip("/")) for r in lustre_osc.DEFAULT_ROOTS]

    def dir_of(self, fname: str) -> Path:
        if not self.split or fname in ("import", "rpc_stats", "uuid"):
            return self.proc
        return self.debug if fname == "stats" else self.sys

    def write(self, osc: str, fname: str, text: str) -> None:
        path = self.dir_of(fname) / osc / fname
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def add(self, osc: str, counter: str, count: int, total: int) -> None:
        c, s = self.counters[osc].get(counter, (0, 0))
        self.counters[osc][counter] = (c + count, s + total)
        self.write(osc, "stats", stats_text(self.counters[osc]))


class FakeBlockDevices:
    """/sys/block/<dev>/ under ``base``: queue files, inflight and stat."""

    def __init__(self, base: Path, devices=("sda", "nvme0n1", "loop0")):
        self.root = Path(base) / "sys/block"
        self.stats: dict[str, list[int]] = {}
        for dev in devices:
            q = self.root / dev / "queue"
            q.mkdir(parents=True, exist_ok=True)
            (q / "read_ahead_kb").write_text("128\n")
            (q / "nr_requests").write_text("64\n")
            (q / "max_sectors_kb").write_text("1280\n")
            (q / "rotational").write_text("1\n" if dev.startswith("sd") else "0\n")
            (q / "scheduler").write_text("mq-deadline kyber [bfq] none\n"
                                         if dev.startswith("sd") else "[none] mq-deadline\n")
            self.set_inflight(dev, 0, 0)
            self.set_stat(dev, [0] * 17)

    def set_inflight(self, dev: str, reads: int, writes: int) -> None:
        (self.root / dev / "inflight").write_text(f"{reads:8d} {writes:8d}\n")

    def set_stat(self, dev: str, values: list[int]) -> None:
        self.stats[dev] = list(values)
        (self.root / dev / "stat").write_text(" ".join(f"{v:8d}" for v in values) + "\n")

    def add(self, dev: str, **fields: int) -> None:
        """Advance stat counters by name: read_ios=..., write_sectors=..., io_ticks=..."""
        idx = {"read_ios": 0, "read_merges": 1, "read_sectors": 2, "read_ticks": 3,
               "write_ios": 4, "write_merges": 5, "write_sectors": 6, "write_ticks": 7,
               "io_ticks": 9, "time_in_queue": 10}
        values = list(self.stats[dev])
        for name, delta in fields.items():
            values[idx[name]] += delta
        self.set_stat(dev, values)


VMSTAT_TEXT = """nr_free_pages 5830870
nr_zone_inactive_file 137430
nr_dirty {nr_dirty}
nr_writeback {nr_writeback}
nr_dirtied {nr_dirtied}
nr_written {nr_written}
nr_dirty_threshold 1203685
nr_dirty_background_threshold 601107
pgpgin {pgpgin}
pgpgout {pgpgout}
pswpin 0
pswpout 0
pgfault 9315442
pgmajfault {pgmajfault}
"""

MEMINFO_TEXT = """MemTotal:       32768000 kB
MemFree:        23323272 kB
MemAvailable:   24003356 kB
Buffers:           18364 kB
Cached:         {cached} kB
SwapCached:            0 kB
Dirty:          {dirty} kB
Writeback:      {writeback} kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


class FakeProc:
    """/proc/vmstat, /proc/meminfo and /proc/sys/vm/dirty_* under ``base`` (which stands
    for ``/``), as an older kernel without pgscan/pgsteal counters prints them."""

    SYSCTLS = {"dirty_ratio": 20, "dirty_background_ratio": 10,
               "dirty_expire_centisecs": 3000, "dirty_writeback_centisecs": 500,
               "dirty_bytes": 0, "dirty_background_bytes": 0}

    def __init__(self, base: Path):
        self.root = Path(base) / "proc"
        (self.root / "sys/vm").mkdir(parents=True, exist_ok=True)
        self.vm = dict(nr_dirty=100, nr_writeback=0, nr_dirtied=10_000, nr_written=9_000,
                       pgpgin=500_000, pgpgout=800_000, pgmajfault=40)
        self.mem = dict(cached=911_892, dirty=400, writeback=0)
        for name, value in self.SYSCTLS.items():
            (self.root / "sys/vm" / name).write_text(f"{value}\n")
        self.write()

    def write(self) -> None:
        (self.root / "vmstat").write_text(VMSTAT_TEXT.format(**self.vm))
        (self.root / "meminfo").write_text(MEMINFO_TEXT.format(**self.mem))

    def add(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self.vm[name] += delta
        self.write()


def osc_collector(client: FakeLustreClient, clock=None, **options):
    return build_collector("lustre_osc", {"root": client.roots, "clock": clock or FakeClock(),
                                          **options})


# -- lustre_osc -------------------------------------------------------------------------------

def test_stock_client_reports_standard_fields_per_osc_and_totals(tmp_path):
    client = FakeLustreClient(tmp_path)
    col = osc_collector(client)
    names = col.names()
    for short in ("lustre-OST0000", "lustre-OST0001"):
        for field in ("max_rpcs_in_flight", "read_rpcs_in_flight", "pending_write_pages",
                      "cur_dirty_bytes", "read_bytes_s", "write_bytes_s", "req_wait_us"):
            assert f"osc.{short}.{field}" in names
    assert names[-2:] == ["osc.total.read_bytes_s", "osc.total.write_bytes_s"]
    # no ASCAR patch: its indicators are left out rather than reported as NaN forever
    assert not [n for n in names if n.endswith(("ack_ewma", "send_ewma", "pt_ratio"))]
    values = col.collect()
    assert set(values) == set(names)
    assert values["osc.lustre-OST0000.max_rpcs_in_flight"] == 8
    assert values["osc.lustre-OST0001.cur_dirty_bytes"] == 4096


def test_ascar_indicators_are_read_from_the_import_file(tmp_path):
    client = FakeLustreClient(tmp_path, ascar=True)
    values = osc_collector(client).collect()
    assert values["osc.lustre-OST0000.ack_ewma"] == 45
    assert values["osc.lustre-OST0000.send_ewma"] == 60
    assert values["osc.lustre-OST0001.pt_ratio"] == pytest.approx(3.2)   # rtt_ratio100 / 100


def test_ascar_indicator_files_take_precedence(tmp_path):
    client = FakeLustreClient(tmp_path, ascar=True)
    for osc in client.oscs:
        client.write(osc, "ackgap", "17.5\n")
    col = osc_collector(client, ascar_files={"ack_ewma": "ackgap"})
    assert col.collect()["osc.lustre-OST0001.ack_ewma"] == 17.5


def test_throughput_is_a_rate_and_the_total_sums_the_oscs(tmp_path):
    client, clock = FakeLustreClient(tmp_path), FakeClock()
    client.add(OSC_DIRS[0], "write_bytes", 10, 100 * MiB)     # history before the start
    col = osc_collector(client, clock)
    clock.t += 2.0
    client.add(OSC_DIRS[0], "write_bytes", 4, 4 * MiB)
    client.add(OSC_DIRS[1], "write_bytes", 2, 2 * MiB)
    client.add(OSC_DIRS[1], "read_bytes", 1, MiB)             # first read: line appears
    v = col.collect()
    assert v["osc.lustre-OST0000.write_bytes_s"] == 2 * MiB
    assert v["osc.lustre-OST0001.write_bytes_s"] == 1 * MiB
    assert v["osc.lustre-OST0001.read_bytes_s"] == MiB / 2
    assert v["osc.lustre-OST0000.read_bytes_s"] == 0
    assert v["osc.total.write_bytes_s"] == 3 * MiB
    assert v["osc.total.read_bytes_s"] == MiB / 2
    clock.t += 1.0                                            # an idle second
    assert col.collect()["osc.total.write_bytes_s"] == 0


def test_request_wait_is_the_mean_of_the_tick(tmp_path):
    client, clock = FakeLustreClient(tmp_path), FakeClock()
    client.add(OSC_DIRS[0], "req_waittime", 100, 1_000_000)   # old requests: 10 ms each
    col = osc_collector(client, clock)
    clock.t += 1.0
    client.add(OSC_DIRS[0], "req_waittime", 4, 2000)
    v = col.collect()
    assert v["osc.lustre-OST0000.req_wait_us"] == 500
    assert v["osc.lustre-OST0001.req_wait_us"] == 0           # no request completed


def test_cleared_stats_give_nan_once_then_rates_again(tmp_path):
    client, clock = FakeLustreClient(tmp_path), FakeClock()
    client.add(OSC_DIRS[0], "write_bytes", 10, 50 * MiB)
    col = osc_collector(client, clock)
    clock.t += 1.0
    client.counters[OSC_DIRS[0]] = {}                         # `lctl set_param osc.*.stats=0`
    client.add(OSC_DIRS[0], "write_bytes", 1, MiB)
    v = col.collect()
    assert math.isnan(v["osc.lustre-OST0000.write_bytes_s"])
    assert math.isnan(v["osc.total.write_bytes_s"])           # a total never undercounts
    clock.t += 1.0
    client.add(OSC_DIRS[0], "write_bytes", 1, 3 * MiB)
    assert col.collect()["osc.lustre-OST0000.write_bytes_s"] == 3 * MiB


def test_rpc_stats_header_and_changed_knob(tmp_path):
    client = FakeLustreClient(tmp_path)
    col = osc_collector(client)
    client.write(OSC_DIRS[1], "rpc_stats", rpc_stats_text(2, 7, 256, 3))
    client.write(OSC_DIRS[1], "max_rpcs_in_flight", "32\n")
    v = col.collect()
    fields = ("read_rpcs_in_flight", "write_rpcs_in_flight", "pending_write_pages",
              "pending_read_pages")
    assert [v[f"osc.lustre-OST0001.{f}"] for f in fields] == [2, 7, 256, 3]
    assert v["osc.lustre-OST0001.max_rpcs_in_flight"] == 32
    assert v["osc.lustre-OST0000.max_rpcs_in_flight"] == 8


def test_files_split_over_proc_sys_and_debugfs(tmp_path):
    client, clock = FakeLustreClient(tmp_path, split=True), FakeClock()
    assert not (client.proc / OSC_DIRS[0] / "max_rpcs_in_flight").exists()
    col = osc_collector(client, clock)
    client.write(OSC_DIRS[0], "max_rpcs_in_flight", "16\n")
    clock.t += 1.0
    client.add(OSC_DIRS[0], "read_bytes", 1, 5 * MiB)
    v = col.collect()
    assert v["osc.lustre-OST0000.max_rpcs_in_flight"] == 16
    assert v["osc.lustre-OST0000.read_bytes_s"] == 5 * MiB
    assert v["osc.lustre-OST0000.read_rpcs_in_flight"] == 0


def test_fields_and_pattern_choose_the_pis(tmp_path):
    client = FakeLustreClient(tmp_path, oscs=OSC_DIRS + ("other-OST0000-osc-ffff88001",))
    col = osc_collector(client, pattern="lustre-*", fields=["max_rpcs_in_flight"],
                        totals=False)
    assert col.names() == ["osc.lustre-OST0000.max_rpcs_in_flight",
                           "osc.lustre-OST0001.max_rpcs_in_flight"]


def test_two_mounts_of_one_file_system_keep_distinct_names(tmp_path):
    dirs = ("lustre-OST0000-osc-ffff8800aaaa", "lustre-OST0000-osc-ffff8800bbbb")
    col = osc_collector(FakeLustreClient(tmp_path, oscs=dirs), fields=["max_rpcs_in_flight"])
    assert col.names() == [f"osc.{d}.max_rpcs_in_flight" for d in dirs]


def test_an_osc_that_vanishes_reads_nan_and_does_not_raise(tmp_path):
    client = FakeLustreClient(tmp_path)
    col = osc_collector(client)
    for f in (client.proc / OSC_DIRS[1]).iterdir():
        f.unlink()
    v = col.collect()
    assert math.isnan(v["osc.lustre-OST0001.max_rpcs_in_flight"])
    assert math.isnan(v["osc.total.write_bytes_s"])
    assert v["osc.lustre-OST0000.max_rpcs_in_flight"] == 8


def test_lustre_osc_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no OSC directory matches"):
        build_collector("lustre_osc", {"root": str(tmp_path)})
    client = FakeLustreClient(tmp_path)
    with pytest.raises(ValueError, match="unknown field 'rpcs'"):
        osc_collector(client, fields=["rpcs"])
    with pytest.raises(ValueError, match="ASCAR"):
        osc_collector(client, fields=["ack_ewma"])
    with pytest.raises(ValueError, match="ascar_files"):
        osc_collector(client, ascar_files={"rtt": "x"})


def test_parsers_read_the_kernel_formats():
    header = lustre_osc.parse_rpc_stats_header(rpc_stats_text(1, 2, 3, 4))
    assert header == {"read rpcs in flight": 1, "write rpcs in flight": 2,
                      "pending write pages": 3, "pending read pages": 4}
    stats = lustre_osc.parse_stats(stats_text({"write_bytes": (3, 3 * MiB)}))
    assert stats["write_bytes"] == (3, 3 * MiB) and "snapshot_time" not in stats
    imported = lustre_osc.parse_import(import_text(OSC_DIRS[0], {"ack_ewma": 1, "sent_ewma": 2,
                                                                 "rtt_ratio100": 150}))
    assert (imported["inflight"], imported["avg_waittime"], imported["rtt_ratio100"]) \
        == (3, 1754, 150)
    assert lustre_osc.short_name(OSC_DIRS[1]) == "lustre-OST0001"


# -- blockdev ---------------------------------------------------------------------------------

def block_collector(devs: FakeBlockDevices, clock=None, **options):
    return build_collector("blockdev", {"root": str(devs.root), "clock": clock or FakeClock(),
                                        **options})


def test_blockdev_gauges_and_default_device_choice(tmp_path):
    devs = FakeBlockDevices(tmp_path)
    col = block_collector(devs)
    assert {n.split(".")[1] for n in col.names()} == {"sda", "nvme0n1"}   # no loop0
    devs.set_inflight("sda", 3, 5)
    (devs.root / "sda/queue/read_ahead_kb").write_text("512\n")
    v = col.collect()
    assert v["blockdev.sda.read_ahead_kb"] == 512
    assert v["blockdev.nvme0n1.read_ahead_kb"] == 128
    assert (v["blockdev.sda.inflight_reads"], v["blockdev.sda.inflight_writes"]) == (3, 5)
    assert v["blockdev.sda.scheduler"] == blockdev.SCHEDULERS.index("bfq")
    assert v["blockdev.nvme0n1.scheduler"] == blockdev.SCHEDULERS.index("none")
    assert (v["blockdev.sda.rotational"], v["blockdev.nvme0n1.rotational"]) == (1, 0)
    assert v["blockdev.sda.nr_requests"] == 64


def test_blockdev_stat_becomes_rates(tmp_path):
    devs, clock = FakeBlockDevices(tmp_path), FakeClock()
    devs.add("sda", read_ios=1000, read_sectors=10 ** 6, io_ticks=5000)   # since boot
    col = block_collector(devs, clock, devices=["sda"])
    clock.t += 2.0
    devs.add("sda", read_ios=200, read_sectors=4096, read_ticks=600, read_merges=10,
             write_ios=50, write_sectors=2048, write_ticks=1000,
             io_ticks=1000, time_in_queue=3000)
    v = col.collect()
    assert v["blockdev.sda.read_iops"] == 100
    assert v["blockdev.sda.read_bytes_s"] == 4096 * 512 / 2
    assert v["blockdev.sda.read_merges_s"] == 5
    assert v["blockdev.sda.read_await_ms"] == 3
    assert v["blockdev.sda.write_iops"] == 25
    assert v["blockdev.sda.write_bytes_s"] == 2048 * 512 / 2
    assert v["blockdev.sda.write_await_ms"] == 20
    assert v["blockdev.sda.busy_percent"] == 50
    assert v["blockdev.sda.avg_queue_depth"] == 1.5
    clock.t += 1.0
    v = col.collect()                                          # idle: rates 0, await 0
    assert v["blockdev.sda.read_iops"] == 0 and v["blockdev.sda.read_await_ms"] == 0


def test_blockdev_counter_going_backwards_gives_nan(tmp_path):
    devs, clock = FakeBlockDevices(tmp_path), FakeClock()
    devs.add("sda", read_ios=1000, read_sectors=8000)
    col = block_collector(devs, clock, devices=["sda"])
    clock.t += 1.0
    devs.set_stat("sda", [0] * 17)                             # device re-registered
    v = col.collect()
    assert math.isnan(v["blockdev.sda.read_iops"])
    assert math.isnan(v["blockdev.sda.read_await_ms"])
    assert v["blockdev.sda.write_iops"] == 0
    clock.t += 1.0
    devs.add("sda", read_ios=7)
    assert col.collect()["blockdev.sda.read_iops"] == 7


def test_blockdev_options_and_errors(tmp_path):
    devs = FakeBlockDevices(tmp_path)
    col = block_collector(devs, devices=["nvme*", "loop*"], exclude=[],
                          fields=["read_ahead_kb", "read_bytes_s"])
    assert col.names() == ["blockdev.loop0.read_ahead_kb", "blockdev.loop0.read_bytes_s",
                           "blockdev.nvme0n1.read_ahead_kb", "blockdev.nvme0n1.read_bytes_s"]
    with pytest.raises(ValueError, match="no block device"):
        block_collector(devs, devices=["vd*"])
    with pytest.raises(ValueError, match="unknown field"):
        block_collector(devs, fields=["iops"])
    with pytest.raises(ValueError, match="cannot list"):
        build_collector("blockdev", {"root": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="devices"):
        block_collector(devs, devices="sda")


def test_scheduler_parsing():
    assert blockdev.parse_scheduler("[mq-deadline] kyber bfq none") == 1
    assert blockdev.parse_scheduler("none") == 0
    assert blockdev.parse_scheduler("[fancy] none") == -1
    assert math.isnan(blockdev.parse_scheduler(""))
