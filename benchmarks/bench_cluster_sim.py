"""Cluster simulator speed and workload-change detection quality (issue 11).

    .venv/bin/python benchmarks/bench_cluster_sim.py            # both parts
    .venv/bin/python benchmarks/bench_cluster_sim.py --part sim --nodes 8 64 1000
    .venv/bin/python benchmarks/bench_cluster_sim.py --part detect --seeds 20

Part ``sim``: wall time per simulated hour (3,600 ticks) of ``ClusterSim`` alone on one
core, for a static setting (knobs never move: the steady state is reused) and for the
worst case where every node moves its window every tick (the fixed point is solved every
tick), plus the time of the best-static search of every phase of
``configs/cluster-sim.toml`` (shared and per-class).

Part ``detect``: detection delay and false alarms per simulated hour of the change
detectors in ``drl_engine/change_detection.py`` on the single-node default game
(peak window 50, delay 3 ticks) under three policies that stand in for an agent:

- ``fixed``: window 50, rate limit 200 (a converged agent that never moves);
- ``greedy``: an ε-greedy agent with ε = 0.1 that has converged on (50, 200): with
  probability 0.9 it steps towards (50, 200), else it takes a random action;
- ``random``: a uniformly random action every tick (ε = 1: an exploring agent).

Step runs move the peak from window 50 to 75 at tick 1,500 (a ``GamePhase``) and give the
detection delay: simulated seconds from the change to the first alarm at or after it,
counting the first changed sample as 1 (the sample of tick 1,500 is the first with the
new peak). Missed: no alarm in the remaining 2,100 s. False alarms per hour: every alarm
of the stationary runs (one hour, no change) and every alarm of the step runs but the
detection itself (before the change, or again after it), over all the simulated hours.
``raw`` is the robust CUSUM on the measured throughput itself; ``resid`` is the CUSUM on
residuals against each setting's expected level (``SettingResidualDetector`` keyed by
(window, rate limit), ``delays = [3, 0]``: the game's window acts 3 ticks late, its rate
limit at once).
Goal (issue 11): median delay <= 60 s and <= 1 false alarm per simulated hour.

Part ``cluster-detect``: the same on ``configs/cluster-sim.toml`` (64 nodes by default),
every node playing ``fixed``, ``greedy`` or ``random`` from phase 0's best static setting
(``random``: a random action every tick on every node, a random walk from there); the
delays are those of both phase changes (ticks 1,200 and 2,400).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from capes.common.config import build, read_toml  # noqa: E402
from drl_engine.change_detection import (ChangeDetector, ChangeDetectorConfig,  # noqa: E402
                                         SettingResidualDetector)
from storagegamesim.cluster import ClusterConfig, ClusterSim, phase_optima  # noqa: E402
from storagegamesim.game import GameConfig, StorageGameSim  # noqa: E402
from storagegamesim.phases import GamePhase  # noqa: E402

HOUR = 3600
CHANGE_AT = 1500


# --------------------------------------------------------------------------- simulator
def cluster_config(nodes: int) -> ClusterConfig:
    table = read_toml(ROOT / "configs" / "cluster-sim.toml")["cluster"]
    return build(ClusterConfig, {**table, "nodes": nodes}, "cluster-sim.toml", "cluster")


def sim_hour(nodes: int, moving: bool, seed: int = 0) -> float:
    cfg = cluster_config(nodes)
    sim = ClusterSim(cfg, seed=seed, judge=False)
    rng = np.random.default_rng(seed)
    steps = rng.integers(-1, 2, (HOUR, nodes)).astype(float) if moving else None
    t = time.perf_counter()
    for k in range(HOUR):
        if moving:
            sim.set_params(window=sim.window + steps[k])
        sim.tick()
    return time.perf_counter() - t


def bench_sim(node_counts, runs: int) -> None:
    print("ClusterSim, configs/cluster-sim.toml (3 phases), one core, wall s per simulated hour")
    print(f"{'nodes':>6} {'servers':>7} {'static':>8} {'all move':>9} {'search shared':>14} "
          f"{'search class':>13}")
    for n in node_counts:
        cfg = cluster_config(n)
        static = statistics.median(sim_hour(n, False, s) for s in range(runs))
        moving = statistics.median(sim_hour(n, True, s) for s in range(runs))
        t = time.perf_counter()
        phase_optima(cfg, "shared")
        t_sh = time.perf_counter() - t
        t = time.perf_counter()
        phase_optima(cfg, "class")
        t_cl = time.perf_counter() - t
        print(f"{n:>6} {cfg.n_servers:>7} {static:>8.2f} {moving:>9.2f} {t_sh:>13.2f}s "
              f"{t_cl:>12.2f}s", flush=True)


# --------------------------------------------------------------------------- detection
ACTIONS = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))      # NULL, window ±1, rate ±1 step


def policy_step(policy: str, game: StorageGameSim, rng: np.random.Generator) -> None:
    cfg = game.config
    if policy == "fixed":
        return
    if policy == "random" or rng.random() < 0.1:
        dw, dr = ACTIONS[int(rng.integers(len(ACTIONS)))]
    else:                                   # greedy towards the old optimum (50, 200)
        dw = int(np.sign(50 - game.window))
        dr = int(np.sign(cfg.rate_limit.max - game.rate_limit)) if dw == 0 else 0
    game.set_params(window=game.window + dw * cfg.window.step,
                    rate_limit=game.rate_limit + dr * cfg.rate_limit.step)


def make_detector(kind: str, dcfg: ChangeDetectorConfig, delay: int):
    if kind == "raw":
        return ChangeDetector(dcfg)
    # the key is (window, rate limit): the game's window acts delay_ticks late, its rate
    # limit at once
    return SettingResidualDetector(dataclasses.replace(dcfg, delays=[delay, 0]))


def detection_run(noise: float, policy: str, kind: str, seed: int, change: bool,
                  dcfg: ChangeDetectorConfig | None = None) -> list[int]:
    """Ticks (1-based) at which the detector alarmed in one simulated hour."""
    phases = [GamePhase(at_tick=CHANGE_AT, peak_window=75.0)] if change else []
    gcfg = GameConfig(noise=noise, win_hold_ticks=10 ** 6, phases=phases)
    if policy != "random":                  # start settled at the (old) optimum
        gcfg.window.default, gcfg.rate_limit.default = 50, 200
    game = StorageGameSim(gcfg, seed=seed)
    rng = np.random.default_rng(10_000 + seed)
    det = make_detector(kind, dcfg or ChangeDetectorConfig(), gcfg.delay_ticks)
    alarms = []
    while game.ticks < HOUR:
        policy_step(policy, game, rng)
        key = (game.window, game.rate_limit)
        x = game.tick()
        hit = det.update(x) if kind == "raw" else det.update(x, key)
        if hit:
            alarms.append(game.ticks)
    return alarms


def detection_cell(noise, policy, kind, seeds, dcfg=None) -> dict:
    fa_stationary = sum(len(detection_run(noise, policy, kind, s, False, dcfg))
                        for s in range(seeds))
    delays, missed, fa_step = [], 0, 0
    for s in range(seeds):
        alarms = detection_run(noise, policy, kind, 1000 + s, True, dcfg)
        after = [a for a in alarms if a >= CHANGE_AT]
        fa_step += len(alarms) - (1 if after else 0)    # all but the detection itself
        if after:
            delays.append(after[0] - CHANGE_AT + 1)
        else:
            missed += 1
    hours = 2 * seeds
    return {"noise": noise, "policy": policy, "detector": kind,
            "fa_per_hour": (fa_stationary + fa_step) / hours,
            "median_delay": statistics.median(delays) if delays else None,
            "p90_delay": float(np.percentile(delays, 90)) if delays else None,
            "max_delay": max(delays) if delays else None, "missed": missed, "runs": seeds}


def fmt(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def bench_detect(seeds: int, noises, policies, kinds) -> list[dict]:
    print(f"\nChange detection on the single-node default game, {seeds} stationary hours + "
          f"{seeds} step runs (peak 50 -> 75 at tick {CHANGE_AT}) per cell; "
          f"defaults of ChangeDetectorConfig")
    print(f"{'noise':>6} {'policy':>7} {'detector':>8} {'FA/hour':>8} {'median delay':>13} "
          f"{'p90':>6} {'max':>6} {'missed':>7}")
    rows = []
    for noise in noises:
        for policy in policies:
            for kind in kinds:
                r = detection_cell(noise, policy, kind, seeds)
                rows.append(r)
                print(f"{noise:>6.0%} {policy:>7} {kind:>8} {r['fa_per_hour']:>8.2f} "
                      f"{fmt(r['median_delay']):>12}s {fmt(r['p90_delay']):>5}s "
                      f"{fmt(r['max_delay']):>5}s {r['missed']:>4}/{r['runs']}", flush=True)
    return rows


def cluster_detection_run(nodes: int, noise: float, policy: str, kind: str, seed: int,
                          change: bool) -> list[int]:
    """Alarms in one hour of ``configs/cluster-sim.toml`` (phases at 1,200 and 2,400, or
    phase 0 only), every node playing ``policy`` around phase 0's best setting."""
    cfg = cluster_config(nodes)
    cfg = dataclasses.replace(cfg, noise=noise, phases=cfg.phases if change else [])
    opt = phase_optima(cfg)[0]
    w0, r0 = float(opt.window[0]), float(opt.rate_limit[0])
    cfg.window.default, cfg.rate_limit.default = w0, r0
    sim = ClusterSim(cfg, seed=seed, judge=False)
    rng = np.random.default_rng(50_000 + seed)
    d = cfg.delay_ticks
    if kind == "raw":
        det = ChangeDetector()
    elif kind == "vote":
        det = SettingResidualDetector(ChangeDetectorConfig(
            delay=d, min_streams=max(2, nodes // 4)), streams=nodes)
    else:
        det = SettingResidualDetector(ChangeDetectorConfig(delay=d), streams=nodes,
                                      pool="mean")
    alarms = []
    ws, rs = cfg.window.step, cfg.rate_limit.step
    while sim.ticks < HOUR:
        if policy != "fixed":                  # per node: ε random, else back home
            explore = rng.random(nodes) < (0.1 if policy == "greedy" else 1.0)
            a = rng.integers(0, len(ACTIONS), nodes)
            dw = np.where(explore, np.array(ACTIONS)[a, 0], np.sign(w0 - sim.window))
            dr = np.where(explore, np.array(ACTIONS)[a, 1],
                          np.where(dw == 0, np.sign(r0 - sim.rate_limit), 0))
            sim.set_params(window=sim.window + dw * ws, rate_limit=sim.rate_limit + dr * rs)
        keys = list(zip(sim.window.tolist(), sim.rate_limit.tolist()))
        x = sim.tick()
        hit = det.update(float(x.sum())) if kind == "raw" else det.update_many(x, keys)
        if hit:
            alarms.append(sim.ticks)
    return alarms


def bench_cluster_detect(nodes: int, seeds: int, noises, policies, kinds) -> None:
    starts = [p.at_tick for p in cluster_config(nodes).phases]
    print(f"\nChange detection on configs/cluster-sim.toml, {nodes} nodes, {seeds} stationary "
          f"hours (phase 0 only) + {seeds} hours with the phase changes at {starts}; "
          f"'vote': per-node residual CUSUMs, alarm when max(2, nodes/4) vote within 10 s; "
          f"'mean': one CUSUM on the mean per-node residual; 'raw': CUSUM on the total")
    print(f"{'noise':>6} {'policy':>7} {'detector':>8} {'FA/hour':>8} {'delays (s)':>24} "
          f"{'missed':>7}")
    for noise in noises:
        for policy in policies:
            for kind in kinds:
                fa, delays, missed = 0, [], 0
                for s in range(seeds):
                    fa += len(cluster_detection_run(nodes, noise, policy, kind, s, False))
                    alarms = cluster_detection_run(nodes, noise, policy, kind, 100 + s, True)
                    used = set()
                    for k, t0 in enumerate(starts):
                        t1 = starts[k + 1] if k + 1 < len(starts) else HOUR + 1
                        hit = [a for a in alarms if t0 <= a < t1]
                        if hit:
                            delays.append(hit[0] - t0 + 1)
                            used.add(hit[0])
                        else:
                            missed += 1
                    fa += len([a for a in alarms if a not in used])
                shown = (f"median {statistics.median(delays):.0f}, max {max(delays)}"
                         if delays else "-")
                print(f"{noise:>6.0%} {policy:>7} {kind:>8} {fa / (2 * seeds):>8.2f} "
                      f"{shown:>24} {missed:>3}/{seeds * len(starts)}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "sim", "detect", "cluster-detect"),
                   default="all")
    p.add_argument("--cluster-nodes", type=int, default=64,
                   help="nodes of the cluster detection part")
    p.add_argument("--cluster-seeds", type=int, default=3)
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 1000])
    p.add_argument("--runs", type=int, default=3, help="runs per simulator timing (median)")
    p.add_argument("--seeds", type=int, default=20, help="runs per detection cell")
    p.add_argument("--noise", type=float, nargs="+", default=[0.01, 0.1, 0.5])
    p.add_argument("--policy", nargs="+", default=["fixed", "greedy", "random"])
    p.add_argument("--detector", nargs="+", default=["raw", "resid"])
    p.add_argument("--quick", action="store_true",
                   help="CI: every part, 8 nodes, one run or seed, one policy")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.runs, args.seeds, args.noise = [8], 1, 1, [0.1]
        args.policy, args.detector = ["greedy"], ["resid"]
        args.cluster_nodes, args.cluster_seeds = 8, 1
    if args.part in ("all", "sim"):
        bench_sim(args.nodes, args.runs)
    if args.part in ("all", "detect"):
        bench_detect(args.seeds, args.noise, args.policy, args.detector)
    if args.part in ("all", "cluster-detect"):
        bench_cluster_detect(args.cluster_nodes, args.cluster_seeds, [0.1, 0.5],
                             ["fixed", "greedy", "random"], ["raw", "mean", "vote"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
