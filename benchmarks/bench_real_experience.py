"""Experience across sessions on a real device (issue 37): a new workload on the emulated
seek disk, fresh against ``capes drl-engine --experience`` of two recorded sessions.

The device is a loop device over ``tools/seekdisk`` (one request at a time,
``--bandwidth-mbs``, +``--seek-ms`` per non-contiguous request), ``read_ahead_kb`` at
``--original`` when every session starts (4096: a host set up for sequential reads).
The workloads are one family, random reads through mmap of a request size that is also
their signature (the application's mean request size, ``app_io_kib``): a fault reads
read_ahead_kb around the page, so the best setting moves with the size.

1. **static grid** for the new workload (``capes evaluate``'s machinery: every
   ``--grid`` value, ``--grid-reps`` randomised interleaved repetitions of
   ``--grid-duration`` s): its best static setting and throughput (the 90 % level);
2. **recorded sessions**: the whole stack (``configs/linux-readahead-app.toml``, the
   ``default`` preset) tunes each ``--recorded`` workload for ``--record-s`` seconds;
   their replay DBs are merged with ``capes replay merge``;
3. **new sessions**, paired by seed (each ``--seeds`` value runs every arm, the order
   rotating with the seed): the ``--new`` workload for ``--session-s`` seconds,
   ``fresh`` (no experience) and ``experience`` (``--experience merged.db``, its
   default start); ``--arms fresh,experience,gp`` adds ``--experience-start gp``. Per
   session: seconds until a 5-s mean first reaches 90 % of the best static throughput
   (fio seconds from the session's first; a session that never does counts as its
   length, ``censored``), the same for 80 %, its mean and first-60-s relative (÷ best
   static), its worst 10 s, the settings applied.

Writes (``--json``) ``best_static``, ``recorded`` (what each recording learned),
``experience_log`` (per arm the engine's line on what it brought along), ``sessions``
and ``summary`` (per arm the median seconds to 90 %; per seed and arm the difference
from fresh, the ratio, and ``half_or_better``: at most half the fresh time), with the
load average at the start and end. About 11 minutes with the defaults; root, fio, FUSE.

    sudo .venv/bin/python benchmarks/bench_real_experience.py --json out.json
    sudo .venv/bin/python benchmarks/bench_real_experience.py --quick
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from capes.experiments import real_readahead as rr  # noqa: E402

SKIP = 77
ARM_NAMES = ("fresh", "experience", "memory", "interpolate", "gp")  # --experience-start


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recorded", default="mmaprand,mmaprand256k",
                    help="workloads of the recorded sessions, one session each")
    ap.add_argument("--new", default="mmaprand64k", help="the workload never seen")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--arms", default="fresh,experience",
                    help="fresh first, then of experience (the default start), memory, "
                    "interpolate, gp (--experience-start)")
    ap.add_argument("--record-s", type=float, default=120)
    ap.add_argument("--session-s", type=float, default=75)
    ap.add_argument("--original", type=int, default=4096)
    ap.add_argument("--grid", default="4,16,32,64,128,256,1024,4096")
    ap.add_argument("--grid-reps", type=int, default=2)
    ap.add_argument("--grid-duration", type=float, default=5)
    ap.add_argument("--segment", type=float, default=2.0)
    ap.add_argument("--exploration-ticks", type=int, default=None,
                    help="ε anneals 1 → 0.05 over this many ticks (default: half a "
                    "recorded session)")
    rr.add_seekdisk_args(ap)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="a --set for every process of every stack")
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (~90 s): 12-15-s sessions, one seed, a 3-value grid")
    args = ap.parse_args(argv)
    if args.quick:
        args.record_s, args.session_s, args.seeds = 12, 15, "1"
        args.grid, args.grid_reps, args.grid_duration, args.size_gib = "4,64,4096", 1, 2, 1
    if args.exploration_ticks is None:
        args.exploration_ticks = max(1, int(args.record_s / 2))
    args.arms = [a for a in args.arms.split(",") if a]
    if args.arms[:1] != ["fresh"] or len(args.arms) < 2 or \
            not set(args.arms) <= set(ARM_NAMES) or len(set(args.arms)) != len(args.arms):
        ap.error(f"--arms: fresh first, then of {', '.join(ARM_NAMES[1:])}")
    return args


def session_figures(x: np.ndarray, best: float, original: float, seconds: float) -> dict:
    """One new session's figures against the new workload's best static throughput."""
    t90, t80 = rr.seconds_to(x, 0.9 * best), rr.seconds_to(x, 0.8 * best)
    return {"seconds_to_90": t90 if t90 is not None else int(x.size),
            "censored": t90 is None, "seconds_to_80": t80, "seconds": int(x.size),
            "relative": float(x.mean() / best) if x.size else math.nan,
            "first_60s_relative": float(x[:60].mean() / best) if x.size else math.nan,
            "worst_10s_relative": rr.worst_window(x) / best,
            "worst_10s_vs_original": rr.worst_window(x) / original}


def summarise(sessions: list[dict], arms: list[str]) -> dict:
    """Per arm the median seconds to 90 %; per seed each arm − fresh and the ratio."""
    by = {(s["seed"], s["arm"]): s for s in sessions}
    seeds = sorted({s["seed"] for s in sessions
                    if all((s["seed"], a) in by for a in arms)})
    out: dict = {a: {"median_seconds_to_90": float(np.median([by[k, a]["seconds_to_90"]
                                                              for k in seeds]))
                     if seeds else None,
                     "seconds_to_90": [by[k, a]["seconds_to_90"] for k in seeds],
                     "relative": [round(by[k, a]["relative"], 3) for k in seeds]}
                 for a in arms}
    out["pairs"] = []
    for a in arms[1:]:
        for k in seeds:
            f, e = by[k, "fresh"]["seconds_to_90"], by[k, a]["seconds_to_90"]
            out["pairs"].append({"arm": a, "seed": k, "fresh": f, "with": e, "diff": e - f,
                                 "ratio": e / f if f else (math.inf if e else 1.0),
                                 "half_or_better": e <= 0.5 * f})
        won = [p["half_or_better"] for p in out["pairs"] if p["arm"] == a]
        out[a]["half_or_better"] = f"{sum(won)}/{len(won)}"
    return out


def arm_args(arm: str, merged: Path) -> tuple[str, ...]:
    """The engine's extra arguments of an arm: none (``fresh``), the experience with its
    default start (``experience``), or with the start named (``gp``, ``memory``)."""
    if arm == "fresh":
        return ()
    start = () if arm == "experience" else ("--experience-start", arm)
    return ("--experience", str(merged), *start)


def engine_experience_line(sub: Path) -> str | None:
    """The engine's log lines saying what the experience brought along and how the new
    workload's start was proposed."""
    try:
        text = (sub / "logs" / "tuner.log").read_text(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines()
             if "experience:" in ln or "experience start" in ln]
    return " | ".join(lines) or None


