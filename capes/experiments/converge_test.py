"""The converge test (thesis §5.2.2): the engine against StorageGameSim, in simulated time.

One run is the real data path in one process, with no second, simplified loop:

    game PIs -> ReplayWriter (SQLite WAL) -> ReplayReader cache -> Engine.act
             -> action row -> game parameters;  Engine.train (Algorithm 2 minibatches)

Per simulated second (tick): the game's PIs of tick t are written and committed, the
engine refreshes, picks a_t on s_t, the action is written and applied, the engine runs
``train_steps_per_tick`` minibatch updates, and the game advances to t + 1.
A run ends at the win or at the game's time limit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from capes.common import config as cfgmod
from capes.common.one_core import use_one_core
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
from capes.common.stats import median_ci, paired_mean_ci, wilson_ci
from drl_engine.config import DQNConfig
from drl_engine.decision import Decision
from drl_engine.engine import Engine
from drl_engine.loop import TickRecord, TickState, run_ticks
from drl_engine.config import RewardConfig
from capes.experiments.ray_backend import map_jobs
from capes.experiments.recall_scoring import score_occurrences
from storagegamesim.game import GameConfig, StorageGameSim
from capes.common.shipped_configs import config_path

DEFAULT_CONFIG = config_path("storagegamesim")


@dataclass
class ConvergeConfig:
    game: GameConfig = field(default_factory=GameConfig)
    engine: DQNConfig = field(default_factory=DQNConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


def load_config(path: str | Path | None = None, overrides=(), preset: str | None = None
                ) -> ConvergeConfig:
    """Load a converge-test config; the engine preset fills keys the file leaves out."""
    from capes.settings import load_settings
    path = Path(path) if path else (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    s = load_settings(path, overrides, preset)
    return ConvergeConfig(game=s.game, engine=s.engine, reward=s.reward)


@dataclass
class RunResult:
    seed: int
    noise: float
    reward: str
    preset: str
    won: bool                   # the paper's win rule met within the time limit
    ticks: int                  # simulated seconds played (the time limit with play-on)
    wall_s: float
    train_steps: int
    final_window: float
    final_rate_limit: float
    tuner: str = "capes"
    first_win_s: int | None = None   # converge time: simulated s to the first win
    # What a win does not show (README, "Converge test"), from the noise-free
    # throughput tp_t and the ideal throughput tp*:
    in_band_late: float | None = None      # share of ticks with |tp − tp*| <= band·tp*,
                                           # second half of the time limit (1,800–3,600 s)
    tp_frac_hour: float | None = None      # mean tp / tp* over the whole run (exploration
                                           # included: the price of tuning)
    tp_frac_late: float | None = None      # mean tp / tp* over the second half
    min_tp_frac_after_300: float | None = None   # lowest tp / tp* after tick 300
    change_alarms: int = 0      # workload changes the engine detected by itself ...
    change_alarm_ticks: list[int] | None = None   # ... at these ticks
    phases: list[dict] | None = None   # per workload phase (game.phases): recovery etc.
    trace: dict | None = None   # per-tick series, kept only when asked for


def tuning_metrics(true_tp: np.ndarray, ideal: np.ndarray, band: float,
                   time_limit: int) -> dict:
    """The honest metrics of one run from its per-tick noise-free and ideal throughput.
    "Late" is the second half of the time limit; a run stopped at the win has none."""
    frac = true_tp / ideal
    in_band = np.abs(true_tp - ideal) <= band * ideal
    late = slice(time_limit // 2, time_limit)
    has_late = len(frac) >= time_limit
    return {"in_band_late": float(in_band[late].mean()) if has_late else None,
            "tp_frac_hour": float(frac.mean()) if len(frac) else None,
            "tp_frac_late": float(frac[late].mean()) if has_late else None,
            "min_tp_frac_after_300": float(frac[300:].min()) if len(frac) > 300 else None}


class GameSource:
    """The simulator as the tick loop's source: each tick the game's PIs are written and
    committed; an action is recorded and applied to the game's knobs; the game then
    advances one simulated second (at the start of the next tick)."""

    def __init__(self, game: StorageGameSim, writer: ReplayWriter, session: int,
                 names: list[str], play_on: bool = True, commit_actions: bool = True):
        self.game, self.writer, self.session, self.names = game, writer, session, names
        # False: an action is committed with the next tick's PIs, one transaction a tick
        # (5 % of a simulated hour), where nothing reads the DB in between (run_one; the
        # next refresh sees both, as it did); True: at once, as a live daemon does
        self.commit_actions = commit_actions
        self.play_on = play_on          # keep playing after the win, to the time limit
        self.started = False
        self.true_tp: list[float] = []  # per tick, for the metrics
        self.ideal: list[float] = []
        self.first_win: int | None = None

    def observe(self) -> TickState | None:
        game = self.game
        if self.started:
            game.tick()
            self.true_tp.append(game.true_throughput)
            self.ideal.append(game.ideal_throughput)
            if game.won and self.first_win is None:
                self.first_win = game.ticks
        self.started = True
        done = game.ticks >= game.config.time_limit_ticks if self.play_on else game.over
        if done:
            return None
        pis = self.game.pis()
        self.writer.add_pis(self.game.ticks, 0, [pis[n] for n in self.game.config.pi_names()])
        self.writer.commit()
        return TickState(session=self.session)

    def apply(self, decision: Decision) -> None:
        self.writer.add_action(self.game.ticks, decision.action, decision.values)
        if self.commit_actions:
            self.writer.commit()
        self.game.set_params(**dict(zip(self.names, decision.values)))


TRACE_KEYS = ("throughput", "true_throughput", "window", "rate_limit", "epsilon", "loss")


def make_player(tuner: str, cfg: ConvergeConfig, reader: ReplayReader, device: str,
                seed: int, specs):
    """The engine (``capes``) or a baseline tuner, both driven by the same tick loop."""
    if tuner == "capes":
        return Engine(cfg.engine, cfg.reward, reader, device=device, seed=seed)
    from capes.experiments.baselines import make_tuner
    return make_tuner(tuner, specs, reader, cfg.reward, seed)


def run_one(cfg: ConvergeConfig, seed: int, db_path: str | Path | None = None,
            init_model: str | None = None, device: str = "cpu",
            keep_trace: bool = False, play_on: bool = True, tuner: str = "capes",
            tensorboard: str | None = None, observers=()) -> RunResult:
    """Play one game to the time limit (or, without ``play_on``, to the win); the same
    seed gives the same result. ``observers``: more of the tick loop's observers
    (``observer(record, game, engine)``), e.g. tools/engine_trace.py's."""
    game_seed, engine_seed = np.random.SeedSequence(seed).generate_state(2)
    game = StorageGameSim(cfg.game, seed=int(game_seed))
    specs = list(cfg.game.param_specs().values())
    with tempfile.TemporaryDirectory(prefix="capes-converge-") as tmp:
        path = Path(db_path) if db_path else Path(tmp) / "replay.db"
        writer = ReplayWriter(path)
        session = writer.begin_session(SessionInfo(
            pi_names=list(cfg.game.pi_names()), node_names=["sim0"], params=specs,
            label=f"converge seed={seed} noise={cfg.game.noise} reward={cfg.reward.type}"))
        reader = ReplayReader(path)
        engine = make_player(tuner, cfg, reader, device, int(engine_seed), specs)
        if init_model:
            engine.load(init_model, weights_only=True)
        trace = {k: [] for k in TRACE_KEYS} if keep_trace else None

        def record(rec: TickRecord) -> None:
            for k, v in (("throughput", game.throughput),
                         ("true_throughput", game.true_throughput),
                         ("window", game.window), ("rate_limit", game.rate_limit),
                         ("epsilon", engine.epsilon), ("loss", rec.loss)):
                trace[k].append(v)

        source = GameSource(game, writer, session.id, [s.name for s in specs], play_on,
                            commit_actions=False)
        extra = list(observers)
        observers = [record] if trace is not None else []
        observers += [lambda rec, f=f: f(rec, game, engine) for f in extra]
        writer_tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            writer_tb = SummaryWriter(str(Path(tensorboard) / (
                f"{tuner}-noise{cfg.game.noise:g}-{cfg.reward.type}-seed{seed}")))

            def scalars(rec: TickRecord) -> None:
                t = game.ticks
                for k, v in (("game/true_throughput", game.true_throughput),
                             ("game/throughput", game.throughput),
                             ("parameters/window", game.window),
                             ("parameters/rate_limit", game.rate_limit),
                             ("engine/epsilon", engine.epsilon), ("engine/loss", rec.loss)):
                    if v is not None:
                        writer_tb.add_scalar(k, v, t)
            observers.append(scalars)
        start = time.perf_counter()
        try:
            run_ticks(engine, source, observers=observers)
        finally:
            if writer_tb is not None:
                writer_tb.close()
        wall = time.perf_counter() - start
        writer.close()
        reader.close()
    metrics = tuning_metrics(np.array(source.true_tp), np.array(source.ideal),
                             cfg.game.win_band, cfg.game.time_limit_ticks)
    if cfg.game.phases:          # per phase occurrence: first visit or return (issue 25)
        metrics["phases"] = score_occurrences(cfg.game, source.true_tp)
    guide = getattr(engine, "guide", None)
    metrics["change_alarms"] = getattr(engine, "change_alarms", 0)
    metrics["change_alarm_ticks"] = list(guide.alarms) if guide is not None else []
    return RunResult(seed=seed, noise=cfg.game.noise, reward=cfg.reward.type,
                     preset=cfg.engine.preset if tuner == "capes" else "-", tuner=tuner,
                     won=source.first_win is not None, ticks=game.ticks, wall_s=wall,
                     train_steps=engine.train_steps, final_window=game.window,
                     final_rate_limit=game.rate_limit, first_win_s=source.first_win,
                     trace=trace, **metrics)


