"""Hardening, fourth round (issue 38, and issue 36's ``config check`` items): a check that
runs nothing, commands that cannot outlive or flood their agent, a control agent that
applies only what changes and leaves an operator's hand-made change alone, bounded
config loading, ``config show`` of shipped configs only, a demo that stays in its
work dir.

Every attack runs the real ``capes`` CLI (``python -m capes``) as a subprocess, as a user
would; programs the plug-ins run are fakes on ``PATH`` (a ``gluster`` that logs its argv,
a wrapper that hangs, a printer of 256 MB) written into the test's tmp dir."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_agents import router  # noqa: F401 -- a fake daemon's ROUTER socket

ROOT = Path(__file__).resolve().parent.parent


def capes(*args: str, timeout: float = 60, env: dict | None = None, cwd=ROOT,
          **kw) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "capes", *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=timeout, **kw)


def no_traceback(out: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr


# ------------------------------------------------------------------ E: bounded loading

def test_a_fifo_config_is_refused_at_once_and_called_a_fifo(tmp_path):
    fifo = tmp_path / "cfg.toml"
    os.mkfifo(fifo)
    for args in (("config", "check", str(fifo)), ("monitor-agent", "--test", "--config",
                                                  str(fifo))):
        t0 = time.monotonic()
        out = capes(*args, timeout=30)
        assert time.monotonic() - t0 < 20               # before: hung until killed
        no_traceback(out)
        assert out.returncode == 2
        text = out.stdout + out.stderr
        assert "FIFO" in text and "not a regular file" in text and "not found" not in text


def test_dev_zero_as_config_is_refused_without_reading_it(tmp_path):
    out = capes("monitor-agent", "--test", "--config", "/dev/zero", timeout=30)
    no_traceback(out)          # before: read until MemoryError
    assert out.returncode == 2 and "character device" in out.stderr


def test_a_huge_config_is_refused_by_size(tmp_path):
    big = tmp_path / "big.toml"
    with big.open("w") as fh:
        fh.write("# padding\n" * 600_000)               # 6 MB of comments
    out = capes("config", "check", str(big))
    no_traceback(out)
    assert out.returncode == 2 and "larger than" in out.stdout


@pytest.mark.parametrize("how", ["file-list", "file-table", "set-value", "set-key"])
def test_deep_nesting_is_one_line_not_a_recursion_traceback(tmp_path, how):
    deep = tmp_path / "deep.toml"
    if how == "file-list":
        deep.write_text("a = " + "[" * 3000 + "]" * 3000 + "\n")
        args = ["config", "check", str(deep)]
    elif how == "file-table":
        deep.write_text("a = " + "{x = " * 200 + "1" + "}" * 200 + "\n")
        args = ["config", "check", str(deep)]
    elif how == "set-value":
        args = ["config", "check", "simulator", "--set", "x=" + "[" * 3000 + "]" * 3000]
    else:
        args = ["config", "check", "simulator", "--set", "a." * 3000 + "b=1"]
    out = capes(*args)
    no_traceback(out)
    assert out.returncode == 2
    assert "nested more than" in out.stdout + out.stderr
    assert len((out.stdout + out.stderr).strip().splitlines()) == 1


def test_vars_naming_each_other_cannot_blow_up_a_config(tmp_path):
    """[vars] whose values name each other (12 x {v1} in v0, 12 x {v2} in v1, ...) grew
    a string of 12**11 copies before (a hang, then the OOM killer): a var's value is put
    in once, never expanded again, and all the text the vars add is bounded."""
    import resource
    names = [f"v{i}" for i in range(12)]
    lines = ["[vars]"] + [f'{n} = "' + ("{" + names[i + 1] + "}") * 12 + '"'
                          for i, n in enumerate(names[:-1])]
    lines += [f'{names[-1]} = "xxxxxxxx"', "[daemon]", 'label = "{v0}"']
    nested = tmp_path / "nested.toml"
    nested.write_text("\n".join(lines) + "\n")
    wide = tmp_path / "wide.toml"
    wide.write_text('[vars]\nbig = "' + "x" * 1_000_000 + '"\n[daemon]\nlabel = "'
                    + "{big}" * 100 + '"\n')

    def one_gib():                       # before: would have taken the machine down
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    for cfg in (nested, wide):
        out = subprocess.run([sys.executable, "-m", "capes", "config", "check", str(cfg)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             preexec_fn=one_gib)
        no_traceback(out)
        assert len(out.stdout.strip().splitlines()) == 1, out.stdout
    assert "larger than 16 MiB" in out.stdout


def test_a_file_knob_glob_over_all_of_sysfs_is_refused_quickly(tmp_path):
    """``/sys/*/*/.../nope`` walked sysfs (whose symlinks loop) for minutes, in the
    check and at every read and apply of the knob: the walk is bounded."""
    cfg = tmp_path / "glob.toml"
    cfg.write_text('[keys]\nenabled = false\n[control]\nnode = "n1"\nstate_file = ""\n'
                   '[control.appliers.k]\nname = "file"\n'
                   'options = { path = "/sys/*/*/*/*/*/*/*/*/*/*/*/*/nope" }\n'
                   "[parameters.k]\nmin = 1\nmax = 9\nstep = 1\ndefault = 5\n")
    out = capes("config", "check", str(cfg), timeout=45)       # before: "ok" (not looked)
    no_traceback(out)
    assert out.returncode == 2 and "narrower pattern" in out.stdout
    out = capes("restore-defaults", "--dry-run", "--config", str(cfg), timeout=45)
    no_traceback(out)                                  # before: still walking after 90 s
    assert out.returncode in (0, 1) and re.search(r"\bk\b", out.stdout + out.stderr)


# ------------------------------------------------------------------ F: config show

@pytest.mark.parametrize("how", ["absolute", "dotdot", "repo-path"])
def test_config_show_prints_only_shipped_configs(tmp_path, how):
    secret = tmp_path / "secret.toml"
    secret.write_text('token = "s3cr3t"\n')
    from capes.common.shipped_configs import config_dir
    name = {"absolute": str(secret),
            "dotdot": os.path.relpath(secret, config_dir()),
            "repo-path": str(ROOT / "configs" / "simulator.toml")}[how]
    out = capes("config", "show", name)
    no_traceback(out)
    assert out.returncode == 2 and out.stdout == ""    # before: printed the file
    assert "no shipped config" in out.stderr and "s3cr3t" not in out.stderr


# ------------------------------------------------------------------ G: the demo's files

@pytest.mark.slow
def test_the_demo_keeps_its_control_state_in_its_workdir(tmp_path):
    """The control agent's recorded originals live in the demo's work dir while it runs,
    and nothing is written under the user's state dir (as root: /var/lib/capes-agent,
    keyed by the relative knob path, shared by every demo at once)."""
    work, xdg = tmp_path / "work", tmp_path / "xdg"
    env = {**os.environ, "XDG_STATE_HOME": str(xdg), "HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "capes", "demo", "--workdir", str(work),
                             "--timeout", "25", "--plot", "", "--seed", "1"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    seen = False
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            seen = seen or any(work.glob("control-*.json"))
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert seen, "the control agent's state file never appeared in the work dir"
    assert not xdg.exists() and not (tmp_path / "home").exists()


# ------------------------------------------------------------------ C: bounded commands

def script(path: Path, body: str) -> str:
    """An executable ``#!/bin/sh`` script at ``path``; returns its path."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def processes_with(marker: str) -> list[int]:
    """PIDs of live processes whose command line holds ``marker``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            out.append(int(entry))
    return out


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sim_config(tmp_path: Path, extra: str = "") -> Path:
    """The shipped simulator config with its knob dirs under ``tmp_path`` and ``extra``
    appended."""
    text = (ROOT / "configs" / "simulator.toml").read_text()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(text + extra)
    return cfg


def collector_config(tmp_path: Path, argv: list[str], timeout_s: float = 1.0) -> Path:
    cfg = tmp_path / "collect.toml"
    cfg.write_text(
        "tick_seconds = 0.2\n[keys]\nenabled = false\n[monitor]\ncollectors = [{ name = "
        f'"command", options = {{ argv = {argv!r}, names = ["x"], timeout_s = {timeout_s} }} '
        "}]\n".replace("'", '"'))
    return cfg


def test_a_hanging_collector_wrapper_leaves_no_process_behind(tmp_path):
    marker = f"{time.time_ns() % 10**9}.5"             # sleep's argument: unique
    wrapper = script(tmp_path / "wrapper.sh", f"sleep {marker}\necho x 1\n")
    cfg = collector_config(tmp_path, [wrapper])
    try:
        out = capes("monitor-agent", "--test", "--config", str(cfg), timeout=60)
        no_traceback(out)
        assert "timed out" in out.stderr
        left = processes_with(f"sleep {marker}")
        assert left == [], f"{len(left)} orphaned children of the timed-out wrapper"
    finally:
        kill_all(processes_with(f"sleep {marker}"))


def test_a_hanging_applier_read_leaves_no_process_behind(tmp_path):
    marker = f"{time.time_ns() % 10**9}.25"
    wrapper = script(tmp_path / "read.sh", f"sleep {marker}\necho 5\n")
    cfg = tmp_path / "apply.toml"
    cfg.write_text(
        '[keys]\nenabled = false\n[control]\nnode = "n1"\nstate_file = ""\n'
        '[control.appliers.knob]\nname = "command"\n'
        f'options = {{ argv = ["true"], read_argv = ["{wrapper}"], timeout_s = 1.0 }}\n'
        "[parameters.knob]\nmin = 1\nmax = 9\nstep = 1\ndefault = 5\n")
    try:
        out = capes("restore-defaults", "--dry-run", "--config", str(cfg), timeout=60)
        no_traceback(out)
        left = processes_with(f"sleep {marker}")
        assert left == [], f"{len(left)} orphaned children of the timed-out read_argv"
    finally:
        kill_all(processes_with(f"sleep {marker}"))


def test_a_256_mb_printer_does_not_blow_the_agents_memory(tmp_path):
    printer = script(tmp_path / "printer.sh", "head -c 268435456 /dev/zero | tr '\\0' a\n")
    cfg = collector_config(tmp_path, [printer], timeout_s=5.0)
    measure = ("import resource, subprocess, sys, time\n"
               "t0 = time.monotonic()\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "time.monotonic() - t0)\nsys.stderr.write(p.stderr)\n")
    out = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "capes",
                          "monitor-agent", "--test", "--config", str(cfg)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    no_traceback(out)
    peak_kb, wall = out.stdout.split()
    assert "printed more than" in out.stderr
    assert int(peak_kb) < 200 * 1024, f"peak RSS {int(peak_kb) >> 10} MB (before: ~800 MB)"


# ------------------------------------------------------------------ A: config check

FIX = ROOT / "tests" / "fixtures" / "glusterfs"


def fake_gluster(bin_dir: Path, reachable: bool = True) -> Path:
    """A ``gluster`` on PATH that logs its argv to ``bin_dir/argv.log`` and answers
    ``volume info``/``volume get`` from the fixtures (or, not ``reachable``, fails as
    gluster does when glusterd is down)."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir / "argv.log"
    body = f'echo "$@" >> "{log}"\n'
    if reachable:
        body += (f'case "$*" in\n  *"volume info"*) cat "{FIX}/volume-info.txt" ;;\n'
                 f'  *"volume get"*) cat "{FIX}/volume-get-all.txt" ;;\n'
                 '  *"volume set"*) echo "volume set: success" ;;\nesac\nexit 0\n')
    else:
        body += 'echo "Connection failed. Please check if gluster daemon is operational."\n' \
                "exit 1\n"
    script(bin_dir / "gluster", body)
    return log