def merge(dbs: list[Path], out: Path) -> None:
    """``capes replay merge`` of the recorded sessions' DBs (the user's way)."""
    subprocess.run([sys.executable, "-m", "capes", "replay", "merge", *map(str, dbs),
                    "-o", str(out)], check=True, capture_output=True, text=True,
                   cwd=rr.REPO, timeout=120)


def run(args, stop, log=print) -> dict:
    """Grid, recordings, paired new sessions; everything removed on every exit path."""
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="capes-real-exp-"))
    spec = rr.seekdisk_spec(args, args.original)
    recorded = [w for w in args.recorded.split(",") if w]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    grid = [int(v) for v in args.grid.split(",")]
    sets = tuple(args.sets)
    result: dict = {"device": spec.describe(), "recorded_workloads": recorded,
                    "new_workload": args.new, "seeds": seeds, "record_s": args.record_s,
                    "session_s": args.session_s, "arms": args.arms, "grid": grid,
                    "grid_reps": args.grid_reps, "grid_duration_s": args.grid_duration,
                    "exploration_ticks": args.exploration_ticks,
                    "load_average_start": os.getloadavg()[0], "recorded": {},
                    "sessions": []}
    try:
        with rr.ReadaheadDevice(spec, work) as dev:
            result["original_read_ahead_kb"] = dev.original
            runner = rr.SessionRunner(dev, work / "fio", args.segment,
                                      work / "app-throughput")
            log(f"== static grid: {args.new} x read_ahead_kb {grid}, "
                f"{args.grid_reps} x {args.grid_duration:g} s each")
            report = rr.static_grid(runner, [args.new], grid, args.grid_reps,
                                    args.grid_duration, seeds[0], stop, log)[args.new]
            if stop.is_set():
                return result
            means = rr.grid_means(report, dev.original)
            best_v = max(means, key=lambda v: means[v][0])
            best = means[best_v][0]
            original = means[dev.original][0]
            result["best_static"] = {"setting": best_v, "bytes_s": best,
                                     "se": means[best_v][1], "original_bytes_s": original,
                                     "grid": {str(v): m for v, m in sorted(means.items())}}
            log(f"best static for {args.new}: read_ahead_kb {best_v}, "
                f"{best / 1e6:.2f} MB/s; original {dev.original}: {original / 1e6:.2f} MB/s")
            dbs = []
            for w in recorded:
                if stop.is_set():
                    return result
                name = f"capes-record-{w}"
                log(f"== recording {w}, {args.record_s:g} s")
                done = rr.run_tuner(name, runner, [rr.Phase(w, args.record_s)], work,
                                    seeds[0], stop, args.exploration_ticks, sets, log=log)
                x = runner.series(name)
                result["recorded"][w] = {"best_known": _ladder(done.status.get("best")),
                                         "mean_bytes_s": float(x.mean()) if x.size else None,
                                         "restored": done.restored}
                dbs.append(work / f"stack-{name}" / "replay.db")
            merged = work / "merged.db"
            merge(dbs, merged)
            for seed in seeds:
                r = seed % len(args.arms)            # the order rotates with the seed
                for arm in args.arms[r:] + args.arms[:r]:
                    if stop.is_set():
                        return result
                    name = f"capes-{arm}-s{seed}"
                    log(f"== {arm}, seed {seed}: {args.new}, {args.session_s:g} s")
                    extra = arm_args(arm, merged)
                    done = rr.run_tuner(name, runner, [rr.Phase(args.new, args.session_s)],
                                        work, seed, stop, args.exploration_ticks, sets,
                                        log=log, engine_args=extra)
                    if arm != "fresh":
                        result.setdefault("experience_log", {})[arm] = \
                            engine_experience_line(work / f"stack-{name}")
                    rows = [r for r in runner.rows if r.label == name]
                    s = session_figures(np.array([r.bytes_s for r in rows]), best, original,
                                        args.session_s)
                    s.update(seed=seed, arm=arm, restored=done.restored,
                             applied=sorted(set(done.applied)),
                             settings=[r.read_ahead_kb for r in rows],
                             bytes_s=[round(r.bytes_s) for r in rows],
                             load_average=os.getloadavg()[0])
                    result["sessions"].append(s)
                    log(f"{arm} seed {seed}: 90 % of best static at "
                        f"{s['seconds_to_90']} s{' (never)' if s['censored'] else ''} "
                        f"(80 % at {s['seconds_to_80']} s), "
                        f"relative {s['relative']:.3f}, first 60 s "
                        f"{s['first_60s_relative']:.3f}, worst 10 s "
                        f"{s['worst_10s_relative']:.2f} of best; settings "
                        f"{_runs(s['settings'])}; load {s['load_average']:.1f}")
    finally:
        rr._keep_stacks(work)
        shutil.rmtree(work, ignore_errors=True)
        result["wall_s"] = time.time() - t0
        result["load_average_end"] = os.getloadavg()[0]
        result["summary"] = summarise(result["sessions"], args.arms)
    return result


