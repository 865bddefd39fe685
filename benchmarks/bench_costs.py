"""What CAPES costs: CPU, memory, disk and network of each process, at 1 Hz, by node count.

Runs ``capes demo --nodes N`` at the speed of a real deployment (``tick_seconds = 1``,
one WAL commit a second), waits until every process is up and the daemon has heard every
node, lets it settle for ``--warmup`` seconds, then measures for ``--seconds``:

* CPU: each process's CPU time (user + system, all its threads) over the window, as a
  percentage of one core, by role (interface daemon, DRL engine, monitoring agent,
  control agent; the simulator nodes stand in for the storage target and are reported
  apart, not as a cost of CAPES);
* memory: each process's RSS, sampled every 2 s (the largest sample);
* disk: growth of the replay DB (pages in use) over the window, per row and per
  node-hour;
* network: the daemon's own counters (``capes_daemon_messages_total`` and
  ``capes_daemon_received_bytes_total`` on its ``/metrics``), payload bytes per second
  per monitoring agent; ZMTP framing and CURVE add about 35 B per message on the wire
  (see bench_message_size.py), reported as an estimate beside it.

The demo's own watcher (the ``capes demo`` process: live line, status polls once a
second) is not CAPES and is not counted. Start-up (imports, keys, first connects) is
excluded. The simulator's PIs are three a node: a host with the ``host`` collector sends
more (bench_message_size.py: 44 PIs, 67-129 B/s of payload).

    python benchmarks/bench_costs.py [--nodes 1,8,64] [--seconds 120] [--warmup 30] [--json OUT]
    python benchmarks/bench_costs.py --quick           # 1 node, 15 s

Report the load average printed with the figures: on a shared machine the CPU figures
rise with contention for caches and cores, the memory and byte figures hardly move.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
ROLES = ("interface-daemon", "drl-engine", "monitor-agent", "control-agent", "sim-node")
WIRE_OVERHEAD_B = 35           # ZMTP framing (2 B) + CURVE MESSAGE command (~33 B)


def role_of(name: str) -> str:
    return next(r for r in ROLES if name.startswith(r))


def daemon_counters(addr: str) -> dict[str, float]:
    """The daemon's message and byte counters from its Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    out = {}
    for key in ("capes_daemon_messages_total", "capes_daemon_received_bytes_total",
                "capes_daemon_db_rows_written_total"):
        m = re.search(rf"^{key}(?:{{[^}}]*}})?\s+([0-9.e+]+)$", text, re.M)
        if m:
            out[key] = float(m.group(1))
    return out


