"""The README's walk-through ("Tune one real host, step by step"), run as written, as
root, on a throttled loop device that starts from a wrong readahead (16 KiB): the
commands are read from the README section itself, run one by one in bash (a shell's
variables carry from one command to the next, as in a terminal), with ``capes`` and
``python`` meaning this tree. The only changes are what the README tells the user to do
by hand: the key directory, replay DB, state file and ports pointed into the test's
directory (step 1's "point ... where you want them"). It checks: the dry-run control
agent sets nothing; the real one raises the workload's throughput; stopping it puts
the original 16 KiB back; the device is torn down by name.

Slow (about 3-5 minutes) and root-only; skips with the reason otherwise."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capes.experiments.workload_driver import missing_on_host
from test_first_host import ROOT, walkthrough_commands, walkthrough_text

pytestmark = pytest.mark.slow

LONG_RUNNING = {"capes interface-daemon": "interface-daemon.log",
                "capes drl-engine": "drl-engine.log",
                "capes monitor-agent": "monitor-agent.log",
                "python -m capes.experiments.workload_driver": "workload_driver.log"}
ORIGINAL_KB = 16


def _why_not() -> str | None:
    why = missing_on_host("losetup, cgroups, sysfs", ("fio", "losetup"))
    if why:
        return why
    v2 = Path("/sys/fs/cgroup/cgroup.subtree_control")
    if not (os.path.isfile("/sys/fs/cgroup/blkio/blkio.throttle.read_iops_device") or
            (v2.exists() and "io" in v2.read_text().split())):
        return "no blkio (cgroup v1) or io (cgroup v2) controller to throttle with"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Shell:
    """Runs README lines in bash, one at a time, carrying the shell's variables from
    each to the next (``set -a``: every assignment is exported, then saved)."""

    def __init__(self, tmp: Path, subst: dict[str, str]):
        self.tmp, self.subst = tmp, subst
        bindir = tmp / "bin"
        bindir.mkdir()
        for name, target in (("capes", f'"{sys.executable}" -m capes "$@"'),
                             ("python", f'"{sys.executable}" "$@"')):
            (bindir / name).write_text(f"#!/bin/sh\nexec {target}\n")
            (bindir / name).chmod(0o755)
        self.state = tmp / "shell-state.sh"
        self.state.write_text("")
        self.env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}",
                        PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def _line(self, line: str) -> str:
        for old, new in self.subst.items():
            line = line.replace(old, new)
        return line

    def run(self, line: str, timeout: float = 300) -> subprocess.CompletedProcess:
        script = f"set -a; . {self.state}\n{self._line(line)}\nrc=$?\nexport -p > {self.state}\nexit $rc\n"
        done = subprocess.run(["bash", "-c", script], cwd=self.tmp, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        return done

    def start(self, line: str, log: str) -> subprocess.Popen:
        out = open(self.tmp / log, "wb")
        proc = subprocess.Popen(["bash", "-c", f"set -a; . {self.state}\nexec {self._line(line)}"],
                                cwd=self.tmp, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((log, proc))
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / name).read_text(errors="replace")

    @staticmethod
    def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            try:
                self.stop(proc, 20)
            except ProcessLookupError:
                pass


def hand_edit(config: Path, tmp: Path) -> None:
    """Step 1's by-hand part: keys, DB and state file where this test wants them, and
    free ports (other stacks may run on this machine), metrics off."""
    text = config.read_text()
    ports = {p: str(_free_port()) for p in ("5560", "5561", "50051")}
    for old, new in [("/etc/capes/keys", str(tmp / "keys")),
                     ("/var/lib/capes/readahead-replay.db", str(tmp / "replay.db")),
                     ("/var/lib/capes-agent/control-{node}.json", str(tmp / "control.json")),
                     *((f":{p}", f":{n}") for p, n in ports.items())]:
        assert old in text, f"the shipped config no longer has {old!r}"
        text = text.replace(old, new)
    text = text.replace("[daemon]\n", '[daemon]\nmetrics = ""\n', 1)
    text = text.replace("[engine]\n", '[engine]\nmetrics = ""\n', 1)
    config.write_text(text)


def segment_rates(log: str) -> list[float]:
    """MB/s of each fio segment the workload driver logged."""
    return [float(x) for x in re.findall(r"seqread: ([0-9.]+) MB/s mean", log)]


def test_the_readme_walkthrough_tunes_a_slow_loop_device_and_restores_it(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    commands = walkthrough_commands()
    create = [c for c in commands if "slow_device create" in c]
    assert len(create) == 1 and f"--read-ahead-kb {ORIGINAL_KB}" in create[0]
    name = create[0].split("create", 1)[1].split()[0]
    sh = Shell(tmp_path, {"/etc/capes/keys": str(tmp_path / "keys"),
                          "/var/lib/capes/readahead-replay.db": str(tmp_path / "replay.db")})
    ra_file = None
    try:
        sh.run(create[0])
        dev = re.search(r"DEV=(\S+)", sh.state.read_text()).group(1).strip("'\"")
        ra_file = Path(f"/sys/block/{dev}/queue/read_ahead_kb")
        assert int(ra_file.read_text()) == ORIGINAL_KB
        dry_agent = real_agent = None
        for line in commands[commands.index(create[0]) + 1:]:
            if "slow_device destroy" in line:
                continue                                  # in finally, after the checks
            if line.startswith("capes config show"):
                sh.run(line)
                assert f'device = "{dev}"' in (tmp_path / "readahead.toml").read_text()
                hand_edit(tmp_path / "readahead.toml", tmp_path)
            elif line.startswith("capes control-agent") and "--dry-run" in line:
                dry_agent = line
            elif line.startswith("capes control-agent"):
                real_agent = line
            elif line.startswith(tuple(LONG_RUNNING)) and "--test" not in line:
                sh.start(line, next(v for k, v in LONG_RUNNING.items() if line.startswith(k)))
            elif line.startswith(("capes status", "capes replay plot")):
                continue                                  # once the session has data
            else:
                sh.run(line)
        assert dry_agent and real_agent, "the walk-through names both control agents"

        # dry run: the agent logs what it would set and sets nothing
        dry = sh.start(dry_agent, "control-dry.log")
        deadline = time.monotonic() + 240
        while "dry run: would set read_ahead_kb" not in sh.log("control-dry.log") or \
                len(segment_rates(sh.log("workload_driver.log"))) < 3:
            assert time.monotonic() < deadline, (sh.log("control-dry.log")[-2000:],
                                                 sh.log("drl-engine.log")[-3000:])
            assert dry.poll() is None, sh.log("control-dry.log")[-2000:]
            time.sleep(1)
        assert int(ra_file.read_text()) == ORIGINAL_KB
        assert sh.stop(dry) == 0, sh.log("control-dry.log")[-2000:]
        assert int(ra_file.read_text()) == ORIGINAL_KB      # nothing to put back
        before = segment_rates(sh.log("workload_driver.log"))
        assert before, sh.log("workload_driver.log")[-2000:]
        base = sorted(before)[len(before) // 2]             # the median at 16 KiB

        # for real: the throughput rises
        agent = sh.start(real_agent, "control.log")
        t0 = time.monotonic()
        risen = None
        while risen is None:
            rates = segment_rates(sh.log("workload_driver.log"))[len(before):]
            if len(rates) >= 3 and min(rates[-3:]) >= 3 * base:
                risen = time.monotonic() - t0
            assert time.monotonic() - t0 < 300, (base, rates, sh.log("control.log")[-2000:])
            time.sleep(2)
        print(f"walk-through: median {base:.1f} MB/s at {ORIGINAL_KB} KiB before; three "
              f"segments in a row at >= 3x within {risen:.0f} s of the real control agent "
              f"(last three {rates[-3:]}; read_ahead_kb now {ra_file.read_text().strip()}; "
              f"load {open('/proc/loadavg').read().split()[:3]})")

        hold = float(os.environ.get("CAPES_WALKTHROUGH_HOLD_S", "0"))   # for the docs
        if hold > 0:
            n0, kbs, end = len(segment_rates(sh.log("workload_driver.log"))), [], \
                time.monotonic() + hold
            while time.monotonic() < end:
                kbs.append(int(ra_file.read_text()))
                time.sleep(5)
            held = sorted(segment_rates(sh.log("workload_driver.log"))[n0:])
            print(f"walk-through, the next {hold:.0f} s: {len(held)} segments, MB/s min "
                  f"{held[0]:.1f} median {held[len(held) // 2]:.1f} max {held[-1]:.1f}; "
                  f"read_ahead_kb every 5 s: {kbs}; load "
                  f"{open('/proc/loadavg').read().split()[:3]}")

        for line in commands:                               # step 5, with data now
            if line.startswith(("capes status", "capes replay plot")):
                done = sh.run(line)
                assert "Traceback" not in done.stderr
        assert (tmp_path / "readahead.png").read_bytes()[:4] == b"\x89PNG"

        # stop: the original comes back
        assert sh.stop(agent) == 0, sh.log("control.log")[-2000:]
        assert int(ra_file.read_text()) == ORIGINAL_KB
        assert "refused messages from key" not in sh.log("interface-daemon.log")
    finally:
        sh.stop_all()
        destroy = re.findall(r"`(python -m capes\.experiments\.slow_device destroy \w+)`",
                             walkthrough_text())
        assert destroy == [f"python -m capes.experiments.slow_device destroy {name}"]
        sh.run(destroy[0])
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
                         capture_output=True, text=True).stdout
    assert f"capes-slow-{name}.img" not in out
