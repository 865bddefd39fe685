"""``capes evaluate``: compare configurations on a real target, Pilot-style.

    capes evaluate --config configs/linux-readahead.toml --workload seqread \
        --target /dev/sda --config-set original --config-set read_ahead_kb=4096 \
        --repetitions 5 --duration 30 --json eval.json --plot eval.png

Sets each configuration through the deployment's appliers (no daemon needed), runs the
fio workload for ``--duration`` seconds per repetition in a randomised interleaved
order, and reports each configuration's mean with its CI and every configuration
against the first. The original values come back at the end, on Ctrl-C and on SIGTERM.
See docs/evaluate.md.
"""
from __future__ import annotations

import json
import logging
import sys


def add_arguments(p) -> None:
    from capes.cli import common_config_args
    common_config_args(p)
    from capes.common.shipped_configs import workload_dir
    shipped = ", ".join(sorted(f.stem for f in workload_dir().glob("*.fio")))
    p.add_argument("--workload", required=True,
                   help=f"fio job file, or the name of one in configs/workloads ({shipped})")
    p.add_argument("--target", help="file or block device the workload uses (CAPES_TARGET)")
    p.add_argument("--directory", help="directory for file-set workloads (CAPES_DIR)")
    p.add_argument("--size", help="CAPES_SIZE (default: 100%% of a device, else 1g)")
    p.add_argument("--config-set", dest="config_sets", action="append", default=[],
                   metavar="SET", required=True,
                   help="'original' (the host's values before the run), "
                   "NAME=VALUE[,NAME=VALUE], or best:PATH (the best-known setting in a "
                   "drl-engine --status-file); give two or more; the first is the baseline")
    p.add_argument("--repetitions", type=int, default=5,
                   help="repetitions of each configuration (default: %(default)s)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds per repetition (default: %(default)s)")
    p.add_argument("--metric", default="fio",
                   help="'fio' (fio's per-second bandwidth log) or a PI name of the "
                   "config's [monitor] collectors, e.g. blockdev.sda.read_bytes_s")
    p.add_argument("--direction", choices=("read", "write", "total"), default="total",
                   help="which fio bandwidth counts (default: %(default)s)")
    p.add_argument("--drop-caches", action="store_true",
                   help="sync and drop the page cache before every repetition (root)")
    p.add_argument("--cgroup", help="run fio in this cgroup directory (e.g. a throttled one)")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds to wait after setting a configuration (default: 0)")
    p.add_argument("--warmup", default="auto",
                   help="seconds dropped from the start of every repetition: 'auto' "
                   "(MSER, see docs/evaluate.md) or a number, e.g. 0 to keep a buffered "
                   "write's page-cache burst (default: auto)")
    p.add_argument("--seed", type=int, default=None, help="seed of the run order")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence level of the intervals and of Welch's test "
                        "(default: %(default)s)")
    p.add_argument("--precision", type=float, default=0.05,
                   help="wanted relative CI half-width, for 'more reps' (default: 0.05)")
    p.add_argument("--acf-threshold", type=float, default=0.1,
                   help="|lag-1 autocorrelation| deemed negligible (Pilot: 0.1)")
    p.add_argument("--json", metavar="PATH",
                   help="write the report as JSON ('-': stdout, the table then on stderr)")
    p.add_argument("--plot", metavar="PNG", help="plot samples and CIs")


def run(args) -> int:
    log = logging.getLogger("capes.evaluate")
    from capes.common.atomic import write_json
    from capes.common.deployment import load_deployment
    from capes.common.stop_signal import StopSignal
    from capes.experiments import evaluate as ev
    from capes.experiments.workload_driver import WorkloadError

    try:
        warmup = None if args.warmup == "auto" else float(args.warmup)
    except ValueError:
        warmup = -1
    try:                        # every setting before anything is measured
        ev.check_settings(args.repetitions, args.duration, args.confidence, args.precision,
                          args.acf_threshold, args.settle, warmup)
    except ValueError as exc:
        print(f"capes evaluate: --{exc}", file=sys.stderr)
        return 2
    warmup = None if warmup is None else int(warmup)
    cfg = load_deployment(args.config, args.overrides)
    try:
        configs = [ev.ConfigSet.parse(s) for s in args.config_sets]
    except ValueError as exc:
        print(f"capes evaluate: {exc}", file=sys.stderr)
        return 2
    if len(configs) < 2:
        print("capes evaluate: give two or more --config-set", file=sys.stderr)
        return 2
    names = sorted({n for c in configs for n in (c.values or {})})
    if not names:
        print("capes evaluate: no configuration sets any parameter", file=sys.stderr)
        return 2
    try:
        knobs = ev.Knobs(cfg, names)
        collectors = []
        pi = None if args.metric == "fio" else args.metric
        if pi is not None:
            from monitor_agent.agent import build_collectors
            collectors = build_collectors(cfg, args.config or "<config>")
        meter = ev.FioMeter(args.workload, args.duration, args.target, args.directory,
                            args.size, args.direction, args.cgroup, pi, collectors)
    except (ValueError, WorkloadError) as exc:
        print(f"capes evaluate: {exc}", file=sys.stderr)
        return 2

    def on_rep(rep, i, total):
        import numpy as np
        x = np.asarray(rep.samples)
        log.info("%d/%d %s: %d s, mean %.4g", i, total, configs[rep.config].label,
                 x.size, x.mean() if x.size else float("nan"))

    with StopSignal() as stop:
        try:
            report = ev.evaluate(knobs, configs, meter, args.repetitions, args.seed, stop,
                                 prepare=ev.drop_caches if args.drop_caches else None,
                                 settle_s=args.settle, confidence=args.confidence,
                                 precision=args.precision,
                                 acf_threshold=args.acf_threshold, warmup=warmup,
                                 on_rep=on_rep)
        except (ValueError, RuntimeError) as exc:
            print(f"capes evaluate: {exc}", file=sys.stderr)
            return 1
        finally:
            knobs.close()
    target = args.target or args.directory or ""
    report.update({
        "workload": str(meter.jobfile), "target": target, "duration_s": args.duration,
        "metric": meter.describe(), "unit": meter.unit,
        "title": (f"{meter.jobfile.stem} on {target}: {args.repetitions} x "
                  f"{args.duration:g} s per configuration, {meter.describe()}"),
    })
    # with --json - stdout is the JSON document alone; the table goes to stderr
    print(ev.format_report(report), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        doc = ev.jsonable(report)
        if args.json == "-":
            json.dump(doc, sys.stdout, indent=1)
            print()
        else:
            write_json(args.json, doc)
    if args.plot:
        ev.plot_report(report, args.plot)
    if report["interrupted"]:
        return 130
    return 0 if report["restored"] else 1
