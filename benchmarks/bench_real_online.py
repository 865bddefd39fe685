"""CAPES online on a real target: throughput during tuning (exploration included), the
worst 10 seconds, and the best-known setting judged afterwards by `capes evaluate`.

The whole stack runs as real processes on loopback (CURVE keys in a temp dir): the
interface daemon, a monitoring agent, a control agent and the DRL engine with the
``default`` preset, on ``configs/linux-readahead.toml`` pointed at a loop device (its
``sda`` replaced by the device; everything it writes redirected to a temp dir). The
loop device (direct I/O, over a sparse file by default, so the host's disk is not the
bottleneck) is capped at ``--read-iops`` read requests per second by a throttled
cgroup: a slow device whose every request costs the same, where the request size, and
so readahead, decides throughput (docs/evaluate.md: 128 KiB gives ~26 MB/s, the
device's ~1.2 MiB requests ~120 MB/s at 100 IOPS).

The workload is ``configs/workloads/seqread.fio`` (16 KiB sequential buffered reads)
in the cgroup, run back to back in segments of ``--segment`` seconds: a readahead
change reaches a reader only when it opens the device, so every segment reopens it.
fio's per-second bandwidth is recorded throughout, with the device's read_ahead_kb at
that second.

1. **original, before**: ``--baseline`` seconds with the device's own read_ahead_kb;
2. **tuning**: the stack starts and tunes for ``--tuning`` seconds (ε anneals from 1 to
   0.05 over ``--exploration-ticks``); the control agent never applies a value outside
   the config's safe range (read_ahead_kb 128…4096);
3. the engine's best-known setting is read from its status file, the stack is stopped
   (the control agent puts the original back; checked);
4. **after**: ``capes evaluate``'s machinery compares the original with the best-known
   setting: ``--eval-reps`` randomised interleaved repetitions of ``--eval-duration``
   seconds each, 95 % CIs, Welch's p.

Prints the table: mean throughput of each phase against the original, the worst
10-second window during tuning against the original, the read_ahead_kb values the
engine explored (min/max, the share of seconds below the original), the best-known
setting, and the evaluate table. Root only; the original read_ahead_kb, the loop
device, the cgroup and the temp dir are restored or removed on every exit path
(Ctrl-C included). About 15 minutes with the defaults.

    sudo .venv/bin/python benchmarks/bench_real_online.py [--tuning 600] \
        [--baseline 60] [--segment 5] [--read-iops 100] [--json OUT] [--plot PNG]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real_blockdev import hardware, table  # noqa: E402

from capes.common.atomic import write_json  # noqa: E402
from capes.common.deployment import load_deployment  # noqa: E402
from capes.common.stop_signal import StopSignal  # noqa: E402
from capes.experiments import evaluate as ev  # noqa: E402
from capes.experiments import workload_driver as wd  # noqa: E402
from capes.experiments.process_group import ProcessGroup  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "linux-readahead.toml"


class Stop(StopSignal):
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def worst_window(x, width: int = 10) -> tuple[float, int]:
    """The lowest mean of ``width`` consecutive samples and where it starts (NaN, -1
    when there are fewer)."""
    x = np.asarray(x, dtype=float)
    if x.size < width:
        return math.nan, -1
    m = np.convolve(x, np.ones(width) / width, mode="valid")
    i = int(np.argmin(m))
    return float(m[i]), i


class Recorder:
    """fio in segments, back to back, until told otherwise; one row per fio second:
    (wall time, bytes/s, read_ahead_kb when the segment opened the device, phase)."""

    def __init__(self, dev: str, cgroup: str | None, segment: float, workdir: Path):
        self.dev, self.cgroup, self.segment = dev, cgroup, segment
        self.ra_file = Path("/sys/block") / Path(dev).name / "queue" / "read_ahead_kb"
        self.workdir = workdir
        self.rows: list[tuple[float, float, int, str]] = []
        self.n = 0

    def read_ahead(self) -> int:
        return int(self.ra_file.read_text().split()[0])

    def run(self, seconds: float, phase: str, stop, tick=None) -> None:
        """Play segments for ``seconds`` (the last one shortened); ``tick()`` between
        segments and about once a second is not needed: fio runs unattended."""
        end = time.monotonic() + seconds
        while not stop.is_set():
            left = end - time.monotonic()
            if left < 2:
                break
            self.n += 1
            ra = self.read_ahead()
            env = wd.fio_env(self.dev, None, min(self.segment, left), "100%")
            t0 = time.time()
            seg_dir = self.workdir / f"seg{self.n}"
            res = wd.run_fio("seqread", env, "read", stop, self.cgroup, workdir=seg_dir)
            shutil.rmtree(seg_dir, ignore_errors=True)
            if stop.is_set():
                break
            for i, bw in enumerate(res.bandwidth):
                self.rows.append((t0 + i + 1, float(bw), ra, phase))
            if tick is not None:
                tick()

    def series(self, phase: str) -> np.ndarray:
        return np.array([r[1] for r in self.rows if r[3] == phase])


class KnobSampler:
    """The knob's value every ``every_s`` seconds on a thread: what the control agent
    applied, including values held too briefly to reach a segment's open."""

    def __init__(self, path: Path, every_s: float = 0.5):
        import threading
        self.path, self.every_s = path, every_s
        self.values: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.values.append(int(self.path.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
            self._stop.wait(self.every_s)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(2)
        return self.values


def stack_config(workdir: Path, dev: str) -> Path:
    """configs/linux-readahead.toml with its device replaced by ours."""
    name = Path(dev).name
    text = CONFIG.read_text().replace('"sda"', f'"{name}"').replace(
        "/sys/block/sda/", f"/sys/block/{name}/").replace("blockdev.sda.",
                                                          f"blockdev.{name}.")
    path = workdir / "online.toml"
    path.write_text(text)
    return path


def start_stack(workdir: Path, config: Path, args) -> tuple[ProcessGroup, Path, dict]:
    from capes.common.curve import generate
    from capes.settings import load_settings
    ports = {k: free_port() for k in ("ingest", "control", "grpc", "metrics")}
    keys = workdir / "keys"
    sets = [f"daemon.ingest=tcp://127.0.0.1:{ports['ingest']}",
            f"daemon.control=tcp://127.0.0.1:{ports['control']}",
            f"daemon.grpc=127.0.0.1:{ports['grpc']}",
            f"daemon.metrics=127.0.0.1:{ports['metrics']}",
            f"monitor.daemon=tcp://127.0.0.1:{ports['ingest']}",
            f"control.daemon=tcp://127.0.0.1:{ports['control']}",
            f'keys.dir="{keys}"', f'daemon.db="{workdir / "replay.db"}"',
            f'control.state_file="{workdir / "control-{node}.json"}"',
            f"engine.exploration_ticks={args.exploration_ticks}"]
    deploy = load_settings(config, sets)
    if deploy.keys.enabled:
        generate(keys, ["monitor", "control", "engine"])
    cfg_args = ["--config", str(config)]
    for s in sets:
        cfg_args += ["--set", s]
    status = workdir / "engine.json"
    stack = ProcessGroup(workdir)
    stack.start("interface-daemon", "interface-daemon", *cfg_args,
                "--ready-file", "daemon.ready")
    stack.start("monitor-agent", "monitor-agent", *cfg_args, "--set", "keys.client=monitor")
    stack.start("control-agent", "control-agent", *cfg_args, "--set", "keys.client=control")
    stack.start("drl-engine", "drl-engine", *cfg_args, "--set", "keys.client=engine",
                "--seed", str(args.seed), "--checkpoint-dir", str(workdir / "checkpoints"),
                "--status-file", str(status), "--log-every", "30", "--metrics", "")
    return stack, status, {"sets": sets, "ports": ports}


def _ci(x) -> list[float] | None:
    """95 % t-interval of the mean of 5 s batch means (a rough guide only: the phase is
    one run, so drift is not in it; the evaluate table is the judge)."""
    if np.size(x) < 10:
        return None
    c = ev.mean_ci(ev.batch_means(x, 5))
    return [c.low, c.high]


def summarise(rec: Recorder, original: int, floor: float, best, eval_report) -> dict:
    base = rec.series("original-before")
    tune = rec.series("tuning")
    tune_ra = np.array([r[2] for r in rec.rows if r[3] == "tuning"])
    ref = float(base.mean()) if base.size else math.nan
    worst, at = worst_window(tune)
    out = {"original_read_ahead_kb": original, "floor": floor,
           "before": {"mean": ref, "seconds": int(base.size),
                      "ci_5s_batches": _ci(base)},
           "tuning": {"mean": float(tune.mean()) if tune.size else math.nan,
                      "seconds": int(tune.size)},
           "worst_10s": {"mean": worst, "start_s": at,
                         "read_ahead_kb": (sorted(set(tune_ra[at:at + 10].tolist()))
                                           if at >= 0 else [])},
           "explored": {"min": int(tune_ra.min()) if tune_ra.size else None,
                        "max": int(tune_ra.max()) if tune_ra.size else None,
                        "distinct": int(np.unique(tune_ra).size),
                        "share_below_original": float((tune_ra < original).mean())
                        if tune_ra.size else math.nan},
           "best": best}
    if tune.size >= 120:
        last = tune[-120:]
        out["tuning_last_120s"] = {"mean": float(last.mean())}
    if eval_report:
        o = next(c for c in eval_report["configs"] if c["name"] == "original")
        out["eval_original_mean"] = o["mean"]
    return out


def online_table(s: dict, args) -> str:
    ref = s["before"]["mean"]
    ev_ref = s.get("eval_original_mean", math.nan)

    def rel(x, r):
        return f"{(x / r - 1) * 100:+.1f}%" if r and math.isfinite(r) and \
            math.isfinite(x) else "-"
    rows = ["| phase | seconds | mean MB/s | vs original (before) | vs original (evaluate) |",
            "|---|---:|---:|---:|---:|",
            f"| original before tuning (read_ahead_kb={s['original_read_ahead_kb']}) | "
            f"{s['before']['seconds']} | {ref / 1e6:.1f} |  | {rel(ref, ev_ref)} |",
            f"| CAPES tuning, exploration included (ε 1 → 0.05 over "
            f"{args.exploration_ticks} ticks) | {s['tuning']['seconds']} | "
            f"{s['tuning']['mean'] / 1e6:.1f} | {rel(s['tuning']['mean'], ref)} | "
            f"{rel(s['tuning']['mean'], ev_ref)} |"]
    if "tuning_last_120s" in s:
        m = s["tuning_last_120s"]["mean"]
        rows.append(f"| last 120 s of tuning | 120 | {m / 1e6:.1f} | {rel(m, ref)} | "
                    f"{rel(m, ev_ref)} |")
    w = s["worst_10s"]
    rows.append(f"| worst 10 s during tuning (read_ahead_kb {w['read_ahead_kb']}) | 10 | "
                f"{w['mean'] / 1e6:.1f} | {rel(w['mean'], ref)} | {rel(w['mean'], ev_ref)} |")
    e = s["explored"]
    a = s.get("applied") or {}
    rows += ["", f"Explored read_ahead_kb: min {e['min']}, max {e['max']}, {e['distinct']} "
             f"distinct values at segment starts (what reached the reader); the knob held "
             f"min {a.get('min')}, max {a.get('max')} (sampled every 0.5 s; safe floor "
             f"{s['floor']:g}); "
             f"{e['share_below_original'] * 100:.0f}% of the tuning seconds below the "
             f"original {s['original_read_ahead_kb']}. Best-known setting at the end: "
             f"{s['best']}."]
    return "\n".join(rows)


def plot(rec: Recorder, path: str, s: dict) -> None:
    from capes.experiments.plots import _pyplot
    plt = _pyplot()
    t0 = rec.rows[0][0] if rec.rows else 0
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for phase, col in (("original-before", "grey"), ("tuning", "tab:blue")):
        pts = [(r[0] - t0, r[1] / 1e6, r[2]) for r in rec.rows if r[3] == phase]
        if pts:
            t, y, ra = zip(*pts)
            a1.plot(t, y, ".", ms=2, color=col, label=phase)
            a2.step(t, ra, where="post", color=col)
    a1.axhline(s["before"]["mean"] / 1e6, color="black", lw=0.8, ls=":",
               label="original (before)")
    a1.set_ylabel("fio read MB/s")
    a1.legend(fontsize=8)
    a2.set_ylabel("read_ahead_kb")
    a2.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tuning", type=float, default=600, help="seconds of online tuning")
    ap.add_argument("--baseline", type=float, default=60,
                    help="seconds of the original setting before the stack starts")
    ap.add_argument("--exploration-ticks", type=int, default=None,
                    help="ε anneals 1 → 0.05 over this many 1 s ticks (default: 2/3 of "
                    "--tuning)")
    ap.add_argument("--segment", type=float, default=5,
                    help="seconds per fio run (each reopens the device)")
    ap.add_argument("--read-iops", type=int, default=100, help="read IOPS cap (0: none)")
    ap.add_argument("--size-gib", type=int, default=8)
    ap.add_argument("--zero-fill", action="store_true",
                    help="back the loop device by zeros on the host's disk (default: a "
                    "sparse file, so the cap alone limits the device)")
    ap.add_argument("--eval-reps", type=int, default=4)
    ap.add_argument("--eval-duration", type=float, default=15)
    ap.add_argument("--dir", help="parent of the work dir (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, DB)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the per-second series and the results here")
    ap.add_argument("--plot", help="PNG of throughput and read_ahead_kb over time")
    args = ap.parse_args()
    if args.exploration_ticks is None:
        args.exploration_ticks = max(1, int(args.tuning * 2 / 3))
    if os.geteuid() != 0:
        print("bench_real_online: needs root (losetup, cgroup, sysfs)", file=sys.stderr)
        return 2
    for tool in ("losetup", "fio"):
        if shutil.which(tool) is None:
            print(f"bench_real_online: {tool} is not installed", file=sys.stderr)
            return 2
    print(f"hardware: {hardware()}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="capes-bench-online-", dir=args.dir))
    dev = cgroup = stack = None
    original = None
    result: dict = {"hardware": hardware(), "command": sys.argv}
    eval_report = None
    best = None
    rc = 0
    with Stop() as stop:
        try:
            img = work / "disk.img"
            if args.zero_fill:
                subprocess.run(["dd", "if=/dev/zero", f"of={img}", "bs=4M",
                                f"count={args.size_gib * 256}", "oflag=direct",
                                "status=none"], check=True)
            else:
                with open(img, "wb") as fh:
                    fh.truncate(args.size_gib << 30)
            dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(img)],
                                 capture_output=True, text=True, check=True).stdout.strip()
            rec = Recorder(dev, None, args.segment, work / "fio")
            original = rec.read_ahead()
            print(f"{dev}: loop device (direct I/O) over a {args.size_gib} GiB "
                  f"{'zero-filled' if args.zero_fill else 'sparse'} file; original "
                  f"read_ahead_kb {original}", flush=True)
            if args.read_iops:
                cgroup = wd.ThrottledCgroup(dev, read_iops=args.read_iops)
                rec.cgroup = cgroup.path
            config = stack_config(work, dev)
            spec = load_deployment(config).parameters["read_ahead_kb"]
            floor = spec.min
            result["config"] = {"file": str(CONFIG), "device": dev, "floor": floor,
                                "max": spec.max, "step": spec.step}

            print(f"\n== original, {args.baseline:g} s", flush=True)
            rec.run(args.baseline, "original-before", stop)
            b = rec.series("original-before")
            print(f"original: {b.mean() / 1e6 if b.size else math.nan:.1f} MB/s over "
                  f"{b.size} s", flush=True)

            if not stop.is_set():
                print(f"\n== CAPES online, {args.tuning:g} s (ε 1 → 0.05 over "
                      f"{args.exploration_ticks} ticks)", flush=True)
                stack, status_file, info = start_stack(work, config, args)
                result["stack"] = info
                last = [time.monotonic()]
                t_tune = time.monotonic()

                def progress() -> None:
                    stack.check_alive()
                    if time.monotonic() - last[0] < 30:
                        return
                    last[0] = time.monotonic()
                    st = read_json(status_file)
                    x = rec.series("tuning")[-30:]
                    eps = st.get("epsilon")
                    print(f"  [{time.monotonic() - t_tune:5.0f} s] last 30 s "
                          f"{x.mean() / 1e6 if x.size else math.nan:6.1f} MB/s, "
                          f"read_ahead_kb {rec.read_ahead()}, ε "
                          f"{eps if eps is not None else math.nan:.2f}, "
                          f"best {st.get('best')}", flush=True)
                sampler = KnobSampler(rec.ra_file)
                try:
                    rec.run(args.tuning, "tuning", stop, progress)
                finally:
                    applied = sampler.stop()
                result["applied_values"] = {"min": min(applied, default=None),
                                            "max": max(applied, default=None),
                                            "samples": len(applied)}
                st = read_json(status_file)
                best = st.get("best")
                result["engine_status"] = st
                codes = stack.stop(first=("drl-engine",))
                result["exit_codes"] = codes
                stack = None
                after = rec.read_ahead()
                result["restored_by_agent"] = after == original
                print(f"stack stopped (exit codes {codes}); read_ahead_kb {after} "
                      f"({'the original' if after == original else 'NOT the original'})",
                      flush=True)

            if not stop.is_set() and best and "read_ahead_kb" in best:
                value = int(round(best["read_ahead_kb"]))
                toml = work / "eval.toml"
                toml.write_text(f"""tick_seconds = 1.0
[control.appliers.read_ahead_kb]
name = "file"
options = {{ path = "/sys/block/{Path(dev).name}/queue/read_ahead_kb" }}
[parameters.read_ahead_kb]
min = {spec.min:g}
max = {spec.max:g}
step = {spec.step:g}
default = {spec.default:g}
""")
                knobs = ev.Knobs(load_deployment(toml), ["read_ahead_kb"])
                configs = [ev.ConfigSet.parse("original"),
                           ev.ConfigSet.parse(f"read_ahead_kb={value}")]
                meter = ev.FioMeter("seqread", args.eval_duration, dev, size="100%",
                                    direction="read", cgroup=rec.cgroup)
                print(f"\n== evaluate: original vs the best-known read_ahead_kb={value}, "
                      f"{args.eval_reps} x {args.eval_duration:g} s", flush=True)

                def on_rep(r, i, total):
                    x = r.samples
                    print(f"  {i:>2}/{total} {configs[r.config].label:<24} "
                          f"{(sum(x) / len(x) / 1e6 if x else math.nan):8.1f} MB/s",
                          flush=True)
                try:
                    eval_report = ev.evaluate(knobs, configs, meter, args.eval_reps,
                                              args.seed, stop, on_rep=on_rep)
                finally:
                    knobs.close()
                eval_report.update(
                    title=f"Best-known setting after {args.tuning:g} s of CAPES online vs "
                    f"the original: sequential buffered 16 KiB reads, {dev} capped at "
                    f"{args.read_iops} read IOPS; {args.eval_reps} x "
                    f"{args.eval_duration:g} s per configuration",
                    unit="bytes/s", metric=meter.describe())
            elif not stop.is_set():
                print("the engine reported no best-known setting: nothing to evaluate",
                      flush=True)
        except (subprocess.CalledProcessError, wd.WorkloadError, RuntimeError, OSError,
                ValueError) as exc:
            print(f"bench_real_online: {exc}", file=sys.stderr)
            rc = 1
        finally:
            if stack is not None:
                result["exit_codes"] = stack.stop(first=("drl-engine",))
            if dev and original is not None:
                ra = Path("/sys/block") / Path(dev).name / "queue" / "read_ahead_kb"
                try:
                    if int(ra.read_text()) != original:
                        ra.write_text(f"{original}\n")
                except OSError:
                    pass
            if cgroup is not None:
                cgroup.remove()
            if dev:
                subprocess.run(["losetup", "-d", dev], check=False)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"kept {work}")
    if original is not None and "rec" in locals() and rec.rows:
        s = summarise(rec, original, result.get("config", {}).get("floor", math.nan),
                      best, eval_report)
        s["applied"] = result.get("applied_values")
        result["summary"] = s
        print("\n### CAPES online: sequential buffered 16 KiB reads, loop device capped at "
              f"{args.read_iops} read IOPS, fio in {args.segment:g} s segments\n")
        print(online_table(s, args))
        if eval_report:
            print()
            print(table(eval_report))
        if args.plot:
            plot(rec, args.plot, s)
        result["series"] = [{"t": r[0], "bw": r[1], "read_ahead_kb": r[2], "phase": r[3]}
                            for r in rec.rows]
    result["eval"] = eval_report
    result["wall_s"] = time.time() - t_start
    print(f"\ntotal {result['wall_s']:.0f} s, load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, ev.jsonable(result))
    return 130 if stop.signum is not None else rc


if __name__ == "__main__":
    sys.exit(main())
