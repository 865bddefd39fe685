"""Hardening, third round (issue 27, items 4-10): files and inputs CAPES cannot trust.

Each attack runs against the real CLI or agent as a subprocess where the issue's
reproduction did: a state file that lies (bad types, 10**400, NaN, a FIFO, a symlink to
/dev/zero, 1.5 GB), a symlink swapped under the file applier while it writes, a
categorical knob on an applier that cannot set one, a dwell time across restarts of the
agent, of both and of the daemon alone, hostile and large replay DBs, bad ``capes
evaluate`` arguments, and the systemd units' state directories."""
from __future__ import annotations

import configparser
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from capes.common import curve
from capes.common.control_client import ControlClient
from capes.common.deployment import KeysConfig
from capes.common.protocol import Action, encode
from daemon_harness import (ROOT, DaemonProcess, free_port_below_ephemeral, wait_for,
                            write_config)

from test_agents import (deployment_toml, knob_dir, load, recv, recv_until,  # noqa: F401
                         router)


def capes(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "capes", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kw)


def start(*args: str) -> subprocess.Popen:
    """``capes ARGS`` as a subprocess; its stderr goes to a file (a pipe nobody reads
    would fill up and block it)."""
    import tempfile
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "capes", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    return proc


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> str:
    """Signal ``proc``, wait for it and return its stderr."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.log.seek(0)
    err = proc.log.read()
    proc.log.close()
    return err


def no_traceback(err: str) -> None:
    assert "Traceback" not in err, err


# ------------------------------------------------------------------ 4. the state file

def entry(param, value, recorded_at=0.0, knobs=None):
    return {"param": param, "applier": {"name": "file", "options": {"path": f"{knobs}/{param}"}},
            "value": value, "recorded_at": recorded_at}


def _bad_entry(value=30, recorded_at=0.0):
    def make(state: Path, knobs: Path) -> None:
        state.write_text(json.dumps({"version": 1, "originals": [
            entry("window", value, recorded_at, knobs), entry("rate_limit", 120, 0, knobs)]}))
    return make


def _raw_entry(text):
    """An entry written as raw JSON text (10**400 and NaN are not json.dumps output)."""
    def make(state: Path, knobs: Path) -> None:
        good = json.dumps(entry("rate_limit", 120, 0, knobs))
        bad = json.dumps(entry("window", 0, 0, knobs)).replace('"value": 0', f'"value": {text}')
        state.write_text(f'{{"version": 1, "originals": [{bad}, {good}]}}')
    return make


def _fifo(state: Path, knobs: Path) -> None:
    os.mkfifo(state)


def _dev_zero(state: Path, knobs: Path) -> None:
    state.symlink_to("/dev/zero")


def _huge(state: Path, knobs: Path) -> None:
    with open(state, "wb") as fh:             # sparse: costs no disk
        fh.write(b'{"originals": [')
        fh.truncate(1_500_000_000)


def _directory(state: Path, knobs: Path) -> None:
    state.mkdir()


# case -> (make the state file, window afterwards, rate_limit afterwards, moved aside)
STATE_ATTACKS = {
    "recorded_at null": (_bad_entry(recorded_at=None), "30", "120", True),
    "recorded_at a string": (_bad_entry(recorded_at="yesterday"), "30", "120", True),
    "recorded_at 1e300": (_bad_entry(recorded_at=1e300), "30", "120", True),
    "value 10**400": (_raw_entry("1" + "0" * 400), "10", "120", True),
    "value NaN": (_raw_entry("NaN"), "10", "120", True),
    "value a list": (_bad_entry(value=[1, 2]), "10", "120", True),
    "a FIFO": (_fifo, "10", "50", True),
    "a symlink to /dev/zero": (_dev_zero, "10", "50", True),
    "1.5 GB": (_huge, "10", "50", True),
    "a directory": (_directory, "10", "50", True),
}


@pytest.mark.parametrize("attack", list(STATE_ATTACKS))
def test_restore_defaults_survives_a_hostile_state_file(tmp_path, attack):
    """Every good original comes back, the bad ones fall back to the default (asked for
    with --to-config-default), the file
    is kept aside for the operator, with a one-line warning and no traceback or hang."""
    make, window, rate, aside = STATE_ATTACKS[attack]
    knobs = knob_dir(tmp_path)
    state = tmp_path / "control-state.json"
    path = deployment_toml(tmp_path, knobs, 1, state_file=f'"{state}"')
    (knobs / "window").write_text("77\n")          # tuned values left by a killed agent
    (knobs / "rate_limit").write_text("190\n")
    make(state, knobs)
    try:
        done = capes("restore-defaults", "--config", str(path), "--to-config-default",
                     timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{attack}: restore-defaults hangs")
    no_traceback(done.stderr)
    assert done.returncode == 0, done.stderr
    assert (knobs / "window").read_text() == f"{window}\n"
    assert (knobs / "rate_limit").read_text() == f"{rate}\n"
    warnings = [ln for ln in done.stderr.splitlines() if "state file" in ln]
    assert len(warnings) == 1, done.stderr
    assert (tmp_path / "control-state.json.corrupt").exists() == aside
    assert not state.exists() or state.is_file() and not state.is_symlink()


def test_control_agent_process_starts_with_a_hostile_state_file(tmp_path, router):
    sock, port = router
    knobs = knob_dir(tmp_path)
    state = tmp_path / "control-state.json"
    _bad_entry(recorded_at=1e300)(state, knobs)
    proc = start("control-agent", "--config", str(deployment_toml(tmp_path, knobs, port,
                                                                  state_file=f'"{state}"')))
    try:
        ident, hello = recv(sock, 20)
        assert hello.seq == 0
        sock.send_multipart([ident, encode(Action(1, 7, {"window": 40}))])
        recv_until(sock, lambda m: m.seq == 1)
        assert (knobs / "window").read_text() == "40\n"
    finally:
        err = stop(proc)
    no_traceback(err)
    assert proc.returncode == 0
    assert (knobs / "window").read_text() == "30\n"        # the recorded original


def test_a_knob_reading_nan_is_never_written_back_as_nan(tmp_path):
    from control_agent.agent import ControlAgent
    knobs = knob_dir(tmp_path)
    (knobs / "window").write_text("nan\n")
    agent = ControlAgent(load(deployment_toml(tmp_path, knobs, 1)))
    try:
        agent.handle_action(Action(1, 1, {"window": 40}))
        assert (knobs / "window").read_text() == "40\n"
        agent.restore_defaults("test")
    finally:
        agent.close()
    assert (knobs / "window").read_text() == "10\n"        # the default, not "nan"


# ------------------------------------------------------------------ 5. the file applier

def test_file_applier_writes_never_land_outside_the_root_while_a_symlink_is_swapped(
        tmp_path, router):
    """The knob's directory is writable by an attacker who swaps a symlink between the
    allowed directory and one outside while the agent writes 2,000 times."""
    sock, port = router
    root = tmp_path / "knobs"
    real = root / "real"
    real.mkdir(parents=True)
    (real / "window").write_text("10\n")
    (real / "rate_limit").write_text("50\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "window").write_text("0\n")
    link = root / "dev"
    link.symlink_to(real)
    path = deployment_toml(tmp_path, root / "dev", port)
    text = path.read_text().replace(f'path = "{root}/dev/window"',
                                    f'path = "{root}/dev/window", root = "{root}"')
    path.write_text(text)
    landed = []
    done = threading.Event()

    def swap():
        tmp = root / "dev.tmp"
        while not done.is_set():
            for target in (outside, real):
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(target)
                os.replace(tmp, link)
            got = (outside / "window").read_text()
            if got != "0\n":
                landed.append(got)
                (outside / "window").write_text("0\n")

    proc = start("control-agent", "--config", str(path))
    swapper = threading.Thread(target=swap, daemon=True)
    try:
        ident, _ = recv(sock, 20)
        swapper.start()
        for seq in range(1, 2001):
            sock.send_multipart([ident, encode(Action(seq, seq, {"window": 20 + seq % 2}))])
            recv_until(sock, lambda m: m.seq == seq)
        assert proc.poll() is None, "the agent died"
    finally:
        done.set()
        swapper.join(5)
        err = stop(proc)
    no_traceback(err)
    assert not landed, f"{len(landed)} of 2000 writes landed outside the root"
    assert (outside / "window").read_text() == "0\n"


def test_file_applier_turns_a_resolve_error_into_a_refused_write(tmp_path, monkeypatch):
    from control_agent.agent import ControlAgent
    knobs = knob_dir(tmp_path)
    agent = ControlAgent(load(deployment_toml(tmp_path, knobs, 1)))
    try:
        def broken(path, *a, **kw):
            raise OSError(40, "Too many levels of symbolic links")
        monkeypatch.setattr(os.path, "realpath", broken)
        ack = agent.handle_action(Action(1, 1, {"window": 40}))
        assert ack.values.get("window", 10) == 10
        assert agent.counters.apply_failed + sum(agent.counters.refused.values()) == 1
    finally:
        monkeypatch.undo()
        agent.close()
    assert (knobs / "window").read_text() == "10\n"


# ------------------------------------------------------------------ 6. applier kinds

def gluster_deployment(tmp_path: Path, port: int, unit: str = "") -> tuple[Path, Path]:
    """A categorical knob (cluster.eager-lock: on/off) on the gluster applier, through a
    fake ``gluster`` that logs its argv and answers ``volume get`` with ``on``."""
    (tmp_path / "get.txt").write_text("Option                                  Value\n"
                                      "------                                  -----\n"
                                      "cluster.eager-lock                      on\n")
    cli = tmp_path / "gluster"
    cli.write_text(f"""#!/bin/sh
