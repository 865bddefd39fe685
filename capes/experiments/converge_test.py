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
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from capes.common import config as cfgmod
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
from capes.common.stats import median_ci, wilson_ci
from drl_engine.config import DQNConfig
from drl_engine.engine import Decision, Engine
from drl_engine.loop import TickRecord, TickState, run_ticks
from drl_engine.config import RewardConfig
from storagegamesim.game import PI_NAMES, GameConfig, StorageGameSim

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "storagegamesim.toml"


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
    won: bool
    ticks: int                  # simulated seconds played (the converge time when won)
    wall_s: float
    train_steps: int
    final_window: float
    final_rate_limit: float
    trace: dict | None = None   # per-tick series, kept only when asked for


class GameSource:
    """The simulator as the tick loop's source: each tick the game's PIs are written and
    committed; an action is recorded and applied to the game's knobs; the game then
    advances one simulated second (at the start of the next tick)."""

    def __init__(self, game: StorageGameSim, writer: ReplayWriter, session: int,
                 names: list[str]):
        self.game, self.writer, self.session, self.names = game, writer, session, names
        self.started = False

    def observe(self) -> TickState | None:
        if self.started:
            self.game.tick()
        self.started = True
        if self.game.over:
            return None
        pis = self.game.pis()
        self.writer.add_pis(self.game.ticks, 0, [pis[n] for n in PI_NAMES])
        self.writer.commit()
        return TickState(session=self.session)

    def apply(self, decision: Decision) -> None:
        self.writer.add_action(self.game.ticks, decision.action, decision.values)
        self.writer.commit()
        self.game.set_params(**dict(zip(self.names, decision.values)))


TRACE_KEYS = ("throughput", "true_throughput", "window", "rate_limit", "epsilon", "loss")


def run_one(cfg: ConvergeConfig, seed: int, db_path: str | Path | None = None,
            init_model: str | None = None, device: str = "cpu",
            keep_trace: bool = False) -> RunResult:
    """Play one game to the win or the time limit; deterministic for a given seed."""
    game_seed, engine_seed = np.random.SeedSequence(seed).generate_state(2)
    game = StorageGameSim(cfg.game, seed=int(game_seed))
    specs = list(cfg.game.param_specs().values())
    with tempfile.TemporaryDirectory(prefix="capes-converge-") as tmp:
        path = Path(db_path) if db_path else Path(tmp) / "replay.db"
        writer = ReplayWriter(path)
        session = writer.begin_session(SessionInfo(
            pi_names=list(PI_NAMES), node_names=["sim0"], params=specs,
            label=f"converge seed={seed} noise={cfg.game.noise} reward={cfg.reward.type}"))
        reader = ReplayReader(path)
        engine = Engine(cfg.engine, cfg.reward, reader, device=device, seed=int(engine_seed))
        if init_model:
            engine.load(init_model, weights_only=True)
        trace = {k: [] for k in TRACE_KEYS} if keep_trace else None

        def record(rec: TickRecord) -> None:
            for k, v in (("throughput", game.throughput),
                         ("true_throughput", game.true_throughput),
                         ("window", game.window), ("rate_limit", game.rate_limit),
                         ("epsilon", engine.epsilon), ("loss", rec.loss)):
                trace[k].append(v)

        start = time.perf_counter()
        run_ticks(engine, GameSource(game, writer, session.id, [s.name for s in specs]),
                  observers=[record] if trace is not None else [])
        wall = time.perf_counter() - start
        writer.close()
        reader.close()
    return RunResult(seed=seed, noise=cfg.game.noise, reward=cfg.reward.type,
                     preset=cfg.engine.preset, won=game.won, ticks=game.ticks, wall_s=wall,
                     train_steps=engine.train_steps, final_window=game.window,
                     final_rate_limit=game.rate_limit, trace=trace)


# -- grids of runs ------------------------------------------------------------------------

def _run_job(job):
    cfg, seed, init_model, keep_trace, device = job
    import torch
    torch.set_num_threads(1)
    return run_one(cfg, seed, init_model=init_model, device=device, keep_trace=keep_trace)