def with_path(bin_dir: Path) -> dict:
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_checking_a_glusterfs_config_only_queries_the_volume(tmp_path):
    log = fake_gluster(tmp_path / "bin")
    out = capes("config", "check", "glusterfs", env=with_path(tmp_path / "bin"))
    no_traceback(out)
    calls = log.read_text().splitlines() if log.exists() else []
    assert not [c for c in calls if " set " in f" {c} " or "profile" in c or "reset" in c], \
        calls                                      # before: three `volume set diagnostics.*`
    assert any("volume info capes" in c for c in calls)          # it did ask glusterd
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stdout


def test_an_unreachable_glusterd_is_an_error_not_ok(tmp_path):
    fake_gluster(tmp_path / "bin", reachable=False)
    out = capes("config", "check", "glusterfs", env=with_path(tmp_path / "bin"))
    no_traceback(out)
    assert out.returncode == 2, out.stdout                       # before: "ok"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "glusterd" in lines[0] and "Connection failed" in lines[0]


def test_a_command_collectors_program_is_not_run_by_a_check(tmp_path):
    marker = tmp_path / "ran"
    prog = script(tmp_path / "prog.sh", f'touch "{marker}"\necho x 1\n')
    cfg = tmp_path / "c.toml"
    for names in ("", ', names = ["x"]'):
        cfg.write_text('[keys]\nenabled = false\n[monitor]\ncollectors = [{ name = '
                       f'"command", options = {{ argv = ["{prog}"]{names} }} }}]\n')
        out = capes("config", "check", str(cfg))
        no_traceback(out)
        assert (out.returncode, out.stdout) == (0, "ok\n"), out.stdout
        assert not marker.exists(), "config check ran the collector's program"
    cfg.write_text('[keys]\nenabled = false\n[monitor]\ncollectors = [{ name = "command", '
                   'options = { argv = ["no-such-program-38"] } }]\n')
    out = capes("config", "check", str(cfg))
    assert out.returncode == 2 and "no-such-program-38" in out.stdout