def db_bytes(db: Path) -> int:
    """The replay DB's logical size (pages in use, the WAL's committed ones included),
    read as a reader sees it: the files' sizes say little, a WAL keeps its length after
    a checkpoint."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        pages, free, size = (con.execute(f"PRAGMA {k}").fetchone()[0]
                             for k in ("page_count", "freelist_count", "page_size"))
    finally:
        con.close()
    return (pages - free) * size


def wait_ready(demo: subprocess.Popen, workdir: Path, nodes: int, limit_s: float) -> dict:
    """The demo's info file once every process of N nodes runs and the daemon has rows
    from all of them."""
    want = 2 + 3 * nodes
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if demo.poll() is not None:
            raise RuntimeError(f"capes demo exited ({demo.returncode}) before it was ready")
        try:
            info = json.loads((workdir / "capes-demo.json").read_text())
        except (OSError, ValueError):
            info = {}
        if len(info.get("children", {})) == want:
            try:
                c = daemon_counters(info["daemon_metrics"])
                if c.get("capes_daemon_db_rows_written_total", 0) >= 2 * nodes:
                    return info
            except OSError:
                pass
        time.sleep(1)
    raise RuntimeError(f"not ready within {limit_s:.0f} s")


def snapshot(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            t = p.cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            pass
    return out


def measure(nodes: int, seconds: float, warmup: float, seed: int, ready_s: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="capes-costs-"))
    cmd = [sys.executable, "-m", "capes", "demo", "--nodes", str(nodes), "--seed", str(seed),
           "--workdir", str(workdir), "--plot", "", "--timeout", str(ready_s + warmup + seconds + 120),
           "--hold", "100000", "--set", "tick_seconds=1", "--set", "daemon.commit_every_s=1",
           "--set", "daemon.ack_timeout_s=2", "--log-level", "WARNING"]
    load_start = os.getloadavg()
    demo = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=open(workdir / "demo.err", "w"), start_new_session=True)
    try:
        t_start = time.monotonic()
        info = wait_ready(demo, workdir, nodes, ready_s)
        startup_s = time.monotonic() - t_start
        time.sleep(warmup)
        procs = {n: psutil.Process(pid) for n, pid in info["children"].items()}
        db = Path(info["db"])
        cpu0, c0, d0, t0 = snapshot(procs), daemon_counters(info["daemon_metrics"]), \
            db_bytes(db), time.monotonic()
        rss = {n: 0 for n in procs}
        while time.monotonic() - t0 < seconds:
            for n, p in procs.items():
                try:
                    rss[n] = max(rss[n], p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(2)
        cpu1, c1, d1, t1 = snapshot(procs), daemon_counters(info["daemon_metrics"]), \
            db_bytes(db), time.monotonic()
        wall = t1 - t0
        load_end = os.getloadavg()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGTERM)
            try:
                demo.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    roles: dict[str, dict] = {}
    for n in procs:
        if n not in cpu0 or n not in cpu1:
            continue
        r = roles.setdefault(role_of(n), {"cpu_pct": [], "rss_mb": []})
        r["cpu_pct"].append(100 * (cpu1[n] - cpu0[n]) / wall)
        r["rss_mb"].append(rss[n] / 2**20)
    summary = {}
    for role, r in roles.items():
        cpu, mem = sorted(r["cpu_pct"]), sorted(r["rss_mb"])
        summary[role] = {"processes": len(cpu), "cpu_pct_median": cpu[len(cpu) // 2],
                         "cpu_pct_max": cpu[-1], "cpu_pct_total": sum(cpu),
                         "rss_mb_median": mem[len(mem) // 2], "rss_mb_max": mem[-1],
                         "rss_mb_total": sum(mem)}
    msgs = c1["capes_daemon_messages_total"] - c0["capes_daemon_messages_total"]
    byts = c1["capes_daemon_received_bytes_total"] - c0["capes_daemon_received_bytes_total"]
    rows = c1.get("capes_daemon_db_rows_written_total", 0) - c0.get("capes_daemon_db_rows_written_total", 0)
    return {
        "nodes": nodes, "seconds": round(wall, 1), "warmup_s": warmup, "seed": seed,
        "startup_s": round(startup_s, 1), "tick_seconds": 1.0,
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in load_end], "cpus": os.cpu_count(),
        "roles": summary,
        "network": {"messages_per_s_per_agent": msgs / wall / nodes,
                    "payload_bytes_per_s_per_agent": byts / wall / nodes,
                    "wire_bytes_per_s_per_agent_est": (byts + WIRE_OVERHEAD_B * msgs) / wall / nodes},
        "disk": {"db_growth_bytes": d1 - d0, "rows_written": rows,
                 "bytes_per_node_hour": (d1 - d0) / wall * 3600 / nodes,
                 "bytes_per_row": (d1 - d0) / rows if rows else None},
        "command": " ".join(cmd[1:]),
    }


def show(res: dict) -> None:
    print(f"{res['nodes']} node(s), {res['seconds']:.0f} s at 1 Hz after {res['warmup_s']:.0f} s "
          f"warm-up (start-up {res['startup_s']:.0f} s); load {res['load_start'][0]:.1f} -> "
          f"{res['load_end'][0]:.1f} on {res['cpus']} CPUs")
    print(f"  {'process':18s} {'n':>3s} {'CPU % core (median/max)':>24s} {'RSS MB (median/max)':>20s}")
    for role in ROLES:
        r = res["roles"].get(role)
        if r:
            print(f"  {role:18s} {r['processes']:3d} {r['cpu_pct_median']:11.2f} / "
                  f"{r['cpu_pct_max']:6.2f}   {r['rss_mb_median']:9.1f} / {r['rss_mb_max']:6.1f}")
    n, d = res["network"], res["disk"]
    print(f"  network: {n['payload_bytes_per_s_per_agent']:.1f} B/s payload per agent "
          f"({n['messages_per_s_per_agent']:.2f} messages/s; ~{n['wire_bytes_per_s_per_agent_est']:.0f} "
          f"B/s on the wire)")
    print(f"  replay DB: {d['bytes_per_node_hour'] / 1e6:.2f} MB per node-hour "
          f"({d['db_growth_bytes']} B in {res['seconds']:.0f} s, {d['rows_written']:.0f} rows)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,8,64", help="comma-separated node counts")
    ap.add_argument("--seconds", type=float, default=120.0, help="measured window")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--ready", type=float, default=600.0, help="start-up limit, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--quick", action="store_true", help="1 node, 15 s after 10 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.seconds, args.warmup = "1", 15.0, 10.0
    results = []
    for n in (int(x) for x in args.nodes.split(",")):
        res = measure(n, args.seconds, args.warmup, args.seed, args.ready)
        show(res)
        results.append(res)
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
