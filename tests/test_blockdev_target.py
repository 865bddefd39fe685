"""The Linux block layer as a target: categorical parameters (the I/O scheduler), the
safe range re-checked by the control agent, the file applier's allowed roots, the
vmstat collector and loop-device selection against fixture trees, the host's original
values remembered across restarts and kills and put back, and (slow, as root) the whole
stack on a real loop device."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capes.common import config as cfgmod
from capes.common.config import ConfigError
from capes.common.deployment import DeploymentConfig
from capes.common.params import ParameterSpec
from capes.common.protocol import Action, encode
from capes.experiments.workload_driver import missing_on_host
from control_agent.agent import ControlAgent, state_path
from control_agent.appliers import ApplyError, build_applier
from monitor_agent.collectors import build_collector
from test_agents import REPO, deployment_toml, finish, knob_dir, load, recv, recv_until, start
from test_target_collectors import FakeBlockDevices, FakeClock, FakeProc

SCHEDS = ["none", "mq-deadline", "kyber", "bfq"]


def spec(**kw) -> ParameterSpec:
    s = ParameterSpec(**kw)
    s.validate()
    return s


# ---------------------------------------------------------------- categorical parameters

def test_categorical_parameter_moves_an_index_and_names_its_values():
    s = spec(values=SCHEDS, default="kyber", forbidden=["bfq"])
    assert (s.min, s.max, s.step, s.default, s.forbidden) == (0, 3, 1, 2.0, [3.0])
    assert s.categorical and s.label(1) == "mq-deadline" and s.index_of("none") == 0
    assert s.index_of("cfq") is None
    assert s.check_value(1) is None
    assert s.check_value(3) == "forbidden value"
    assert s.check_value(0.5).startswith("off the step grid")
    assert s.check_value(4).startswith("outside")
    assert s.describe(2.0) == "kyber (2)" and s.describe("bfq") == "bfq"
    assert spec(values=SCHEDS, default=0).default == 0.0         # an index works too
    s.validate()                                                  # idempotent
    assert s.default == 2.0


@pytest.mark.parametrize("kw,match", [
    (dict(values=["none", "none"], default=0), "listed twice"),
    (dict(values=["none", "mq deadline"], default=0), "without spaces"),
    (dict(values=SCHEDS, default="cfq"), "'cfq' is not one of"),
    (dict(values=SCHEDS, default=4), "neither a value's name nor an index"),
    (dict(values=SCHEDS, default=1.5), "neither"),
    (dict(values=SCHEDS), "default: required"),
    (dict(values=SCHEDS, default=0, max=9), "leave max out"),
    (dict(values=SCHEDS, default=0, forbidden=["cfq"]), "forbidden"),
    (dict(min=0, max=10, default=5), "step: required"),
    (dict(values=[], min=0, max=3, step=1, default="none"), "default: expected a number"),
    (dict(min=0, max=10, step=1, default=5, forbidden=["x"]), "names need values"),
    (dict(min=0, max=4096, step=128, default=100), "not on the step grid"),
])
def test_parameter_spec_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        spec(**kw)


def test_categorical_parameter_from_toml_and_the_engine_sees_numbers(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[parameters.scheduler]\nvalues = ["none", "mq-deadline", "bfq"]\n'
                    'default = "bfq"\n[parameters.read_ahead_kb]\nmin = 128\nmax = 4096\n'
                    'step = 128\ndefault = 128\n')
    cfg = cfgmod.load(DeploymentConfig, path)
    s = cfg.parameters["scheduler"]
    assert (s.min, s.max, s.step, s.default) == (0, 2, 1, 2.0) and s.name == "scheduler"
    assert all(isinstance(p.default, float) for p in cfg.param_specs())
    bad = tmp_path / "bad.toml"
    bad.write_text('[parameters.scheduler]\nvalues = ["none"]\ndefault = "kyber"\n')
    with pytest.raises(ConfigError, match=r"parameters.scheduler.default: 'kyber'"):
        cfgmod.load(DeploymentConfig, bad)


def test_grid_and_forbidden_checks_use_a_tolerance():
    s = spec(min=128, max=4000, step=128, default=256, forbidden=[512])
    assert s.check_value(128 + 2 * 128 * (1 + 1e-12)) is None      # float noise: on grid
    assert s.check_value(512 + 1e-9) == "forbidden value"            # not float equality
    assert s.check_value(200).startswith("off the step grid 128 + k × 128")
    assert s.check_value(4000) is None                               # max: the engine clamps there
    assert s.check_value(0).startswith("outside [128, 4000]")
    assert s.check_value(math.nan) == "not a finite number"
    assert s.check_value(True) == "not a finite number"


# ---------------------------------------------------------------- the file applier

@pytest.fixture
def sysfs(tmp_path):
    devs = FakeBlockDevices(tmp_path, devices=("sda", "loop0"))
    return tmp_path, devs


def test_file_applier_reads_and_writes_a_scheduler_by_name(sysfs):
    base, devs = sysfs
    sched = devs.root / "sda/queue/scheduler"           # "mq-deadline kyber [bfq] none"
    ap = build_applier("file", {"path": str(sched)})
    assert ap.read_text("scheduler") == "bfq" and ap.read("scheduler") is None
    ap.apply("scheduler", "kyber")
    assert sched.read_text() == "kyber\n"               # a plain file keeps what was written
    sched.write_text("[mq-deadline] none\n")            # what the kernel would show
    with pytest.raises(ApplyError, match="does not offer 'kyber'.*mq-deadline, none"):
        ap.apply("scheduler", "kyber")
    assert sched.read_text() == "[mq-deadline] none\n"
    with pytest.raises(ApplyError, match="refusing to write"):
        ap.apply("scheduler", "none\nbfq")


def test_file_applier_rolls_a_scheduler_back_by_name(sysfs):
    """Rolling back a bracketed file writes the active name, not the whole listing."""
    base, devs = sysfs
    (devs.root / "loop0/queue/scheduler").write_text("[none] mq-deadline\n")
    (devs.root / "sda/queue/scheduler").write_text("[none] mq-deadline\n")
    blocked = devs.root / "sda/queue/scheduler"
    ap = build_applier("file", {"path": str(devs.root / "*/queue/scheduler")})
    blocked.chmod(0o444)
    if os.access(blocked, os.W_OK):                     # root ignores file modes
        blocked.unlink()
        blocked.mkdir()
        ap = build_applier("file", {"path": str(devs.root / "*/queue/scheduler")})
    with pytest.raises(ApplyError, match="sda"):
        ap.apply("scheduler", "mq-deadline")
    assert (devs.root / "loop0/queue/scheduler").read_text() == "none"


def test_file_applier_refuses_paths_resolving_outside_its_roots(tmp_path):
    knobs = tmp_path / "knobs"
    knobs.mkdir()
    (knobs / "window").write_text("10\n")
    secret = tmp_path / "secret"
    secret.write_text("keep\n")
    (knobs / "evil").symlink_to(secret)
    ap = build_applier("file", {"path": str(knobs / "*")})
    with pytest.raises(ApplyError, match="outside the allowed roots"):
        ap.apply("window", 5)                           # the glob matches the symlink too
    assert secret.read_text() == "keep\n" and (knobs / "window").read_text() == "10\n"
    assert ap.read("window") is None
    one = build_applier("file", {"path": str(knobs / "evil")})
    with pytest.raises(ApplyError, match="resolves to"):
        one.apply("evil", 1)
    # an explicit root: the symlink's target is inside, so it is allowed
    ok = build_applier("file", {"path": str(knobs / "evil"), "root": str(tmp_path)})
    ok.apply("evil", 7)
    assert secret.read_text() == "7\n"
    with pytest.raises(ValueError, match="outside the allowed roots"):
        build_applier("file", {"path": "/etc/passwd", "root": str(tmp_path)})
    with pytest.raises(ValueError, match="root: must be"):
        build_applier("file", {"path": str(knobs / "window"), "root": []})


def test_file_applier_kernel_roots():
    """/sys, /proc/sys and /proc/fs are allowed by default; the rest of /proc is not."""
    build_applier("file", {"path": "/sys/block/sda/queue/read_ahead_kb"})
    build_applier("file", {"path": "/proc/sys/vm/dirty_ratio"})
    build_applier("file", {"path": "/proc/fs/lustre/osc/*/max_rpcs_in_flight"})
    for bad in ("/proc/sysrq-trigger", "/proc/self/oom_score_adj", "/proc/sys/../kcore"):
        with pytest.raises(ValueError, match="outside the allowed roots"):
            build_applier("file", {"path": bad})
    loop = next(iter(sorted(Path("/sys/block").glob("*/queue/read_ahead_kb"))), None)
    if loop is not None:                # /sys/block/X is a symlink into /sys/devices
        ap = build_applier("file", {"path": str(loop)})
        assert ap.files("read_ahead_kb") == [str(loop)]
        assert ap.read("read_ahead_kb") is not None


# ---------------------------------------------------------------- collectors

def test_vmstat_collector_rates_gauges_and_sysctls(tmp_path):
    proc, clock = FakeProc(tmp_path), FakeClock()
    col = build_collector("vmstat", {"root": str(proc.root), "clock": clock})
    names = col.names()
    assert "vmstat.pgscan_kswapd_s" not in names        # not in this kernel's vmstat
    assert {"vmstat.nr_dirty", "vmstat.pgpgin_kb_s", "vmstat.mem_dirty_kb",
            "vmstat.dirty_ratio", "vmstat.dirty_expire_centisecs"} <= set(names)
    clock.t += 2.0
    proc.add(pgpgin=4000, pgpgout=1000, nr_dirtied=600, nr_written=200, nr_dirty=50)
    proc.mem["dirty"] = 1234
    proc.write()
    (proc.root / "sys/vm/dirty_ratio").write_text("35\n")
    v = col.collect()
    assert len(v) == len(names)
    assert v["vmstat.pgpgin_kb_s"] == 2000 and v["vmstat.pgpgout_kb_s"] == 500
    assert v["vmstat.nr_dirtied_s"] == 300 and v["vmstat.nr_written_s"] == 100
    assert v["vmstat.pgmajfault_s"] == 0
    assert v["vmstat.nr_dirty"] == 150                   # a gauge, as it is
    assert v["vmstat.mem_dirty_kb"] == 1234 and v["vmstat.mem_cached_kb"] == 911_892
    assert v["vmstat.dirty_ratio"] == 35 and v["vmstat.dirty_bytes"] == 0
    clock.t += 1.0
    proc.vm["pgpgin"] = 0                                # counter reset
    proc.write()
    v = col.collect()
    assert math.isnan(v["vmstat.pgpgin_kb_s"]) and v["vmstat.pgpgout_kb_s"] == 0
    clock.t += 1.0
    proc.add(pgpgin=10)
    assert col.collect()["vmstat.pgpgin_kb_s"] == 10


def test_vmstat_collector_missing_reads_and_options(tmp_path):
    proc, clock = FakeProc(tmp_path), FakeClock()
    col = build_collector("vmstat", {"root": str(proc.root), "clock": clock,
                                     "fields": ["mem_writeback_kb", "nr_written_s"]})
    assert col.names() == ["vmstat.nr_written_s", "vmstat.mem_writeback_kb"]
    (proc.root / "vmstat").unlink()                      # a tick it cannot be read: NaN
    clock.t += 1.0
    assert math.isnan(col.collect()["vmstat.nr_written_s"])
    proc.add(nr_written=30)                             # rate over the 2 s since the last read
    clock.t += 1.0
    assert col.collect()["vmstat.nr_written_s"] == 15
    with pytest.raises(ValueError, match="unknown field 'dirty'"):
        build_collector("vmstat", {"root": str(proc.root), "fields": ["dirty"]})
    with pytest.raises(ValueError, match="'pgscan_direct_s' cannot be read"):
        build_collector("vmstat", {"root": str(proc.root), "fields": ["pgscan_direct_s"]})
    with pytest.raises(ValueError, match="root: cannot read"):
        build_collector("vmstat", {"root": str(tmp_path / "nope")})


def test_vmstat_collector_on_this_host():
    if not Path("/proc/vmstat").exists():
        pytest.skip("no /proc/vmstat here")
    col = build_collector("vmstat")
    time.sleep(0.05)
    v = col.collect()
    assert set(v) == set(col.names()) and v["vmstat.mem_cached_kb"] > 0


def test_named_loop_devices_are_never_excluded(tmp_path):
    devs = FakeBlockDevices(tmp_path, devices=("sda", "loop0", "loop1", "ram0"))
    root = str(devs.root)

    def devices(**kw):
        col = build_collector("blockdev", {"root": root, "fields": ["read_ahead_kb"], **kw})
        return [n.split(".")[1] for n in col.names()]

    assert devices() == ["sda"]                                   # default exclusions
    assert devices(devices=["loop1"]) == ["loop1"]                # named: kept
    assert devices(devices=["loop*"]) == ["loop0", "loop1"]       # asked for: lifted
    assert devices(devices=["*"]) == ["sda"]                      # a wildcard: excluded
    assert devices(devices=["sda", "loop0"], exclude=["sd*"]) == ["loop0", "sda"]
    assert devices(devices=["loop*"], exclude=["loop1"]) == ["loop0"]   # as written
    with pytest.raises(ValueError, match="no block device"):
        devices(devices=["l*"])                                   # "loop*" still applies


def test_blockdev_scheduler_pi_indexes_the_parameter_values(tmp_path):
    devs = FakeBlockDevices(tmp_path, devices=("sda",))   # "mq-deadline kyber [bfq] none"
    col = build_collector("blockdev", {"root": str(devs.root), "fields": ["scheduler"],
                                       "schedulers": ["none", "bfq"]})
    assert col.collect() == {"blockdev.sda.scheduler": 1.0}
    (devs.root / "sda/queue/scheduler").write_text("[kyber] none bfq\n")
    assert col.collect() == {"blockdev.sda.scheduler": -1.0}
    with pytest.raises(ValueError, match="schedulers"):
        build_collector("blockdev", {"root": str(devs.root), "schedulers": ["a", "a"]})


# ---------------------------------------------------------------- originals, in process

SCHED_PARAM = """
[control.appliers.scheduler]
name = "file"
options = {{ path = "{path}" }}
[parameters.scheduler]
values = ["none", "mq-deadline", "kyber", "bfq"]
default = "mq-deadline"
"""


def blockish(tmp_path: Path, port: int = 1, **control) -> tuple[Path, Path]:
    """The simulator-knob config of test_agents plus a scheduler file, state in tmp."""
    knobs = knob_dir(tmp_path)
    (knobs / "scheduler").write_text("[bfq] none mq-deadline kyber\n")
    path = deployment_toml(tmp_path, knobs, port, **control)
    path.write_text(path.read_text() + SCHED_PARAM.format(path=knobs / "scheduler"))
    return path, knobs


def state(tmp_path: Path) -> dict:
    return {e["param"]: e["value"] for e in
            json.loads((tmp_path / "control-state.json").read_text())["originals"]}


def test_originals_are_recorded_before_the_first_change_and_put_back(tmp_path):
    path, knobs = blockish(tmp_path)
    (knobs / "window").write_text("37\n")             # the host's own value, not the default
    agent = ControlAgent(load(path))
    assert agent.current == {"window": 37, "rate_limit": 50, "scheduler": 3.0}   # bfq: 3
    agent.handle_action(Action(1, 1, {"window": 50, "scheduler": 2}))
    assert (knobs / "window").read_text() == "50\n" and (knobs / "scheduler").read_text() == "kyber\n"
    assert state(tmp_path) == {"window": 37, "scheduler": "bfq"}
    agent.handle_action(Action(2, 2, {"window": 60}))
    assert state(tmp_path) == {"window": 37, "scheduler": "bfq"}   # the first value stays
    restored, failed = agent.restore_defaults("test")
    assert restored == {"window": 37, "scheduler": "bfq"} and failed == []
    assert (knobs / "window").read_text() == "37\n"      # the original, not the default 10
    assert (knobs / "scheduler").read_text() == "bfq\n"
    assert (knobs / "rate_limit").read_text() == "50\n"  # never touched, left alone
    assert agent.current["window"] == 37 and agent.current["scheduler"] == 3.0
    assert not (tmp_path / "control-state.json").exists()    # all restored: cleared
    agent.close()


def test_a_restarted_agent_keeps_the_first_original(tmp_path):
    path, knobs = blockish(tmp_path)
    (knobs / "window").write_text("37\n")
    first = ControlAgent(load(path))
    first.handle_action(Action(1, 1, {"window": 50}))
    first.close()                                        # "killed": no restore
    second = ControlAgent(load(path))                    # finds window at 50
    assert second.originals.values == {"window": 37}
    second.handle_action(Action(1, 1, {"window": 70}))
    assert state(tmp_path) == {"window": 37}             # not overwritten by 50
    second.restore_defaults("stopping")
    assert (knobs / "window").read_text() == "37\n"
    second.close()


def test_restore_falls_back_to_the_default_only_where_nothing_was_recorded(tmp_path):
    path, knobs = blockish(tmp_path)
    (knobs / "window").write_text("37\n")
    (knobs / "rate_limit").write_text("190\n")
    agent = ControlAgent(load(path))
    agent.handle_action(Action(1, 1, {"window": 50}))
    plan = agent.restore_plan(fallback=True)
    assert plan == {"window": (37, "original"), "rate_limit": (50.0, "default"),
                    "scheduler": ("mq-deadline", "default")}
    assert agent.restore_plan() == {"window": (37, "original")}
    agent.close()


def test_original_outside_the_safe_range_is_still_put_back(tmp_path):
    """The safe range bounds what CAPES sets, not what the host had."""
    path, knobs = blockish(tmp_path)
    (knobs / "window").write_text("250\n")               # max is 100
    agent = ControlAgent(load(path))
    agent.handle_action(Action(1, 1, {"window": 50}))
    agent.restore_defaults("test")
    assert (knobs / "window").read_text() == "250\n"
    agent.close()


def test_an_original_recorded_for_another_knob_is_not_written_here(tmp_path):
    path, knobs = blockish(tmp_path)
    (tmp_path / "control-state.json").write_text(json.dumps({"version": 1, "originals": [
        {"param": "window", "applier": {"name": "file", "options": {"path": "/elsewhere"}},
         "value": 99, "recorded_at": 0}]}))
    agent = ControlAgent(load(path))
    assert agent.originals.values == {}
    agent.handle_action(Action(1, 1, {"window": 50}))
    agent.restore_defaults("test")
    assert (knobs / "window").read_text() == "10\n"
    kept = json.loads((tmp_path / "control-state.json").read_text())["originals"]
    assert [e["value"] for e in kept] == [99]            # the other knob's entry survives
    agent.close()


def test_a_corrupt_state_file_is_moved_aside(tmp_path):
    path, knobs = blockish(tmp_path)
    (tmp_path / "control-state.json").write_text("{not json")
    agent = ControlAgent(load(path))
    assert agent.originals.values == {}
    assert (tmp_path / "control-state.json.corrupt").read_text() == "{not json"
    agent.close()


def test_no_change_without_a_saved_original(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")                               # a file where a directory must be
    path, knobs = blockish(tmp_path, state_file=f'"{blocker / "state.json"}"')
    agent = ControlAgent(load(path))
    assert agent.originals.check_writable() is not None
    ack = agent.handle_action(Action(1, 1, {"window": 50}))
    assert (knobs / "window").read_text() == "10\n" and ack.values["window"] == 10
    assert agent.counters.refused == {"original value not saved": 1}
    agent.close()
    # in memory only, when the config says so
    (tmp_path / "mem").mkdir()
    path, knobs = blockish(tmp_path / "mem", state_file='""')
    agent = ControlAgent(load(path))
    agent.handle_action(Action(1, 1, {"window": 50}))
    assert agent.originals.values == {"window": 10.0} and agent.originals.path is None
    agent.close()


def test_control_agent_rechecks_range_grid_and_forbidden_values(tmp_path):
    path, knobs = blockish(tmp_path)
    cfg = load(path, "daemon.forbidden={rate_limit=[70]}")
    agent = ControlAgent(cfg)
    agent.handle_action(Action(1, 1, {"rate_limit": 55, "window": 13 + 1e-9,
                                      "scheduler": 1.5}))
    agent.handle_action(Action(2, 2, {"rate_limit": 70, "scheduler": 9}))
    assert agent.counters.refused == {"off the step grid": 2, "forbidden value": 2,
                                      "out of range": 1}
    assert agent.counters.applied == 0 and not (tmp_path / "control-state.json").exists()
    assert (knobs / "rate_limit").read_text() == "50\n"
    agent.close()


def test_state_file_paths(tmp_path):
    cfg = load(deployment_toml(tmp_path, knob_dir(tmp_path), 1,
                               state_file='"/var/lib/x/control-{node}.json"'))
    assert state_path(cfg) == Path("/var/lib/x/control-sim1.json")
    cfg.control.state_file = "auto"
    cfg.control.node = "a/b"
    want = "/var/lib/capes" if os.geteuid() == 0 else ".local/state/capes"
    assert want in str(state_path(cfg)) and state_path(cfg).name == "control-a_b.json"
    cfg.control.state_file = ""
    assert state_path(cfg) is None
    with pytest.raises(ConfigError, match="control.state_file: must name a file"):
        load(deployment_toml(tmp_path, tmp_path / "node", 1, state_file='"/tmp/"'))


# ---------------------------------------------------------------- originals, real processes

def test_kill_9_then_restore_defaults_puts_the_originals_back(tmp_path, router):
    sock, port = router
    path, knobs = blockish(tmp_path, port)
    (knobs / "window").write_text("37\n")
    proc = start("control-agent", "--config", str(path))
    try:
        ident, _ = recv(sock, 20)
        sock.send_multipart([ident, encode(Action(1, 1, {"window": 50, "scheduler": 0}))])
        recv_until(sock, lambda m: m.seq == 1)
        assert (knobs / "window").read_text() == "50\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        finish(proc)
    assert state(tmp_path) == {"window": 37, "scheduler": "bfq"}
    assert (knobs / "window").read_text() == "50\n"      # killed: nothing restored
    dry = subprocess.run([sys.executable, "-m", "capes", "restore-defaults", "--config",
                          str(path), "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert "would restore window = 37 (the recorded original; now 50)" in dry.stdout, dry.stderr
    assert "rate_limit: left at " in dry.stdout           # no original: never a guess
    done = subprocess.run([sys.executable, "-m", "capes", "restore-defaults", "--config",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "window = 37 (original)" in done.stdout and "scheduler = bfq (original)" in done.stdout
    assert (knobs / "window").read_text() == "37\n"
    assert (knobs / "scheduler").read_text() == "bfq\n"
    assert not (tmp_path / "control-state.json").exists()


def test_control_agent_refuses_to_start_without_a_writable_state_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    path, _ = blockish(tmp_path, state_file=f'"{blocker / "state.json"}"')
    done = subprocess.run([sys.executable, "-m", "capes", "control-agent", "--config",
                           str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "control.state_file" in done.stderr


@pytest.fixture
def router():
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close()
    ctx.term()


# ---------------------------------------------------------------- a real loop device

def _sh(*argv: str, timeout: float = 30) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _active(text: str) -> str:
    """A knob file's value as it must be written back: ``[none] kyber`` -> ``none``."""
    tokens = text.split()
    return next((t[1:-1] for t in tokens if t.startswith("[")), text.strip())


