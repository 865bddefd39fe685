"""The cluster converge test (issue 11): the engine, per node, against ClusterSim's phases.

    capes converge-test --config configs/cluster-sim.toml [--set cluster.nodes=N] \\
        --seeds K [--tuner capes,random,hill,bo] [--json OUT]

One run is the real data path in one process, in simulated time:

    ClusterSim PIs -> ReplayWriter (one row per node and tick, SQLite WAL)
        -> the engine's ring (ReplayReader refresh, or the same rows fed directly:
           ``feed``) -> Engine.act (per-node mode: one action per node) -> every node's knobs;
        Engine.train (minibatches of ticks × nodes)

driven by :func:`drl_engine.loop.run_ticks`, the engine's own tick loop. The engine is
told nothing about the phases: it has to notice the change itself (its change
detector). The baselines of ``capes/experiments/baselines.py`` (``random``, ``hill``,
``bo``, ``tpe``, ``cma``) run in the same loop on the same replay DB, tuning one setting
shared by every node (what :func:`~storagegamesim.cluster.phase_optima` calls the best
static setting), and are *told* each phase change (``workload_changed``): they search
again from scratch at every phase, as the issue asks.

Per phase (:func:`~storagegamesim.phases.score_phases` on the noise-free objective):
time to recover (first tick from which it stays in the ±band of the phase's best static
setting for ``win_hold_ticks`` + 1 ticks), in-band share, mean and median throughput
relative to the phase's best static setting; per run the median and mean over the hour;
for the engine its weight count, the change detector's alarms (detections with their
delay and false alarms) and the wall time.

``feed``: ``reader`` (the engine refreshes a ReplayReader: the whole read path) or
``rows`` (the harness hands the engine the rows it has just committed). ``auto`` picks
``reader`` up to 64 nodes and ``rows`` above: at 1,000 nodes a ReplayReader refresh
costs ~4-8 ms a tick in its per-row decode loop (``benchmarks/bench_cluster_engine.py
--part replay``; it was ~50 ms and growing after 600 ticks while its sizing query
scanned the whole index).

``refused_live``: the engine's per-node actions that a live interface daemon would
refuse under its per-node step rule (:class:`LiveStepRule`, the daemon's own
``ActionChecker.check_rows``: a row moves one knob by at most ``MAX_STEPS`` steps a
tick); the simulator applies them anyway, so this counts a bug class the simulated
cluster would otherwise hide (a rollback or recall that jumps every knob at once works
here and is refused live).

For the engine the report also has its rollbacks to the best-known setting
(``rollbacks``, ``rollback_ticks``, ``stale_bests``; ``RB/h`` in the table) and the
recommendations for knobs whose cost category keeps them from being tuned online.
``backend="ray"`` sends the runs to Ray (:mod:`capes.experiments.ray_backend`).
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
from capes.common.params import ParameterSpec
from capes.common.replay_db import ReplayReader, ReplayWriter, SessionInfo
from drl_engine.cluster_config import NodeModelConfig
from drl_engine.engine import Engine
from drl_engine.decision import Decision
from drl_engine.config import DQNConfig, RewardConfig
from drl_engine.loop import TickRecord, TickState, run_ticks
from storagegamesim.cluster import ClusterConfig, ClusterSim, phase_optima
from storagegamesim.phases import phase_starts, score_phases, summarise
from capes.experiments.ray_backend import map_jobs
from capes.experiments.recall_scoring import (cluster_workloads, recall_summary,
                                              score_classes, with_visits)
from capes.common.shipped_configs import config_path
from capes.settings import is_cluster_config  # noqa: F401  (re-exported)
from interface_daemon.action_checker import ActionChecker, Verdict

DEFAULT_CONFIG = config_path("cluster-sim")
DETECT_WINDOW = 300          # an alarm within this many ticks of a phase start detects it
READER_MAX_NODES = 64        # feed="auto": ReplayReader up to this many nodes


@dataclass
class ClusterTestConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engine: DQNConfig = field(default_factory=DQNConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    model: NodeModelConfig = field(default_factory=NodeModelConfig)


def load_config(path: str | Path | None = None, overrides=(), preset: str | None = None
                ) -> ClusterTestConfig:
    from capes.settings import load_settings
    path = Path(path) if path else DEFAULT_CONFIG
    s = load_settings(path, overrides, preset)
    return ClusterTestConfig(cluster=s.cluster, engine=s.engine, reward=s.reward,
                             model=s.cluster_engine)


# -- one run ------------------------------------------------------------------------------

class WriteProcess:
    """The replay writer's calls, in order, in a process of their own (spawned). With
    ``feed="rows"`` the engine is handed each tick's rows and reads nothing back from the
    DB during the run, so nothing waits for a commit: the PI rows are pickled through a
    pipe to a second :class:`ReplayWriter` on the same DB and session, which encodes,
    inserts and commits them in the same order, so the DB is the same. Unlike a thread
    (``WriteBehind``, removed: 50.7-56.7 s against 42-43 s for 1,000 nodes idle) it
    shares no GIL with the engine: on a second core nothing of the writes is left on the
    engine's process but the pipe's send (~0.05 ms a tick at 1,000 nodes). The pipe's
    buffer bounds how far the writer may lag. A call's error comes back at the next
    :meth:`submit` or at :meth:`close` (the calls after it are skipped).
    ``busy_s``, ``cpu_s``: the writer's time in the calls and its process's CPU time."""

    def __init__(self, path, session: SessionInfo):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")       # no fork of torch or a DB handle
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_write_process_main, args=(str(path), session, child),
                                 name="replay-writer", daemon=True)
        self._proc.start()
        child.close()
        self.busy_s = self.cpu_s = 0.0
        try:
            self.error: BaseException | None = self._conn.recv()   # its writer is open
        except EOFError:
            raise RuntimeError("the replay writer process exited at its start") from None

    def submit(self, fn, *args) -> None:
        """``fn``: :meth:`ClusterSource._write_rows` or :meth:`ReplayWriter.update_layout`
        (sent by name, run on the child's writer)."""
        if self.error is None and self._conn.poll():
            self.error = self._conn.recv()[2]
        if self.error is not None:
            raise self.error
        self._conn.send((fn.__name__, args))

    def close(self) -> None:
        if self._proc.is_alive() or self._conn.poll():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            while True:
                try:
                    busy, cpu, error = self._conn.recv()
                except EOFError:
                    break
                self.error = self.error or error
                if busy is not None:
                    self.busy_s, self.cpu_s = busy, cpu
                    break
            self._proc.join()
        if self.error is not None:
            raise self.error


def _write_process_main(path: str, session: SessionInfo, conn) -> None:
    """The writer process of :class:`WriteProcess`: None (or the error) once its writer
    is open, then (name, args) jobs until None, then (busy s, CPU s from the first job,
    first error); an error is also sent at once as (None, None, error)."""
    try:
        writer = ReplayWriter(path)
        writer.session = session
    except Exception as exc:
        conn.send(exc)
        return
    conn.send(None)
    busy, error, cpu = 0.0, None, time.process_time()
    try:
        while (job := conn.recv()) is not None:
            if error is not None:
                continue
            t0 = time.perf_counter()
            try:
                if job[0] == "_write_rows":
                    writer.add_pis_rows(*job[1])
                    writer.commit()
                else:
                    getattr(writer, job[0])(*job[1])
            except Exception as exc:      # re-raised in the engine's process
                error = exc
                conn.send((None, None, exc))
            busy += time.perf_counter() - t0
        writer.close()
    finally:
        conn.send((busy, time.process_time() - cpu, error))


class LiveStepRule:
    """Counts the per-node actions a live interface daemon would refuse: each present
    row's change checked by the daemon's :meth:`ActionChecker.check_rows` (one row's
    knobs as ``<node>/<knob>``; an action is refused whole when one row breaks the
    rule). Verdicts are cached by (values before, values after) of a row, and an action
    asks once per distinct move: on the step grids the same few moves recur, so an hour
    of 1,000 nodes costs little."""

    EXAMPLES = 3                 # reasons kept for the report

    def __init__(self, specs: list[ParameterSpec]):
        self.checker = ActionChecker([dataclasses.replace(p, name=f"node/{p.name}")
                                      for p in specs])
        self.names = self.checker.order
        self.cache: dict[tuple, str | None] = {}
        self.refused = 0             # actions refused
        self.rows = 0                # rows breaking the rule, over all actions
        self.examples: list[str] = []

    def _reason(self, key: tuple) -> str | None:
        """The daemon's verdict on one row's move ``key`` = (*before, *after)."""
        if key not in self.cache:
            k = len(key) // 2
            self.cache[key] = self.checker.check_rows(
                Verdict(dict(zip(self.names, key[k:]))), dict(zip(self.names, key[:k]))).reason
        return self.cache[key]

    def check(self, tick: int, before: np.ndarray, after: np.ndarray,
              present: np.ndarray) -> bool:
        """One action: ``before``/``after`` (N, K) knob values, rows ``present``; True
        when a live daemon would refuse it."""
        rows = np.flatnonzero(present & (before != after).any(axis=1))
        if not len(rows):
            return False
        moves, which = np.unique(np.hstack([before[rows], after[rows]]), axis=0,
                                 return_inverse=True)
        which = which.ravel()                       # (numpy 2 keeps the axis)
        why = [self._reason(tuple(m)) for m in moves.tolist()]
        refused = np.array([w is not None for w in why])[which]
        bad = int(refused.sum())
        for i in np.flatnonzero(refused)[:self.EXAMPLES - len(self.examples)]:
            self.examples.append(f"tick {tick} row {rows[i]}: {why[which[i]]}")
        self.rows += bad
        self.refused += bad > 0
        return bad > 0


def live_counts(rule: LiveStepRule | None) -> dict:
    """The report's ``refused_live*`` keys (None: not checked)."""
    return {"refused_live": None if rule is None else rule.refused,
            "refused_live_rows": None if rule is None else rule.rows,
            "refused_live_examples": [] if rule is None else rule.examples}


class ClusterSource:
    """The simulator as the tick loop's source: each tick every node's PIs are written
    (one row per node) and committed, and, with ``feed``, handed to the engine; an action
    sets the knobs (per node for the engine, one shared setting for a baseline).

    A node absent from the cluster (:attr:`ClusterSim.present`) writes no rows; one that
    joins is appended to the session's nodes, as the interface daemon appends a node it
    first hears from: the session's (and the engine's) node order is the order of
    joining, ``order`` the simulator's index of each. ``behind``: the PI rows are
    written and committed by that writer process (only where nothing reads the DB
    mid-run)."""

    def __init__(self, sim: ClusterSim, writer: ReplayWriter, session: int,
                 feed: Engine | None = None, tell_phases: bool = False,
                 behind: WriteProcess | None = None, refuse_live: bool = False,
                 check_live: bool = True):
        self.sim, self.writer, self.session, self.feed = sim, writer, session, feed
        self.refuse_live = refuse_live
        self.behind = behind
        self.tell = tell_phases
        index = {name: i for i, name in enumerate(sim.node_names)}
        self.order = np.array([index[n] for n in writer.session.node_names], np.int64)
        self.member = np.zeros(sim.nodes, bool)
        self.member[self.order] = True
        self.started = False
        self.true_obj: list[float] = []
        self.true_nodes: list[np.ndarray] = []   # per node, for the per-class scores
        self.knob_names = list(sim.config.param_specs())       # action order
        self.step_rule = LiveStepRule(list(sim.config.param_specs().values())) \
            if check_live or refuse_live else None
        self.write_s = 0.0

    def matrix(self) -> np.ndarray:
        pis = self.sim.pis()
        return np.column_stack([pis[n] for n in self.sim.config.pi_names()]).astype(np.float32)

    def observe(self) -> TickState | None:
        sim = self.sim
        if self.started:
            sim.tick()
            self.true_obj.append(sim.true_objective)
            self.true_nodes.append(sim.true_throughput.copy())
        self.started = True
        if sim.ticks >= sim.config.time_limit_ticks:
            return None
        joined = np.flatnonzero(sim.present & ~self.member)
        if len(joined):
            self.order = np.concatenate([self.order, joined])
            self.member[joined] = True
            self._write(self.writer.update_layout, list(sim.config.pi_names()),
                        [sim.node_names[i] for i in self.order])
        x = self.matrix()[self.order]
        here = sim.present[self.order]
        x[~here] = np.nan
        rows = np.flatnonzero(here)
        self._write(self._write_rows, sim.ticks, rows, x[rows])
        if self.feed is not None:
            self.feed.ingest(sim.ticks, x)
        current = np.column_stack([getattr(sim, n) for n in self.knob_names])[self.order]
        return TickState(session=self.session, workload_epoch=sim.phase if self.tell else 0,
                         current=current[0].tolist() if self.tell else current)

    def _write_rows(self, tick: int, nodes: np.ndarray, rows: np.ndarray) -> None:
        t0 = time.perf_counter()
        self.writer.add_pis_rows(tick, nodes, rows)
        self.writer.commit()
        self.write_s += time.perf_counter() - t0

    def _write(self, fn, *args) -> None:
        if self.behind is not None:
            self.behind.submit(fn, *args)
        else:
            fn(*args)

    def apply(self, decision: Decision) -> None:
        if decision.rows:
            vals = decision.values
            if self.step_rule is not None:
                before = np.column_stack([getattr(self.sim, n) for n in self.knob_names])
                refused = self.step_rule.check(self.sim.ticks,
                                               before[self.order].astype(np.float64),
                                               np.asarray(vals, np.float64),
                                               self.sim.present[self.order])
                if refused and self.refuse_live:
                    return                   # as a live daemon: nothing of it applied
            self.sim.set_params(**{n: vals[:, k] for k, n in enumerate(self.knob_names)},
                                nodes=self.order)
            return
        self.writer.add_action(self.sim.ticks, decision.action, decision.values)
        self.writer.commit()
        self.sim.set_params(**dict(zip(self.knob_names, decision.values)))


TRACE_KEYS = ("true_objective", "relative", "epsilon", "loss", "window_mean",
              "window_std", "window_active", "rate_limit_mean", "rate_limit_active",
              "explored")


def run_one(cfg: ClusterTestConfig, seed: int, tuner: str = "capes", feed: str = "auto",
            init_model: str | None = None, save_model: str | None = None,
            keep_trace: bool = False, device: str = "cpu", db_path: str | None = None,
            tuner_options: dict | None = None, write_behind: bool = True,
            refuse_live: bool = False, check_live: bool = True, observers=(),
            experience=None) -> dict:
    """Play one hour (the config's ``time_limit_ticks``); the same seed gives the same
    result. Returns a JSON-ready dict. ``write_behind``: with ``feed="rows"``, commit the
    PI rows in a process of their own (True, :class:`WriteProcess`: the report then has
    ``writer_cpu_s``) or on the main thread (False); the same DB each way.
    ``refuse_live``: an action a live daemon would refuse (``refused_live``) is not
    applied, as live (the engine reads the nodes' values back). ``check_live = False``
    skips the check (``refused_live`` None): ~3 s of CPU an hour at 1,000 nodes, which
    the engine's speed benchmark leaves out. ``observers``: more of the tick loop's
    observers (``observer(record, sim, player)``), e.g. tools/engine_trace.py's.
    ``experience``: a :class:`~drl_engine.row_experience.RowExperience` seeded into the
    engine's rows (earlier sessions' workloads known from the start)."""
    ccfg = cfg.cluster
    sim_seed, engine_seed = (int(s) for s in np.random.SeedSequence(seed).generate_state(2))
    optima = phase_optima(ccfg, ccfg.best_static)
    sim = ClusterSim(ccfg, seed=sim_seed, optima=optima, judge=False)
    specs = list(ccfg.param_specs().values())
    feed = feed if feed != "auto" else ("reader" if ccfg.nodes <= READER_MAX_NODES else "rows")
    is_engine = tuner == "capes"
    with tempfile.TemporaryDirectory(prefix="capes-cluster-") as tmp:
        path = Path(db_path) if db_path else Path(tmp) / "replay.db"
        writer = ReplayWriter(path)
        members = [sim.node_names[i] for i in np.flatnonzero(sim.present)]  # joining: appended
        session = writer.begin_session(SessionInfo(
            pi_names=list(ccfg.pi_names()), node_names=members, params=specs,
            label=f"cluster converge seed={seed} nodes={ccfg.nodes} tuner={tuner}"))
        reader = ReplayReader(path, grow_nodes=is_engine) \
            if (not is_engine or feed == "reader") else None
        if is_engine:
            player = Engine.over_rows(cfg.engine, cfg.reward, list(ccfg.pi_names()), specs,
                                      len(members), model=cfg.model, reader=reader,
                                      device=device, seed=engine_seed)
            if init_model:
                player.load(init_model, weights_only=True)
            if experience is not None and not experience.seed(player):
                raise ValueError(experience.refused)
        else:
            from capes.experiments.baselines import make_tuner
            player = make_tuner(tuner, specs, reader, cfg.reward, engine_seed,
                                **(tuner_options or {}))
        rows_fed = is_engine and feed == "rows"
        behind = WriteProcess(path, session) if rows_fed and write_behind else None
        source = ClusterSource(sim, writer, session.id, feed=player if rows_fed else None,
                               tell_phases=not is_engine, behind=behind,
                               refuse_live=refuse_live, check_live=check_live)
        trace = {k: [] for k in TRACE_KEYS} if keep_trace else None
        best = [o.objective for o in optima]
        starts = phase_starts(ccfg.phases)

        def record(rec: TickRecord) -> None:
            d = rec.decision
            trace["true_objective"].append(sim.true_objective)
            trace["relative"].append(sim.true_objective / best[sim.phase])
            trace["epsilon"].append(player.epsilon)
            trace["loss"].append(rec.loss)
            trace["window_mean"].append(float(sim.window.mean()))
            trace["window_std"].append(float(sim.window.std()))
            trace["rate_limit_mean"].append(float(sim.rate_limit.mean()))
            act = sim.state.active
            trace["window_active"].append(float(sim.window[act].mean()))
            trace["rate_limit_active"].append(float(sim.rate_limit[act].mean()))
            trace["explored"].append(float(np.mean(d.row_explored))
                                     if d is not None and d.rows else None)

        start = time.perf_counter()
        try:
            run_ticks(player, source, observers=([record] if trace is not None else []) + [
                lambda rec, f=f: f(rec, sim, player) for f in observers])
        finally:
            if behind is not None:
                behind.close()
        wall = time.perf_counter() - start
        if behind is not None:
            source.write_s = behind.busy_s
        if save_model and is_engine:
            player.save(save_model)
        writer.close()
        if reader is not None:
            reader.close()
    tp = np.array(source.true_obj)
    scores = score_phases(tp, starts, best, band=ccfg.win_band, hold=ccfg.win_hold_ticks + 1,
                          first_tick=1, names=sim.phase_names)
    summary = summarise(scores, tp, starts, best, first_tick=1)
    out = {"seed": seed, "tuner": tuner, "nodes": ccfg.nodes, "noise": ccfg.noise,
           "ticks": len(tp), "wall_s": wall, "write_s": source.write_s,
           "train_steps": player.train_steps,
           **summary, "per_phase": [s.to_dict() for s in scores],
           # workloads that come back (issue 25): each phase occurrence as a first visit
           # or a return, for the cluster and per node class
           "occurrences": with_visits(scores, cluster_workloads(sim)), "tp_frac_hour": summary["mean_relative"],
           "classes": score_classes(sim, np.array(source.true_nodes), optima),
           "final_window_mean": float(sim.window.mean()),
           "final_rate_limit_mean": float(sim.rate_limit.mean())}
    if is_engine:
        out.update(weights=player.weights, feed=feed, init_model=init_model,
                   rollbacks=len(player.control.rollback.rollback_ticks),
                   rollback_ticks=list(player.control.rollback.rollback_ticks),
                   stale_bests=player.control.rollback.stale_bests,
                   floor_falls=player.control.floor.fall_count,
                   floor_blocked=player.control.floor.blocked,
                   refuse_live=refuse_live, **live_counts(source.step_rule),
                   handed_over_at=player.control.handed_over_at,
                   recommendations=player.recommendations(),
                   **(player.row_context.counters() if player.row_context else {}),
                   **_detections(player.control.alarm_ticks, starts, len(tp)))
    if behind is not None:
        out["writer_cpu_s"] = behind.cpu_s
    if trace is not None:
        out["trace"] = trace
    return out


def _detections(alarms: list[int], starts: list[int], ticks: int) -> dict:
    """Alarms → the first alarm within DETECT_WINDOW ticks of each phase change (its
    delay, counting the change's own tick as 1) and the rest as false alarms."""
    used, delays = set(), []
    for s in starts[1:]:
        hit = [a for a in alarms if s <= a < s + DETECT_WINDOW and a not in used]
        if hit:
            used.add(hit[0])
            delays.append(hit[0] - s + 1)
        else:
            delays.append(None)
    false = [a for a in alarms if a not in used]
    return {"alarms": len(alarms), "alarm_ticks": list(alarms), "detection_delays": delays,
            "false_alarms": len(false), "false_alarms_per_hour": len(false) * 3600 / max(1, ticks)}


# -- many runs ----------------------------------------------------------------------------

def _run_job(job):
    cfg, seed, tuner, kw = job
    use_one_core()
    return run_one(cfg, seed, tuner, **kw)


def _median(values):
    values = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.median(values)) if values else None


