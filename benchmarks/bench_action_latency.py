"""Action latency: from the engine's decision to the value applied on the node.

Starts, as real processes on loopback with CURVE keys in a temporary directory, ``capes
interface-daemon``, ``capes monitor-agent`` (time of day only: it gives the daemon the
node and a replay DB session, as on a real deployment) and ``capes control-agent`` with
a ``file`` applier on a knob file in the temporary directory. Then, acting as the DRL
engine, it submits N actions over the gRPC control plane (``ControlClient.submit_action``,
one step up or down, alternately) and times each from just before the call until the
knob file holds the new value: gRPC to the daemon, the action checker, the replay DB
record, the CURVE-encrypted ZeroMQ hop, the agent's own range check, the write.

Prints p50, p99 and max in ms (and the gRPC call alone), after ``--warmup`` actions that
are not counted. Every process it started is stopped at the end, whatever happens.

    .venv/bin/python benchmarks/bench_action_latency.py [--actions 300] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from capes.experiments.demo import free_port
from capes.experiments.process_group import ProcessGroup

REPO = Path(__file__).resolve().parent.parent
NODE = "bench0"
PARAM = "knob"
DEFAULT = 10
POLL_S = 0.0001                  # knob file polled every 0.1 ms
ACTION_TIMEOUT_S = 5.0




def config_text(work: Path, curve_on: bool, tick: float) -> str:
    ingest, control, grpc = free_port(), free_port(), free_port()
    return f"""
tick_seconds = {tick}
[keys]
dir = "{work / 'keys'}"
enabled = {'true' if curve_on else 'false'}
[daemon]
ingest = "tcp://127.0.0.1:{ingest}"
control = "tcp://127.0.0.1:{control}"
grpc = "127.0.0.1:{grpc}"
db = "{work / 'replay.db'}"
[monitor]
node = "{NODE}"
daemon = "tcp://127.0.0.1:{ingest}"
collectors = [{{ name = "timeofday" }}]
[control]
node = "{NODE}"
daemon = "tcp://127.0.0.1:{control}"
[control.appliers.{PARAM}]
name = "file"
options = {{ path = "{work / PARAM}" }}
[parameters.{PARAM}]
min = 1
max = 100
step = 1
default = {DEFAULT}
"""


def wait_until(what: str, check, procs: ProcessGroup, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check_alive()
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def read_knob(path: Path) -> float | None:
    try:
        text = path.read_text()
        return float(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


def measure(client, knob: Path, n: int, first_tick: int) -> tuple[list, list, int]:
    """Submit ``n`` alternating actions; (latencies s, gRPC call times s, timeouts)."""
    latencies, calls, lost = [], [], 0
    value = read_knob(knob)
    for i in range(n):
        up = value <= DEFAULT
        target = value + 1 if up else value - 1
        t0 = time.perf_counter()
        reply = client.submit_action(first_tick + i, 1 if up else 2, {PARAM: target})
        calls.append(time.perf_counter() - t0)
        if not reply["accepted"]:
            raise RuntimeError(f"action refused: {reply['reason']}")
        while read_knob(knob) != target:
            if time.perf_counter() - t0 > ACTION_TIMEOUT_S:
                lost += 1
                break
            time.sleep(POLL_S)
        else:
            latencies.append(time.perf_counter() - t0)
        value = target
    return latencies, calls, lost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=300, help="actions timed")
    ap.add_argument("--warmup", type=int, default=20, help="actions before timing starts")
    ap.add_argument("--tick", type=float, default=1.0, help="tick_seconds of the deployment")
    ap.add_argument("--no-curve", action="store_true", help="plain sockets (comparison only)")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--quick", action="store_true", help="CI: 30 actions after 5")
    args = ap.parse_args()
    if args.quick:
        args.actions, args.warmup = 30, 5

    from capes.common.control_client import ControlClient
    from capes.common.curve import generate
    from capes.common.deployment import load_deployment

    tmp = tempfile.TemporaryDirectory(prefix="capes-bench-latency-")
    work = Path(tmp.name)
    cfg_path = work / "deploy.toml"
    cfg_path.write_text(config_text(work, not args.no_curve, args.tick))
    cfg = load_deployment(cfg_path)
    generate(work / "keys", ["monitor", "control"])
    knob = work / PARAM
    knob.write_text(f"{DEFAULT}\n")
    procs = ProcessGroup(work)
    cfg_args = ["--config", str(cfg_path)]
    try:
        procs.start("interface-daemon", "interface-daemon", *cfg_args,
                    "--ready-file", str(work / "daemon.ready"), "--log-level", "WARNING")
        wait_until("the daemon", lambda: (work / "daemon.ready").exists(), procs)
        procs.start("monitor-agent", "monitor-agent", *cfg_args, "--set", "keys.client=monitor")
        procs.start("control-agent", "control-agent", *cfg_args, "--set", "keys.client=control")
        with ControlClient.from_config(cfg) as client:
            status = wait_until("a replay DB session (the monitoring agent's first frame)",
                                lambda: (s := client.status())["session_id"] > 0 and s, procs)
            wait_until("the control agent", lambda: any(
                n.get("control") and n["name"] == NODE for n in client.nodes()), procs)
            tick = status["latest_tick"] + 1
            measure(client, knob, args.warmup, tick)
            t_start = time.perf_counter()
            latencies, calls, lost = measure(client, knob, args.actions, tick + args.warmup)
            elapsed = time.perf_counter() - t_start
            procs.check_alive()
            final = client.status()
    finally:
        procs.stop()
        tmp.cleanup()

    if not latencies:
        print(f"no action reached the knob within {ACTION_TIMEOUT_S:g} s", file=sys.stderr)
        return 1
    ms = [x * 1000.0 for x in latencies]
    result = {
        "actions": len(ms), "lost": lost, "curve": not args.no_curve,
        "p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3), "mean_ms": round(statistics.fmean(ms), 3),
        "grpc_call_p50_ms": round(percentile([c * 1000 for c in calls], 50), 3),
        "grpc_call_p99_ms": round(percentile([c * 1000 for c in calls], 99), 3),
        "actions_per_s": round(len(ms) / elapsed, 1), "poll_interval_ms": POLL_S * 1000,
        "daemon_actions": final["actions"],
    }
    print(f"action latency, engine decision -> value in the knob file "
          f"({'CURVE' if result['curve'] else 'plain'} loopback, {result['actions']} actions"
          f"{f', {lost} LOST' if lost else ''}): p50 {result['p50_ms']} ms, "
          f"p99 {result['p99_ms']} ms, max {result['max_ms']} ms "
          f"(gRPC submit alone: p50 {result['grpc_call_p50_ms']} ms, "
          f"p99 {result['grpc_call_p99_ms']} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
