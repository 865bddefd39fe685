"""What a new user meets first, through real ``capes`` processes: a bad argument is one
line and exit 2 (never a traceback), a command with nothing to talk to says what to
do, the shipped configs can be listed, printed and checked, and ``monitor-agent
--test`` prints what would be collected. Also the wheel: it carries the configs and
workloads, and an installed CAPES finds them from any directory."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from capes.common import shipped_configs
from capes.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent


def capes(*argv, cwd=None, env=None, timeout=120, code=None):
    """Run the ``capes`` CLI as its own process (``python -c`` of the entry point, or
    ``code`` run first in that process)."""
    prelude = (code or "") + "\nimport sys\nfrom capes.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", prelude, *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


def one_line_error(out, rc=2) -> str:
    assert out.returncode == rc, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ argument errors

def test_a_bare_noise_above_one_is_refused_not_read_as_1000_percent(tmp_path):
    line = one_line_error(capes("converge-test", "--noise", "10", cwd=tmp_path))
    assert "--noise" in line and "10%" in line and "0.1" in line


def test_noise_as_percent_or_fraction_is_accepted():
    from capes.commands.converge import _floats
    assert _floats("10%,0.5, 150%") == [0.1, 0.5, 1.5]


def test_an_unknown_tuner_is_one_line_naming_the_known_ones(tmp_path):
    line = one_line_error(capes("converge-test", "--tuner", "nosuch", cwd=tmp_path))
    assert "'nosuch'" in line and "tpe" in line and "capes" in line


def test_tuner_help_lists_tpe(tmp_path):
    out = capes("converge-test", "--help", cwd=tmp_path)
    assert out.returncode == 0 and "tpe" in out.stdout


def test_bo_without_optuna_names_the_extra(tmp_path):
    hide = "import sys\nsys.modules['optuna'] = None   # as if it were not installed"
    line = one_line_error(capes("converge-test", "--tuner", "bo", cwd=tmp_path, code=hide))
    assert "capes[tune]" in line


@pytest.mark.parametrize("command", ["status", "nodes"])
def test_status_with_nothing_running_is_one_line_with_a_hint(tmp_path, command):
    port = free_port()                     # nothing listens there
    extra = ["--engine-metrics", ""] if command == "status" else []
    out = capes(command, "--grpc", f"127.0.0.1:{port}", "--timeout", "2", *extra,
                cwd=tmp_path)
    line = one_line_error(out, rc=1)
    assert "--workdir" in line and "--config" in line and "UNAVAILABLE" not in line
    assert out.stdout == ""


def test_every_option_has_help_and_commands_come_in_order(tmp_path):
    from capes.cli import COMMANDS
    out = capes("--help", cwd=tmp_path)
    listed = [line.split()[0] for line in out.stdout.splitlines()
              if line.startswith("    ") and line.split()[0] in COMMANDS]
    assert listed[:3] == ["demo", "converge-test", "config"]
    for flag, command in (("--seed", "demo"), ("--plot", "demo"),
                          ("--checkpoint-every", "drl-engine"), ("--confidence", "evaluate")):
        text = capes(command, "--help", cwd=tmp_path).stdout
        after = text.split(flag, 1)[1].split("\n  -", 1)[0]
        assert len(after.split()) > 2, f"capes {command} {flag} has no help text"
    assert "original" in capes("--help", cwd=tmp_path).stdout.split("restore-defaults")[1][:80]


# ------------------------------------------------------------------ configs

def test_config_list_and_show_print_the_shipped_configs(tmp_path):
    out = capes("config", "list", cwd=tmp_path)
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert out.returncode == 0 and {"simulator", "linux-readahead", "lustre"} <= set(names)
    shown = capes("config", "show", "linux-readahead", cwd=tmp_path)
    assert shown.stdout == (ROOT / "configs" / "linux-readahead.toml").read_text()
    one_line_error(capes("config", "show", "nosuch", cwd=tmp_path))


def test_config_check_says_ok_for_a_good_file(tmp_path):
    mine = tmp_path / "my.toml"
    mine.write_text(capes("config", "show", "simulator", cwd=tmp_path).stdout)
    out = capes("config", "check", str(mine), cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, "ok\n")


def test_config_check_gives_one_line_per_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "configs" / "simulator.toml").read_text().replace(
        'collectors = [{ name = "simulator", options = { dir = "sim" } }]',
        'collectors = [{ name = "blockdev", options = { devices = ["nosuchdev0"] } }]')
        + '\n[control.appliers.extra]\nname = "file"\noptions = { path = "/x" }\n')
    out = capes("config", "check", str(bad), cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert "monitor.collectors[0]" in lines[0] and "nosuchdev0" in lines[0]
    assert "control.appliers.extra" in lines[1]


def test_config_check_stops_at_a_bad_value_with_one_line(tmp_path):
    out = capes("config", "check", "simulator", "--set", "engine.gama=0.9", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stdout.strip().splitlines()) == 1
    assert "engine.gama" in out.stdout and "unknown key" in out.stdout


def test_a_block_device_config_names_its_device_once():
    for name in ("linux-readahead", "linux-blockdev"):
        text = shipped_configs.config_path(name).read_text()
        settings = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        assert [line for line in settings if "sda" in line] == ['device = "sda"']
        cfg = load_settings(shipped_configs.config_path(name), ["vars.device=nvme0n1"])
        paths = [a.options["path"] for a in cfg.control.appliers.values()
                 if "path" in a.options and "/sys/block/" in a.options["path"]]
        assert paths and all("/nvme0n1/" in p for p in paths)
        assert all("nvme0n1" in p for p in cfg.reward.pis)
        devices = [c.options["devices"] for c in cfg.monitor.collectors if c.name == "blockdev"]
        assert devices == [["nvme0n1"]]


def test_config_flag_takes_a_shipped_name_from_any_directory(tmp_path, monkeypatch):
    from capes.cli import config_file
    monkeypatch.chdir(tmp_path)          # restored after the test: later tests use paths
    assert Path(config_file("configs/lustre.toml")) == shipped_configs.config_path("lustre")
    assert Path(config_file("lustre")) == shipped_configs.config_path("lustre")
    assert config_file("nosuch.toml") == "nosuch.toml"      # the loader's error names it


def test_monitor_agent_test_prints_every_pi_once(tmp_path):
    out = capes("monitor-agent", "--test", "--config", "simulator", "--set",
                'monitor.collectors=[{name="host"},{name="timeofday"}]', cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = dict(line.split() for line in out.stdout.splitlines())
    assert {"cpu_percent", "mem_used_percent"} <= set(rows)
    float(rows["mem_used_percent"])
    assert f"{len(rows)} PIs from 2 collector(s)" in out.stderr


# ------------------------------------------------------------------ the wheel

@pytest.mark.slow
def test_the_wheel_carries_the_configs_and_finds_them_from_elsewhere(tmp_path):
    """Build the wheel (no network: no build isolation, no dependencies), unpack it into
    a target folder and run the installed CAPES from a directory outside the repository.
    The full install into a fresh venv, demo included, is tools/check-wheel (CI)."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip().splitlines()[-1:]}")
    wheel = next((tmp_path / "dist").glob("capes-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for cfg in (ROOT / "configs").glob("*.toml"):
        assert f"capes/configs/{cfg.name}" in names
    for job in (ROOT / "configs" / "workloads").glob("*.fio"):
        assert f"capes/configs/workloads/{job.name}" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import capes.experiments.demo as d, "
                            "capes.experiments.workload_driver as w; print(d.DEFAULT_CONFIG); "
                            "print(w.WORKLOAD_DIR)"], capture_output=True, text=True,
                           cwd=elsewhere, env=env, check=True)
    demo_config, workloads = map(Path, where.stdout.split())
    assert demo_config.is_file() and str(demo_config).startswith(str(target))
    assert (workloads / "seqread.fio").is_file()
    out = capes("config", "check", "storagegamesim", cwd=elsewhere, env=env)
    assert (out.returncode, out.stdout) == (0, "ok\n"), out.stderr