def aggregate(runs: list[dict]) -> dict:
    """Medians over the seeds of one tuner."""
    out = {"runs": len(runs),
           "median_relative": _median(r["median_relative"] for r in runs),
           "mean_relative": _median(r["mean_relative"] for r in runs),
           "in_band_share": _median(r["in_band_share"] for r in runs),
           "phases_won": sum(r["phases_won"] for r in runs),
           "phases": sum(r["phases"] for r in runs),
           "wall_s_per_run": _median(r["wall_s"] for r in runs)}
    n_ph = len(runs[0]["per_phase"]) if runs else 0
    per = []
    for k in range(n_ph):
        ph = [r["per_phase"][k] for r in runs]
        rec = [p["recover_ticks"] for p in ph]
        per.append({"phase": k, "name": ph[0]["name"],
                    "recovered": sum(v is not None for v in rec),
                    "median_recover_ticks": _median(rec),
                    "in_band_share": _median(p["in_band_share"] for p in ph),
                    "mean_relative": _median(p["mean_relative"] for p in ph),
                    "median_relative": _median(p["median_relative"] for p in ph)})
    out["per_phase"] = per
    if runs and all("occurrences" in r for r in runs):
        out["recall"] = recall_summary([{"phases": r["occurrences"],
                                         "tp_frac_hour": r["tp_frac_hour"]} for r in runs])
        out["class_recall"] = class_recall(runs)
    if runs and "weights" in runs[0]:
        delays = [d for r in runs for d in r["detection_delays"] if d is not None]
        out.update(weights=runs[0]["weights"],
                   detections=len(delays),
                   changes=sum(len(r["detection_delays"]) for r in runs),
                   median_detection_delay=_median(delays),
                   false_alarms_per_hour=float(np.mean([r["false_alarms_per_hour"]
                                                        for r in runs])),
                   rollbacks_per_hour=float(np.mean([r.get("rollbacks", 0) * 3600 /
                                                     max(1, r["ticks"]) for r in runs])),
                   refused_live=sum(r.get("refused_live") or 0 for r in runs),
                   recommendations=runs[0].get("recommendations", []))
    return out