echo "$@" >> "{tmp_path}/argv.log"
case "$*" in *"volume get"*) cat "{tmp_path}/get.txt" ;; esac
""")
    cli.chmod(0o755)
    path = tmp_path / "gluster.toml"
    path.write_text(f"""
[keys]
enabled = false
[control]
node = "g1"
daemon = "tcp://127.0.0.1:{port}"
state_file = "{tmp_path / 'state.json'}"
[control.appliers.lock]
name = "gluster"
options = {{ volume = "capes", key = "cluster.eager-lock", gluster = "{cli}", unit = "{unit}" }}
[parameters.lock]
values = ["on", "off"]
default = "on"
""")
    return path, tmp_path / "argv.log"


def test_a_categorical_knob_on_the_gluster_applier_is_set_by_name(tmp_path, router):
    sock, port = router
    path, argv = gluster_deployment(tmp_path, port)
    done = capes("restore-defaults", "--config", str(path), "--to-config-default")
    no_traceback(done.stderr)
    assert done.returncode == 0 and "lock = on (default)" in done.stdout, done.stderr
    assert "volume set capes cluster.eager-lock on" in argv.read_text()
    proc = start("control-agent", "--config", str(path))
    try:
        ident, hello = recv(sock, 20)
        assert hello.values == {"lock": 0}                     # "on" is index 0
        sock.send_multipart([ident, encode(Action(1, 1, {"lock": 1}))])
        recv_until(sock, lambda m: m.seq == 1)
    finally:
        err = stop(proc)
    no_traceback(err)
    assert proc.returncode == 0
    sets = [ln.split()[-1] for ln in argv.read_text().splitlines() if "volume set" in ln]
    assert sets == ["on", "off", "on"]          # restore-defaults, the action, the restore


def test_an_applier_that_cannot_set_a_kind_is_a_config_error_naming_the_key(tmp_path):
    path, argv = gluster_deployment(tmp_path, 1, unit="bool")
    for command in ("restore-defaults", "control-agent"):
        done = capes(command, "--config", str(path))
        no_traceback(done.stderr)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "control.appliers.lock" in lines[0] and "categorical" in lines[0]
    assert not argv.exists()                    # nothing was ever set


# ------------------------------------------------------------------ 7. dwell across restarts

def dwell_toml(tmp_path: Path, knobs: Path, port: int) -> Path:
    path = deployment_toml(tmp_path, knobs, port)
    path.write_text(path.read_text().replace("forbidden = [13]\n",
                                             "forbidden = [13]\nmin_dwell_s = 60\n"))
    return path


def change_then_stop(sock, path: Path, sig) -> None:
    """An agent sets window 10 -> 11 (min_dwell_s 60), then gets ``sig``."""
    proc = start("control-agent", "--config", str(path))
    try:
        ident, _ = recv(sock, 20)
        sock.send_multipart([ident, encode(Action(1, 1, {"window": 11}))])
        _, ack = recv_until(sock, lambda m: m.seq == 1)
        assert ack.values["window"] == 11
    finally:
        stop(proc, sig)


def test_dwell_outlives_an_agent_restart(tmp_path, router):
    """kill -9 right after a change: the next agent still holds the knob (no flap)."""
    sock, port = router
    knobs = knob_dir(tmp_path)
    path = dwell_toml(tmp_path, knobs, port)
    change_then_stop(sock, path, signal.SIGKILL)
    assert (knobs / "window").read_text() == "11\n"
    proc = start("control-agent", "--config", str(path))
    try:
        ident, hello = recv_until(sock, lambda m: m.seq == 0, 20)
        sock.send_multipart([ident, encode(Action(1, 2, {"window": 10}))])
        _, ack = recv_until(sock, lambda m: m.seq == 1)
        assert ack.values["window"] == 11                # held: no 11 -> 10 flap
        assert 55 < hello.dwell["window"] <= 60          # it says so to the daemon too
    finally:
        err = stop(proc)
    assert (knobs / "window").read_text() == "10\n"      # restores are never held
    assert "1 dwell" in err


def test_dwell_outlives_a_restore_and_a_restart_of_both(tmp_path, router):
    """The agent stops (restoring the original: a change) and starts again: an engine
    change 4 s later is still refused with min_dwell_s = 60."""
    sock, port = router
    knobs = knob_dir(tmp_path)
    path = dwell_toml(tmp_path, knobs, port)
    change_then_stop(sock, path, signal.SIGTERM)
    assert (knobs / "window").read_text() == "10\n"
    restored_at = time.monotonic()
    while sock.poll(300):                      # the stopped agent's last hello
        sock.recv_multipart()
    proc = start("control-agent", "--config", str(path))
    try:
        ident, _ = recv_until(sock, lambda m: m.seq == 0, 20)
        time.sleep(max(0.0, 4 - (time.monotonic() - restored_at)))
        sock.send_multipart([ident, encode(Action(1, 2, {"window": 11}))])
        _, ack = recv_until(sock, lambda m: m.seq == 1)
        assert ack.values["window"] == 10
    finally:
        stop(proc)
    assert (knobs / "window").read_text() == "10\n"


def test_a_restarted_daemon_learns_the_agents_dwell(tmp_path):
    """Daemon restart alone: the daemon must not record as accepted a change that the
    agent then refuses (the DB and the node would disagree)."""
    curve.generate(tmp_path / "keys", ["ctl", "x"])
    cfg = write_config(tmp_path, control=f"tcp://127.0.0.1:{free_port_below_ephemeral()}")
    cfg.write_text(cfg.read_text().replace("forbidden = [13]\n",
                                           "forbidden = [13]\nmin_dwell_s = 60\n"))
    knobs = tmp_path / "node"
    knobs.mkdir()
    (knobs / "window").write_text("10\n")
    (knobs / "rate").write_text("50\n")
    with open(cfg, "a") as fh:
        fh.write(f"""
