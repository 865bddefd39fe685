"""GlusterFS as a real target: the collector's parsers against captured output, the
applier's value syntax, and (slow, root + gluster + FUSE only) a real 3-brick volume
stood up, tuned through the applier, measured through the collector, and torn down
leaving nothing behind."""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from capes.experiments import gluster_volume as gv
from control_agent.appliers import ApplyError, build_applier
from control_agent.appliers.gluster import (GlusterApplier, from_option, parse_volume_get,
                                            to_option)
from monitor_agent.collectors import build_collector
from monitor_agent.collectors.glusterfs import (FOPS, GlusterFSCollector, brick_dump_name,
                                                combine, find_client, parse_option_value,
                                                parse_profile, parse_stats_dump,
                                                parse_volume_info_bricks, profile_rates)
from monitor_agent.collectors import glusterfs as glc

FIX = Path(__file__).resolve().parent / "fixtures" / "glusterfs"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


# ---------------------------------------------------------------- stats dumps

def test_client_dump_gives_the_interval_rates():
    s = parse_stats_dump(fixture("client-write.dump"))
    assert s["write_bytes_s"] == 120455168.0 and s["read_bytes_s"] == 0.0
    assert s["write_s"] == 918.0 and s["fops_s"] == 920.0
    # the dump's "usec" are nanoseconds in GlusterFS 10: 66201.34 -> 66.2 µs
    assert s["write_lat_us"] == pytest.approx(66.20134)
    assert s["latency_us"] == pytest.approx(66.0646163)
    assert s["read_s"] == 0.0 and s["read_lat_us"] == 0.0
    assert set(s) == {*glc.TOTALS, *(f"{f}{x}" for f in FOPS for x in ("_s", "_lat_us"))}


def test_brick_dump_parses_and_idle_fops_are_zero():
    busy = parse_stats_dump(fixture("brick-write.dump"))
    assert busy["write_bytes_s"] == 237502464.0 and busy["write_s"] == 1811.0
    assert busy["write_lat_us"] == pytest.approx(202.84497)
    idle = parse_stats_dump(fixture("brick-idle.dump"))
    assert idle["write_bytes_s"] == 0.0 and idle["write_s"] == 0.0
    assert idle["fops_s"] == 2.0                       # two GETXATTRs, not in FOPS


@pytest.mark.parametrize("text", ["", "   \n", "{\n\"gluster.x.aggr.read_1b\": 0,\n",
                                  "not json"])
def test_empty_or_half_written_dump_is_none(text):
    assert parse_stats_dump(text) is None


def test_dump_cut_inside_the_interval_object_is_none():
    text = fixture("client-write.dump")
    assert parse_stats_dump(text[: text.index("inter.fop.write.per_sec")]) is None


def test_dump_latency_unit_can_be_microseconds():
    s = parse_stats_dump(fixture("client-write.dump"), latency_scale=1.0)
    assert s["write_lat_us"] == pytest.approx(66201.34)


def test_combine_sums_rates_and_weights_latencies():
    a = dict.fromkeys(glc.TOTALS + tuple(f"{f}{x}" for f in FOPS for x in ("_s", "_lat_us")),
                      0.0)
    b = dict(a)
    a.update(write_bytes_s=10.0, fops_s=1.0, latency_us=100.0, write_s=1.0, write_lat_us=100.0)
    b.update(write_bytes_s=30.0, fops_s=3.0, latency_us=200.0, write_s=3.0, write_lat_us=200.0)
    c = combine([a, b])
    assert c["write_bytes_s"] == 40.0 and c["fops_s"] == 4.0 and c["write_s"] == 4.0
    assert c["latency_us"] == c["write_lat_us"] == 175.0
    assert c["read_lat_us"] == 0.0


def test_brick_dump_name_matches_io_stats():
    assert brick_dump_name("/srv/gl/b3") == "glusterfsd__srv_gl_b3.dump"
    assert parse_volume_info_bricks(fixture("volume-info.txt")) == \
        ["/srv/gl/b1", "/srv/gl/b2", "/srv/gl/b3"]


# ---------------------------------------------------------------- profile