# -- grids of runs ------------------------------------------------------------------------

def _run_job(job):
    cfg, seed, init_model, keep_trace, device, play_on, tuner, tensorboard = job
    use_one_core()
    return run_one(cfg, seed, init_model=init_model, device=device, keep_trace=keep_trace,
                   play_on=play_on, tuner=tuner, tensorboard=tensorboard)


def cell_config(base: ConvergeConfig, noise: float, reward: str) -> ConvergeConfig:
    """The base config at one grid cell; a reward type other than the config's runs
    with its own default options."""
    options = base.reward.options if reward == base.reward.type else {}
    return dataclasses.replace(base, game=dataclasses.replace(base.game, noise=noise),
                               reward=dataclasses.replace(base.reward, type=reward,
                                                          options=options))


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


MIN_CI_RUNS = 6     # the fewest values whose min..max covers the median with >= 95 %


def summarise(runs: list[RunResult]) -> dict:
    wins = [r for r in runs if r.won]
    times = [r.first_win_s for r in wins]
    med = median_ci(times)
    # with fewer than MIN_CI_RUNS first-win times, the order-statistic interval is just
    # their range, not a 95 % interval: none is reported
    ci = [med[1], med[2]] if med and len(times) >= MIN_CI_RUNS else None
    lo, hi = wilson_ci(len(wins), len(runs))
    return {"runs": len(runs), "wins": len(wins),
            "success_rate": len(wins) / len(runs) if runs else 0.0,
            "success_rate_ci95": [lo, hi],
            "converge_times": times,
            "median_converge_s": med[0] if med else None,
            "median_ci95": ci,
            "median_in_band_late": _median(r.in_band_late for r in runs),
            "mean_in_band_late": (float(np.mean([r.in_band_late for r in runs]))
                                  if runs and all(r.in_band_late is not None for r in runs)
                                  else None),
            "median_tp_frac_hour": _median(r.tp_frac_hour for r in runs),
            "median_tp_frac_late": _median(r.tp_frac_late for r in runs),
            "median_min_tp_frac_after_300": _median(r.min_tp_frac_after_300 for r in runs),
            "wall_s": sum(r.wall_s for r in runs),
            "wall_s_per_sim_hour": (sum(r.wall_s for r in runs) /
                                    max(1, sum(r.ticks for r in runs)) * 3600)}


