"""Real readahead sessions (capes/experiments/real_readahead.py): fio's live status
parsed, the alternating schedule, the scores against the best static setting, the
shipped application-objective config, the live baseline tuner's source; and (slow, as
root with fio and FUSE) the emulated seek disk and a small seeded alternating bench
through the whole stack, checking the contract, the safe range and the clean-up."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capes.experiments import real_readahead as rr
from capes.settings import load_settings

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ pieces

def test_terse_status_lines_give_kib_and_runtime_and_junk_is_none():
    line = "3;fio-3.33;x;0;0;18688;10200;643;1832;0;0"
    assert rr.parse_terse_status(line) == (18688.0, 1832.0)
    assert rr.parse_terse_status("fio: some note") is None
    assert rr.parse_terse_status("3;fio;x;0;0;abc;1;2;3") is None


def test_terse_io_size_is_bandwidth_over_iops_and_none_without_reads():
    # sequential 16 KiB reads and random 4 KiB page faults, as fio's status reports them
    assert rr.terse_io_kib("3;fio-3.33;x;0;0;18688;10200;637;1832;0;0") == pytest.approx(
        16.0, rel=0.01)
    assert rr.terse_io_kib("3;fio-3.33;x;0;0;372104;426724;109798;872;0") == pytest.approx(
        3.9, rel=0.01)
    assert rr.terse_io_kib("3;fio-3.33;x;0;0;0;0;0;0;0") is None
    assert rr.terse_io_kib("fio: some note") is None


def test_the_runner_publishes_the_objective_and_the_signature_for_the_command_collector(
        tmp_path):
    from monitor_agent.collectors.command import parse_lines
    runner = rr.SessionRunner(None, tmp_path, pi_file=tmp_path / "app")
    runner.publish(0.0)
    first = parse_lines((tmp_path / "app").read_text())
    assert first[rr.PI_NAME] == 0 and math.isnan(first[rr.SIGNATURE_PI])   # none yet
    runner.publish(5e6, 16.0)
    runner.publish(6e6)               # a second without reads: the signature stays
    assert parse_lines((tmp_path / "app").read_text()) == {rr.PI_NAME: 6e6,
                                                          rr.SIGNATURE_PI: 16.0}


def test_alternating_schedule_alternates_and_rejects_nonsense():
    s = rr.alternating_schedule(4, 120)
    assert [p.workload for p in s] == ["seqread4", "mmaprand"] * 2
    assert all(p.seconds == 120 for p in s)
    with pytest.raises(ValueError):
        rr.alternating_schedule(0, 120)


def test_a_capes_variant_gets_its_own_settings_and_runs_the_engine():
    v = rr.parse_variants(["poll:engine.tick_poll_s=0.1;engine.probe_dwell=5"])
    assert v == {"capes-poll": ("engine.tick_poll_s=0.1", "engine.probe_dwell=5")}
    assert rr.is_capes("capes") and rr.is_capes("capes-poll")
    assert not rr.is_capes("hill") and not rr.is_capes("capesx")
    for bad in ["poll", "poll:", ":engine.tick_poll_s=0.1"]:
        with pytest.raises(ValueError):
            rr.parse_variants([bad])


def test_the_engine_gets_its_extra_arguments_and_a_baseline_does_not(tmp_path):
    """``run_tuner(engine_args=...)``: how a real session starts from the experience of
    earlier ones (``--experience DB``, benchmarks/bench_real_experience.py)."""
    started = []

    class Stack:
        def start(self, name, *args, module="capes"):
            started.append((name, args, module))
    extra = ("--experience", str(tmp_path / "merged.db"))
    rr.start_tuner(Stack(), "capes-experience-s1", ["--config", "x.toml"], 3, tmp_path,
                   tmp_path / "s.json", engine_args=extra)
    rr.start_tuner(Stack(), "hill", ["--config", "x.toml"], 3, tmp_path, tmp_path / "s.json",
                   engine_args=extra)
    (_, engine, _), (_, hill, module) = started
    assert engine[0] == "drl-engine" and engine[-2:] == extra and "--seed" in engine
    assert module == "capes.experiments.live_tuner" and "--experience" not in hill


def _rows(label, schedule, levels, seconds):
    rows = []
    for i, ph in enumerate(schedule):
        for k in range(seconds):
            level = levels[ph.workload] * (1 + 0.01 * (k % 3 - 1))
            rows.append(rr.Row(float(i * seconds + k), level, 128, i, ph.workload, label))
    return rows


def test_score_normalises_each_workload_by_its_own_best():
    sched = rr.alternating_schedule(4, 60)
    best = {"seqread4": 80e6, "mmaprand": 1e6}
    # the tuner gets each workload's best in full: relative 1, whatever the scales
    rows = _rows("t", sched, best, 60)
    sc = rr.score(rows, sched, best, static_rel=0.7, static_se=0.01,
                  original={"seqread4": 40e6, "mmaprand": 0.5e6})
    assert sc["relative"] == pytest.approx(1.0, abs=0.01)
    assert sc["diff_vs_best_static"] == pytest.approx(0.3, abs=0.01)
    lo, hi = sc["ci95"]
    assert lo < sc["diff_vs_best_static"] < hi and lo > 0
    assert [p["vs_original"] for p in sc["phases"]] == pytest.approx([2, 2, 2, 2], abs=0.03)
    # half of each workload's best: 0.5, below the static's 0.7
    half = _rows("t", sched, {w: v / 2 for w, v in best.items()}, 60)
    sc = rr.score(half, sched, best, 0.7, 0.01, best)
    assert sc["relative"] == pytest.approx(0.5, abs=0.01)
    assert sc["ci95"][1] < 0


def test_returns_are_timed_to_90_percent_of_their_workload_s_best():
    """Issue 25's real figure: each later phase of a workload, seconds until its 5 s mean
    reaches 90 % of that workload's best static; a return that never does is None."""
    sched = rr.alternating_schedule(4, 60)
    best = {"seqread4": 80e6, "mmaprand": 1e6}
    rows = _rows("t", sched, best, 60)
    for r in rows:                      # the seq return starts low for 20 s, mmap never
        start = min(q.t for q in rows if q.phase == r.phase)
        if r.phase == 2 and r.t - start < 20 or r.phase == 3:
            r.bytes_s *= 0.5
    sc = rr.score(rows, sched, best, 0.7, 0.01, best)
    assert [p["visit"] for p in sc["phases"]] == [1, 1, 2, 2]
    rc = sc["recall_15s"]
    assert rc["returns"] == 2 and rc["within_15s"] == 0
    assert 16 <= rc["seconds_to_90"][0] <= 20 and rc["seconds_to_90"][1] is None