def class_recall(runs: list[dict]) -> dict:
    """Per node class (workload): :func:`recall_summary` of its phase occurrences, and
    the median over runs of its returns' tick-weighted throughput / best static."""
    names = sorted({c["workload"] for r in runs for c in r.get("classes", [])})
    out = {}
    for name in names:
        mine = [{"phases": [c for c in r["classes"] if c["workload"] == name]} for r in runs]
        summary = recall_summary(mine)
        del summary["median_tp_frac"]
        ret = [_weighted([c for c in m["phases"] if c["visit"] > 1]) for m in mine]
        out[name] = {**summary, "median_return_tp_frac": _median(ret)}
    return out


def _weighted(phases: list[dict]) -> float | None:
    ticks = sum(p["ticks"] for p in phases)
    return sum(p["mean_relative"] * p["ticks"] for p in phases) / ticks if ticks else None


def run_tuners(cfg: ClusterTestConfig, tuners: list[str], seeds: int, first_seed: int = 0,
               jobs: int = 1, progress=sys.stderr, backend: str = "local",
               ray_address: str | None = None, **kw) -> dict:
    """Every tuner × seed run; ``backend="local"``: ``jobs`` processes on this machine,
    ``"ray"``: Ray tasks (:mod:`capes.experiments.ray_backend`; a local Ray of ``jobs``
    CPUs, or the cluster at ``ray_address``). The report is the same either way."""
    if backend not in ("local", "ray"):
        raise ValueError(f"backend: must be 'local' or 'ray' (got {backend!r})")
    plan = [(cfg, first_seed + s, t, kw) for t in tuners for s in range(seeds)]
    results: list[dict] = []
    t0 = time.perf_counter()

    def report(i, r):
        if progress is not None:
            extra = (f", alarms {r['alarm_ticks']}, rollbacks {r['rollback_ticks']}, "
                     f"refused live {r['refused_live']}" if "alarm_ticks" in r else "")
            print(f"[{i + 1}/{len(plan)}] {r['tuner']} nodes={r['nodes']} seed={r['seed']}: "
                  f"median tp {r['median_relative']:.3f}, mean {r['mean_relative']:.3f} of "
                  f"the best static, in band {r['in_band_share']:.2f}{extra}, "
                  f"{r['wall_s']:.1f} s wall (elapsed {time.perf_counter() - t0:.0f} s)",
                  file=progress, flush=True)

    for i, r in enumerate(map_jobs(_run_job, plan, backend, jobs, ray_address)):
        results.append(r)
        report(i, r)
    optima = phase_optima(cfg.cluster, cfg.cluster.best_static)
    return {"nodes": cfg.cluster.nodes, "seeds": seeds, "first_seed": first_seed,
            "best_static": [o.to_dict() for o in optima],
            "phase_starts": phase_starts(cfg.cluster.phases),
            "model": dataclasses.asdict(cfg.model),
            "config": cfgmod.to_table(dataclasses.replace(cfg, model=NodeModelConfig())),
            "tuners": {t: aggregate([r for r in results if r["tuner"] == t]) for t in tuners},
            "runs": results, "wall_s": time.perf_counter() - t0}


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(report: dict) -> str:
    lines = [f"cluster converge test: {report['nodes']} nodes, {report['seeds']} seed(s), "
             f"phases start at {report['phase_starts']}; medians over seeds; relative: "
             f"noise-free objective / the phase's best static (shared) setting",
             f"{'tuner':>8} {'med tp':>7} {'mean tp':>7} {'in-band':>7} {'won':>6} "
             f"{'weights':>8} {'detected':>8} {'delay s':>7} {'FA/h':>5} {'RB/h':>5} "
             f"{'wall s':>7}"]
    for name, a in report["tuners"].items():
        det = f"{a['detections']}/{a['changes']}" if "weights" in a else "-"
        lines.append(f"{name:>8} {_fmt(a['median_relative'], '.3f'):>7} "
                     f"{_fmt(a['mean_relative'], '.3f'):>7} {_fmt(a['in_band_share'], '.2f'):>7} "
                     f"{a['phases_won']:>2}/{a['phases']:<3} {a.get('weights', '-'):>8} "
                     f"{det:>8} {_fmt(a.get('median_detection_delay'), '.0f'):>7} "
                     f"{_fmt(a.get('false_alarms_per_hour'), '.1f'):>5} "
                     f"{_fmt(a.get('rollbacks_per_hour'), '.1f'):>5} "
                     f"{_fmt(a['wall_s_per_run'], '.1f'):>7}")
    lines.append("per phase: recovered runs, median recovery s, in-band share, mean / "
                 "median throughput relative to the phase's best static")
    for name, a in report["tuners"].items():
        cells = []
        for p in a["per_phase"]:
            cells.append(f"{p['name'][:10]}: {p['recovered']}/{a['runs']} "
                         f"{_fmt(p['median_recover_ticks'], '.0f')}s "
                         f"{_fmt(p['in_band_share'], '.2f')} "
                         f"{_fmt(p['mean_relative'], '.3f')}/{_fmt(p['median_relative'], '.3f')}")
        lines.append(f"{name:>8}  " + " | ".join(cells))
    lines.append("recall (returns to a seen workload / first visits): median s to band, "
                 "a phase that never got there counted as its length; per node class: "
                 "median over runs of its returns' throughput / its best static")
    for name, a in report["tuners"].items():
        rc = a.get("recall") or {}
        cells = [f"cluster {_fmt(rc.get('median_return_ticks'), '.0f')}s / "
                 f"{_fmt(rc.get('median_first_ticks'), '.0f')}s"]
        for cname, c in (a.get("class_recall") or {}).items():
            cells.append(f"{cname[:10]} {_fmt(c['median_return_ticks'], '.0f')}s / "
                         f"{_fmt(c['median_first_ticks'], '.0f')}s "
                         f"{_fmt(c['median_return_tp_frac'], '.3f')}")
        lines.append(f"{name:>8}  " + " | ".join(cells))
    for name, a in report["tuners"].items():
        for rec in a.get("recommendations") or []:
            levels = ", ".join(f"{v:g}: {lv:.4g}" for v, lv in rec["levels"].items())
            lines.append(f"{name:>8}  recommendation ({rec['cost']}, not tuned online): "
                         f"{rec['name']} = {_fmt(rec['suggest'], 'g')} (in effect "
                         f"{_fmt(rec['current'], 'g')}; {rec['evidence']}; mean objective "
                         f"by value: {levels or '-'})")
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=_json_default, allow_nan=False))
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _clean(o):
    """NaN/inf → None (strict JSON)."""
    if isinstance(o, float):
        return o if np.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def main(args) -> int:
    """``capes converge-test`` on a config with a ``[cluster]`` table."""
    from capes.cli import load_experience
    from drl_engine.device import pick_device
    overrides = list(args.overrides)
    if args.noise:
        overrides.append(f"cluster.noise={args.noise[0]}")
    if args.reward:
        overrides.append(f'reward.type="{args.reward[0]}"')
    try:
        device = str(pick_device(args.device))
    except RuntimeError as exc:
        print(f"capes converge-test: {exc}", file=sys.stderr)
        return 2
    backend = getattr(args, "backend", "local")
    if backend == "ray":
        from capes.experiments.ray_backend import RAY_MISSING, ray_available
        if not ray_available():
            print(f"capes converge-test: {RAY_MISSING}", file=sys.stderr)
            return 2
    cfg = load_config(args.config, overrides, args.preset)
    tuners = [t.strip() for t in args.tuner.split(",") if t.strip()]
    specs = cfg.cluster.param_specs()
    try:                                    # the per-node memory (drl_engine/row_experience)
        experience = load_experience(args, cfg.engine, cfg.reward,
                                     (cfg.model, list(specs.values())))
        if experience is not None:
            experience.check_layout(cfg.cluster.pi_names(), list(specs))
            print(experience.summary(), file=sys.stderr)
    except ValueError as exc:
        print(f"capes converge-test: {exc}", file=sys.stderr)
        return 2
    print(f"cluster converge test: {cfg.cluster.nodes} nodes, tuners {', '.join(tuners)}, "
          f"{args.seeds} seed(s), preset {cfg.engine.preset}", file=sys.stderr)
    report = run_tuners(cfg, tuners, args.seeds, args.first_seed, args.jobs,
                        progress=None if args.quiet else sys.stderr,
                        backend=backend, ray_address=getattr(args, "ray_address", None),
                        init_model=args.init_model, device=device,
                        **({} if experience is None else {"experience": experience}))
    report = _clean(report)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


__all__ = ["ClusterTestConfig", "ClusterSource", "load_config", "is_cluster_config",
           "run_one", "run_tuners", "aggregate", "format_table", "write_json", "main"]