def a_sysfs_queue_dir() -> Path:
    found = sorted(Path("/sys/block").glob("*/queue/read_ahead_kb"))
    if not found:
        pytest.skip("no block device with a queue/read_ahead_kb here")
    return found[0].parent


def test_two_errors_are_two_lines_and_a_bad_sysfs_path_is_one(tmp_path):
    queue = a_sysfs_queue_dir()
    cfg = tmp_path / "two.toml"
    cfg.write_text(
        '[keys]\nenabled = false\n[control]\nnode = "n1"\n'
        '[control.appliers.ra]\nname = "file"\n'
        f'options = {{ path = "{queue}/read_ahead_kbb" }}\n'
        "[parameters.ra]\nmin = 8\nmax = 4096\nstep = 8\ndefault = 128\n"
        "[engine]\ngama = 0.9\n[game]\nnoise = 10\n")
    out = capes("config", "check", str(cfg))
    no_traceback(out)
    assert out.returncode == 2
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout          # before: one line (the first bad key)
    assert "engine.gama" in lines[0] and "unknown key" in lines[0]
    assert "game.noise" in lines[1] and "1000 %" in lines[1]
    assert "control.appliers.ra" in lines[2] and "read_ahead_kbb does not exist" in lines[2]
    good = cfg.read_text().replace("read_ahead_kbb", "read_ahead_kb").split("[engine]")[0]
    cfg.write_text(good)
    assert capes("config", "check", str(cfg)).stdout == "ok\n"