[control]
node = "n1"
state_file = "{tmp_path / 'state.json'}"
[control.appliers.window]
name = "file"
options = {{ path = "{knobs}/window" }}
[control.appliers.rate]
name = "file"
options = {{ path = "{knobs}/rate" }}
""")
    token = curve.load_token(KeysConfig(dir=str(tmp_path / "keys"), client="x"))
    d = DaemonProcess(cfg, tmp_path / "ready.json")
    agent = c = None
    try:
        agent = start("control-agent", "--config", str(cfg), "--set", "keys.client=ctl",
                      "--set", f'control.daemon="{d.info["control"]}"')
        c = ControlClient(d.info["grpc"], token)
        wait_for(lambda: any(n["name"] == "n1" for n in c.nodes()), 20)
        assert c.submit_action(100, 3, {"window": 11})["accepted"]      # window+
        wait_for(lambda: (knobs / "window").read_text() == "11\n")
        c.close()
        d.stop()
        d = DaemonProcess(cfg, tmp_path / "ready.json")     # the agent reconnects
        assert agent.poll() is None
        c = ControlClient(d.info["grpc"], token)
        wait_for(lambda: any(n["name"] == "n1" for n in c.nodes()), 20)
        r = c.submit_action(200, 3, {"window": 12})
        assert not r["accepted"] and "dwell" in r["reason"], r
    finally:
        if c is not None:
            c.close()
        d.stop()
        if agent is not None:
            no_traceback(stop(agent))


# ------------------------------------------------------------------ 8. replay tools

def replay_db(path: Path, pi_names=("throughput", "x"), ticks: int = 50,
              stray: int | None = None) -> Path:
    """A small, valid simulator-like replay DB (plus one row at tick ``stray``)."""
    from capes.common.params import ParameterSpec
    from capes.common.replay_db import ReplayWriter, SessionInfo
    params = [ParameterSpec(min=1, max=100, step=1, default=10, name="rate_limit"),
              ParameterSpec(min=1, max=100, step=1, default=10, name="window")]
    with ReplayWriter(path) as w:
        w.begin_session(SessionInfo(pi_names=list(pi_names), node_names=["n0"],
                                    params=params))
        for t in list(range(ticks)) + ([stray] if stray is not None else []):
            w.add_pis(t, 0, [float(t % 7)] * len(pi_names))
            w.add_action(t, 0, [10, 10])
    return path


def _sql(*statements):
    def damage(conn):
        for st in statements:
            conn.execute(st)
    return damage


def _malformed_page(path: Path) -> None:
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:3 * page] = b"\xa5" * (2 * page)              # pages 2 and 3: garbage
    path.write_bytes(bytes(data))


DAMAGE = {
    "params not JSON": _sql("UPDATE sessions SET params='not json'"),
    "params of the wrong shape": _sql("""UPDATE sessions SET params='[{"bogus": 1}]'"""),
    "pi_names not a list": _sql("""UPDATE sessions SET pi_names='{"a": 1}'"""),
    "tick as text": _sql("UPDATE pis SET tick='abc' WHERE rowid=3"),
    "vector as text": _sql("UPDATE pis SET vec='text' WHERE rowid=3"),
    "vector not lz4": _sql("UPDATE pis SET vec=x'050a00ffffffffffffffffffffffffffffffff' "
                           "WHERE rowid=3"),
    "orphan row": _sql("INSERT INTO pis VALUES (99, 5, 0, x'00000000')"),
    "malformed pages": None,
}


# damage a command may pass over: merge copies vectors as opaque blobs; the tools that
# read session by session never see a row of no session (the engine's reader refuses it)
HARMLESS = {("vector not lz4", "merge"), ("orphan row", "info"), ("orphan row", "export"),
            ("orphan row", "merge")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_replay_tools_and_train_give_one_line_errors_on_a_damaged_db(tmp_path, damage):
    import sqlite3
    db = replay_db(tmp_path / "r.db")
    if DAMAGE[damage] is None:
        _malformed_page(db)
    else:
        with sqlite3.connect(db) as conn:
            DAMAGE[damage](conn)
        conn.close()
    runs = [("replay", "info", str(db)),
            ("replay", "export", str(db), "--format", "npz", "-o", str(tmp_path / "x.npz")),
            ("replay", "merge", str(db), "-o", str(tmp_path / "m.db"))]
    if damage in ("vector not lz4", "orphan row"):    # train imports torch: two cases
        runs.append(("train", "--replay", str(db), "--steps", "1", "--out",
                     str(tmp_path / "ck.pt"), "--quiet"))
    for args in runs:
        done = capes(*args, timeout=120)
        no_traceback(done.stderr)
        if (damage, args[1]) in HARMLESS:
            assert done.returncode == 0, done.stderr
            continue
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("capes ")]
        assert done.returncode == 1 and len(errors) == 1, (args, done.stderr)
        if args[1] == "export":
            assert not (tmp_path / "x.npz").exists()


def test_a_crafted_schema_is_refused_before_any_query_runs(tmp_path):
    """``pis`` as a view over an endless recursive query: ``info`` ran forever and
    ``merge`` ignored SIGTERM."""
    import sqlite3
    db = replay_db(tmp_path / "r.db")
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE pis RENAME TO real_pis")
        conn.execute("CREATE VIEW pis AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL "
                     "SELECT x + 1 FROM c) SELECT 1 AS session, x AS tick, 0 AS node, "
                     "x'0000803f' AS vec FROM c")
    conn.close()
    for args in (("info", str(db)), ("merge", str(db), "-o", str(tmp_path / "m.db"))):
        proc = subprocess.Popen([sys.executable, "-m", "capes", "replay", *args], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=10)
                pytest.fail(f"replay {args[0]}: ran past 20 s on a crafted schema")
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                pytest.fail(f"replay {args[0]}: ran past 20 s and ignored SIGTERM")
        no_traceback(err)
        assert proc.returncode == 1 and "pis is a view, not a table" in err, err
    assert not (tmp_path / "m.db").exists()


def test_a_stray_far_tick_cannot_make_npz_export_write_gigabytes(tmp_path):
    """600 ticks and one row 12 million ticks ahead: the dense arrays would take 2.2 GB
    (the export runs with 1 GiB of address space, so the old one died of MemoryError)."""
    import resource
    db = replay_db(tmp_path / "r.db", pi_names=[f"pi{i}" for i in range(44)], ticks=600,
                   stray=12_000_000)
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # noqa: E731
    done = capes("replay", "export", str(db), "--format", "npz", "-o",
                 str(tmp_path / "x.npz"), preexec_fn=limit)
    no_traceback(done.stderr)
    assert done.returncode == 1 and "--max-bytes" in done.stderr, done.stderr
    assert "601 ticks with data" in done.stderr
    assert not (tmp_path / "x.npz").exists()
    done = capes("replay", "export", str(db), "--format", "csv", "-o",
                 str(tmp_path / "x.csv"), preexec_fn=limit)      # sparse: fine
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "x.csv").read_text().splitlines()) == 1 + 601


def test_65535_pi_names_cost_no_minute_of_list_lookups(tmp_path):
    """The daemon's own max_session_pis: merge and export found each name with
    list.index / list membership, O(P²): 163 s (export) and over 400 s (merge) before
    doing anything. A minute is the issue's bound; by dict each takes a few seconds."""
    db = replay_db(tmp_path / "r.db", pi_names=[f"pi{i}" for i in range(65_535)], ticks=3)
    for args in (("export", str(db), "--format", "csv", "-o", str(tmp_path / "x.csv")),
                 ("merge", str(db), "-o", str(tmp_path / "m.db"))):
        try:
            done = capes("replay", *args, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"replay {args[0]} with 65,535 PIs ran past a minute")
        assert done.returncode == 0, done.stderr
    from capes.common.replay_db import ReplayReader
    with ReplayReader(tmp_path / "m.db") as r:             # the engine's reader too
        assert len(r.layout.pi_names) == 65_535 and r.sessions[1].identity_pis


