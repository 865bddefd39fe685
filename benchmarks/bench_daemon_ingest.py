"""Interface-daemon ingest: sustained indicator messages per second, nothing dropped.

One ``capes interface-daemon`` process (CURVE on, replay DB in a temporary directory);
this script plays many monitoring agents on loopback, each a CURVE DEALER streaming
busy-host frames of 44 PIs (about 24 changed per frame, see bench_message_size.py).
For each offered rate it sends for ``--seconds``, then waits for the daemon to catch up
and reads its counters over gRPC. A rate is *sustained* when every message arrived,
none was dropped and every row was committed to the replay DB, within a second of the
last send. Floor 2,000 messages/s; goal 10,000.

    python benchmarks/bench_daemon_ingest.py [--agents 200] [--rates 2000,5000,10000,20000]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import zmq  # noqa: E402

from bench_message_size import NAMES, Host  # noqa: E402
from capes.common import curve  # noqa: E402
from capes.common.control_client import ControlClient  # noqa: E402
from capes.common.deployment import KeysConfig  # noqa: E402
from capes.common.protocol import DeltaEncoder  # noqa: E402


def start_daemon(tmp: Path) -> tuple[subprocess.Popen, dict]:
    cfg = tmp / "deploy.toml"
    cfg.write_text(f"""
[keys]
dir = "{tmp / 'keys'}"
[daemon]
ingest = "tcp://127.0.0.1:0"
control = "tcp://127.0.0.1:0"
grpc = "127.0.0.1:0"
db = "{tmp / 'replay.db'}"
commit_every_s = 1.0
max_nodes = 100000
""")
    ready = tmp / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "capes", "interface-daemon", "--config",
                             str(cfg), "--ready-file", str(ready), "--log-level", "WARNING"],
                            cwd=ROOT, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the daemon did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--rates", default="2000,5000,10000,20000",
                    help="offered messages/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per rate")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    rates = [int(r) for r in args.rates.split(",")]

    host = Host(busy_disks=2, busy_nets=3)
    ticks = sum(int(r * args.seconds / args.agents) for r in rates) + 2
    samples = [host.sample(t) for t in range(min(ticks, 600))]
    print(f"encoding {ticks} frames for each of {args.agents} agents ...", file=sys.stderr)
    frames = []
    for a in range(args.agents):
        enc = DeltaEncoder(f"node{a:05d}", NAMES, 60)
        frames.append([enc.frame(10_000 + t, samples[t % len(samples)]) for t in range(ticks)])

    results = []
    with tempfile.TemporaryDirectory(prefix="capes-bench-") as tmpdir:
        tmp = Path(tmpdir)
        curve.generate(tmp / "keys", ["agent"])
        proc, info = start_daemon(tmp)
        ctx = zmq.Context()
        keys = KeysConfig(dir=str(tmp / "keys"))
        socks = []
        try:
            client = ControlClient(info["grpc"], curve.load_token(keys), timeout=10)
            for _ in range(args.agents):
                s = curve.client_socket(ctx, zmq.DEALER, keys, hwm=100_000)
                s.connect(info["ingest"])
                socks.append(s)
            time.sleep(1.0)                            # CURVE handshakes
            cursor = 0
            print(f"{'offered/s':>10} {'sent':>8} {'received':>9} {'rows':>8} {'drops':>6} "
                  f"{'catch-up s':>10} {'ingest/s':>9}  sustained")
            for rate in rates:
                n_ticks = int(rate * args.seconds / args.agents)
                before = client.status()
                t0 = time.perf_counter()
                for i in range(n_ticks):
                    due = t0 + i * args.agents / rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    t = cursor + i
                    for a, s in enumerate(socks):
                        s.send(frames[a][t], copy=True)
                sent_at = time.perf_counter()
                cursor += n_ticks
                sent = n_ticks * args.agents
                while True:                           # wait for the daemon to drain
                    st = client.status()
                    got = st["messages"] - before["messages"]
                    if got >= sent or time.perf_counter() - sent_at > 20:
                        break
                    time.sleep(0.05)
                caught = time.perf_counter()
                time.sleep(1.1)                       # one commit period
                st = client.status()
                rows = st["rows_written"] - before["rows_written"]
                drops = sum(st["drops"].values()) - sum(before["drops"].values())
                ingest = got / (caught - t0)
                ok = got == sent and drops == 0 and rows == sent and caught - sent_at < 1.0
                results.append({"offered": rate, "sent": sent, "received": got, "rows": rows,
                                "drops": drops, "catch_up_s": caught - sent_at,
                                "ingest_per_s": ingest, "sustained": ok})
                print(f"{rate:>10} {sent:>8} {got:>9} {rows:>8} {drops:>6} "
                      f"{caught - sent_at:>10.2f} {ingest:>9.0f}  {'yes' if ok else 'NO'}")
            client.close()
        finally:
            for s in socks:
                s.close(0)
            ctx.term()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    best = max((r["offered"] for r in results if r["sustained"]), default=0)
    print(f"sustained with nothing dropped: {best} messages/s "
          f"(floor 2,000; goal 10,000) on {os.cpu_count()} CPUs shared by sender and daemon")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