def test_switches_are_noticed_only_inside_their_window():
    sched = rr.alternating_schedule(3, 100)
    rows = _rows("t", sched, {"seqread4": 1.0, "mmaprand": 1.0}, 100)
    starts = [min(r.t for r in rows if r.phase == i) - 1 for i in range(3)]
    noticed = [starts[0] + 5, starts[1] + 30, starts[2] + 80]
    got = rr.switches_noticed(rows, noticed)
    assert got == {"switches": 2, "found": 1, "false": 1}


def _report(original, means):
    """An evaluate report with the fields static_summary reads."""
    configs = []
    for v, m in means.items():
        name = "original" if v == original else f"read_ahead_kb={v}"
        configs.append({"name": name, "n": 10, "mean": m, "ci_low": m * 0.98,
                        "ci_high": m * 1.02, "values": {"read_ahead_kb": v}})
    return {"configs": configs}


def test_static_summary_finds_the_best_single_setting_and_per_workload_bests():
    sched = rr.alternating_schedule(4, 120)
    grids = {"seqread4": _report(128, {128: 30e6, 4: 5e6, 512: 70e6, 4096: 76e6}),
             "mmaprand": _report(128, {128: 0.5e6, 4: 0.9e6, 512: 0.3e6, 4096: 0.05e6})}
    st = rr.static_summary(grids, 128, sched)
    assert st["per_workload_best_setting"] == {"seqread4": 4096, "mmaprand": 4}
    rel = {int(k): v for k, v in st["relative_by_setting"].items()}
    assert rel[512] == pytest.approx((70 / 76 + 0.3 / 0.9) / 2)
    assert st["best_static"]["setting"] == max(rel, key=rel.get)
    assert st["original"]["setting"] == 128
    assert st["original"]["relative"] == pytest.approx((30 / 76 + 0.5 / 0.9) / 2)
    assert st["best_static"]["se"] > 0