def paired_difference(runs_a: list[dict], runs_b: list[dict], key: str,
                      confidence: float = 0.95) -> dict | None:
    """``key`` of B minus A over the seeds both played (runs as in a report's
    ``runs``): mean, its t interval and the number of pairs; None under two pairs."""
    a = {r["seed"]: r.get(key) for r in runs_a}
    pairs = [(a[r["seed"]], r.get(key)) for r in runs_b
             if r["seed"] in a and a[r["seed"]] is not None and r.get(key) is not None]
    ci = paired_mean_ci([x for x, _ in pairs], [y for _, y in pairs], confidence)
    if ci is None:
        return None
    return {"mean": ci[0], "ci": [ci[1], ci[2]], "n": len(pairs)}


def run_grid(base: ConvergeConfig, noises, rewards, seeds: int, first_seed: int = 0,
             jobs: int = 1, init_model: str | None = None, keep_traces: int = 0,
             progress=sys.stderr, device: str = "cpu", play_on: bool = True,
             tuner: str = "capes", tensorboard: str | None = None,
             backend: str = "local", ray_address: str | None = None) -> dict:
    """Every (noise, reward) cell with ``seeds`` runs; returns the JSON-ready report.
    ``backend="ray"``: the runs are Ray tasks (``capes.experiments.ray_backend``)."""
    plan = [(noise, reward, first_seed + s) for noise in noises for reward in rewards
            for s in range(seeds)]
    jobs_in = [(cell_config(base, n, r), seed, init_model, seed - first_seed < keep_traces,
                device, play_on, tuner, tensorboard) for n, r, seed in plan]
    results: list[RunResult] = []
    t0 = time.perf_counter()

    def report(i, res):
        if progress is not None:
            status = (f"won at {res.first_win_s} s" if res.won else f"lost ({res.ticks} s)")
            if res.in_band_late is not None:
                status += f", in band {res.in_band_late:.2f} late"
            print(f"[{i + 1}/{len(plan)}] noise={res.noise:g} reward={res.reward} "
                  f"seed={res.seed}: {status}, {res.wall_s:.1f} s wall "
                  f"(elapsed {time.perf_counter() - t0:.0f} s)", file=progress, flush=True)

    for i, res in enumerate(map_jobs(_run_job, jobs_in, backend, jobs, ray_address)):
        results.append(res)
        report(i, res)
    cells = []
    for noise in noises:
        for reward in rewards:
            runs = [r for r in results if r.noise == noise and r.reward == reward]
            cells.append({"noise": noise, "reward": reward, **summarise(runs)})
    return {"preset": base.engine.preset, "tuner": tuner, "play_on": play_on,
            "seeds_per_cell": seeds, "first_seed": first_seed, "device": device,
            "train_steps_per_tick": base.engine.train_steps_per_tick,
            "config": cfgmod.to_table(base), "cells": cells,
            "runs": [dataclasses.asdict(r) for r in results],
            "wall_s": time.perf_counter() - t0}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """One line per cell: the paper's success rate and converge time, then what a win
    does not show: in-band share and throughput (fraction of ideal) late and overall,
    and the lowest throughput after tick 300."""
    lines = [f"tuner={report.get('tuner', 'capes')}  preset={report['preset']}  "
             f"seeds/cell={report['seeds_per_cell']}  "
             f"train steps/tick={report['train_steps_per_tick']}  "
             f"play-on={'yes' if report.get('play_on', True) else 'no'}",
             f"{'noise':>6} {'reward':>10} {'wins':>7} {'success':>8} "
             f"{'1st win s':>9} {'95% CI':>12} {'in-band':>7} {'tp hour':>7} "
             f"{'tp late':>7} {'min tp':>6} {'wall s':>7} {'s/sim-h':>7}",
             f"{'':>6} {'':>10} {'':>7} {'':>8} {'(median)':>9} {'':>12} "
             f"{'late':>7} {'':>7} {'':>7} {'>300s':>6} {'':>7} {'':>7}"]
    for c in report["cells"]:
        ci = c["median_ci95"]
        cis = (f"[{ci[0]:.0f}, {ci[1]:.0f}]" if ci else
               f"n={c['wins']}<{MIN_CI_RUNS}" if c["wins"] else "-")
        lines.append(f"{c['noise'] * 100:>5.0f}% {c['reward']:>10} "
                     f"{c['wins']:>3}/{c['runs']:<3} {c['success_rate'] * 100:>7.0f}% "
                     f"{_fmt(c['median_converge_s'], '.0f'):>9} {cis:>12} "
                     f"{_fmt(c['median_in_band_late'], '.2f'):>7} "
                     f"{_fmt(c['median_tp_frac_hour'], '.2f'):>7} "
                     f"{_fmt(c['median_tp_frac_late'], '.2f'):>7} "
                     f"{_fmt(c['median_min_tp_frac_after_300'], '.2f'):>6} "
                     f"{c['wall_s']:>7.1f} {c['wall_s_per_sim_hour']:>7.2f}")
    lines.append("in-band late: median share of ticks 1,800–3,600 s with noise-free "
                 "throughput within the win band; tp: median mean noise-free throughput / "
                 "ideal (hour, late); min tp: median lowest after tick 300")
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=float))
    os.replace(tmp, path)
