"""Monitoring agent overhead at 1 Hz: CPU share of one core and resident memory.

Runs the real ``capes monitor-agent`` (host + timeofday collectors, CURVE on unless
``--no-curve``) as a child process against a dummy daemon (a ROUTER socket that only
counts what arrives) and samples the child with psutil. Start-up (imports, first
connect) is excluded: CPU is measured over the steady state after ``--warmup``.

Floors (issue 3): <= 1 % of a core and <= 60 MB RSS; goals 0.2 % and 40 MB.

    .venv/bin/python benchmarks/bench_monitor_agent.py [--seconds 30] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

REPO = Path(__file__).resolve().parent.parent


def config_text(port: int, keys_dir: str | None, tick: float) -> str:
    keys = f'dir = "{keys_dir}"\nclient = "node1"' if keys_dir else "enabled = false"
    return f"""
tick_seconds = {tick}
[keys]
{keys}
[monitor]
node = "node1"
daemon = "tcp://127.0.0.1:{port}"
collectors = [{{ name = "host" }}, {{ name = "timeofday" }}]
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="steady-state measurement")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds ignored at start")
    ap.add_argument("--tick", type=float, default=1.0, help="tick_seconds (1 Hz default)")
    ap.add_argument("--no-curve", action="store_true", help="plain sockets")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--quick", action="store_true", help="CI: 5 s after 2 s of warm-up")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.warmup = 5.0, 2.0

    from capes.common import curve
    tmp = tempfile.TemporaryDirectory(prefix="capes-bench-")
    keys_dir = None if args.no_curve else str(Path(tmp.name) / "keys")
    ctx = zmq.Context()
    auth = None
    if keys_dir:
        curve.generate(keys_dir, ["node1"])
        auth = curve.start_authenticator(ctx, keys_dir)
    daemon = curve.server_socket(ctx, zmq.ROUTER, keys_dir)
    port = daemon.bind_to_random_port("tcp://127.0.0.1")
    cfg = Path(tmp.name) / "monitor.toml"
    cfg.write_text(config_text(port, keys_dir, args.tick))

    child = subprocess.Popen([sys.executable, "-m", "capes", "monitor-agent", "--config",
                              str(cfg)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(child.pid)
    frames = nbytes = 0
    rss_max = 0
    try:
        start = time.monotonic()
        t_begin = cpu_begin = None
        end = start + args.warmup + args.seconds
        while time.monotonic() < end:
            if child.poll() is not None:
                raise SystemExit(f"monitor agent exited: {child.stderr.read()}")
            if daemon.poll(200):
                _, data = daemon.recv_multipart()
                if t_begin is not None:
                    frames += 1
                    nbytes += len(data)
            if t_begin is None and time.monotonic() - start >= args.warmup:
                t_begin = time.monotonic()
                ct = proc.cpu_times()
                cpu_begin = ct.user + ct.system
            if t_begin is not None:
                rss_max = max(rss_max, proc.memory_info().rss)
        ct = proc.cpu_times()
        wall = time.monotonic() - t_begin
        cpu_s = ct.user + ct.system - cpu_begin
        mem = proc.memory_full_info()
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        daemon.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()
        tmp.cleanup()

    result = {
        "seconds": round(wall, 1), "tick_seconds": args.tick, "curve": not args.no_curve,
        "frames": frames, "bytes_per_s": round(nbytes / wall, 1),
        "cpu_percent_of_one_core": round(100.0 * cpu_s / wall, 3),
        "rss_mb": round(max(rss_max, mem.rss) / 2**20, 1),
        "uss_mb": round(mem.uss / 2**20, 1),
    }
    print(f"monitoring agent (host+timeofday, {'CURVE' if result['curve'] else 'plain'}, "
          f"tick {args.tick:g} s) over {result['seconds']} s: "
          f"CPU {result['cpu_percent_of_one_core']} % of a core, "
          f"RSS {result['rss_mb']} MB (USS {result['uss_mb']} MB), "
          f"{frames} frames, {result['bytes_per_s']} B/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