def test_profile_incremental_sums_bricks():
    p = parse_profile(fixture("profile-incremental-read.txt"))
    assert p["bricks"] == 3
    assert p["read_bytes"] == 53 + 209715238 + 60 and p["write_bytes"] == 0
    assert p["fops"]["read"][0] == 7 + 1605 + 8
    assert p["fops"]["release"] == [21, 0.0]           # no latency of its own
    r = profile_rates(p, 2.0)
    assert r["read_bytes_s"] == pytest.approx((53 + 209715238 + 60) / 2)
    assert r["read_s"] == pytest.approx(1620 / 2)
    want = (7 * 127979.71 + 1605 * 397067.06 + 8 * 123023.50) / 1620 / 1000
    assert r["read_lat_us"] == pytest.approx(want)
    assert r["write_s"] == 0.0 and r["write_lat_us"] == 0.0
    calls = sum(c for c, _ in p["fops"].values())
    assert r["fops_s"] == pytest.approx(calls / 2)


def test_profile_write_and_empty_bricks():
    r = profile_rates(parse_profile(fixture("profile-incremental-write.txt")), 1.0)
    assert r["write_bytes_s"] == 309723136 and r["write_s"] == 2362
    assert r["write_lat_us"] == pytest.approx(2420.94612)
    assert r["latency_us"] == pytest.approx(2420.94612)
    flush = profile_rates(parse_profile(fixture("profile-incremental-flush.txt")), 11.0)
    assert flush["write_bytes_s"] == pytest.approx(487325696 / 11)
    assert flush["flush_s"] == pytest.approx(1 / 11) and flush["flush_lat_us"] == 18.257
    small = profile_rates(parse_profile(fixture("profile-incremental-small.txt")), 1.0)
    assert small["write_bytes_s"] == 62259200 and small["flush_s"] == 1


def test_profile_info_counts_only_the_interval_sections():
    p = parse_profile(fixture("profile-info-cumulative.txt"))
    assert p["bricks"] == 3
    cumulative = parse_profile(fixture("profile-info-cumulative.txt").replace(
        "Cumulative Stats:", "Interval 0 Stats:"))
    assert cumulative["fops"]["lookup"][0] > p["fops"].get("lookup", [0])[0]


@pytest.mark.parametrize("text", ["", "Profile on Volume capes is not started\n",
                                  "Connection failed. Please check if gluster daemon "
                                  "is operational.\n"])
def test_profile_failure_texts_are_none(text):
    assert parse_profile(text) is None
    assert profile_rates(parse_profile(text), 1.0) is None


# ---------------------------------------------------------------- option values

@pytest.mark.parametrize("text,unit,want", [
    ("on", "bool", 1.0), ("off", "bool", 0.0), ("enable", "bool", 1.0),
    ("4MB (DEFAULT)", "MB", 4.0), ("131072", "MB", 0.125), ("1GB", "MB", 1024.0),
    ("128KB", "KB", 128.0), ("16", "", 16.0), ("32MB", "", 32.0 * 2 ** 20),
    ("1.5MB", "KB", 1536.0)])
def test_option_values(text, unit, want):
    assert parse_option_value(text, unit) == want
    assert from_option(text, unit.upper() if unit != "bool" else "bool") == want


def test_bad_option_values():
    assert math.isnan(parse_option_value("fast", ""))
    assert from_option("fast", "") is None and from_option("", "MB") is None


@pytest.mark.parametrize("value,unit,want", [
    (1, "bool", "on"), (0, "bool", "off"), (4, "MB", "4MB"), (64, "KB", "64KB"),
    (1.5, "MB", "1572864"), (16, "", "16"), (4096, "B", "4096")])
def test_to_option(value, unit, want):
    assert to_option(value, unit) == want


def test_volume_get_parsers():
    assert parse_volume_get(fixture("volume-get-write-behind-window.txt"),
                            "performance.write-behind-window-size") == ["1MB"]
    assert parse_volume_get(fixture("volume-get-cache-size.txt"),
                            "performance.cache-size") == ["32MB"]
    every = glc.parse_volume_get(fixture("volume-get-all.txt"))
    assert every["performance.cache-size"] == ["32MB", "128MB"]    # io-cache, quick-read
    assert every["performance.write-behind"] == ["on"]
    assert every["performance.write-behind-trickling-writes"] == ["on"]


# ---------------------------------------------------------------- collector and applier
# without a volume: a missing gluster, glusterd or dump is NaN, never an exception