def cell_config(base: ConvergeConfig, noise: float, reward: str) -> ConvergeConfig:
    """The base config at one grid cell; a reward type other than the config's runs
    with its own default options."""
    options = base.reward.options if reward == base.reward.type else {}
    return dataclasses.replace(base, game=dataclasses.replace(base.game, noise=noise),
                               reward=dataclasses.replace(base.reward, type=reward,
                                                          options=options))


def summarise(runs: list[RunResult]) -> dict:
    wins = [r for r in runs if r.won]
    times = [r.ticks for r in wins]
    med = median_ci(times)
    lo, hi = wilson_ci(len(wins), len(runs))
    return {"runs": len(runs), "wins": len(wins),
            "success_rate": len(wins) / len(runs) if runs else 0.0,
            "success_rate_ci95": [lo, hi],
            "converge_times": times,
            "median_converge_s": med[0] if med else None,
            "median_ci95": [med[1], med[2]] if med else None,
            "wall_s": sum(r.wall_s for r in runs),
            "wall_s_per_sim_hour": (sum(r.wall_s for r in runs) /
                                    max(1, sum(r.ticks for r in runs)) * 3600)}


def run_grid(base: ConvergeConfig, noises, rewards, seeds: int, first_seed: int = 0,
             jobs: int = 1, init_model: str | None = None, keep_traces: int = 0,
             progress=sys.stderr, device: str = "cpu") -> dict:
    """Every (noise, reward) cell with ``seeds`` runs; returns the JSON-ready report."""
    plan = [(noise, reward, first_seed + s) for noise in noises for reward in rewards
            for s in range(seeds)]
    jobs_in = [(cell_config(base, n, r), seed, init_model, seed - first_seed < keep_traces,
                device) for n, r, seed in plan]
    results: list[RunResult] = []
    t0 = time.perf_counter()

    def report(i, res):
        if progress is not None:
            status = f"won at {res.ticks} s" if res.won else f"lost ({res.ticks} s)"
            print(f"[{i + 1}/{len(plan)}] noise={res.noise:g} reward={res.reward} "
                  f"seed={res.seed}: {status}, {res.wall_s:.1f} s wall "
                  f"(elapsed {time.perf_counter() - t0:.0f} s)", file=progress, flush=True)

    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for i, res in enumerate(pool.map(_run_job, jobs_in)):
                results.append(res)
                report(i, res)
    else:
        for i, job in enumerate(jobs_in):
            results.append(_run_job(job))
            report(i, results[-1])
    cells = []
    for noise in noises:
        for reward in rewards:
            runs = [r for r in results if r.noise == noise and r.reward == reward]
            cells.append({"noise": noise, "reward": reward, **summarise(runs)})
    return {"preset": base.engine.preset, "seeds_per_cell": seeds, "first_seed": first_seed,
            "device": device,
            "train_steps_per_tick": base.engine.train_steps_per_tick,
            "config": cfgmod.to_table(base), "cells": cells,
            "runs": [dataclasses.asdict(r) for r in results],
            "wall_s": time.perf_counter() - t0}


def format_table(report: dict) -> str:
    lines = [f"preset={report['preset']}  seeds/cell={report['seeds_per_cell']}  "
             f"train steps/tick={report['train_steps_per_tick']}",
             f"{'noise':>6} {'reward':>10} {'wins':>7} {'success':>8} "
             f"{'median s':>9} {'95% CI':>13} {'wall s':>7} {'s/sim-h':>8}"]
    for c in report["cells"]:
        ci = c["median_ci95"]
        med = f"{c['median_converge_s']:.0f}" if c["median_converge_s"] is not None else "-"
        cis = f"[{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "-"
        lines.append(f"{c['noise'] * 100:>5.0f}% {c['reward']:>10} "
                     f"{c['wins']:>3}/{c['runs']:<3} {c['success_rate'] * 100:>7.0f}% "
                     f"{med:>9} {cis:>13} {c['wall_s']:>7.1f} "
                     f"{c['wall_s_per_sim_hour']:>8.2f}")
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=float))
    os.replace(tmp, path)
