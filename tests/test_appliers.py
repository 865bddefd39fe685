"""Appliers against a fixture tree laid out like a Lustre client's /proc and /sys."""
from __future__ import annotations

import sys
import textwrap

import pytest

from control_agent.appliers import APPLIERS, ApplyError, build_applier
from control_agent.appliers.base import format_value

OSCS = ["lustre-OST0000-osc-ffff8800b9b6c800", "lustre-OST0001-osc-ffff8800b9b6c800",
        "lustre-OST0002-osc-ffff8800b9b6c800"]


@pytest.fixture
def tree(tmp_path):
    """/proc/fs/lustre/osc/<osc>/{max_rpcs_in_flight, max_dirty_mb} and
    /sys/block/<dev>/queue/read_ahead_kb, with the kernel's defaults."""
    for osc in OSCS:
        d = tmp_path / "proc/fs/lustre/osc" / osc
        d.mkdir(parents=True)
        (d / "max_rpcs_in_flight").write_text("8\n")
        (d / "max_dirty_mb").write_text("32\n")
    for dev in ("sda", "sdb", "nvme0n1"):
        q = tmp_path / "sys/block" / dev / "queue"
        q.mkdir(parents=True)
        (q / "read_ahead_kb").write_text("128\n")
    return tmp_path


def test_builtin_appliers_are_registered_by_name():
    build_applier("file", {"path": "/nonexistent"})
    APPLIERS.load_builtin()             # every built-in module registers itself
    assert {"file", "command"} <= set(APPLIERS)
    with pytest.raises(ValueError, match="unknown applier 'nope'"):
        build_applier("nope")


def test_values_are_written_as_the_kernel_wants_them():
    assert format_value(32.0) == "32"
    assert format_value(-4.0) == "-4"
    assert format_value(0.25) == "0.25"
    assert format_value(1e6) == "1000000"


def test_file_applier_sets_every_glob_match(tree):
    ap = build_applier("file", {"path": str(tree / "proc/fs/lustre/osc/*/max_rpcs_in_flight")})
    assert ap.read("max_rpcs_in_flight") == 8
    ap.apply("max_rpcs_in_flight", 32.0)
    for osc in OSCS:
        assert (tree / "proc/fs/lustre/osc" / osc / "max_rpcs_in_flight").read_text() == "32\n"
        assert (tree / "proc/fs/lustre/osc" / osc / "max_dirty_mb").read_text() == "32\n"
    assert ap.read("max_rpcs_in_flight") == 32


def test_file_applier_paths_table_maps_parameters(tree):
    ap = build_applier("file", {"paths": {
        "read_ahead_kb": str(tree / "sys/block/sd*/queue/read_ahead_kb"),
        "max_dirty_mb": str(tree / "proc/fs/lustre/osc/*/max_dirty_mb")}})
    ap.apply("read_ahead_kb", 4096)
    ap.apply("max_dirty_mb", 64.5)
    assert (tree / "sys/block/sda/queue/read_ahead_kb").read_text() == "4096\n"
    assert (tree / "sys/block/sdb/queue/read_ahead_kb").read_text() == "4096\n"
    assert (tree / "sys/block/nvme0n1/queue/read_ahead_kb").read_text() == "128\n"
    assert ap.read("max_dirty_mb") == 64.5
    with pytest.raises(ApplyError, match="no path configured"):
        ap.apply("max_rpcs_in_flight", 8)


def test_file_applier_without_matches_fails(tree):
    ap = build_applier("file", {"path": str(tree / "proc/fs/lustre/mdc/*/max_rpcs_in_flight")})
    with pytest.raises(ApplyError, match="no file matches"):
        ap.apply("max_rpcs_in_flight", 16)
    assert ap.read("max_rpcs_in_flight") is None
    plain = build_applier("file", {"path": str(tree / "no/such/knob")})
    with pytest.raises(ApplyError, match="cannot write 16"):
        plain.apply("knob", 16)


def test_file_applier_rolls_back_a_partial_write(tree):
    """The third OSC's knob cannot be written (here: a directory in its place); the
    two written before it get their old values back."""
    bad = tree / "proc/fs/lustre/osc" / OSCS[2] / "max_rpcs_in_flight"
    bad.unlink()
    bad.mkdir()
    ap = build_applier("file", {"path": str(tree / "proc/fs/lustre/osc/*/max_rpcs_in_flight")})
    with pytest.raises(ApplyError, match=OSCS[2]):
        ap.apply("max_rpcs_in_flight", 64)
    for osc in OSCS[:2]:
        assert (tree / "proc/fs/lustre/osc" / osc / "max_rpcs_in_flight").read_text() == "8\n"


def test_file_applier_read_is_none_when_matches_disagree(tree):
    ap = build_applier("file", {"path": str(tree / "sys/block/*/queue/read_ahead_kb")})
    (tree / "sys/block/sdb/queue/read_ahead_kb").write_text("256\n")
    assert ap.read("read_ahead_kb") is None


def test_file_applier_rejects_bad_options():
    with pytest.raises(ValueError, match="path"):
        build_applier("file", {})
    with pytest.raises(ValueError, match="options: file: .*unexpected keyword argument 'mode'"):
        build_applier("file", {"path": "/x", "mode": "w"})


def _fake_lctl(tmp_path):
    """A stand-in for ``lctl``: set_param NAME=VALUE stores, get_param -n NAME prints."""
    store = tmp_path / "lctl-store"
    script = tmp_path / "lctl.py"
    script.write_text(textwrap.dedent(f"""
        import sys, pathlib
        store = pathlib.Path({str(store)!r})
        args = sys.argv[1:]
        if args[0] == "set_param":
            name, value = args[1].split("=", 1)
            float(value)  # refuse anything but a number, like lctl
            store.write_text(value)
        elif args[0] == "get_param":
            print(store.read_text() if store.exists() else "8")
        elif args[0] == "fail":
            print("lctl: permission denied", file=sys.stderr)
            sys.exit(1)
    """))
    return [sys.executable, str(script)], store


def test_command_applier_fills_the_template_without_a_shell(tmp_path):
    lctl, store = _fake_lctl(tmp_path)
    ap = build_applier("command", {
        "argv": lctl + ["set_param", "osc.*.{param}={value}"],
        "read_argv": lctl + ["get_param", "-n", "osc.*.{param}"]})
    assert ap.read("max_rpcs_in_flight") == 8
    ap.apply("max_rpcs_in_flight", 16.0)
    assert store.read_text() == "16"
    assert ap.read("max_rpcs_in_flight") == 16


def test_command_applier_failures_are_apply_errors(tmp_path):
    lctl, _ = _fake_lctl(tmp_path)
    failing = build_applier("command", {"argv": lctl + ["fail", "{value}"]})
    with pytest.raises(ApplyError, match="permission denied"):
        failing.apply("x", 1)
    assert failing.read("x") is None       # no read_argv: unknown
    slow = build_applier("command", {"argv": [sys.executable, "-c", "import time; "
                                               "time.sleep(5)"], "timeout_s": 0.3})
    with pytest.raises(ApplyError, match="timed out"):
        slow.apply("x", 1)
    missing = build_applier("command", {"argv": [str(tmp_path / "no-such-tool"), "{value}"]})
    with pytest.raises(ApplyError, match="cannot run"):
        missing.apply("x", 1)
    with pytest.raises(ValueError, match="argv"):
        build_applier("command", {"argv": "lctl set_param x={value}"})