def fake_gluster(tmp_path: Path, outputs: dict[str, str], rc: int = 0,
                 sleep_s: float = 0.0, name: str = "gluster") -> str:
    """A `gluster` script printing a fixture by subcommand; logs its argv."""
    script = tmp_path / name
    cases = "\n".join(f'  *"{k}"*) cat "{v}" ;;' for k, v in outputs.items())
    script.write_text(f"""#!/bin/sh
echo "$@" >> "{tmp_path}/argv.log"
sleep {sleep_s}
case "$*" in
{cases}
  *) ;;
esac
exit {rc}
""")
    script.chmod(0o755)
    return str(script)


def test_collector_reads_brick_dumps(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    shutil.copy(FIX / "brick-write.dump", stats / brick_dump_name("/srv/gl/b3"))
    shutil.copy(FIX / "brick-idle.dump", stats / brick_dump_name("/srv/gl/b1"))
    c = build_collector("glusterfs", {"volume": "capes", "stats_dir": str(stats),
                                      "bricks": ["/srv/gl/b1", "/srv/gl/b2", "/srv/gl/b3"],
                                      "gluster": str(tmp_path / "missing-gluster")})
    assert len(c.names()) == len(set(c.names())) == 4 + 2 * len(FOPS) + 1
    v = c.collect()
    assert v["glusterfs.capes.write_bytes_s"] == 237502464.0       # b2 is remote: skipped
    assert v["glusterfs.capes.write_s"] == 1811.0
    assert v["glusterfs.capes.fops_s"] == \
        parse_stats_dump(fixture("brick-write.dump"))["fops_s"] + 2.0   # + idle b1's 2
    (stats / brick_dump_name("/srv/gl/b1")).write_text("")          # caught mid-rewrite
    v = c.collect()
    assert math.isnan(v["glusterfs.capes.write_bytes_s"])
    os.utime(stats / brick_dump_name("/srv/gl/b1"), (1, 1))
    (stats / brick_dump_name("/srv/gl/b1")).unlink()
    os.utime(stats / brick_dump_name("/srv/gl/b3"), (1, 1))        # stale: dumps stopped
    assert math.isnan(c.collect()["glusterfs.capes.write_bytes_s"])


def test_collector_discovers_bricks_and_reads_knobs(tmp_path):
    stats = tmp_path / "stats"
    stats.mkdir()
    shutil.copy(FIX / "brick-write.dump", stats / brick_dump_name("/srv/gl/b3"))
    cli = fake_gluster(tmp_path, {"volume info": FIX / "volume-info.txt",
                                  "volume get": FIX / "volume-get-all.txt"})
    c = GlusterFSCollector("capes", stats_dir=str(stats), gluster=cli, glusterd_sock="/s",
                           knobs={"wb": {"key": "performance.write-behind", "unit": "bool"},
                                  "win": {"key": "performance.write-behind-window-size",
                                          "unit": "MB"},
                                  "cache": "performance.cache-size",
                                  "threads": "performance.io-thread-count"})
    assert c.bricks is None and not (tmp_path / "argv.log").exists()  # built: ran nothing
    c.start()
    assert c.bricks == ["/srv/gl/b1", "/srv/gl/b2", "/srv/gl/b3"]
    v = c.collect()
    assert v["glusterfs.capes.write_bytes_s"] == 237502464.0
    assert v["glusterfs.capes.wb"] == 1.0 and v["glusterfs.capes.win"] == 1.0
    assert v["glusterfs.capes.threads"] == 16.0
    assert math.isnan(v["glusterfs.capes.cache"])          # two values disagree
    argv = (tmp_path / "argv.log").read_text().splitlines()
    assert argv[0] == "--glusterd-sock=/s --mode=script volume info capes"


def test_collector_without_gluster_is_all_nan(tmp_path):
    for source in ("bricks", "client", "profile"):
        c = GlusterFSCollector("capes-no-such-volume", source=source,
                               stats_dir=str(tmp_path / "none"),
                               gluster=str(tmp_path / "no-such-gluster"), enable=True,
                               knobs={"wb": "performance.write-behind"})
        v = c.collect()
        assert set(v) == set(c.names())
        assert all(math.isnan(x) for x in v.values()), (source, v)


def test_collector_profile_source_uses_its_own_clock(tmp_path):
    cli = fake_gluster(tmp_path, {"info incremental": FIX / "profile-incremental-write.txt"})
    now = [100.0]
    c = GlusterFSCollector("capes", source="profile", gluster=cli, clock=lambda: now[0])
    c.start()                                  # starts the first interval
    now[0] = 102.0
    v = c.collect()
    assert v["glusterfs.capes.write_bytes_s"] == 309723136 / 2
    assert v["glusterfs.capes.write_s"] == 2362 / 2


def test_collector_command_failure_and_timeout_are_nan(tmp_path):
    failing = fake_gluster(tmp_path, {}, rc=1)
    c = GlusterFSCollector("capes", source="profile", gluster=failing)
    assert all(math.isnan(x) for k, x in c.collect().items() if "rss" not in k)
    slow = fake_gluster(tmp_path, {}, sleep_s=3, name="slow-gluster")
    c = GlusterFSCollector("capes", source="profile", gluster=slow, timeout_s=0.2)
    t0 = time.monotonic()
    v = c.collect()
    assert time.monotonic() - t0 < 2.5
    assert math.isnan(v["glusterfs.capes.write_bytes_s"]) and c.failures >= 2


def test_collector_rejects_bad_options():
    for bad in ({"volume": "a b"}, {"volume": "v", "source": "nfs"},
                {"volume": "v", "bricks": "b1"}, {"volume": "v", "fops": ["READ"]},
                {"volume": "v", "knobs": {"x": {"key": "a.b", "unit": "furlongs"}}},
                {"volume": "v", "knobs_every": 0}, {"volume": "v", "dump_latency_unit": "ms"}):
        with pytest.raises(ValueError):
            GlusterFSCollector(**bad)


def test_find_client_by_volfile_id(tmp_path):
    proc = tmp_path / "proc"
    for pid, argv in ((11, ["/usr/sbin/glusterfsd", "--volfile-id", "capes.vm.b1"]),
                      (12, ["/usr/sbin/glusterfs", "--process-name", "fuse",
                            "--volfile-server=vm", "--volfile-id=/capes", "/mnt/a"]),
                      (13, ["glusterfs", "-N", "--volfile-id=capes", "/mnt/b"])):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv))
    assert find_client("capes", "/mnt/b", proc=str(proc)) == 13
    assert find_client("capes", "/mnt/a", proc=str(proc)) == 12
    assert find_client("other", proc=str(proc)) is None


