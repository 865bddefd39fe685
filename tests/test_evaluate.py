"""`capes evaluate`: the statistics on synthetic series with known answers, the
comparison loop with file knobs and a synthetic workload, the fio workload driver, and
(slow, root) a real loop device on which read_ahead_kb 0 and 4096 must differ."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

scipy = pytest.importorskip("scipy")

from capes.common.deployment import load_deployment  # noqa: E402
from capes.common.params import ParameterSpec  # noqa: E402
from capes.experiments import evaluate as ev  # noqa: E402
from capes.experiments import workload_driver as wd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HAVE_FIO = shutil.which("fio") is not None
HAVE_CATEGORICAL = "values" in ParameterSpec.__dataclass_fields__


def ar1(n, phi, mean=100.0, sd=10.0, rng=None):
    """AR(1) series with the given mean, lag-1 autocorrelation phi and marginal sd."""
    rng = rng or np.random.default_rng(0)
    e = rng.normal(0, sd * math.sqrt(1 - phi * phi), n)
    x = np.empty(n)
    x[0] = rng.normal(0, sd)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + e[t]
    return mean + x


# ------------------------------------------------------------------------- statistics

def test_acf_of_ar1_matches_phi_powers():
    x = ar1(20000, 0.6, rng=np.random.default_rng(1))
    r = ev.acf(x, 3)
    assert r[0] == 1.0
    assert r[1] == pytest.approx(0.6, abs=0.03)
    assert r[2] == pytest.approx(0.36, abs=0.03)
    assert r[3] == pytest.approx(0.216, abs=0.03)
    assert abs(ev.acf(np.random.default_rng(2).normal(size=5000), 1)[1]) < 0.05
    assert list(ev.acf([3, 3, 3, 3], 2)) == [1.0, 0.0, 0.0]
    assert math.isnan(ev.acf([1.0, 2.0], 3)[2])


def test_pooled_lag1_acf_centres_each_repetition():
    # two white-noise repetitions at very different levels: pooled ACF stays near 0,
    # while concatenating them would look strongly autocorrelated
    rng = np.random.default_rng(3)
    a, b = rng.normal(0, 1, 500), rng.normal(100, 1, 500)
    assert abs(ev.pooled_lag1_acf([a, b])) < 0.1
    assert ev.acf(np.concatenate([a, b]), 1)[1] > 0.9
    assert math.isnan(ev.pooled_lag1_acf([[1.0]]))


def test_mser_finds_a_warmup_ramp_and_little_in_stationary_data():
    rng = np.random.default_rng(4)
    ramp = 100 * (1 - np.exp(-np.arange(15) / 3.0))       # 15 s climbing towards 100
    x = np.concatenate([ramp, 100 + rng.normal(0, 3, 45)])
    d = ev.detect_warmup(x)
    assert 8 <= d <= 20
    assert abs(x[d:].mean() - 100) < 2
    # stationary: whatever it drops, the mean of the rest stays unbiased
    drops = []
    for seed in range(200):
        y = ar1(60, 0.3, rng=np.random.default_rng(100 + seed))
        drops.append(ev.detect_warmup(y))
    assert max(drops) <= 30            # never more than half
    assert np.median(drops) <= 10
    assert ev.detect_warmup([1.0, 2.0, 3.0]) == 0


def test_batch_means_drop_the_leading_remainder():
    assert list(ev.batch_means(np.arange(7.0), 3)) == [2.0, 5.0]
    assert ev.batch_means([1.0], 2).size == 0


def test_subsession_size_grows_with_autocorrelation():
    rng = np.random.default_rng(5)
    white = [rng.normal(size=300) for _ in range(3)]
    assert ev.subsession_size(white)[0] == 1
    corr = [ar1(300, 0.9, rng=np.random.default_rng(10 + i)) for i in range(3)]
    size, r = ev.subsession_size(corr)
    assert size is not None and size >= 5 and abs(r) <= 0.1
    # too short to decorrelate: no size qualifies
    assert ev.subsession_size([ar1(20, 0.95)])[0] is None


def test_subsession_samples_give_honest_ci_coverage_on_ar1():
    """AR(1) with phi 0.8 and known mean 50: per-second samples taken as independent
    give a far too narrow CI; the subsession samples cover the mean ~95 % of the time."""
    naive = honest = 0
    trials = 200
    for seed in range(trials):
        reps = [ar1(120, 0.8, mean=50, sd=5, rng=np.random.default_rng(1000 + seed * 7 + i))
                for i in range(4)]
        ci_naive = ev.mean_ci(np.concatenate(reps))
        naive += ci_naive.low <= 50 <= ci_naive.high
        s = ev.independent_samples(reps)
        ci = ev.mean_ci(s.values)
        honest += ci.low <= 50 <= ci.high
    assert naive / trials < 0.85
    assert honest / trials >= 0.90


def test_disagreeing_repetitions_fall_back_to_repetition_means():
    rng = np.random.default_rng(6)
    reps = [level + rng.normal(0, 1, 60) for level in (100, 110, 95, 105)]
    s = ev.independent_samples(reps)
    assert s.unit == "repetition" and s.anova_p < 0.05
    assert s.values == pytest.approx([r.mean() for r in reps])
    agreeing = [100 + rng.normal(0, 1, 60) for _ in range(4)]
    s2 = ev.independent_samples(agreeing)
    assert s2.unit == "subsession" and s2.values.size >= 4 * 12


def test_mean_ci_is_the_student_t_interval():
    x = np.array([9.0, 10.0, 11.0, 10.0, 10.0])
    ci = ev.mean_ci(x)
    half = scipy.stats.t.ppf(0.975, 4) * x.std(ddof=1) / math.sqrt(5)
    assert ci.mean == 10.0 and ci.low == pytest.approx(10 - half)
    assert ci.rel_half_width == pytest.approx(half / 10)
    assert math.isnan(ev.mean_ci([1.0]).low)
    assert ev.mean_ci([2.0, 2.0]).low == 2.0


def test_fieller_relative_difference_covers_the_true_ratio():
    rng = np.random.default_rng(7)
    hits = 0
    trials = 1000
    for _ in range(trials):
        a = rng.normal(100, 15, 8)
        b = rng.normal(120, 30, 12)
        c = ev.relative_difference(a, b)
        hits += c.rel_low <= 0.2 <= c.rel_high
    assert 0.93 <= hits / trials <= 0.97


def test_relative_difference_point_p_value_and_unbounded_case():
    a = np.array([100.0, 102, 98, 101, 99])
    b = np.array([110.0, 111, 109, 112, 108])
    c = ev.relative_difference(a, b)
    assert c.rel == pytest.approx(0.10)
    assert c.rel_low < 0.10 < c.rel_high and c.rel_low > 0 and c.significant
    assert c.p_welch == pytest.approx(scipy.stats.ttest_ind(b, a, equal_var=False).pvalue)
    assert c.diff_low < 10 < c.diff_high
    # a baseline mean indistinguishable from zero: Fieller's set is unbounded
    z = ev.relative_difference(np.array([-1.0, 1.0, 0.5, -0.4]), b)
    assert z.rel_low == -math.inf and not z.significant
    same = ev.relative_difference(a, a + 0.0)
    assert same.rel == 0 and not same.significant and same.p_welch == pytest.approx(1.0)


def test_required_samples_known_answer():
    # t_{n-1} * 10 / sqrt(n) <= 5: n = 17 gives 5.14, n = 18 gives 4.97
    assert ev.required_samples(10, 100, 0.05) == 18
    assert ev.required_samples(0, 100, 0.05) == 2
    n = ev.required_samples(30, 100, 0.01)
    q = scipy.stats.t.ppf(0.975, [n - 2, n - 1])
    assert q[1] * 30 / math.sqrt(n) <= 1 < q[0] * 30 / math.sqrt(n - 1)


def test_required_repetitions_for_ratio_shrinks_the_half_width():
    rng = np.random.default_rng(8)
    a, b = rng.normal(100, 10, 10), rng.normal(110, 10, 10)
    reps = ev.required_repetitions_for_ratio(a, b, 2, 2, 0.02)
    assert reps > 5
    more = ev.required_repetitions_for_ratio(a, b, 2, 2, 0.01)
    assert more > 3 * reps            # a quarter of the variance: ~4x the repetitions


def test_interleaved_order_runs_every_config_once_per_round():
    order = ev.interleaved_order(3, 4, np.random.default_rng(9))
    assert len(order) == 12
    rounds = [order[i:i + 3] for i in range(0, 12, 3)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1          # randomised


def test_analyse_reports_warmup_ci_and_comparison():
    rng = np.random.default_rng(10)

    def rep(level):
        warm = level * (1 - np.exp(-np.arange(6) / 2.0))
        return np.concatenate([warm, ar1(40, 0.5, mean=level, sd=level * 0.03, rng=rng)])
    report = ev.analyse(["base", "fast"], [[rep(100) for _ in range(4)],
                                           [rep(130) for _ in range(4)]], precision=0.01)
    base, fast = report["configs"]
    assert 3 <= base["warmup_s"] <= 15
    assert base["ci_low"] < 100 < base["ci_high"]
    assert fast["ci_low"] < 130 < fast["ci_high"]
    cmp_ = report["comparisons"][0]
    assert cmp_["rel_ci_low"] < 0.3 < cmp_["rel_ci_high"] and cmp_["significant"]
    assert cmp_["p_welch"] < 1e-6
    assert base["more_reps"] >= 0 and base["reps_needed"] >= 4


def test_a_fixed_warmup_overrides_mser():
    rng = np.random.default_rng(12)
    burst = [np.concatenate([[900.0, 800.0], 100 + rng.normal(0, 2, 20)]) for _ in range(3)]
    auto = ev.analyse_config(burst)
    kept = ev.analyse_config(burst, warmup=0)
    assert auto["warmup_s"] >= 2 and auto["mean"] == pytest.approx(100, abs=3)
    assert kept["warmup_s"] == 0 and kept["mean"] > 150


def test_config_set_parsing():
    assert ev.ConfigSet.parse("original").values is None
    cs = ev.ConfigSet.parse("read_ahead_kb=4096, nr_requests=64")
    assert cs.values == {"read_ahead_kb": 4096.0, "nr_requests": 64.0}
    assert cs.label == "read_ahead_kb=4096,nr_requests=64"
    assert ev.ConfigSet.parse("scheduler=bfq").values == {"scheduler": "bfq"}
    for bad in ("", "read_ahead_kb", "=3", "x="):
        with pytest.raises(ValueError):
            ev.ConfigSet.parse(bad)


# ------------------------------------------------------------------------- the loop

def deployment(tmp_path, knobs: dict[str, tuple[str, int, int, int]]):
    """A deployment TOML with a file applier per knob: name -> (path, min, max, step)."""
    lines = ["tick_seconds = 1.0", "[control]", "dry_run = false"]
    for name, (path, lo, hi, step) in knobs.items():
        lines += [f"[control.appliers.{name}]", 'name = "file"',
                  f'options = {{ path = "{path}" }}']
    for name, (path, lo, hi, step) in knobs.items():
        lines += [f"[parameters.{name}]", f"min = {lo}", f"max = {hi}", f"step = {step}",
                  f"default = {lo}"]
    p = tmp_path / "deploy.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


class SyntheticWorkload:
    """Throughput rises with the knob in ``path`` (100 + value / 40), AR(1) noise, a
    3-second warm-up; records the knob seen by each repetition."""

    def __init__(self, path, seconds=40, stop_after=None):
        self.path, self.seconds, self.rng = path, seconds, np.random.default_rng(11)
        self.seen = []
        self.stop_after = stop_after

    def __call__(self, stop=None):
        v = float(Path(self.path).read_text())
        self.seen.append(v)
        if self.stop_after is not None and len(self.seen) >= self.stop_after:
            stop.set()
        level = 100 + v / 40
        x = ar1(self.seconds, 0.5, mean=level, sd=2, rng=self.rng)
        x[:3] *= [0.3, 0.6, 0.9]
        return x


def test_evaluate_compares_interleaves_and_restores(tmp_path):
    knob = tmp_path / "read_ahead_kb"
    knob.write_text("2560\n")
    cfg = load_deployment(deployment(tmp_path, {"read_ahead_kb": (knob, 0, 4096, 128)}))
    configs = [ev.ConfigSet.parse(s) for s in ("original", "read_ahead_kb=0",
                                               "read_ahead_kb=4096")]
    knobs = ev.Knobs(cfg, ["read_ahead_kb"])
    work = SyntheticWorkload(knob)
    report = ev.evaluate(knobs, configs, work, repetitions=3, seed=1)
    assert knob.read_text().strip() == "2560" and report["restored"]
    assert report["original"] == {"read_ahead_kb": 2560.0}
    assert sorted(work.seen) == [0] * 3 + [2560] * 3 + [4096] * 3
    assert all(sorted(work.seen[i:i + 3]) == [0, 2560, 4096] for i in (0, 3, 6))
    names = [c["name"] for c in report["configs"]]
    assert names == ["original", "read_ahead_kb=0", "read_ahead_kb=4096"]
    low, high = report["comparisons"]
    assert low["rel_ci_high"] < 0 and high["rel_ci_low"] > 0
    assert report["configs"][0]["warmup_s"] >= 2
    text = ev.format_report(report)
    assert "original (read_ahead_kb=2560)" in text and "restored" in text
    doc = json.loads(json.dumps(ev.jsonable(report), allow_nan=False))   # strict JSON
    assert doc["comparisons"][0]["significant"] is True


def test_evaluate_refuses_out_of_range_values_before_changing_anything(tmp_path):
    knob = tmp_path / "k"
    knob.write_text("8192\n")                  # the host's value may lie outside the range
    cfg = load_deployment(deployment(tmp_path, {"k": (knob, 0, 4096, 128)}))
    knobs = ev.Knobs(cfg, ["k"])
    with pytest.raises(ValueError, match="outside"):
        ev.evaluate(knobs, [ev.ConfigSet.parse("original"), ev.ConfigSet.parse("k=5000")],
                    SyntheticWorkload(knob), 1)
    assert knob.read_text() == "8192\n"
    report = ev.evaluate(knobs, [ev.ConfigSet.parse("original"), ev.ConfigSet.parse("k=128")],
                         SyntheticWorkload(knob, seconds=10), 1)
    assert knob.read_text().strip() == "8192" and report["restored"]
    with pytest.raises(ValueError, match="not a parameter"):
        ev.Knobs(cfg, ["nope"])


def test_evaluate_restores_after_a_stop_and_after_an_error(tmp_path):
    knob = tmp_path / "k"
    knob.write_text("256\n")
    cfg = load_deployment(deployment(tmp_path, {"k": (knob, 0, 4096, 128)}))
    configs = [ev.ConfigSet.parse("original"), ev.ConfigSet.parse("k=4096")]

    class Stop:
        flag = False

        def set(self):
            self.flag = True

        def is_set(self):
            return self.flag

        def wait(self, t):
            return self.flag
    stop = Stop()
    report = ev.evaluate(ev.Knobs(cfg, ["k"]), configs,
                         SyntheticWorkload(knob, stop_after=3), 5, seed=0, stop=stop)
    assert report["interrupted"] and report["restored"] and len(report["runs"]) == 2
    assert knob.read_text().strip() == "256"

    def broken(stop=None):
        raise OSError("device vanished")
    with pytest.raises(OSError):
        ev.evaluate(ev.Knobs(cfg, ["k"]), configs, broken, 2)
    assert knob.read_text().strip() == "256"


@pytest.mark.skipif(not HAVE_CATEGORICAL, reason="categorical parameters not available")
def test_evaluate_sets_and_restores_a_categorical_knob(tmp_path):
    knob = tmp_path / "scheduler"
    knob.write_text("[mq-deadline] none kyber bfq\n")
    toml = tmp_path / "cat.toml"
    toml.write_text(f"""[control.appliers.scheduler]