def test_a_noise_set_is_range_checked_like_the_flag(tmp_path):
    out = capes("config", "check", "simulator", "--set", "game.noise=10")
    no_traceback(out)
    assert out.returncode == 2 and "--set game.noise=10" in out.stdout   # before: "ok"
    assert capes("config", "check", "simulator", "--set", "game.noise=0.5").stdout == "ok\n"


# ------------------------------------------------------------------ B: monitor-agent --test

def test_monitor_agent_test_turns_off_what_it_turned_on(tmp_path):
    log = fake_gluster(tmp_path / "bin")
    out = capes("monitor-agent", "--test", "--config", "glusterfs",
                env=with_path(tmp_path / "bin"), timeout=120)
    no_traceback(out)
    calls = log.read_text().splitlines()
    sets = [c.split()[-2:] for c in calls if "volume set" in c]
    assert sets, calls                      # enable = true: it did turn the dumps on
    start = {k: v for k, v in (line.split()[:2] for line in
                               (FIX / "volume-get-all.txt").read_text().splitlines()
                               if line.startswith("diagnostics."))}
    final = {}
    for key, value in sets:
        final[key] = value
    assert final == {k: start[k] for k in final}, sets   # before: left at on / 1
    assert "collector glusterfs turns on the bricks source of volume capes" in out.stderr