def test_applier_sets_and_reads_through_the_cli(tmp_path):
    cli = fake_gluster(tmp_path, {"volume get": FIX / "volume-get-write-behind-window.txt"})
    a = build_applier("gluster", {"volume": "capes", "gluster": cli,
                                  "glusterd_sock": "/run/x.socket",
                                  "keys": {"win": "performance.write-behind-window-size",
                                           "wb": "performance.write-behind"},
                                  "units": {"win": "MB", "wb": "bool"}})
    a.apply("win", 4)
    a.apply("wb", 0)
    assert a.read("win") == 1.0
    argv = (tmp_path / "argv.log").read_text().splitlines()
    assert argv[:2] == [
        "--glusterd-sock=/run/x.socket --mode=script volume set capes "
        "performance.write-behind-window-size 4MB",
        "--glusterd-sock=/run/x.socket --mode=script volume set capes "
        "performance.write-behind off"]
    assert a.read("nope") is None


def test_applier_errors(tmp_path):
    failing = fake_gluster(tmp_path, {}, rc=1)
    a = GlusterApplier("capes", key="performance.io-thread-count", gluster=failing)
    with pytest.raises(ApplyError):
        a.apply("threads", 8)
    assert a.read("threads") is None
    slow = GlusterApplier("capes", key="performance.io-thread-count",
                          gluster=fake_gluster(tmp_path, {}, sleep_s=3, name="slow"),
                          timeout_s=0.2)
    with pytest.raises(ApplyError, match="timed out"):
        slow.apply("threads", 8)
    with pytest.raises(ApplyError):
        GlusterApplier("capes", key="a.b", gluster=str(tmp_path / "absent")).apply("x", 1)
    for bad in ({"volume": "capes"}, {"volume": "capes", "key": "nodots"},
                {"volume": "capes", "key": "a.b", "unit": "furlong"},
                {"volume": "c d", "key": "a.b"}):
        with pytest.raises(ValueError):
            GlusterApplier(**bad)