name = "file"
options = {{ path = "{knob}" }}
[parameters.scheduler]
values = ["none", "mq-deadline", "kyber", "bfq"]
default = "mq-deadline"
""")
    cfg = load_deployment(toml)
    seen = []

    def work(stop=None):
        seen.append(knob.read_text().split()[0])
        return ar1(10, 0.3, rng=np.random.default_rng(len(seen)))
    report = ev.evaluate(ev.Knobs(cfg, ["scheduler"]),
                         [ev.ConfigSet.parse("original"), ev.ConfigSet.parse("scheduler=bfq")],
                         work, 2, seed=0)
    assert report["original"] == {"scheduler": "mq-deadline"}
    assert sorted(seen) == ["bfq", "bfq", "mq-deadline", "mq-deadline"]
    assert knob.read_text().split()[0] == "mq-deadline" and report["restored"]
    with pytest.raises(ValueError, match="one of"):
        ev.Knobs(cfg, ["scheduler"]).check(ev.ConfigSet.parse("scheduler=cfq"))


def test_plot_is_written(tmp_path):
    knob = tmp_path / "k"
    knob.write_text("128\n")
    cfg = load_deployment(deployment(tmp_path, {"k": (knob, 0, 4096, 128)}))
    report = ev.evaluate(ev.Knobs(cfg, ["k"]), [ev.ConfigSet.parse("original"),
                                                ev.ConfigSet.parse("k=4096")],
                         SyntheticWorkload(knob, seconds=15), 2, seed=0)
    report.update(unit="bytes/s", metric="synthetic", title="synthetic")
    ev.plot_report(report, tmp_path / "e.png")
    assert (tmp_path / "e.png").stat().st_size > 10_000


# ------------------------------------------------------------------------- fio driver

def test_bw_log_parsing_sums_jobs_and_directions(tmp_path):
    (tmp_path / "fio_bw.1.log").write_text("1000, 100, 0, 0, 0\n1000, 50, 1, 0, 0\n"
                                           "2001, 200, 0, 0, 0\n3000, 7, 0, 0, 0\n")
    (tmp_path / "fio_bw.2.log").write_text("999, 10, 0, 0, 0\n2000, 20, 0, 0, 0\n")
    logs = sorted(tmp_path.glob("fio_bw.*.log"))
    assert list(wd.per_second_bandwidth(logs)) == [160 * 1024, 220 * 1024]
    assert list(wd.per_second_bandwidth(logs, "write")) == [50 * 1024]
    assert wd.per_second_bandwidth([]).size == 0


def test_schedule_parsing_and_workload_files():
    assert wd.parse_schedule("seqread:60, randread:30.5") == [("seqread", 60.0),
                                                              ("randread", 30.5)]
    for bad in ("", "seqread", "seqread:x", "seqread:0", ":5"):
        with pytest.raises(ValueError):
            wd.parse_schedule(bad)
    assert {"seqread", "randread", "seqwrite", "randrw19", "smallfiles"} <= \
        set(wd.available_workloads())
    with pytest.raises(wd.WorkloadError):
        wd.resolve_workload("no-such-workload")
    env = wd.fio_env("/tmp/x.dat", runtime=7.4, base={})
    assert env == {"CAPES_TARGET": "/tmp/x.dat", "CAPES_DIR": "/tmp", "CAPES_SIZE": "1g",
                   "CAPES_RUNTIME": "7"}


@pytest.mark.skipif(not HAVE_FIO, reason="fio is not installed")
def test_fio_runs_the_job_files_and_reports_per_second_bandwidth(tmp_path):
    target = tmp_path / "data"
    switches = []
    results = wd.play(wd.parse_schedule("seqread:2,seqwrite:2"), str(target), size="16m",
                      on_switch=lambda name, i: switches.append(name))
    assert switches == ["seqread", "seqwrite"]
    (_, r1), (_, r2) = results
    assert r1.bandwidth.size >= 1 and r1.bandwidth.min() > 0
    assert r1.total_bw("read") > 0 and r2.total_bw("write") > 0 and r2.total_bw("read") == 0
    d = tmp_path / "files"
    d.mkdir()
    small = tmp_path / "small.fio"           # the job file with fewer files: quicker layout
    small.write_text((wd.WORKLOAD_DIR / "smallfiles.fio").read_text()
                     .replace("nrfiles=1000", "nrfiles=20"))
    res = wd.run_fio(small, wd.fio_env(directory=str(d), runtime=1))
    assert res.total_bw() > 0


@pytest.mark.skipif(not HAVE_FIO, reason="fio is not installed")
def test_fio_is_stopped_by_pid(tmp_path):
    from capes.common.stop_signal import StopSignal
    env = wd.fio_env(str(tmp_path / "d"), runtime=60, size="8m")
    run = wd.FioRun("seqread", env, tmp_path / "logs").start()
    time.sleep(2.5)
    t0 = time.monotonic()
    run.stop()
    assert time.monotonic() - t0 < 10 and not run.running()
    res = run.result()
    assert res.stopped and res.bandwidth.size >= 1
    with StopSignal() as stop:
        stop.set()
        res = wd.run_fio("seqread", env, stop=stop)
    assert res.stopped


class CountingCollector:
    """A stand-in for a [monitor] collector: its PI is the number of calls so far."""
    name = "fake"

    def __init__(self):
        self.calls = []

    def names(self):
        return ["fake.calls"]

    def collect(self):
        self.calls.append(time.monotonic())
        return {"fake.calls": float(len(self.calls))}


@pytest.mark.skipif(not HAVE_FIO, reason="fio is not installed")
def test_fio_meter_samples_a_collector_pi_every_second(tmp_path):
    col = CountingCollector()
    meter = ev.FioMeter("seqread", 3, str(tmp_path / "d"), size="8m", pi="fake.calls",
                        collectors=[col])
    x = meter()
    assert 2 <= x.size <= 4 and list(x) == list(range(2, x.size + 2))   # primed once
    gaps = np.diff(col.calls[1:])
    assert np.all(np.abs(gaps - 1.0) < 0.3)
    with pytest.raises(ValueError, match="no collector"):
        ev.FioMeter("seqread", 3, str(tmp_path / "d"), pi="nope", collectors=[col])


@pytest.mark.skipif(not HAVE_FIO, reason="fio is not installed")
def test_capes_evaluate_restores_on_sigterm(tmp_path):
    knob = tmp_path / "knob"
    knob.write_text("384\n")
    toml = deployment(tmp_path, {"k": (knob, 0, 4096, 128)})
    cmd = [sys.executable, "-m", "capes", "evaluate", "--config", str(toml),
           "--workload", "seqread", "--target", str(tmp_path / "data"), "--size", "8m",
           "--config-set", "original", "--config-set", "k=4096",
           "--repetitions", "3", "--duration", "30"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(tmp_path.glob("data")):
        time.sleep(0.2)
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert knob.read_text().strip() == "384"
    assert "original values restored" in out


# ------------------------------------------------------------------------- real device

def _loop_reason() -> str | None:
    why = wd.missing_on_host("losetup, /sys/block/*/queue/read_ahead_kb", ("losetup", "fio"))
    if why:
        return why
    if not os.path.exists("/dev/loop-control"):
        return "no loop device support (/dev/loop-control)"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_loop_reason() is not None, reason=str(_loop_reason()))
def test_evaluate_separates_readahead_0_from_4096_on_a_loop_device(tmp_path):
    """A sparse 2 GiB file behind a loop device with direct I/O (no page cache of the
    backing file), capped at 300 read IOPS by a throttled cgroup where the kernel has
    one (a loop device over a sparse file is CPU-bound and noisy on a busy host; with a
    cap, each request costs a fixed time, like on a real disk) and 20 MB/s (uncapped,
    4096 gave 172, 189 and 44 MB/s at load 8, too wide a CI for 3 reps). fio's buffered
    sequential 16 KiB reads with invalidate=1, caches dropped before each repetition:
    4096 KiB of readahead must beat none, with a relative-difference CI that excludes
    zero. ~50 s."""
    back = tmp_path / "disk.img"
    with open(back, "wb") as fh:
        fh.truncate(2 << 30)
    dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(back)],
                         capture_output=True, text=True, check=True).stdout.strip()
    name = os.path.basename(dev)
    ra = Path(f"/sys/block/{name}/queue/read_ahead_kb")
    before = ra.read_text()
    cgroup = None
    try:
        try:
            cgroup = wd.ThrottledCgroup(dev, read_iops=300, read_bps=20_000_000)
        except (wd.WorkloadError, OSError):
            cgroup = None                     # no controller: unthrottled, noisier
        toml = tmp_path / "loop.toml"
        toml.write_text(f"""tick_seconds = 1.0
