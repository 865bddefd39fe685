"""Scoring workloads that come back (issue 25): every phase occurrence of a run, as a
first visit of its workload or a return, and a grid's summary of them.

A phase's score (:func:`storagegamesim.phases.score_phases`) says how long the tuner took
to reach the phase's band and hold it (``recover_ticks``: the game's win rule inside the
phase) and its throughput against the phase's best static setting. Here each phase also
carries its workload's name and which visit of that workload it is (1: the first), so
that "does the tuner recall a workload it has seen" is one number: the median
``recover_ticks`` of returns, next to that of first visits.
"""
from __future__ import annotations

import math

import numpy as np

from storagegamesim.phases import phase_starts, score_phases


def score_occurrences(game_cfg, true_tp, first_tick: int = 1) -> list[dict]:
    """Per phase of ``game_cfg`` (a :class:`~storagegamesim.game.GameConfig`) in the
    trace ``true_tp`` (noise-free throughput of ticks ``first_tick`` …): its score, its
    ``workload`` and ``visit`` (1 for a first visit, 2, 3 … for returns)."""
    cfgs = game_cfg.phase_configs()
    names = [c.workload or f"phase {k}" for k, c in enumerate(cfgs)]
    scores = score_phases(true_tp, phase_starts(game_cfg.phases),
                          [c.ideal_throughput for c in cfgs], band=game_cfg.win_band,
                          hold=game_cfg.win_hold_ticks + 1, first_tick=first_tick,
                          names=names)
    return with_visits(scores)


def with_visits(scores, workloads=None) -> list[dict]:
    """Phase scores as dicts with their ``workload`` (``workloads[k]``, default the
    phase's name) and ``visit`` (1 for a first visit of that workload, 2, 3 … for
    returns)."""
    seen: dict[str, int] = {}
    out = []
    for k, s in enumerate(scores):
        w = s.name if workloads is None else workloads[k]
        seen[w] = seen.get(w, 0) + 1
        out.append({**s.to_dict(), "workload": w, "visit": seen[w]})
    return out


def cluster_workloads(sim) -> list[str]:
    """Each phase's workload on the cluster variant: its active classes' names (the
    first phase is named by its workloads too, not "phase 0")."""
    return ["+".join(name for name, _ in sim.class_nodes(k))
            for k in range(len(sim.phase_names))]


def score_classes(sim, node_tp, best, first_tick: int = 1) -> list[dict]:
    """The cluster variant scored per node class: for every phase of ``sim`` (a
    :class:`~storagegamesim.cluster.ClusterSim`) and every workload class active in it,
    the same score as a phase's (:func:`with_visits`), on the summed noise-free
    throughput of that class's nodes (``node_tp``: (ticks, nodes) from ``first_tick``)
    against their throughput at the phase's best static setting ``best[k]`` (a
    :class:`~storagegamesim.cluster.StaticOptimum`). A class's visits count the phases
    its workload ran in; ``phase`` says which phase an entry is of."""
    tp = np.asarray(node_tp, float)
    cfg = sim.config
    starts = phase_starts(cfg.phases)
    out: list = []
    seen: dict[str, int] = {}
    for k, opt in enumerate(best):
        ideal = sim.evaluate(opt.window, opt.rate_limit, k)["throughput"]
        for name, nodes in sim.class_nodes(k):
            one = [starts[k]] + ([starts[k + 1]] if k + 1 < len(starts) else [])
            sc = score_phases(tp[:, nodes].sum(axis=1), one,
                              [float(ideal[nodes].sum())] * len(one),
                              band=cfg.win_band, hold=cfg.win_hold_ticks + 1,
                              first_tick=first_tick, names=[name] * len(one))[0]
            seen[name] = seen.get(name, 0) + 1
            out.append({**sc.to_dict(), "phase": k, "workload": name, "visit": seen[name],
                        "nodes": len(nodes)})
    return out


def new_first_share(run: dict, known: int = 3) -> float | None:
    """Tick-weighted throughput / best static setting over the first visits of every
    workload after the first ``known``: where a new workload's setting can be inferred
    from others (``engine.context_infer``; on the mixes game, the mixes' first visits).
    None when the run has no such visit."""
    ph = [p for p in run.get("phases") or [] if p["visit"] == 1][known:]
    ticks = sum(p["ticks"] for p in ph)
    if not ticks:
        return None
    return sum(p["mean_relative"] * p["ticks"] for p in ph) / ticks


def recall_summary(runs: list[dict], censor: bool = True) -> dict:
    """Over the runs (dicts with ``phases`` as above and ``tp_frac_hour``): the median
    time to band of returns and of first visits, the share of each reached, and the
    median whole-session throughput against the per-phase best. A phase that never
    reached its band counts as its length (``censor``): a median over reached phases
    only would flatter a tuner that misses the short ones."""
    def times(first: bool):
        out, reached = [], 0
        for r in runs:
            for p in r.get("phases") or []:
                if (p["visit"] == 1) != first or not p["ticks"]:
                    continue
                if p["recover_ticks"] is not None:
                    out.append(p["recover_ticks"])
                    reached += 1
                elif censor:
                    out.append(p["ticks"])
        return out, reached

    ret, ret_ok = times(first=False)
    fst, fst_ok = times(first=True)
    tp = [r["tp_frac_hour"] for r in runs if r.get("tp_frac_hour") is not None]
    return {"runs": len(runs),
            "return_phases": len(ret), "returns_reached": ret_ok,
            "median_return_ticks": float(np.median(ret)) if ret else math.nan,
            "first_phases": len(fst), "firsts_reached": fst_ok,
            "median_first_ticks": float(np.median(fst)) if fst else math.nan,
            "median_tp_frac": float(np.median(tp)) if tp else math.nan}