def test_applier_retries_while_the_volume_is_locked(tmp_path):
    counter = tmp_path / "n"
    script = tmp_path / "gluster"
    script.write_text(f"""#!/bin/sh
n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}
if [ "$n" -lt 2 ]; then echo "volume set: failed: Another transaction is in progress for capes." >&2; exit 1; fi
exit 0
""")
    script.chmod(0o755)
    GlusterApplier("capes", key="performance.io-thread-count", gluster=str(script)).apply("t", 8)
    assert counter.read_text().strip() == "3"


# ---------------------------------------------------------------- the test volume tool

def test_tool_refuses_without_state(tmp_path, capsys):
    assert gv.main(["status", "--dir", str(tmp_path)]) == 1
    assert "no test volume state" in capsys.readouterr().err


def test_snapshot_removes_only_what_appeared(tmp_path):
    tree = tmp_path / "tree"
    (tree / "old").mkdir(parents=True)
    (tree / "old" / "keep.log").write_text("x")
    before = gv.snapshot([str(tree), str(tmp_path / "absent")])
    (tree / "old" / "new.log").write_text("y")
    (tree / "new" / "deep").mkdir(parents=True)
    (tree / "new" / "deep" / "f").write_text("z")
    (tmp_path / "absent" / "x").mkdir(parents=True)
    assert gv.remove_new(before) == []
    assert sorted(p.name for p in tree.rglob("*")) == ["keep.log", "old"]
    assert not (tmp_path / "absent").exists()


def test_loopback_host_refuses_localhost():
    with pytest.raises(gv.GlusterError, match="--host"):
        gv.loopback_host(["localhost", "127.0.0.1", "no-such-host.invalid"])


# ---------------------------------------------------------------- integration (real gluster)