# ------------------------------------------------------------------ 9. capes evaluate

@pytest.mark.parametrize("bad", [("--confidence", "1.5"), ("--confidence", "nan"),
                                 ("--duration", "nan")])
def test_evaluate_refuses_bad_arguments_before_measuring_anything(tmp_path, bad):
    """Before: every repetition ran, then the analysis failed and the measurements were
    lost. Now: one line, exit 2, no knob touched, nothing run."""
    knobs = knob_dir(tmp_path)
    before = (knobs / "window").stat().st_mtime_ns
    t0 = time.monotonic()
    done = capes("evaluate", "--config", str(deployment_toml(tmp_path, knobs, 1)),
                 "--workload", "seqread", "--target", str(tmp_path / "data"), "--size", "1m",
                 "--config-set", "original", "--config-set", "window=20",
                 "--repetitions", "1", "--duration", "2", *bad, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert bad[0] in lines[0]
    assert time.monotonic() - t0 < 20
    assert (knobs / "window").stat().st_mtime_ns == before
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------ 10. systemd units

def _unit(path: Path) -> configparser.ConfigParser:
    p = configparser.ConfigParser(strict=False, interpolation=None)
    p.optionxform = str
    p.read_string(path.read_text())
    return p


def test_each_systemd_user_owns_its_own_state_directory():
    """systemd re-owns a StateDirectory to each starting unit's User=: one shared by
    the root control agent and the capes daemon would hand root's file to capes."""
    from control_agent.state_file import AGENT_STATE_DIR
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    owner: dict[str, set[str]] = {}
    by_unit = {}
    for path in units:
        svc = _unit(path)["Service"]
        for d in svc.get("StateDirectory", "").split():
            owner.setdefault(d, set()).add(svc.get("User", "root"))
            by_unit[path.name] = d
    assert owner, "no unit declares a StateDirectory"
    assert all(len(users) == 1 for users in owner.values()), owner
    agent_dir = by_unit["capes-control-agent@.service"]
    assert owner[agent_dir] == {"root"}
    assert AGENT_STATE_DIR == f"/var/lib/{agent_dir}"         # control.state_file "auto"
    capes_dir = by_unit["capes-interface-daemon.service"]
    assert owner[capes_dir] == {"capes"} and agent_dir != capes_dir
    for cfg in sorted((ROOT / "configs").glob("*.toml")):       # the shipped configs agree
        text = cfg.read_text()
        for line in text.splitlines():
            key = line.split("=")[0].strip()
            if key == "state_file" and "/var/lib/" in line:
                assert f"/var/lib/{agent_dir}/" in line, (cfg.name, line)
            if key == "db" and "/var/lib/" in line:
                assert f"/var/lib/{capes_dir}/" in line, (cfg.name, line)