def test_app_config_objective_is_the_application_figure_and_reaches_4_kib(tmp_path):
    s = load_settings(rr.APP_CONFIG)
    spec = s.parameters["read_ahead_kb"]
    assert [int(v) for v in spec.values] == rr.LADDER
    assert spec.values[0] == "4" and spec.values[-1] == "4096"
    assert s.reward.pis == [rr.PI_NAME]
    collectors = [c.name for c in s.monitor.collectors]
    assert "command" in collectors
    # the workload's signature is the application's request size, which read_ahead_kb
    # does not move (the blockdev PIs, which it does, would split one workload in two)
    assert s.engine.use_context and s.engine.context_pis == [rr.SIGNATURE_PI]
    command = next(c for c in s.monitor.collectors if c.name == "command")
    assert rr.SIGNATURE_PI in command.options["names"]

    class Dev:
        name = "loop7"
    path = rr.stack_config(tmp_path, Dev(), tmp_path / "app")
    text = path.read_text()
    assert "/sys/block/loop7/queue/read_ahead_kb" in text and str(tmp_path / "app") in text
    assert '"sda"' not in text
    load_settings(path)



@pytest.mark.slow
def test_a_session_starting_away_from_the_default_starts_where_the_knob_is(tmp_path):
    """The whole stack as the real bench starts it (the shipped config, its keys), on a
    file-backed read_ahead_kb found at 512 where the config's default is 128: the knob
    never reads 128 in the first 12 s; it holds 512 while the anchor is measured and
    then moves one rung at a time (found live: 512 -> 128 at t = 4 s, because the
    daemon never took the control agent's hello and the guide credited the session's
    first ticks to the default), and the original comes back at the end."""
    import re
    import time

    from capes.experiments.process_group import ProcessGroup
    knob, app = tmp_path / "read_ahead_kb", tmp_path / "app"
    knob.write_text("512\n")
    app.write_text(f"{rr.PI_NAME} 60000000\n{rr.SIGNATURE_PI} 4\n")
    text = re.sub(r'^\s*\{ name = "blockdev".*\n', "", rr.APP_CONFIG.read_text(), flags=re.M)
    config = tmp_path / "stack.toml"
    config.write_text(text.replace("/sys/block/sda/queue/read_ahead_kb", str(knob))
                      .replace("/run/capes/app-throughput", str(app)))
    assert load_settings(config).parameters["read_ahead_kb"].default == 5   # "128"
    sets = rr.stack_sets(tmp_path, [f'control.state_file="{tmp_path / "ctl-{node}.json"}"'])
    rr.stack_keys(tmp_path / "keys", load_settings(config, sets))
    cfg = ["--config", str(config)] + [a for s in sets for a in ("--set", s)]
    stack = ProcessGroup(tmp_path)
    seen: list[int] = []
    try:
        stack.start("interface-daemon", "interface-daemon", *cfg, "--ready-file", "ready")
        stack.start("monitor-agent", "monitor-agent", *cfg, "--set", "keys.client=monitor")
        stack.start("control-agent", "control-agent", *cfg, "--set", "keys.client=control")
        rr.start_tuner(stack, "capes", cfg, 7, tmp_path, tmp_path / "engine.json")
        end = time.monotonic() + 12
        while time.monotonic() < end:
            stack.check_alive()
            seen.append(int(knob.read_text()))
            time.sleep(0.25)
        acted = json.loads((tmp_path / "engine.json").read_text())
    finally:
        codes = stack.stop(first=("tuner",))
    assert 128 not in seen, seen
    assert set(seen) <= {256, 512, 1024}, seen          # one rung from where it started
    assert seen[:20] == [512] * 20, seen                  # the anchor is measured first
    assert acted["action_ticks"] >= 4, acted              # the engine did act meanwhile
    assert codes == dict.fromkeys(codes, 0), codes
    assert knob.read_text().strip() == "512"              # the original, restored


def test_worst_window():
    x = [10] * 20 + [1] * 10 + [10] * 20
    assert rr.worst_window(x) == pytest.approx(1)
    assert math.isnan(rr.worst_window([1, 2]))


def test_a_1_s_monitor_re_reads_a_figure_not_renewed_and_fresh_only_hears_it_once():
    # fio seconds published at 1.1 and 2.1 s into each 2.7 s segment (a reopen between)
    series = []
    for seg in range(40):
        for k, at in enumerate((1.1, 2.1)):
            series.append([seg * 2.7 + at, 100.0 + (seg * 2 + k) % 7, 128, 0, 16.0])
    ticks = rr.as_ticks(series, 0.5)
    assert len(ticks["p"]) == int(series[-1][0] - series[0][0] - 0.5) + 1
    repeats = int(np.sum(np.diff(ticks["p"]) == 0))
    assert repeats >= len(ticks["p"]) // 4          # the reopen gaps: figures read twice
    heard = []

    class Spy:
        def __init__(self, config=None):
            pass

        def update(self, p, key):
            heard.append(p)
            return False
    import drl_engine.change_detection as cd
    real = cd.SettingResidualDetector
    cd.SettingResidualDetector = Spy
    try:
        rr.replay_detector(ticks)
        everything = len(heard)
        heard.clear()
        rr.replay_detector(ticks, fresh_only=True)
    finally:
        cd.SettingResidualDetector = real
    late = sum(ticks["p"][i] == ticks["p"][i - 1] for i in range(3, len(ticks["p"])))
    assert len(heard) == everything - late         # (the first 3 s are never heard)