def _host_reason(needs: str, tools: tuple[str, ...]) -> str | None:
    """Why this host cannot stand GlusterFS up: not root, ``tools`` or FUSE missing."""
    if os.geteuid() != 0:
        return f"needs root ({needs})"
    missing = [t for t in tools if not shutil.which(t) and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return f"{', '.join(missing)} not installed"
    return None if os.path.exists("/dev/fuse") else "no /dev/fuse"


def _gluster_reason(check) -> str | None:
    try:
        check()
    except gv.GlusterError as exc:
        return str(exc)
    return None


def _skip_reason() -> str | None:
    why = _host_reason("glusterd, FUSE mount", ("glusterd", "glusterfs", "gluster"))
    if why:
        return why
    if gv.port_in_use() or gv.glusterd_pids():
        return f"a glusterd already runs here (pids {gv.glusterd_pids()}, port {gv.GLUSTERD_PORT})"
    return _gluster_reason(gv.loopback_host)


@pytest.mark.slow
def test_real_volume_tuned_measured_and_gone(tmp_path):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    base = tmp_path / "vol"
    before = gv.snapshot()
    vol = gv.GlusterTestVolume(base, stats_dump=True,
                               options={"diagnostics.count-fop-hits": "on",
                                        "diagnostics.latency-measurement": "on"})
    started: dict[int, list[str]] = {}
    try:
        vol.up()
        started = vol.our_pids()
        names = sorted(os.path.basename(a[0]) for a in started.values())
        assert names == ["glusterd", "glusterfs", "glusterfsd", "glusterfsd", "glusterfsd"]
        assert gv.mounted(vol.mount)
        sock = vol.socket_path

        # a tunable set through the applier is what `gluster volume get` shows
        a = GlusterApplier(vol.volume, keys={"win": "performance.write-behind-window-size",
                                             "threads": "performance.io-thread-count",
                                             "ra": "performance.read-ahead"},
                           units={"win": "MB", "ra": "bool"}, glusterd_sock=sock)
        t0 = time.monotonic()
        a.apply("win", 4)
        set_s = time.monotonic() - t0
        a.apply("threads", 24)
        a.apply("ra", 1)
        got = vol.gluster("volume", "get", vol.volume, "performance.write-behind-window-size")
        assert parse_volume_get(got.stdout, "performance.write-behind-window-size") == ["4MB"]
        assert (a.read("win"), a.read("threads"), a.read("ra")) == (4.0, 24.0, 1.0)
        with pytest.raises(ApplyError):
            a.apply("threads", 100000)          # gluster refuses: out of its own range
        assert a.read("threads") == 24.0

        # PIs while writing: the bricks' per-second dumps, the client's RSS
        c = GlusterFSCollector(vol.volume, glusterd_sock=sock, mount=str(vol.mount),
                               knobs={"win": {"key": "performance.write-behind-window-size",
                                              "unit": "MB"}})
        stop = threading.Event()

        def write():
            chunk = b"\xab" * (1 << 20)
            while not stop.is_set():
                with open(vol.mount / "data", "wb") as fh:
                    for _ in range(32):
                        fh.write(chunk)
                        if stop.is_set():
                            break

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        seen = []
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(seen) < 3:
                time.sleep(1.0)
                v = c.collect()
                if v[f"glusterfs.{vol.volume}.write_bytes_s"] > 0:
                    seen.append(v)
        finally:
            stop.set()
            writer.join(10)
        assert len(seen) >= 3, "no write throughput seen in the brick dumps within 20 s"
        last = seen[-1]
        for field in ("write_bytes_s", "write_s", "client_rss_bytes", "win", "fops_s"):
            value = last[f"glusterfs.{vol.volume}.{field}"]
            assert not math.isnan(value) and value > 0, (field, value)
        assert last[f"glusterfs.{vol.volume}.win"] == 4.0
        print(f"\nvolume up {vol.state.timings_s['up']:.2f} s, volume set {set_s:.2f} s, "
              f"write {last[f'glusterfs.{vol.volume}.write_bytes_s'] / 1e6:.0f} MB/s")
    finally:
        problems = vol.down()
    assert problems == []
    assert not any(gv._alive(p) and gv._cmdline(p) == argv for p, argv in started.items())
    assert not gv.mounted(base / "mnt")
    assert not base.exists()
    left = [p for p, a in gv.gluster_processes().items() if str(base) in " ".join(a)]
    assert not left
    assert gv.snapshot() == before, "gluster left files in system paths"


@pytest.mark.slow
def test_a_failed_up_cleans_up_after_itself(tmp_path):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    before = gv.snapshot()
    vol = gv.GlusterTestVolume(tmp_path / "vol", host="no-such-host.invalid")
    with pytest.raises(gv.GlusterError, match="volume create"):
        vol.up()                                   # glusterd started, create refused
    assert not (tmp_path / "vol").exists()
    assert not [p for p, a in gv.gluster_processes().items() if str(tmp_path) in " ".join(a)]
    assert gv.snapshot() == before


def test_descendants_finds_grandchildren():
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        found: set[int] = set()
        while time.monotonic() < deadline and len(found) < 2:
            found = gv.descendants([parent.pid])
            time.sleep(0.05)
        assert len(found) == 2 and all(gv._cmdline(p)[0] == "sleep" for p in found)
    finally:
        for p in gv.descendants([parent.pid]):
            os.kill(p, 9)
        parent.kill()
        parent.wait()


# ---------------------------------------------------------------- the cluster (issue 40)

def _cluster_skip_reason() -> str | None:
    """As _skip_reason, but the cluster runs in a network namespace of its own, so a
    glusterd elsewhere on the host does not stop it."""
    why = _host_reason("glusterd, FUSE mounts, loop devices",
                       ("glusterd", "glusterfs", "gluster", "ip", "nsenter"))
    if why:
        return why
    missing = [t for t in ("losetup", "mkfs.xfs") if not shutil.which(t)]
    if missing:
        return f"{', '.join(missing)} not installed (loop-device bricks)"
    return _gluster_reason(gv.throttle_mechanism)


def _nothing_of_ours_left(base: Path, before: dict) -> None:
    """No process, mount, loop device, throttle rule or netns of the volume in ``base``."""
    assert not [p for p, a in gv.gluster_processes().items() if str(base) in " ".join(a)]
    with open("/proc/mounts") as fh:
        assert str(base) not in fh.read()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(base) not in loops
    if os.path.isdir(gv.BLKIO_V1):
        for f in Path(gv.BLKIO_V1).glob("blkio.throttle.*_device"):
            assert f.read_text() == before["throttle"][f.name], f
    assert not [n for n in os.listdir("/run/netns") if n.startswith("capes-gluster-")] \
        if os.path.isdir("/run/netns") else True
    assert not base.exists()
    now = gv.snapshot()
    if any(os.path.basename(a[0]) == "glusterd" for a in gv.gluster_processes().values()):
        token = str(base).strip("/").replace("/", "-")      # another glusterd writes too:
        new = [p for t, rels in now.items() for p in rels or []   # only ours must be gone
               if p not in set(before["trees"].get(t) or [])]
        assert not [p for p in new if token in p or str(base) in p], new
    else:
        assert now == before["trees"], "gluster left files in system paths"


def _before() -> dict:
    return {"trees": gv.snapshot(),
            "throttle": {f.name: f.read_text()
                         for f in Path(gv.BLKIO_V1).glob("blkio.throttle.*_device")}}


@pytest.fixture
def cluster_base(tmp_path):
    """(the cluster's directory, the host's state before it): skips where no cluster can
    stand up."""
    why = _cluster_skip_reason()
    if why:
        pytest.skip(why)
    return tmp_path / "cluster", _before()


@pytest.mark.slow
def test_cluster_of_four_throttled_bricks_and_four_clients_works_and_goes(cluster_base):
    base, before = cluster_base
    vol = gv.GlusterTestVolume(base, bricks=4, clients=4, netns=True,
                               disk=gv.BrickDisk(size_gib=1, read_mbs=40, write_mbs=40,
                                                 memory_mib=128))
    try:
        vol.up()
        st = vol.status()
        assert st["up"] and st["throttle"] == gv.throttle_mechanism()
        assert [c["node"] for c in st["clients"]] == ["client1", "client2", "client3",
                                                      "client4"]
        assert len({c["bdi"] for c in st["clients"]}) == 4 and len(st["loops"]) == 4
        names = sorted(os.path.basename(a[0]) for a in vol.our_pids().values())
        assert names == ["glusterd"] + ["glusterfs"] * 4 + ["glusterfsd"] * 4
        # every mount works and sees what the others wrote: one volume, four clients
        for i, m in enumerate(vol.mounts):
            (m / f"from-{i}").write_bytes(os.urandom(1 << 16))
        for m in vol.mounts:
            assert sorted(p.name for p in m.iterdir()) == [f"from-{i}" for i in range(4)]
        # each client's FUSE readahead is its own knob
        ra = [Path(c["read_ahead_kb"]) for c in st["clients"]]
        ra[0].write_text("512\n")
        assert ra[0].read_text().split() == ["512"] and ra[1].read_text().split() != ["512"]
        # the bricks' disks are throttled: 24 MB of direct writes to one brick's
        # device take about 0.6 s at 40 MB/s (over 0.3 s even on a loaded host)
        loop = st["loops"][0]
        t0 = time.monotonic()
        subprocess.run(["dd", "if=/dev/zero", f"of={vol.state.brick_mounts[0]}/raw",
                        "bs=1M", "count=24", "oflag=direct", "status=none"], check=True)
        assert time.monotonic() - t0 > 0.3, f"{loop} not throttled"
        # lifted while data is laid out, and back afterwards, even after an error
        rule, mm = vol.state.throttle_rules[0]

        def has_rule() -> bool:
            return any(line.split()[0] == mm for line in Path(rule).read_text().splitlines())
        assert has_rule()
        with pytest.raises(KeyError), vol.throttle_lifted():
            assert not has_rule()
            raise KeyError("a failed lay-out")
        assert has_rule()
    finally:
        problems = vol.down()
    assert problems == []
    assert vol.state.netns is None
    _nothing_of_ours_left(base, before)


@pytest.mark.slow
def test_cluster_tool_run_tears_down_when_signalled(cluster_base):
    base, before = cluster_base
    tool = Path(__file__).resolve().parents[1] / "tools" / "gluster-test-volume"
    done = subprocess.run(
        [sys.executable, str(tool), "run", "--netns", "--dir", str(base), "--bricks", "4",
         "--clients", "4", "--brick-gib", "1", "--brick-mbs", "50", "--",
         "sh", "-c", 'n=0; for m in $CAPES_GLUSTER_MOUNTS; do touch $m/x && n=$((n+1)); '
                     'done; echo "mounts $n"; kill -TERM $PPID; sleep 60'],
        capture_output=True, text=True, timeout=180)
    assert "mounts 4" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "left behind" not in done.stderr
    _nothing_of_ours_left(base, before)


def test_delay_without_netem_is_refused_clearly(tmp_path):
    if os.geteuid() != 0 or not shutil.which("tc"):
        pytest.skip("needs root and tc")
    if gv.netem_available() is None:
        pytest.skip("this kernel has netem: the refusal cannot be seen")
    vol = gv.GlusterTestVolume(tmp_path / "v", delay_ms=5)
    with pytest.raises(gv.GlusterError, match="netem"):
        vol.up()
    assert not (tmp_path / "v").exists()