def _ladder(best: dict | None) -> int | None:
    """The engine's best-known setting (a rung index of the config's ladder) in KiB."""
    v = (best or {}).get("read_ahead_kb")
    return rr.LADDER[int(v)] if v is not None and 0 <= int(v) < len(rr.LADDER) else None


def _runs(values: list[int]) -> str:
    """``4096x3 256x5 64x30``: a session's settings, each run of equal ones counted."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return " ".join(f"{v}x{n}" for v, n in out)


def table(result: dict) -> str:
    """Seconds to 90 % of the best static per seed and arm, each arm's ratio to fresh."""
    sm, arms = result["summary"], result["arms"]
    lines = ["| seed | " + " | ".join(f"{a}: s to 90 %" for a in arms) + " | " +
             " | ".join(f"{a} ÷ fresh" for a in arms[1:]) + " |",
             "|---:|" + "---:|" * (2 * len(arms) - 1)]
    for i, seed in enumerate(sorted({p["seed"] for p in sm["pairs"]})):
        mine = {p["arm"]: p for p in sm["pairs"] if p["seed"] == seed}
        lines.append(f"| {seed} | " + " | ".join(str(sm[a]["seconds_to_90"][i])
                                                  for a in arms) + " | " +
                     " | ".join(f"{mine[a]['ratio']:.2f}" for a in arms[1:]) + " |")
    lines.append("| median | " + " | ".join(f"{sm[a]['median_seconds_to_90']:g}"
                                             for a in arms) + " | " +
                 " | ".join(f"≤ half: {sm[a]['half_or_better']}" for a in arms[1:]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import signal

    from capes.common.atomic import write_json
    from capes.common.stop_signal import StopSignal
    from capes.experiments import evaluate as ev
    args = parse_args(argv)
    why = rr.missing_requirements("seekdisk")
    if why:
        print(f"skip: {why}")
        return SKIP

    class Stop(StopSignal):
        SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    print(f"command: {' '.join(sys.argv)}; load average {os.getloadavg()[0]:.2f}", flush=True)
    with Stop() as stop:
        try:
            result = run(args, stop, log=lambda m: print(m, flush=True))
        except (rr.RealTargetError, OSError, subprocess.CalledProcessError) as exc:
            print(f"bench_real_experience: {exc}", file=sys.stderr)
            return 1
    result["command"] = sys.argv
    if result["sessions"]:
        print()
        print(table(result))
    print(f"\ntotal {result['wall_s']:.0f} s; load average {result['load_average_start']:.2f}"
          f" at the start, {result['load_average_end']:.2f} at the end")
    if args.json:
        write_json(args.json, ev.jsonable(result))
    return 130 if stop.signum is not None else 0


if __name__ == "__main__":
    sys.exit(main())