@pytest.fixture
def loop_device(tmp_path):
    """A loop device on a 256 MiB file in tmp_path (direct I/O where the kernel allows);
    yields its name; detaches it, whatever happens."""
    why = missing_on_host("creates a loop device and writes sysfs/sysctl knobs",
                          ("losetup", "fio"))
    if why:
        pytest.skip(why)
    img = tmp_path / "disk.img"
    with open(img, "wb") as fh:
        fh.truncate(256 << 20)
    try:
        dev = _sh("losetup", "--find", "--show", "--direct-io=on", str(img))
    except RuntimeError:
        try:
            dev = _sh("losetup", "--find", "--show", str(img))
        except RuntimeError as exc:
            pytest.skip(f"cannot create a loop device here: {exc}")
    try:
        yield Path(dev).name
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=30)


REAL_CONFIG = """
tick_seconds = 0.25
[keys]
enabled = false
[daemon]
ingest = "tcp://127.0.0.1:0"
control = "tcp://127.0.0.1:0"
grpc = "127.0.0.1:0"
db = "{tmp}/replay.db"
commit_every_s = 0.1
ack_timeout_s = 0.5
[monitor]
node = "host1"
full_frame_every = 20
collectors = [{{ name = "blockdev", options = {{ devices = ["{dev}"], schedulers = {scheds} }} }},
              {{ name = "vmstat", options = {{ fields = ["pgpgin_kb_s", "mem_cached_kb", "dirty_expire_centisecs"] }} }}]
[control]
node = "host1"
state_file = "{tmp}/control-{{node}}.json"
[control.appliers.read_ahead_kb]
name = "file"
options = {{ path = "/sys/block/{dev}/queue/read_ahead_kb" }}
[control.appliers.scheduler]
name = "file"
options = {{ path = "/sys/block/{dev}/queue/scheduler" }}
[control.appliers.dirty_expire_centisecs]
name = "file"
options = {{ path = "/proc/sys/vm/dirty_expire_centisecs" }}
[parameters.read_ahead_kb]
min = 128
max = 4096
step = 128
default = 128
[parameters.scheduler]
values = {scheds}
default = "{sched_default}"
[parameters.dirty_expire_centisecs]
min = 500
max = 6000
step = 100
default = 3000
"""