[control.appliers.read_ahead_kb]
name = "file"
options = {{ path = "{ra}" }}
[parameters.read_ahead_kb]
min = 0
max = 4096
step = 128
default = 128
""")
        out = tmp_path / "eval.json"
        cmd = [sys.executable, "-m", "capes", "evaluate", "--config", str(toml),
               "--workload", "seqread", "--target", dev, "--drop-caches",
               "--config-set", "read_ahead_kb=0", "--config-set", "read_ahead_kb=4096",
               "--repetitions", "3", "--duration", "6", "--seed", "1",
               "--json", str(out), "--plot", str(tmp_path / "eval.png")]
        if cgroup is not None:
            cmd += ["--cgroup", cgroup.path]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        report = json.loads(out.read_text())
        cmp_ = report["comparisons"][0]
        assert cmp_["rel_ci_low"] > 0, res.stdout
        assert cmp_["p_welch"] < 0.05
        assert ra.read_text() == before and report["restored"]
        assert (tmp_path / "eval.png").exists()
    finally:
        ra.write_text(before)
        subprocess.run(["losetup", "-d", dev], check=False)
        if cgroup is not None:
            cgroup.remove()


def test_config_set_from_an_engine_status_file(tmp_path):
    """``best:PATH``: the best-known setting the engine wrote to its status file (a
    checkpoint does not store it); refused, with the reason, when there is none."""
    status = tmp_path / "engine.json"
    status.write_text(json.dumps({"tick": 99, "values": {"read_ahead_kb": 512.0},
                                  "best": {"read_ahead_kb": 3840.0, "nr_requests": 64}}))
    cs = ev.ConfigSet.parse(f"best:{status}")
    assert cs.values == {"read_ahead_kb": 3840.0, "nr_requests": 64.0}
    assert cs.label == "best(read_ahead_kb=3840,nr_requests=64)"
    for doc in ({"best": None}, {"best": {}}, {"best": {"x": "fast"}}, {"best": {"x": True}},
                [1, 2], {"values": {"x": 1}}):
        status.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="no best-known setting"):
            ev.ConfigSet.parse(f"best:{status}")
    status.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable engine status file"):
        ev.ConfigSet.parse(f"best:{status}")
    with pytest.raises(ValueError, match="not a readable"):
        ev.ConfigSet.parse(f"best:{tmp_path / 'missing.json'}")
    with pytest.raises(ValueError, match="give the engine's status file"):
        ev.ConfigSet.parse("best:")