# ------------------------------------------------------------------ real (root, slow)

def _need(backing: str) -> None:
    why = rr.missing_requirements(backing)
    if why:
        pytest.skip(why)


def _leftovers() -> tuple[str, str]:
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    mounts = Path("/proc/mounts").read_text()
    return loops, mounts


@pytest.mark.slow
def test_seekdisk_charges_seeks_and_is_removed(tmp_path):
    """Random 4 KiB reads pay the seek (≈ 4 ms each, < 250 IOPS at most); sequential
    reads stream far faster; everything is gone afterwards."""
    _need("seekdisk")
    spec = rr.DeviceSpec(backing="seekdisk", size_gib=0.25, memory_mib=0, original=4)
    dev = rr.ReadaheadDevice(spec, tmp_path)
    with dev:
        name, mount = dev.dev, dev.mount
        assert os.path.ismount(mount) and dev.read_ahead() == 4
        runner = rr.SessionRunner(dev, tmp_path / "fio", 3)
        rand = np.mean(runner.segment("mmaprand", 3))
        dev.set_read_ahead(1024)
        seq = np.mean(runner.segment("seqread", 3))
    assert rand / 4096 < 260            # IOPS: each random read pays the seek
    assert seq > 20 * rand
    loops, mounts = _leftovers()
    assert name not in loops and str(mount) not in mounts
    assert not list(Path("/dev/shm").glob(f"capes-real-*{os.getpid()}*"))


@pytest.mark.slow
def test_alternating_bench_small_seeded_run_meets_the_contract(tmp_path):
    """Two 15 s phases, a 2-value grid, CAPES and the hill climber live through the
    stack: the JSON contract, nothing outside the safe range, the original back."""
    _need("seekdisk")
    out = tmp_path / "alt.json"
    before = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    mounts = Path("/proc/mounts").read_text().count("capes-real")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_real_alternating.py"),
         "--phases", "2", "--phase-s", "15", "--grid", "4,4096", "--grid-reps", "1",
         "--grid-duration", "4", "--tuners", "capes,hill", "--size-gib", "1",
         "--seed", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["best_static"]) >= {"setting", "relative"}
    for name in ("capes", "hill"):
        t = res["tuners"][name]
        assert {"relative", "diff_vs_best_static", "ci95"} <= set(t)
        assert t["restored"] is True
        assert t["outside_safe_range"] == 0
        assert 4 <= t["applied_min"] <= t["applied_max"] <= 4096
        assert len(t["phases"]) == 2
    after = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert after == before                      # its loop device is gone
    assert Path("/proc/mounts").read_text().count("capes-real") <= mounts   # its FUSE too


def test_live_tuner_reaches_a_wanted_setting_by_moves_the_daemon_accepts():
    """A search tuner names the setting it wants; the daemon only takes moves (of at most
    8 steps) whose values are the move: the jump 128 → 4096 KiB on the ladder (index 5
    → 10) goes as one move of +5, the jump 10 → 0 as -8 then -2."""
    from capes.common import actions
    from capes.common.params import ParameterSpec
    from capes.experiments.live_tuner import TunerSource
    from drl_engine.decision import Decision

    class Client:
        def __init__(self):
            self.sent = []

        def submit_action(self, tick, action, values):
            self.sent.append((action, dict(values)))
            return {"values": dict(values)}

    class Layout:
        param_names = ("read_ahead_kb",)

    class Tuner:
        class reader:
            layout = Layout()

    spec = ParameterSpec(values=[str(v) for v in rr.LADDER], default="128")
    spec.validate()
    client = Client()
    src = TunerSource(client, Tuner(), [spec])
    src.current = [5.0]
    src.apply(Decision(1, 0, [10.0], 1.0, True, None))
    assert client.sent == [(actions.encode(0, 5, 1), {"read_ahead_kb": 10.0})]
    for tick in (2, 3, 4):
        src.apply(Decision(tick, 0, [0.0], 1.0, True, None))
    assert [a for a, _ in client.sent[1:]] == [actions.encode(0, -8, 1),
                                                actions.encode(0, -2, 1)]
    assert src.current == [0.0]                 # there: nothing more is sent
    assert all(actions.valid(a, 1) for a, _ in client.sent)