@pytest.mark.slow
def test_whole_stack_on_a_real_loop_device(tmp_path, loop_device):
    """Daemon, monitoring agent and control agent as real processes on a loop device:
    knobs really change in /sys and /proc/sys, PIs are non-zero under an fio read, and
    the host's values come back after a clean stop, and after kill -9 of the control
    agent (restarted once in between: it must keep the first originals) followed by
    ``capes restore-defaults``."""
    from capes.common.control_client import ControlClient
    from capes.common.replay_db import ReplayReader
    from daemon_harness import DaemonProcess, wait_for

    dev = loop_device
    queue = Path("/sys/block") / dev / "queue"
    files = {"read_ahead_kb": queue / "read_ahead_kb", "scheduler": queue / "scheduler",
             "dirty_expire_centisecs": Path("/proc/sys/vm/dirty_expire_centisecs")}
    host = {k: _active(p.read_text()) for k, p in files.items()}   # to put back, always
    offered = [t.strip("[]") for t in files["scheduler"].read_text().split()]
    if len(offered) < 2:
        pytest.skip(f"{dev} offers one I/O scheduler only ({offered})")
    # one engine step on each knob (the daemon accepts nothing else): order is by name
    i = offered.index(host["scheduler"])
    ra, expire = int(host["read_ahead_kb"]), int(host["dirty_expire_centisecs"])
    moves = [(0, 1 if expire + 100 <= 6000 else -1), (1, -1 if ra > 128 else 1),
             (2, 1 if i + 1 < len(offered) else -1)]
    tuned = {"dirty_expire_centisecs": str(expire + 100 * moves[0][1]),
             "read_ahead_kb": str(ra + 128 * moves[1][1]),
             "scheduler": offered[i + moves[2][1]]}
    cfg = tmp_path / "real.toml"
    cfg.write_text(REAL_CONFIG.format(tmp=tmp_path, dev=dev, scheds=json.dumps(offered),
                                      sched_default=offered[0]))
    state_file = tmp_path / "control-host1.json"
    now = lambda: {k: _active(p.read_text()) for k, p in files.items()}   # noqa: E731
    daemon = None
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        daemon = DaemonProcess(cfg, tmp_path / "ready.json")
        sets = ["--set", f'monitor.daemon="{daemon.info["ingest"]}"',
                "--set", f'control.daemon="{daemon.info["control"]}"']
        agent = lambda: start("control-agent", "--config", str(cfg), *sets)  # noqa: E731
        procs += [start("monitor-agent", "--config", str(cfg), *sets), agent()]
        client = ControlClient(daemon.info["grpc"], None)
        wait_for(lambda: any(n.get("name") == "host1" for n in client.nodes()), 30)
        wait_for(lambda: client.status()["parameters"] == {   # adopted from the hello
            "dirty_expire_centisecs": expire, "read_ahead_kb": ra, "scheduler": i}, 15)
        for k, sign in moves:
            values = client.status()["parameters"]
            name = sorted(values)[k]
            values[name] += sign * {0: 100, 1: 128, 2: 1}[k]
            r = client.submit_action(int(time.time() / 0.25) + k, 1 + 2 * k + (sign < 0),
                                     values)
            assert r["accepted"], r
        wait_for(lambda: now() == tuned, 15)                # the knobs really changed

        fio = subprocess.run(["fio", "--name=seqread", f"--filename=/dev/{dev}",
                              "--rw=read", "--bs=128k", "--direct=1", "--readonly",
                              "--ioengine=psync", "--time_based", "--runtime=3",
                              "--output-format=terse"],
                             capture_output=True, text=True, timeout=60)
        assert fio.returncode == 0, fio.stderr

        def peak(pi: str) -> float:
            with ReplayReader(tmp_path / "replay.db") as reader:
                names = list(reader.layout.pi_names)
                if pi not in names:
                    return 0.0
                best = 0.0
                for data in reader.sessions.values():
                    col = data.pis[:data.length, :, names.index(pi)]
                    if col.size and not all(math.isnan(x) for x in col.ravel()):
                        best = max(best, float(max(x for x in col.ravel() if x == x)))
                return best

        wait_for(lambda: peak(f"blockdev.{dev}.read_bytes_s") > 0, 15)
        assert peak(f"blockdev.{dev}.read_iops") > 0
        assert peak("vmstat.pgpgin_kb_s") > 0
        def seen(pi: str, value: float) -> bool:
            """``value`` was recorded for ``pi`` at some tick (the PI shows the knob)."""
            with ReplayReader(tmp_path / "replay.db") as reader:
                names = list(reader.layout.pi_names)
                return pi in names and any(
                    (data.pis[:data.length, :, names.index(pi)] == value).any()
                    for data in reader.sessions.values())

        wait_for(lambda: seen(f"blockdev.{dev}.read_ahead_kb",
                              float(tuned["read_ahead_kb"])), 15)

        # a clean stop puts the host's values back and clears the state file
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=15) == 0
        assert now() == host and not state_file.exists()

        # restarted, the agent is sent the engine's values again; killed twice, it keeps
        # the first originals, and restore-defaults puts those back
        for _ in range(2):
            procs.append(agent())
            wait_for(lambda: now() == tuned, 20)
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(timeout=10)
            assert now() == tuned                       # killed: nothing restored
            recorded = {e["param"]: e["value"] for e in
                        json.loads(state_file.read_text())["originals"]}
            assert recorded == {"read_ahead_kb": float(host["read_ahead_kb"]),
                                "scheduler": host["scheduler"],
                                "dirty_expire_centisecs": float(expire)}
        done = subprocess.run([sys.executable, "-m", "capes", "restore-defaults", "--config",
                               str(cfg)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert now() == host and not state_file.exists()
        client.close()
        assert time.monotonic() - t0 < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            finish(p)
        if daemon is not None:
            daemon.stop()
        for key, path in files.items():                 # whatever happened above
            try:
                if _active(path.read_text()) != host[key]:
                    path.write_text(host[key] + "\n")
            except OSError:
                pass
