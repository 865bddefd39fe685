"""How big the replay DB of the paper's evaluation gets, on disk and in the reader.

The thesis (Table 5.3) kept 250,000 one-second records of 8 Lustre clients × 44 PIs
(70 hours) in 0.5 GB on disk and 1.5 GB in memory. This writes the same volume through
:class:`~capes.common.replay_db.ReplayWriter` and reports the file size, then loads it with a
:class:`~capes.common.replay_db.ReplayReader` in a fresh process and reports the reader's
memory (RSS after loading minus RSS before, the peak, and the numpy bytes it holds).

The PIs resemble the paper's clients rather than noise, since noise compresses like
nothing real does and constants compress like nothing real does either. Per node and
tick: time of day as month / weekday / hour / minute (§5.1.1), then for each of 4 OSCs:
max_rpcs_in_flight (a slow random walk), max_dirty_mb (constant), ack and send EWMA
(full-precision floats), the process-time ratio (1.0 when idle), read and write MB/s,
RPCs in flight, pending pages and dirty bytes (whole numbers). Each node switches
between busy and idle phases (about 3 minutes each), and idle PIs read 0.

    python benchmarks/bench_replay_storage.py                 # the full 250 k ticks
    python benchmarks/bench_replay_storage.py --ticks 25000   # quick; extrapolated
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PAPER_TICKS, PAPER_NODES, PAPER_PIS = 250_000, 8, 44
FLOOR_DISK_GB, GOAL_DISK_GB = 0.5, 0.35
FLOOR_MEM_GB, GOAL_MEM_GB = 1.0, 0.4
GB = 1e9


def pi_names() -> list[str]:
    names = ["month", "weekday", "hour", "minute"]
    for osc in range(4):
        names += [f"osc{osc}.{n}" for n in (
            "max_rpcs_in_flight", "max_dirty_mb", "ack_ewma_us", "send_ewma_us",
            "pt_ratio", "read_mb_s", "write_mb_s", "rpcs_in_flight", "pending_pages",
            "dirty_bytes")]
    return names


class HostLikePIs:
    """Blocks of (ticks, nodes, 44) float32 PIs, reproducible for a seed."""

    def __init__(self, nodes: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes = nodes
        self.busy = self.rng.random(nodes) < 0.7
        self.rpcs = self.rng.integers(1, 32, size=(nodes, 4)).astype(np.float64)

    def block(self, start_tick: int, ticks: int) -> np.ndarray:
        rng, T, N = self.rng, ticks, self.nodes
        out = np.empty((T, N, PAPER_PIS), np.float32)
        t = start_tick + np.arange(T)
        out[:, :, 0] = 3                                   # month
        out[:, :, 1] = ((t // 86400) % 7)[:, None]         # weekday
        out[:, :, 2] = ((t // 3600) % 24)[:, None]         # hour
        out[:, :, 3] = ((t // 60) % 60)[:, None]           # minute
        flips = rng.random((T, N)) < 1 / 180               # phase changes
        busy = self.busy ^ (np.cumsum(flips, axis=0) % 2).astype(bool)
        self.busy = busy[-1].copy()
        for osc in range(4):
            b = 4 + 10 * osc
            walk = (rng.random((T, N)) < 0.05) * rng.choice([-1.0, 1.0], size=(T, N))
            rpcs = np.clip(self.rpcs[:, osc] + np.cumsum(walk, axis=0), 1, 256)
            self.rpcs[:, osc] = rpcs[-1]
            ack = rng.gamma(4.0, 250.0, (T, N))
            reads = rng.gamma(2.0, 40.0, (T, N)) * (rng.random((T, N)) < 0.5)
            out[:, :, b + 0] = rpcs
            out[:, :, b + 1] = 32
            out[:, :, b + 2] = np.where(busy, ack, 0)
            out[:, :, b + 3] = np.where(busy, ack * rng.uniform(0.8, 1.2, (T, N)), 0)
            out[:, :, b + 4] = np.where(busy, 1 + rng.exponential(0.5, (T, N)), 1)
            out[:, :, b + 5] = np.where(busy, reads, 0)
            out[:, :, b + 6] = np.where(busy, rng.gamma(2.0, 60.0, (T, N)), 0)
            out[:, :, b + 7] = np.where(busy, np.floor(rng.random((T, N)) * (rpcs + 1)), 0)
            out[:, :, b + 8] = np.where(busy, rng.integers(0, 4096, (T, N)), 0)
            out[:, :, b + 9] = np.where(busy, rng.integers(0, 32, (T, N)) * 1048576.0, 0)
        return out


def write_db(path: Path, ticks: int, nodes: int, seed: int = 0, compress: bool = True,
             progress=sys.stderr) -> dict:
    """Write ``ticks`` × ``nodes`` PI rows plus one action per tick; return timings."""
    from capes.common.params import ParameterSpec
    from capes.common.replay_db import ReplayWriter, SessionInfo
    params = [ParameterSpec(min=1, max=256, step=1, default=8, name=f"osc{i}.max_rpcs_in_flight")
              for i in range(4)]
    gen = HostLikePIs(nodes, seed)
    rng = np.random.default_rng(seed + 1)
    t0 = time.perf_counter()
    with ReplayWriter(path, compress=compress) as w:
        w.begin_session(SessionInfo(pi_names=pi_names(), node_names=[f"client{i}"
                                    for i in range(nodes)], params=params,
                                    label="bench_replay_storage"))
        values = np.array([p.default for p in params], np.float32)
        chunk = 5000
        for start in range(0, ticks, chunk):
            block = gen.block(start, min(chunk, ticks - start))
            for i, row in enumerate(block):
                tick = start + i
                for n in range(nodes):
                    w.add_pis(tick, n, row[n])
                action = int(rng.integers(0, 2 * len(params) + 1))
                if action:
                    k, down = divmod(action - 1, 2)
                    values[k] = min(256, max(1, values[k] + (-1 if down else 1)))
                w.add_action(tick, action, values)
            w.commit()
            if progress is not None:
                print(f"  wrote {start + len(block):,}/{ticks:,} ticks "
                      f"({time.perf_counter() - t0:.0f} s)", file=progress, flush=True)
    return {"write_s": time.perf_counter() - t0}


def disk_bytes(path: Path) -> int:
    """The DB and its WAL / shared-memory files, as they lie on disk."""
    total = 0
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(path) + suffix)
        if p.exists():
            total += p.stat().st_blocks * 512
    return total


def rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def measure_reader(path: Path) -> dict:
    """Load the whole DB into a ReplayReader (run in a fresh process)."""
    from capes.common.replay_db import ReplayReader
    before = rss()
    t0 = time.perf_counter()
    reader = ReplayReader(path)
    load_s = time.perf_counter() - t0
    after = rss()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(d.pis.nbytes + d.actions.nbytes + d.after.nbytes
               for d in reader.sessions.values())
    ticks = sum(d.length for d in reader.sessions.values())
    reader.close()
    return {"load_s": load_s, "rss_delta_bytes": after - before,
            "peak_rss_delta_bytes": peak - before, "numpy_bytes": held,
            "ticks_loaded": ticks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=PAPER_TICKS)
    ap.add_argument("--nodes", type=int, default=PAPER_NODES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raw", action="store_true",
                    help="store PI vectors uncompressed (ReplayWriter(compress=False))")
    ap.add_argument("--db", help="keep the DB here (default: a temporary directory)")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--quick", action="store_true", help="CI: 5,000 ticks, extrapolated")
    ap.add_argument("--measure-reader", metavar="DB", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.ticks = 5000
    if args.measure_reader:
        print(json.dumps(measure_reader(Path(args.measure_reader))))
        return 0

    with tempfile.TemporaryDirectory(prefix="capes-bench-") as tmp:
        path = Path(args.db) if args.db else Path(tmp) / "replay.db"
        if path.exists():
            print(f"{path} exists; give a new path", file=sys.stderr)
            return 2
        print(f"writing {args.ticks:,} ticks × {args.nodes} nodes × {PAPER_PIS} PIs "
              f"to {path}{' (raw vectors)' if args.raw else ''}", file=sys.stderr)
        result = {"ticks": args.ticks, "nodes": args.nodes, "pis": PAPER_PIS,
                  "compress": not args.raw,
                  **write_db(path, args.ticks, args.nodes, args.seed, not args.raw)}
        result["disk_bytes"] = disk_bytes(path)
        proc = subprocess.run([sys.executable, __file__, "--measure-reader", str(path)],
                              capture_output=True, text=True, check=True)
        result.update(json.loads(proc.stdout))
    scale = PAPER_TICKS * PAPER_NODES / (args.ticks * args.nodes)
    result["scale_to_paper"] = scale
    lines = [f"{args.ticks:,} ticks × {args.nodes} nodes × {PAPER_PIS} PIs "
             f"({'raw' if args.raw else 'compact'} vectors): "
             f"written in {result['write_s']:.1f} s, loaded in {result['load_s']:.1f} s"]
    for label, key, floor, goal in (
            ("disk", "disk_bytes", FLOOR_DISK_GB, GOAL_DISK_GB),
            ("reader RSS delta", "rss_delta_bytes", FLOOR_MEM_GB, GOAL_MEM_GB),
            ("reader peak RSS delta", "peak_rss_delta_bytes", None, None),
            ("reader numpy bytes", "numpy_bytes", None, None)):
        gb = result[key] / GB
        line = f"  {label:<22} {gb:7.3f} GB"
        if scale != 1:
            line += f"  (×{scale:.2f} → {gb * scale:.3f} GB at the paper's size)"
        if floor is not None:
            at_size = gb * scale
            line += (f"  floor {floor} GB: {'ok' if at_size <= floor else 'MISSED'}, "
                     f"goal {goal} GB: {'ok' if at_size <= goal else 'missed'}")
        lines.append(line)
    if scale != 1:
        lines.append("  (linear extrapolation; fixed overheads make it overstate memory at "
                     "small sizes: quote a full-size run)")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
