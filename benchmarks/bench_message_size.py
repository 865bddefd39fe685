"""Steady-state indicator bytes per client per second for 44 host PIs at 1 Hz.

The paper (thesis §5.1.3) reports about 186 B per client per second for 44 PIs; our goal
is 93 B. This script streams one simulated hour of a host's PIs through
``DeltaEncoder`` (periodic full frames included, every 60 ticks by default) and prints
the mean payload bytes per second, for two hosts and three PI precisions:

* ``busy``: a storage client under steady I/O: CPU figures and two of six disks, and
  all three network interfaces, change every tick (about 20 of 44 PIs per tick);
* ``quiet``: the same host lightly used: one disk and one interface busy, others
  mostly idle with periodic journal flushes (about 8 PIs per tick);

and precision ``mantissa_bits`` 23 (lossless float32, the replay DB's own precision),
15 (relative error <= 1.5e-5) and 7 (<= 0.4 %). ``--live SECONDS`` adds a run on this
machine's real ``host`` and ``timeofday`` collectors, sampled at 1 Hz.

Bytes are the protocol payload (what ``DeltaEncoder.frame`` returns). On the wire ZMTP
adds 2 bytes of framing, and CURVE about 33 more per message (MESSAGE command, nonce,
MAC), independent of the protocol.

    python benchmarks/bench_message_size.py [--ticks 3600] [--full-every 60] [--live 30]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capes.common.protocol import DeltaEncoder, encode  # noqa: E402

DISKS = ["sda", "sdb", "sdc", "sdd", "nvme0n1", "nvme1n1"]
NETS = ["eth0", "eth1", "ib0"]
DISK_PIS = ["read_bytes_s", "write_bytes_s", "read_iops", "write_iops", "busy_percent"]
NAMES = (["cpu_percent", "cpu_iowait_percent", "cpu_system_percent", "mem_used_percent"]
         + [f"disk.{d}.{p}" for d in DISKS for p in DISK_PIS]
         + [f"net.{n}.{p}" for n in NETS for p in ("rx_bytes_s", "tx_bytes_s")]
         + ["month", "weekday", "hour", "minute"])
assert len(NAMES) == 44


class Host:
    """PIs the way the host collector makes them: rates are counter differences over a
    measured interval (so arbitrary floats), percentages have one decimal (psutil)."""

    def __init__(self, busy_disks: int, busy_nets: int, seed: int = 1):
        self.rng = random.Random(seed)
        self.busy_disks = set(DISKS[:busy_disks])
        self.busy_nets = set(NETS[:busy_nets])
        self.mem = 42.0
        self.start = time.mktime((2024, 3, 14, 9, 26, 0, 0, 0, -1))

    def sample(self, tick: int) -> list[float]:
        r = self.rng
        dt = 1.0 + r.gauss(0, 0.0005)                  # measured interval
        vals = [round(r.uniform(20, 60), 1), round(r.uniform(1, 9), 1),
                round(r.uniform(5, 15), 1)]
        if r.random() < 0.3:
            self.mem = round(min(95, max(5, self.mem + r.choice((-0.1, 0.1)))), 1)
        vals.append(self.mem)
        for d in DISKS:
            if d in self.busy_disks:
                rb, wb = r.randint(80, 120) * 1_048_576 + r.randint(0, 4095) * 4096, \
                    r.randint(20, 60) * 1_048_576 + r.randint(0, 4095) * 4096
                vals += [rb / dt, wb / dt, r.randint(700, 1100) / dt, r.randint(200, 500) / dt,
                         round(r.uniform(60, 99), 1)]
            elif tick % 5 == 0:                         # journal flush every 5 s
                vals += [0.0, r.randint(2, 40) * 4096 / dt, 0.0, r.randint(1, 8) / dt,
                         round(r.uniform(0, 2), 1)]
            else:
                vals += [0.0, 0.0, 0.0, 0.0, 0.0]
        for n in NETS:
            if n in self.busy_nets:
                vals += [r.randint(50, 110) * 1e6 / dt + r.randint(0, 999),
                         r.randint(5, 30) * 1e6 / dt + r.randint(0, 999)]
            elif r.random() < 0.3:                      # background chatter
                vals += [r.randint(60, 2000) / dt, r.randint(60, 2000) / dt]
            else:
                vals += [0.0, 0.0]
        t = time.localtime(self.start + tick)
        vals += [t.tm_mon, t.tm_wday, t.tm_hour, t.tm_min]
        return vals


def measure(samples: list[list[float]], names: list[str], full_every: int,
            bits: int) -> dict:
    enc = DeltaEncoder("node01", names, full_every, mantissa_bits=bits)
    sizes, changed = [], []
    for tick, vals in enumerate(samples):
        msg = enc.message(1_710_000_000 + tick, vals)
        if not msg.full:
            changed.append(len(msg.values))
        sizes.append(len(encode(msg)))
    steady = sizes[1:]                    # the stream's first frame (with names) aside
    return {"bytes_per_s": statistics.fmean(steady),
            "p50": statistics.median(steady), "max": max(steady),
            "first_frame": sizes[0], "changed_per_tick": statistics.fmean(changed or [0])}


def live_samples(seconds: int) -> tuple[list[str], list[list[float]]]:
    from monitor_agent.collectors.base import build_collector
    cols = [build_collector("host"), build_collector("timeofday")]
    names = [n for c in cols for n in c.names()]
    out = []
    for _ in range(seconds):
        values = {}
        for c in cols:
            values.update(c.collect())
        out.append([values[n] for n in names])
        time.sleep(1.0)
    return names, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=3600, help="ticks (s) per run")
    ap.add_argument("--full-every", type=int, default=60)
    ap.add_argument("--live", type=int, default=0, metavar="SECONDS",
                    help="also measure this machine's host+timeofday collectors")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--quick", action="store_true", help="CI: 600 ticks, no live run")
    args = ap.parse_args()
    if args.quick:
        args.ticks, args.live = 600, 0
    results = []
    hosts = {"busy": Host(busy_disks=2, busy_nets=3), "quiet": Host(busy_disks=1, busy_nets=1)}
    runs = [(name, NAMES, [h.sample(t) for t in range(args.ticks)]) for name, h in hosts.items()]
    if args.live:
        names, samples = live_samples(args.live)
        runs.append((f"live ({len(names)} PIs)", names, samples))
    print(f"indicator payload per client per second, {args.ticks} ticks, full frame every "
          f"{args.full_every} (paper: ~186 B for 44 PIs; goal <= 93 B)")
    print(f"{'host':<16} {'bits':>4} {'B/s':>7} {'p50':>5} {'max':>5} {'first':>6} "
          f"{'changed/tick':>12}")
    for name, names, samples in runs:
        for bits in (23, 15, 7):
            r = measure(samples, names, args.full_every, bits)
            results.append({"host": name, "mantissa_bits": bits, **r})
            print(f"{name:<16} {bits:>4} {r['bytes_per_s']:>7.1f} {r['p50']:>5.0f} "
                  f"{r['max']:>5} {r['first_frame']:>6} {r['changed_per_tick']:>12.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