def test_building_every_shipped_plugin_runs_no_program(monkeypatch):
    """The rule behind a check that acts on nothing, for every plug-in of every shipped
    config: building it starts no process (its ``start`` does, in an agent)."""
    from capes.common import shipped_configs
    from capes.settings import load_settings
    from control_agent.appliers import build_applier
    from monitor_agent.collectors import build_collector

    def refuse(self, argv, *a, **k):
        raise AssertionError(f"building a plug-in ran {argv}")
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    built = 0
    for name in shipped_configs.config_names():
        cfg = load_settings(shipped_configs.config_path(name))
        plugins = [(build_collector, c.name, c.options) for c in cfg.monitor.collectors]
        plugins += [(build_applier, a.name, a.options) for a in cfg.control.appliers.values()]
        for build, plugin, options in plugins:
            try:
                build(plugin, options).close()
                built += 1
            except ValueError:          # a device this host does not have (sda, Lustre)
                pass
    assert built >= 20


# ------------------------------------------------------------------ D: apply what changes

def next_ack(sock, predicate=lambda m: True, timeout: float = 15.0):
    from capes.common.protocol import Ack, decode
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            ident, data = sock.recv_multipart()
            msg = decode(data)
            if isinstance(msg, Ack) and predicate(msg):
                return ident, msg
    raise AssertionError("fake daemon: the expected ack never came")