# ------------------------------------------------------------------ metrics

def test_every_registry_serves_process_metrics_and_the_build(tmp_path):
    from prometheus_client import generate_latest

    from capes import __version__
    from capes.common.metrics import registry_for
    text = generate_latest(registry_for([], lambda: {})).decode()
    assert f'capes_build_info{{python="' in text and f'version="{__version__}"' in text
    if Path("/proc/self/stat").exists():
        assert "process_resident_memory_bytes" in text and "process_start_time_seconds" in text


def test_both_metrics_addresses_are_set_in_the_config(tmp_path):
    cfg = load_settings(shipped_configs.config_path("lustre"),
                        ["engine.metrics=127.0.0.1:9999", "daemon.metrics=127.0.0.1:9998"])
    assert (cfg.engine_metrics, cfg.daemon.metrics) == ("127.0.0.1:9999", "127.0.0.1:9998")
    assert load_settings(None).engine_metrics == "127.0.0.1:9465"
    out = capes("config", "check", "lustre", "--set", "engine.metrics=nowhere", cwd=tmp_path)
    assert out.returncode == 2 and "engine.metrics" in out.stdout


def test_the_engines_cpu_threads_are_set_in_the_config_and_checked(tmp_path):
    """engine.cpu_threads (the live engine's PyTorch threads on CPU) defaults to 1 and
    comes from the config; a negative or non-integer value is refused by name."""
    assert load_settings(None).engine_cpu_threads == 1
    assert load_settings(None, ["engine.cpu_threads=0"]).engine_cpu_threads == 0
    for bad in ("-1", "1.5", '"two"'):
        out = capes("config", "check", "lustre", "--set", f"engine.cpu_threads={bad}",
                    cwd=tmp_path)
        assert out.returncode == 2 and "engine.cpu_threads" in out.stdout, out.stdout


# ------------------------------------------------------------------ the demo

@pytest.mark.slow
def test_demo_stopped_by_sigterm_prints_its_summary_and_plots_into_its_workdir(tmp_path):
    import signal
    import time
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "capes", "demo", "--workdir", str(work),
                             "--timeout", "120"], cwd=elsewhere, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:        # until the live line shows ticks
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("[") and " tick " in line or not line:
                break
        assert any(" tick " in x for x in lines), "".join(lines)
        assert "ε nan" not in "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "== summary" in out and "processes stopped: 5" in out
    assert (work / "capes-demo.png").is_file() and not (elsewhere / "capes-demo.png").exists()
