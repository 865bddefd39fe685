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


# -- the cluster variant: two arms' runs, paired by seed ----------------------------------

def _share(phases: list[dict]) -> float | None:
    """Tick-weighted throughput / best static over ``phases`` (None: no ticks)."""
    ticks = sum(p["ticks"] for p in phases)
    return sum(p["mean_relative"] * p["ticks"] for p in phases) / ticks if ticks else None


def _to_band(phases: list[dict]) -> list[int]:
    return [p["recover_ticks"] if p["recover_ticks"] is not None else p["ticks"]
            for p in phases if p["ticks"]]


def cluster_pairs(runs_a: list[dict], runs_b: list[dict]) -> list[dict]:
    """Arm A against arm B on the cluster variant (runs of
    ``capes.experiments.cluster_test.run_one``), paired by seed: per row, each arm's
    median over seeds and A − B, mean [95 % t]. Rows: the hour, the cluster's returns
    and first visits (throughput / best static), and each node class's returns
    (throughput / its nodes' throughput at the best static setting; the pooled median
    time to band of its returns, a return that never got there counted as its length)."""
    from capes.common.stats import paired_mean_ci
    a = {r["seed"]: r for r in runs_a}
    b = {r["seed"]: r for r in runs_b}
    seeds = sorted(set(a) & set(b))

    def row(name, f, to_band=None):
        va, vb = [f(a[s]) for s in seeds], [f(b[s]) for s in seeds]
        ci = paired_mean_ci(vb, va)
        out = {"row": name, "seeds": seeds, "a": float(np.median(va)), "b": float(np.median(vb)),
               "a_minus_b": None if ci is None else list(ci)}
        if to_band is not None:
            out.update(band_a=float(np.median([t for s in seeds for t in to_band(a[s])])),
                       band_b=float(np.median([t for s in seeds for t in to_band(b[s])])))
        return out

    occ = lambda r, ret: [p for p in r["occurrences"] if (p["visit"] > 1) == ret]  # noqa: E731
    rows = [row("hour", lambda r: r["tp_frac_hour"]),
            row("returns", lambda r: _share(occ(r, True)), lambda r: _to_band(occ(r, True))),
            row("first visits", lambda r: _share(occ(r, False)),
                lambda r: _to_band(occ(r, False)))]
    for name in sorted({c["workload"] for s in seeds for c in a[s]["classes"]}):
        ret = lambda r: [c for c in r["classes"] if c["workload"] == name and c["visit"] > 1]  # noqa: E731
        if all(ret(a[s]) for s in seeds):
            rows.append(row(f"{name} returns", lambda r: _share(ret(r)), lambda r: _to_band(ret(r))))
    return rows


def main(argv=None) -> int:
    """``python -m capes.experiments.recall_scoring A.json … -- B.json …``: the cluster
    variant's arm A (``capes converge-test --json`` reports) against arm B by seed."""
    import json
    import sys
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m capes.experiments.recall_scoring A.json ... -- B.json ...",
              file=sys.stderr)
        return 2
    cut = args.index("--")
    load = lambda paths: [r for p in paths for r in json.load(open(p))["runs"]]  # noqa: E731
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'':18} {'A':>7} {'B':>7}  A − B [95 % t]          to band s (A / B)")
    for r in cluster_pairs(load(args[:cut]), load(args[cut + 1:])):
        d = r["a_minus_b"]
        diff = "-" if d is None else f"{d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}]"
        band = f"{fmt(r.get('band_a'), '.0f')} / {fmt(r.get('band_b'), '.0f')}" \
            if "band_a" in r else ""
        print(f"{r['row']:18} {r['a']:7.4f} {r['b']:7.4f}  {diff:24} {band}")
    print(f"seeds {r['seeds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
