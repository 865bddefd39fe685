"""Recall of workloads that come back (issue 25): the default preset against its two
ablations, paired by seed, on the recurring-workloads game and on the stationary game.

    .venv/bin/python benchmarks/bench_recall.py --seeds 20 --noise 0.01 0.1 0.5 --jobs 4
    .venv/bin/python benchmarks/bench_recall.py --quick       # one short seeded run

Arms: ``default``; ``no-q`` (``engine.use_q_network=false``: greedy holds the best-known
setting); ``no-context`` (``engine.use_context=false``: one best-known setting for all
workloads); on request ``lead`` (``engine.context_lead=true``: the Q-network makes the
first move when the signature changes), ``infer`` (``engine.context_infer=true``: a new
workload's first setting from the Q-network's walk on fresh observations) and ``nearest``
(the same without the network: the nearest known context's best-known setting);
``demo`` (``engine.demo_margin``: the network also learns the move towards each
context's best-known setting, DQfD's margin loss) and its variants (``…3``: the
inference waits for three known workloads, ``engine.context_infer_known=3``; ``…-g0``:
``greedy_guard_steps=0``; ``scoped3``: ``demo3`` with ``engine.q_scope=new_contexts``, the
network acting only in a new workload's walk, so that ``nearest3`` plays its moves
everywhere else); round 7's, each on the default preset: ``slead``
(``engine.context_lead=true``: the scoped network leads on fresh observations when the
signature changes), ``qall`` (``engine.q_scope=everywhere``), ``qfirst``
(``engine.q_scope=first_visits``), ``known1`` / ``known2``
(``engine.context_infer_known`` 1 or 2: the walk acts at the second or third workload's
first visit too) and their ``…-noq`` ablations; round 8's: ``no-replan``
(``engine.context_replan=false``: a new workload's first probe keeps its uniform
target); round 9's: ``no-replan-noq`` (both off: the network's share as it was before
the re-aim) and ``infer-local`` (``engine.context_infer_local=true``: probes stay local
around where the network's walk ended); round 10's: ``pooled``
(``engine.lcb_pooled_noise=true``: each setting's variance in the best-known setting's
bound at least the variance pooled within settings); issue 39's: ``before-39`` (the
default before the real devices' exploration joined it), ``no-safe`` (without
``engine.probe_safe``, ``probe_walk_unit`` and ``wide_replan``) and ``no-safe-probe``
(without ``probe_safe`` only). ``--init-model``: every arm starts from that checkpoint's network, its memory
empty, and is named ``…+init`` (``--save-model`` keeps one session's checkpoint for
it; ``known1`` then walks where a network trained on earlier sessions points at every
new workload but the first). Games: ``recurring`` and ``stationary``
by default; ``mixes`` on request (``configs/recurring-workloads-mixes.toml``:
half-and-half mixes of the recurring game's workloads arrive unseen). Per arm: the median time to band of returns
and of first visits (a phase that never reaches its band counts as its length), and the
whole-session throughput against each phase's best static setting (``tp_frac_hour``);
per other arm: ``--base`` (default: the default arm) minus that arm, mean and 95 % t
interval over the paired seeds, of ``tp_frac_hour`` and of the throughput over the first
visits of the fourth workload on (where a new workload's setting can be inferred; on the
mixes game, the mixes). ``--table`` prints the table of earlier ``--json`` files;
``--turns`` where each arm's trained network turns the window, per workload; ``--losses``
where one arm's session loses against the per-phase best, per phase occurrence and part.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from capes.common.one_core import use_one_core
from capes.common.stats import paired_mean_ci
from capes.experiments.converge_test import load_config, run_one
from capes.common.config import as_overrides
from drl_engine.config import PER_NODE_KEEPS
from capes.experiments.recall_scoring import new_first_share, recall_summary

ROOT = Path(__file__).resolve().parents[1]
GAMES = {"recurring": ROOT / "configs" / "recurring-workloads.toml",
         "stationary": ROOT / "configs" / "storagegamesim.toml",
         "mixes": ROOT / "configs" / "recurring-workloads-mixes.toml"}
ARMS = {"default": [], "no-q": ["engine.use_q_network=false"],
        "no-context": ["engine.use_context=false"],
        "lead": ["engine.context_lead=true"],       # the Q-network's lead (docs/recall.md)
        "infer": ["engine.context_infer=true"],
        "nearest": ["engine.context_infer=true", "engine.use_q_network=false"],
        "infer-stack": ["engine.context_infer=true", "engine.context_infer_fresh=false"],
        "demo": ["engine.context_infer=true", "engine.demo_margin=0.5"],
        "demo-g0": ["engine.context_infer=true", "engine.demo_margin=0.5",
                    "engine.greedy_guard_steps=0"],
        "demo3-g0": ["engine.context_infer=true", "engine.demo_margin=0.5",
                     "engine.greedy_guard_steps=0", "engine.context_infer_known=3"],
        "demo3": ["engine.context_infer=true", "engine.demo_margin=0.5",
                  "engine.context_infer_known=3"],
        "nearest3": ["engine.context_infer=true", "engine.use_q_network=false",
                     "engine.context_infer_known=3"],
        "scoped3": ["engine.context_infer=true", "engine.demo_margin=0.5",
                    "engine.context_infer_known=3", "engine.q_scope=new_contexts"],
        # round 7: on the default preset (scoped3's settings)
        "slead": ["engine.context_lead=true"],
        "qall": ["engine.q_scope=everywhere"],
        "qfirst": ["engine.q_scope=first_visits"],
        "known1": ["engine.context_infer_known=1"],
        "known1-noq": ["engine.context_infer_known=1", "engine.use_q_network=false"],
        "known2": ["engine.context_infer_known=2"],
        "known2-noq": ["engine.context_infer_known=2", "engine.use_q_network=false"],
        # round 8: the default preset's re-aimed first probe of a new workload, off
        "no-replan": ["engine.context_replan=false"],
        # round 9: the network's share without the re-aim
        "no-replan-noq": ["engine.context_replan=false", "engine.use_q_network=false"],
        "infer-local": ["engine.context_infer_local=true"],
        # round 10: the best-known setting's bound with the pooled noise floor
        "pooled": ["engine.lcb_pooled_noise=true"],
        # issue 39: the default preset before the real devices' safe exploration joined
        # it (the values the per-node engine keeps: global probes, q_scope new_contexts)
        "before-39": as_overrides("engine", PER_NODE_KEEPS),
        # issue 39: the default without its safe probes, unit walks and re-aimed wide
        # probes (the default before they joined it)
        "no-safe": ["engine.probe_safe=0", "engine.probe_walk_unit=false",
                    "engine.wide_replan=false"],
        "no-safe-probe": ["engine.probe_safe=0"]}
MAIN_ARMS = ["default", "no-q", "no-context"]


def _config(game: str, arm: str, noise: float, limit: int | None):
    cfg = load_config(GAMES[game], [f"game.noise={noise}", *ARMS[arm]])
    if limit:            # a shorter session: the phases that start before it
        cfg.game = cfg.game.until(limit)
    return cfg


def _job(job):
    game, arm, noise, seed, limit, init = job
    use_one_core()
    r = dataclasses.asdict(run_one(_config(game, arm, noise, limit), seed, init_model=init))
    r.pop("trace", None)
    return {"game": game, "arm": arm + (INIT if init else ""), **r}


INIT = "+init"     # an arm started from --init-model's network (its memory empty)


def _play(cfg, seed: int, note=None, **kw):
    """``run_one`` on one core: its result and the engine it built; ``note(engine,
    record)`` is called on every tick."""
    from capes.experiments import converge_test
    got, make, run = [], converge_test.make_player, converge_test.run_ticks

    def run_ticks(engine, source, observers=(), **k):
        extra = [lambda rec: note(engine, rec)] if note else []
        return run(engine, source, observers=[*observers, *extra], **k)
    converge_test.make_player = lambda *a, **k: got.append(make(*a, **k)) or got[-1]
    converge_test.run_ticks = run_ticks
    try:
        use_one_core()
        return converge_test.run_one(cfg, seed, **kw), got[0]
    finally:
        converge_test.make_player, converge_test.run_ticks = make, run


def save_model(game: str, arm: str, noise: float, seed: int, limit: int, path: str,
               init: str | None = None) -> None:
    """Play one session (from ``init``'s network: sessions chained) and keep its engine's
    checkpoint at ``path``: a network trained on earlier sessions, for ``--init-model``
    (which takes its weights only)."""
    r, engine = _play(_config(game, arm, noise, limit), seed, init_model=init)
    engine.save(path)
    print(f"{game} {arm} noise={noise:g} seed={seed}: tp/best {r.tp_frac_hour:.4f}; "
          f"saved {path}")


def _paired(rs, base, score) -> str:
    pairs = [(score(r), score(base[r["seed"]])) for r in rs if r["seed"] in base]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    ci = paired_mean_ci([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None
    return f"{ci[0]:+.4f} [{ci[1]:+.4f}, {ci[2]:+.4f}] n={len(pairs)}" if ci else "-"


def table(runs: list[dict], base_arm: str = "default") -> str:
    """Per game, noise and arm: medians, and ``base_arm`` minus the arm, paired by seed,
    over the hour and over the first visits of the fourth workload on (``new firsts``:
    on the mixes game, the unseen mixes)."""
    lines = [f"{'game':>10} {'noise':>5} {'arm':>10} {'n':>3} {'return s':>8} "
             f"{'first s':>8} {'tp/best':>7} {base_arm + ' − arm [95 % t]':>34} "
             f"{'same, new firsts':>34}"]
    keys = sorted({(r["game"], r["noise"]) for r in runs})
    for game, noise in keys:
        cell = [r for r in runs if r["game"] == game and r["noise"] == noise]
        base = {r["seed"]: r for r in cell if r["arm"] == base_arm}
        for arm in dict.fromkeys(r["arm"] for r in cell):
            rs = [r for r in cell if r["arm"] == arm]
            if not rs:
                continue
            s = recall_summary(rs)
            hour = new = "-"
            if arm != base_arm:
                hour = _paired(rs, base, lambda r: r["tp_frac_hour"])
                new = _paired(rs, base, new_first_share)
            lines.append(f"{game:>10} {noise * 100:>4g}% {arm:>10} {len(rs):>3} "
                         f"{s['median_return_ticks']:>8.1f} {s['median_first_ticks']:>8.1f} "
                         f"{s['median_tp_frac']:>7.4f} {hour:>34} {new:>34}")
    return "\n".join(lines)


def turns(game: str, arm: str, seed: int, limit: int, rate_limit: float = 120.0) -> dict:
    """Where the network trained by one run (``limit`` simulated s) turns: per workload of
    the game, the first window whose Q(window−) exceeds Q(window+), on steady
    observations of that workload (its signature, the game's noise-free throughput at
    that window) at ``rate_limit`` (None: it never turns)."""
    import numpy as np
    from capes.common import actions
    cfg = _config(game, arm, 0.1, limit)
    engine = _play(cfg, seed)[1]
    exp = engine.experience
    names, params = list(exp.layout.pi_names), list(exp.layout.param_names)
    windows = np.arange(cfg.game.window.min, cfg.game.window.max + 1, cfg.game.window.step)
    up, down = (actions.encode(params.index("window"), s, len(params)) for s in (1, -1))
    out = {}
    for w in cfg.game.workloads:
        phase = cfg.game._with_workload(w.name)
        rows = []
        for v in windows:
            known = {"throughput": min(phase.curve(float(v)), rate_limit), "window": v,
                     "rate_limit": rate_limit}
            rows.append([known[n] if n in known else getattr(w, n) for n in names])
        x = np.array(rows, np.float64)
        x = np.repeat(x[:, None, None, :], exp.stack, 1)
        x = exp.normaliser(x) if exp.normalise else x
        vals = np.array([[rate_limit if p == "rate_limit" else v for p in params]
                         for v in windows])
        obs = np.concatenate([x.reshape(len(windows), -1),
                              (vals - exp._param_lo) / exp._param_span], 1)
        q = engine.dqn.q_values(obs.astype(np.float32))
        turn = np.flatnonzero(q[:, down] > q[:, up])
        out[w.name] = int(windows[turn[0]]) if len(turn) else None
    return out


PARTS = ("detect", "walk", "hold", "probe", "greedy")


def losses(game: str, arm: str, noise: float, seed: int, limit: int) -> list[dict]:
    """Where one session loses against the per-phase best: per phase occurrence, its loss
    (1 − noise-free throughput / the phase's best static, summed over its ticks, as a share
    of the session) split by what the engine was doing on each tick: ``detect`` (before
    the context switch, up to 60 ticks into the phase), ``walk`` (a return's or a new
    workload's walk), ``hold`` (the hold after it), ``probe`` (a probe or an exploring
    tick) and ``greedy`` (the rest)."""
    cfg, ticks = _config(game, arm, noise, limit), []

    def note(engine, rec):
        c, d = engine.context, rec.decision
        ticks.append("walk" if c is not None and c.target is not None else
                     "hold" if c is not None and c.holding(engine.action_ticks) else
                     "probe" if (engine.guide is not None and engine.guide.probe is not None)
                     or (d is not None and d.explored) else "greedy")
    r, engine = _play(cfg, seed, note, keep_trace=True)
    ctx = engine.context
    tp, total = r.trace["true_throughput"], len(r.trace["true_throughput"])
    starts = [0, *[p.at_tick for p in cfg.game.phases], total]
    switched = sorted(s.index for s in (ctx.switches if ctx is not None else []))
    ideal = [c.ideal_throughput for c in cfg.game.phase_configs()]
    out = []
    for k, ph in enumerate(r.phases):
        a, b = starts[k], starts[k + 1]
        found = [i for i in switched if a <= i < a + 60] if k else []
        until = found[0] + 1 if found else a
        part = dict.fromkeys(PARTS, 0.0)
        for t in range(a, b):               # tick t: its throughput, the engine's state
            lost = (1.0 - tp[t] / ideal[k]) / total
            part["detect" if t < until else ticks[t]] += lost
        out.append({"phase": k, "workload": ph["workload"], "visit": ph["visit"],
                    "lag": until - a, **part})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--noise", type=float, nargs="+", default=[0.1])
    p.add_argument("--games", nargs="+", default=["recurring", "stationary"], choices=list(GAMES))
    p.add_argument("--arms", nargs="+", default=MAIN_ARMS, choices=list(ARMS))
    p.add_argument("--limit", type=int, default=0, help="simulated s per session (0: the config's)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", default="", help="write every run here")
    p.add_argument("--base", default="default",
                   help=f"the arm the others are paired against (an arm run with "
                        f"--init-model is named with {INIT})")
    p.add_argument("--init-model", default="", metavar="CKPT",
                   help="every arm starts from this checkpoint's network, its memory empty")
    p.add_argument("--save-model", default="", metavar="CKPT",
                   help="play the first arm's first seed and keep its checkpoint (no table)")
    p.add_argument("--table", nargs="+", default=[],
                   help="print the table of these --json files (no runs)")
    p.add_argument("--turns", action="store_true",
                   help="per arm and seed, where its trained network turns (no table)")
    p.add_argument("--losses", action="store_true",
                   help="per seed of the first arm: where the session loses, per phase (no table)")
    p.add_argument("--quick", action="store_true", help="one seed, default arm, 700 s")
    a = p.parse_args()
    if a.quick:
        a.seeds, a.games, a.arms, a.limit, a.noise = 1, ["recurring"], ["default"], 700, [0.1]
    if a.table:
        runs = {(r["game"], r["noise"], r["arm"], r["seed"]): r      # a seed run twice:
                for f in a.table for r in json.loads(Path(f).read_text())}   # the last
        print(table(list(runs.values()), a.base))
        return 0
    if a.losses:
        rows = [(s, row) for s in range(a.first_seed, a.first_seed + a.seeds)
                for row in losses(a.games[0], a.arms[0], a.noise[0], s, a.limit)]
        print(f"{'seed':>4} {'phase':>5} {'workload':>10} {'visit':>5} {'lag':>4} "
              + " ".join(f"{p:>7}" for p in PARTS))
        for s, x in rows:
            print(f"{s:>4} {x['phase']:>5} {x['workload']:>10} {x['visit']:>5} {x['lag']:>4} "
                  + " ".join(f"{x[p]:7.4f}" for p in PARTS))
        n = a.seeds
        for name, keep in (("first visits", lambda x: x["visit"] == 1),
                           ("returns", lambda x: x["visit"] > 1)):
            sel = [x for _, x in rows if keep(x)]
            print(f"mean a session, {name}: " + ", ".join(
                f"{p} {sum(x[p] for x in sel) / n:.4f}" for p in PARTS))
        return 0
    if a.save_model:
        save_model(a.games[0], a.arms[0], a.noise[0], a.first_seed, a.limit, a.save_model,
                   a.init_model or None)
        return 0
    if a.turns:
        use_one_core()
        for g in a.games:
            for arm in a.arms:
                for seed in range(a.first_seed, a.first_seed + a.seeds):
                    print(g, arm, seed, turns(g, arm, seed, a.limit))
        return 0
    plan = [(g, arm, n, a.first_seed + s, a.limit, a.init_model or None)
            for g in a.games for n in a.noise
            for s in range(a.seeds) for arm in a.arms]
    runs = []
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        for i, r in enumerate(pool.map(_job, plan)):
            runs.append(r)
            print(f"[{i + 1}/{len(plan)}] {r['game']} {r['arm']} noise={r['noise']:g} "
                  f"seed={r['seed']}: tp/best {r['tp_frac_hour']:.4f}, "
                  f"{r['wall_s']:.0f} s wall", file=sys.stderr, flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(runs, indent=1, default=float))
    print(table(runs, a.base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
