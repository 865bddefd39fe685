"""The cluster engine (issue 11, items 1 and 5): speed, scale and checkpoint transfer.

    .venv/bin/python benchmarks/bench_cluster_engine.py                 # every part
    .venv/bin/python benchmarks/bench_cluster_engine.py --part step --device cuda
    .venv/bin/python benchmarks/bench_cluster_engine.py --part hour --nodes 8 64 1000

Parts (one core: ``torch.set_num_threads(1)``, numpy's BLAS on one thread):

* ``replay``: per tick at 8, 64 and 1,000 nodes: ReplayWriter (one row per node, one
  commit), ReplayReader.refresh (and, for comparison, ``OldSizingReader``: the reader
  with the sizing query it had before it read only the new rows, which scanned the
  whole ``(session, tick, node)`` index every refresh) and the engine's ring
  (``Engine.ingest``, per-node mode: log1p, objective, reward, actions read back from the knob
  PIs, the change detector), over ``--replay-ticks`` ticks (the reader's cost grows with
  the DB: the last 10 % of ticks are reported too).
* ``step``: at ``--step-nodes`` (1,000) nodes: the weight count, sampling a minibatch
  (B ticks × M nodes: the default ``loss_nodes`` and all nodes), one training step on
  tensors already on the device (``NodeDQN.train_step``), ``learn`` from the sampled
  arrays (transfer + step; on CUDA a graph replay), ``Engine.train(1)`` including
  sampling with ``engine.cuda_graph`` on and off, and ``act`` (every node's action for
  one tick); on ``--device`` (cpu, cuda). ``--device-sampling`` adds the same engines
  with ``cluster_engine.device_sampling`` (the minibatch drawn on the device, in the
  step's CUDA graph): the per-step copy of the ring's new rows, the draw alone, and
  ``Engine.train(1)``; on CUDA also that graph replayed alone (GPU time, kernels).
  ``--compile``: ``engine.compile_step`` (the step's parts through torch.compile before
  the capture); ``--loss-nodes default`` leaves out the all-nodes minibatch (slow).
* ``hour``: wall and CPU seconds per simulated hour of ``capes converge-test --config
  configs/cluster-sim.toml`` (3 phases) at each of ``--nodes``, with what the run scored;
  the replay writes run in a process of their own (``--writes process``, the default:
  ``WriteProcess``, as the interface daemon is beside the engine; its CPU is the ``w
  CPU s`` column) or on the main thread (``sync``); both, ``--writes process sync``,
  alternate on the same seed (the same results each way); ``--set KEY=VALUE`` overrides the config as
  ``capes converge-test --set`` does.
* ``transfer``: an engine trained for an hour on 8 nodes, saved, and the checkpoint run on
  64 nodes (``--init-model``) beside a fresh engine on the same seeds.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capes.common.one_core import single_thread_blas  # noqa: E402
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo  # noqa: E402
from capes.experiments.cluster_test import load_config, run_one  # noqa: E402
from drl_engine.engine import Engine  # noqa: E402
from storagegamesim.cluster import PI_NAMES, ClusterConfig, ClusterSim  # noqa: E402


def _ms(ts) -> float:
    return 1000.0 * statistics.median(ts)


class OldSizingReader(ReplayReader):
    """The reader with its former sizing query (no ``NOT INDEXED``): SQLite answered it
    with ``SCAN pis USING COVERING INDEX pis_key``, O(rows stored) per refresh. Kept
    here only to show what the fix saves."""

    def _reserve(self, table: str, last_rowid: int) -> None:
        if len(self.sessions) == 0:
            return
        rows = self.conn.execute(f"SELECT session, MIN(tick), MAX(tick), COUNT(*) FROM "
                                 f"{table} WHERE rowid > ? GROUP BY session", (last_rowid,))
        for sid, lo, hi, count in rows:
            data = self.sessions.get(sid)
            if data is not None and count > 1024 and hi - lo < 2 * count and \
                    data.plausible(lo) and data.plausible(hi):
                data.reserve(lo, hi)


def bench_replay(nodes_list, ticks: int) -> None:
    print(f"Replay data path per tick, {ticks} ticks of the cluster simulator's PIs "
          f"(6 per node), one core; ms per tick (mean; last 10 % of ticks in brackets)")
    print(f"{'nodes':>6} {'write':>13} {'ReplayReader':>15} {'old sizing':>15} "
          f"{'ring ingest':>13}")
    cfg = load_config(None, [])
    for n in nodes_list:
        ccfg = dataclasses.replace(cfg.cluster, nodes=n, phases=[])
        sim = ClusterSim(ccfg, seed=0, judge=False)
        specs = list(ccfg.param_specs().values())
        eng = Engine.over_rows(cfg.engine, cfg.reward, list(PI_NAMES), specs, n,
                               model=dataclasses.replace(cfg.model, replay_mb=64))
        with tempfile.TemporaryDirectory() as tmp:
            w = ReplayWriter(Path(tmp) / "r.db")
            w.begin_session(SessionInfo(pi_names=list(PI_NAMES), node_names=sim.node_names,
                                        params=specs))
            stock, old = ReplayReader(Path(tmp) / "r.db"), OldSizingReader(Path(tmp) / "r.db")
            tw, ts, tf, ti = [], [], [], []
            rng = np.random.default_rng(0)
            for t in range(ticks):
                sim.set_params(window=sim.window + rng.integers(-1, 2, n))
                sim.tick()
                p = sim.pis()
                x = np.column_stack([p[k] for k in PI_NAMES]).astype(np.float32)
                a = time.perf_counter()
                for i in range(n):
                    w.add_pis(t, i, x[i])
                w.commit()
                b = time.perf_counter()
                stock.refresh()
                c = time.perf_counter()
                old.refresh()
                d = time.perf_counter()
                eng.ingest(t, x)
                e = time.perf_counter()
                tw.append(b - a), ts.append(c - b), tf.append(d - c), ti.append(e - d)
            w.close(), stock.close(), old.close()
        k = max(1, ticks // 10)

        def f(v):
            return f"{1000 * np.mean(v):6.2f} [{1000 * np.mean(v[-k:]):5.2f}]"
        print(f"{n:>6} {f(tw):>13} {f(ts):>15} {f(tf):>15} {f(ti):>13}", flush=True)


def _filled_engine(n: int, device: str, loss_nodes: int | None = None,
                   ticks: int = 300, cuda_graph: bool = True, sets=()) -> Engine:
    cfg = load_config(None, [f"engine.cuda_graph={str(cuda_graph).lower()}", *sets])
    model = dataclasses.replace(cfg.model, replay_mb=64, stats_ticks=50, learn_start=16)
    if loss_nodes is not None:
        model = dataclasses.replace(model, loss_nodes=loss_nodes)
    specs = list(ClusterConfig().param_specs().values())
    eng = Engine.over_rows(cfg.engine, cfg.reward, list(PI_NAMES), specs, n, model=model,
                           device=device)
    rng = np.random.default_rng(0)
    for t in range(ticks):
        x = rng.uniform(1, 300, (n, len(PI_NAMES))).astype(np.float32)
        x[:, 4] = 20 + rng.integers(-1, 2, n)
        x[:, 5] = 2000
        eng.ingest(t, x)
    return eng


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _median_ms(fn, device, reps: int) -> float:
    ts = []
    for _ in range(reps):
        a = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - a)
    return _ms(ts)


def _back_to_back_ms(fn, device, reps: int) -> float:
    """Mean per call of ``reps`` calls in a row and one wait for the device at the end:
    the cost per step of a loop that trains every tick (the device works while the CPU
    goes on), where :func:`_median_ms` waits for every call."""
    _sync(device)
    a = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return 1000.0 * (time.perf_counter() - a) / reps


def _device_sampling_rows(n: int, device: str, loss_nodes, reps: int, sets=()) -> None:
    """``cluster_engine.device_sampling``: the minibatch drawn on the device
    (drl_engine/device_replay.py), alone (eager, waited for) and in ``Engine.train(1)``,
    whose graph captures the draw with the step, with the CUDA graph on and off; on CUDA
    also the graph's replay alone (GPU time between CUDA events, back to back) and the
    kernels it launches (torch.profiler, where it can read them)."""
    ds = [*sets, "cluster_engine.device_sampling=true"]
    engines = {g: _filled_engine(n, device, loss_nodes, cuda_graph=g, sets=ds)
               for g in (True, False)}
    eng = engines[True]
    batch = eng.cfg.batch_size
    for _ in range(5):                               # warm-up; on CUDA: the capture
        for e in engines.values():
            e.train(1)
    sampler = eng._sampler
    _sync(eng.device)
    prepare = _median_ms(lambda: sampler.prepare(eng.data, batch), eng.device, reps)
    draw = _median_ms(lambda: sampler.batch(batch), eng.device, reps)
    train = {g: _median_ms(lambda: e.train(1), e.device, reps) for g, e in engines.items()}
    row = {g: _back_to_back_ms(lambda: e.train(1), e.device, reps)
           for g, e in engines.items()}
    graphed = f"; graph replays {eng.dqn._graphs.replays}" if eng.dqn._graphs else ""
    if eng.dqn.compiles:
        failed = [f.failed for f in eng.compiled_parts if f.failed]
        graphed += f"; compiled: {'; '.join(failed) if failed else 'all four parts'}"
    print(f"    device sampling (ring of {eng.data.replay.capacity} ticks on {device}): "
          f"prepare (copy the new rows) {prepare:.2f} ms, draw + gather (no graph) "
          f"{draw:.2f} ms, Engine.train(1) with sampling {train[True]:.2f} ms (cuda_graph "
          f"off: {train[False]:.2f} ms); back to back, per call {row[True]:.2f} ms "
          f"(cuda_graph off: {row[False]:.2f} ms){graphed}", flush=True)
    if eng.dqn._graphs is not None:
        print(f"    {_replay_alone(eng, reps)}", flush=True)


def _replay_alone(eng, reps: int) -> str:
    """The captured step's graph replayed by itself: its GPU time per replay (CUDA
    events around ``reps`` replays in a row) and its kernels (a profile of 10)."""
    graph = eng.dqn._graphs.shapes[eng._sampler.key(eng.cfg.batch_size)].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    out = f"the graph replayed alone: {start.elapsed_time(end) / reps:.3f} ms GPU time each"
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / 10 / 1000
        out += f", {len(kernels) / 10:.0f} kernels ({busy:.3f} ms of them busy)"
    except Exception as e:                 # the profiler is a nicety here
        out += f" (kernels not counted: {type(e).__name__})"
    return out


def bench_step(n: int, device: str, reps: int, sets=(), device_sampling: bool = False,
               loss_node_picks=(None, 0)) -> None:
    """Where a training step's time goes: sampling (numpy), the step alone on tensors
    already on the device (as written, eager), ``learn`` from the sampled arrays (the
    transfer and, on CUDA, the graph replay), and ``Engine.train(1)`` (all of it, the
    loss read back) with the CUDA graph on and off (``engine.cuda_graph``) in one run;
    for each of ``loss_node_picks`` (``loss_nodes`` None: the config's, 0: all nodes)."""
    print(f"\nTraining step and act at {n} nodes on {device} "
          f"(torch threads {torch.get_num_threads()}); median of {reps}"
          f"{''.join('; ' + x for x in sets)}")
    for loss_nodes in loss_node_picks:
        engines = {g: _filled_engine(n, device, loss_nodes, cuda_graph=g, sets=sets)
                   for g in (True, False)}
        eng = engines[True]
        m = eng.mcfg.loss_nodes or n
        batch = eng.batch()
        t = eng.dqn.to_tensors(eng.dqn.step_batch(batch))
        for _ in range(5):                           # warm-up; on CUDA: the capture
            eng.dqn.train_step(t), eng.dqn.learn(batch)
            for e in engines.values():
                e.train(1)
        _sync(eng.device)
        sample = _median_ms(lambda: eng.batch(), "cpu", reps)
        step = _median_ms(lambda: eng.dqn.train_step(t), eng.device, reps)
        learn = _median_ms(lambda: eng.dqn.learn(batch), eng.device, reps)
        train = {g: _median_ms(lambda: e.train(1), e.device, reps)
                 for g, e in engines.items()}
        act = _median_ms(eng.act, eng.device, reps)
        row = {g: _back_to_back_ms(lambda: e.train(1), e.device, reps)
               for g, e in engines.items()}
        learn_row = _back_to_back_ms(lambda: eng.dqn.learn(batch), eng.device, reps)
        graphed = f"; graph replays {eng.dqn._graphs.replays}" if eng.dqn._graphs else ""
        print(f"  weights {eng.weights}; minibatch {eng.cfg.batch_size} ticks x {m} nodes "
              f"({eng.cfg.batch_size * m} node transitions): sampling {sample:.2f} ms, "
              f"train_step {step:.2f} ms (eager, inputs on the device), learn {learn:.2f} "
              f"ms (transfer + step), Engine.train(1) with sampling {train[True]:.2f} ms "
              f"(cuda_graph off: {train[False]:.2f} ms), act (all {n} nodes) "
              f"{act:.2f} ms{graphed}\n    back to back ({reps} calls, one wait at the "
              f"end), per call: Engine.train(1) with sampling {row[True]:.2f} ms "
              f"(cuda_graph off: {row[False]:.2f} ms), learn {learn_row:.2f} ms",
              flush=True)
        if device_sampling:
            _device_sampling_rows(n, device, loss_nodes, reps, sets)


WRITES = {"process": True, "sync": False}   # run_one's write_behind


def bench_hour(nodes_list, seed: int, feed: str, writes=("process",), sets=()) -> list[dict]:
    print(f"\nWall and CPU seconds per simulated hour, configs/cluster-sim.toml (3 phases), one "
          f"torch thread, seed {seed}, feed {feed}; writes (with feed rows): process = in a "
          f"process of their own, sync = on the main thread; CPU s: this process, w CPU s: "
          f"the writer process's; the harness's check of the daemon's step rule off "
          f"(check_live: test instrumentation, not the engine's)")
    print(f"{'nodes':>6} {'writes':>7} {'wall s':>7} {'CPU s':>7} {'w CPU s':>7} {'write s':>7} "
          f"{'weights':>8} "
          f"{'med tp':>7} {'mean tp':>7} {'in-band':>7} {'recover s per phase':>22} "
          f"{'alarms':>7}")
    out = []
    for n, how in ((n, how) for n in nodes_list for how in writes):
        cfg = load_config(None, [f"cluster.nodes={n}", *sets])
        cpu = time.process_time()          # the steadier figure on a shared machine
        r = run_one(cfg, seed, feed=feed, write_behind=WRITES[how], check_live=False)
        cpu = time.process_time() - cpu
        rec = ",".join("-" if p["recover_ticks"] is None else str(p["recover_ticks"])
                       for p in r["per_phase"])
        wcpu = f"{r['writer_cpu_s']:.1f}" if "writer_cpu_s" in r else "-"
        print(f"{n:>6} {how:>7} {r['wall_s']:>7.1f} {cpu:>7.1f} {wcpu:>7} {r['write_s']:>7.1f} "
              f"{r['weights']:>8} "
              f"{r['median_relative']:>7.3f} {r['mean_relative']:>7.3f} "
              f"{r['in_band_share']:>7.2f} {rec:>22} {r['alarms']:>7}", flush=True)
        out.append(r)
    return out


def bench_transfer(seeds: int) -> None:
    print(f"\nCheckpoint transfer: an hour on 8 nodes, then 64 nodes from that checkpoint "
          f"(--init-model) against a fresh engine, {seeds} seed(s)")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(Path(tmp) / "n8.pt")
        r8 = run_one(load_config(None, ["cluster.nodes=8"]), 100, save_model=ckpt)
        print(f"  trained on 8 nodes: {r8['weights']} weights, median tp "
              f"{r8['median_relative']:.3f}, {r8['train_steps']} steps")
        cfg = load_config(None, ["cluster.nodes=64"])
        for label, init in (("from 8-node ckpt", ckpt), ("fresh", None)):
            rs = [run_one(cfg, s, init_model=init) for s in range(seeds)]
            ph0 = [r["per_phase"][0] for r in rs]
            print(f"  64 nodes {label:>17}: weights {rs[0]['weights']}, median tp "
                  f"{np.median([r['median_relative'] for r in rs]):.3f}, mean "
                  f"{np.median([r['mean_relative'] for r in rs]):.3f}, phase 0 mean "
                  f"{np.median([p['mean_relative'] for p in ph0]):.3f}, phase 0 recover "
                  f"{[p['recover_ticks'] for p in ph0]}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "replay", "step", "hour", "transfer"),
                   default="all")
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 1000])
    p.add_argument("--replay-ticks", type=int, default=600)
    p.add_argument("--step-nodes", type=int, default=1000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feed", default="auto", choices=("auto", "reader", "rows"))
    p.add_argument("--writes", nargs="+", choices=tuple(WRITES), default=["process"])
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="hour, step: a config override, as capes converge-test --set")
    p.add_argument("--transfer-seeds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true",
                   help="step: --set engine.compile_step=true (on CUDA the step's parts "
                        "through torch.compile before the capture)")
    p.add_argument("--loss-nodes", choices=("both", "default", "all"), default="both",
                   help="step: the minibatch's nodes per tick: the config's loss_nodes, all "
                        "nodes, or both (default)")
    p.add_argument("--device-sampling", action="store_true",
                   help="step: also with cluster_engine.device_sampling (the minibatch drawn "
                        "on the device, in the step's CUDA graph)")
    p.add_argument("--quick", action="store_true",
                   help="CI: the replay and step parts, small (no simulated hours)")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.replay_ticks, args.step_nodes, args.reps = [8], 60, 64, 3
        args.device_sampling = True
        if args.part == "all":
            args.part = "quick"
    # numpy's BLAS on one thread too, as capes converge-test (use_one_core) and the daemon
    # run: its threads spin for a core (the cold start's 256 x 40 grid smoothing took
    # 11 ms a call with them, on a loaded machine)
    single_thread_blas()
    torch.set_num_threads(args.threads)
    if args.part in ("all", "quick", "replay"):
        bench_replay(args.nodes, args.replay_ticks)
    if args.part in ("all", "quick", "step"):
        sets = [*args.sets, *(["engine.compile_step=true"] if args.compile else [])]
        picks = {"both": (None, 0), "default": (None,), "all": (0,)}[args.loss_nodes]
        bench_step(args.step_nodes, args.device, args.reps, sets, args.device_sampling,
                   picks)
    if args.part in ("all", "hour"):
        bench_hour(args.nodes, args.seed, args.feed, args.writes, args.sets)
    if args.part in ("all", "transfer"):
        bench_transfer(args.transfer_seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