def test_the_control_agent_sets_only_what_changes_and_leaves_a_hand_made_change(
        tmp_path, router):
    """Three knobs set by a program that logs each call. One step of one knob is one
    set (before: three); a knob changed by hand is not put back when another is
    stepped (before: it was), and the agent tells the daemon (``Ack.drift``), also
    for a change it finds on its own (``drift_check_s``); a knob changed by hand is held
    as set, also when the engine steps it on (before: set to the engine's value)."""
    from capes.common.protocol import Action, encode
    sock, port = router
    knobs = tmp_path / "knobs"
    knobs.mkdir()
    for name, value in (("a", 10), ("b", 20), ("c", 30)):
        (knobs / name).write_text(f"{value}\n")
    calls = tmp_path / "sets.log"
    setter = script(tmp_path / "set.sh", f'echo "$1 $2" >> "{calls}"\n'
                                         f'echo "$2" > "{knobs}/$1"\n')
    getter = script(tmp_path / "get.sh", f'cat "{knobs}/$1"\n')
    appliers = "".join(
        f'[control.appliers.{k}]\nname = "command"\noptions = {{ argv = ["{setter}", '
        f'"{{param}}", "{{value}}"], read_argv = ["{getter}", "{{param}}"] }}\n'
        f"[parameters.{k}]\nmin = 1\nmax = 100\nstep = 1\ndefault = 50\n" for k in "abc")
    cfg = tmp_path / "ctl.toml"
    cfg.write_text(f'[keys]\nenabled = false\n[control]\nnode = "n1"\n'
                   f'daemon = "tcp://127.0.0.1:{port}"\nstate_file = "{tmp_path}/st.json"\n'
                   f"drift_check_s = 1.0\n" + appliers)
    log = (tmp_path / "agent.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "capes", "control-agent", "--config",
                             str(cfg)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
    try:
        ident, hello = next_ack(sock, lambda m: m.seq == 0)
        assert hello.values == {"a": 10, "b": 20, "c": 30}

        def act(seq, values):
            sock.send_multipart([ident, encode(Action(seq, seq, values))])
            return next_ack(sock, lambda m: m.seq == seq)[1]

        ack = act(1, {"a": 11, "b": 20, "c": 30})
        assert calls.read_text().splitlines() == ["a 11"]      # before: a, b and c set
        assert ack.values == {"a": 11, "b": 20, "c": 30}

        (knobs / "b").write_text("25\n")                       # an operator's change
        ack = act(2, {"a": 12, "b": 20, "c": 30})              # CAPES steps another knob
        assert calls.read_text().splitlines() == ["a 11", "a 12"]
        assert (knobs / "b").read_text() == "25\n"             # before: put back to 20
        _, hello = next_ack(sock, lambda m: m.seq == 0 and m.drift, timeout=10)
        assert hello.drift == {"b": 25} and hello.values["b"] == 25   # found within 1 s

        (knobs / "c").write_text("33\n")                       # by hand, then CAPES steps
        ack = act(3, {"a": 12, "b": 20, "c": 31})              # c from its old value
        assert ack.drift == {"c": 33} and ack.values["c"] == 33
        assert (knobs / "c").read_text() == "33\n"
        assert calls.read_text().splitlines() == ["a 11", "a 12"]

        ack = act(4, {"a": 12, "b": 26, "c": 32})    # the engine steps them on: held
        assert (knobs / "b").read_text() == "25\n" and (knobs / "c").read_text() == "33\n"
        assert ack.values["b"] == 25 and ack.values["c"] == 33
        assert calls.read_text().splitlines() == ["a 11", "a 12"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    log.seek(0)
    err = log.read()
    assert "changed behind CAPES's back" in err and "2 changed by hand" in err
    # restoring at the stop puts back a's original, and leaves b and c as the operator
    # set them
    assert [(knobs / k).read_text() for k in "abc"] == ["10\n", "25\n", "33\n"]


def test_the_daemon_takes_a_hand_made_value_as_current():
    """The daemon side of ``Ack.drift``: the value becomes the daemon's current one
    (what the engine's next action steps from, and its reply's values), counted."""
    from capes.common.params import ParameterSpec
    from capes.common.protocol import Ack, encode
    from interface_daemon.action_checker import ActionChecker
    from interface_daemon.action_plane import ActionPlane
    from interface_daemon.counters import Counters
    specs = [ParameterSpec(1, 100, 1, 50, name="a"), ParameterSpec(1, 100, 1, 50, name="b")]
    counters = Counters()
    plane = ActionPlane(specs, ActionChecker(specs), counters, lambda i, p: True)
    verdict, _, _ = plane.submit(1, 1, {"a": 20, "b": 20}, True)
    assert verdict.ok and plane.current == {"a": 20.0, "b": 20.0}
    assert plane.handle(encode(Ack("n1", 0, {"a": 20, "b": 25}, drift={"b": 25})), b"x") \
        is None
    assert plane.current == {"a": 20.0, "b": 25.0} and counters.actions["drift"] == 1
    plane.handle(encode(Ack("n1", 0, {"a": 20, "b": 500}, drift={"b": 500})), b"x")
    assert plane.current["b"] == 25.0 and counters.actions["drift_refused"] == 1
    plane.handle(encode(Ack("n2", 0, {"a": 20, "b": 25})), b"y")   # a 2nd node holds b
    plane.handle(encode(Ack("n1", 0, {"a": 20, "b": 30}, drift={"b": 30})), b"x")
    assert plane.current["b"] == 25.0        # n1 keeps its 30; n2 is not moved to it


@pytest.mark.slow
def test_a_real_volume_is_left_as_found_by_a_check_and_a_test(tmp_path):
    """On a real GlusterFS volume (root, GlusterFS installed): ``config check`` and
    ``monitor-agent --test`` of the shipped GlusterFS config, retargeted at it, leave
    the diagnostics options as they were (before: both left the three on)."""
    from capes.experiments import gluster_volume as gv
    from test_glusterfs import _skip_reason
    why = _skip_reason()
    if why:
        pytest.skip(why)
    vol = gv.GlusterTestVolume(tmp_path / "vol")
    keys = ("diagnostics.count-fop-hits", "diagnostics.latency-measurement",
            "diagnostics.stats-dump-interval")

    def diagnostics() -> dict:
        from monitor_agent.collectors.glusterfs import parse_volume_get
        got = parse_volume_get(vol.gluster("volume", "get", vol.volume, "all").stdout)
        return {k: got[k] for k in keys}
    try:
        vol.up()
    except gv.GlusterError as exc:
        vol.down()
        if "already running" in str(exc):        # another test's volume: only one glusterd
            pytest.skip(str(exc))
        raise
    try:
        cfg = tmp_path / "gluster.toml"
        cfg.write_text((ROOT / "configs" / "glusterfs.toml").read_text()
                       .replace("/var/tmp/capes-gluster/run/glusterd.socket", vol.socket_path)
                       .replace("/var/tmp/capes-gluster/mnt", str(vol.mount))
                       .replace('volume = "capes"', f'volume = "{vol.volume}"')
                       .replace("glusterfs.capes.", f"glusterfs.{vol.volume}."))
        found = diagnostics()
        out = capes("config", "check", str(cfg), timeout=120)
        assert (out.returncode, out.stdout) == (0, "ok\n"), out.stdout + out.stderr
        assert diagnostics() == found
        out = capes("monitor-agent", "--test", "--config", str(cfg), timeout=120)
        no_traceback(out)
        assert "turns on the bricks source" in out.stderr
        assert diagnostics() == found
        bad = capes("config", "check", str(cfg), "--set", "control.appliers.io_thread_count"
                    '.options.key="performance.io-thread-countt"', timeout=120)
        assert bad.returncode == 2 and "io-thread-countt" in bad.stdout
    finally:
        vol.down()


@pytest.mark.slow
def test_a_file_of_a_quarter_million_bad_keys_is_checked_in_bounded_time(tmp_path):
    """Each bad key is taken out in turn to find the next: on a hostile file (4 MB of
    unknown keys) that stops, saying so, instead of reparsing it for minutes."""
    many = tmp_path / "many.toml"
    many.write_text("".join(f"k{i} = {i}\n" for i in range(250_000)))
    t0 = time.monotonic()
    out = capes("config", "check", str(many), timeout=240)
    no_traceback(out)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 2 and "the check stops after" in lines[-1]
    assert 2 <= len(lines) <= 51 and time.monotonic() - t0 < 120


def test_a_program_printing_inf_gives_no_reading_not_infinity(tmp_path):
    prog = script(tmp_path / "inf.sh", "echo x inf\necho y 1e999\necho z 3\n")
    cfg = collector_config(tmp_path, [prog])
    cfg.write_text(cfg.read_text().replace('names = ["x"]', 'names = ["x", "y", "z"]'))
    out = capes("monitor-agent", "--test", "--config", str(cfg))
    no_traceback(out)
    got = dict(line.split() for line in out.stdout.splitlines())
    assert got == {"x": "-", "y": "-", "z": "3"}         # before: x inf, y inf
