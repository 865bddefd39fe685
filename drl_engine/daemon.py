"""``capes drl-engine``: the engine as a daemon against a live interface daemon.

It reads the replay DB the interface daemon writes (read-only: the daemon is its only
writer), trains continuously, and once per action tick submits the action for the
newest tick over the gRPC control plane, which checks it, records it and sends it to
the control agents. It follows the daemon's switches: tuning off means no actions,
training off means no training steps; a change of the workload epoch bumps ε.
Checkpoints (model, target, optimiser, counters, ε) are written atomically every
``checkpoint_every_s`` and at exit; a restart resumes from the latest one.

What it does is visible while it runs: Prometheus metrics (``--metrics``, loopback by
default; ``docs/metrics.md``), TensorBoard scalars (``--tensorboard DIR``, optional
``tensorboard`` package), a JSON status file (``--status-file``) and a progress line in
the log every ``log_every_s``. All of them are observers of the shared tick loop
(``drl_engine/loop.py``), fed by one :class:`EngineView` per tick.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capes.common.atomic import write_json
from capes.common.control_client import ControlClient, ControlError
from capes.common.deployment import DeploymentConfig
from capes.common.metrics import (DEFAULT_ENGINE_METRICS, TENSORBOARD_MISSING, fmt, iso,
                                  registry_for, serve_metrics, tensorboard_available,
                                  tensorboard_writer, tick_text)
from capes.common.metrics import metric as _m
from capes.common.one_core import single_thread_blas, torch_threads
from capes.common.replay_db import ReplayDBError, ReplayReader
from capes.common.stop_signal import StopSignal
from drl_engine import checkpoint
from drl_engine.config import DQNConfig
from drl_engine.decision import Decision
from drl_engine.engine import Engine, action_name
from drl_engine.loop import PollingClock, TickRecord, TickState, WallClock, run_ticks
from drl_engine.config import RewardConfig
from drl_engine.per_node import rows_of

log = logging.getLogger("capes.drl_engine")


@dataclass
class EngineDaemonOptions:
    device: str = "auto"
    cpu_threads: int = 1               # PyTorch's intra-op threads (0: its default, one
                                       # per core; capes.common.one_core.torch_threads)
    checkpoint_dir: str | None = None  # None: capes-checkpoints/ beside the replay DB
    checkpoint_every_s: float = 60.0
    init_model: str | None = None
    seed: int = 0
    log_every_s: float = 5.0
    max_ticks: int = 0                 # stop after this many ticks; 0: run forever
    status_file: str | None = None     # JSON of tick, ε, loss, ... rewritten every tick
    metrics: str = DEFAULT_ENGINE_METRICS   # Prometheus /metrics, host:port; "" off
    tensorboard: str | None = None     # TensorBoard log dir (needs the tensorboard package)
    experience: object = None          # a PriorExperience (--experience), used when no
                                       # checkpoint is resumed (one keeps what it brought)


def _wait_for_db(client: ControlClient, stop: StopSignal) -> Path | None:
    """The daemon's replay DB path, once the daemon is up and the DB has a session
    (the wait is logged once, and again every minute)."""
    said = -math.inf
    while not stop.is_set():
        why = "its replay DB has no session yet (no agent heard)"
        try:
            status = client.status()
            path = Path(status["db_path"])
            if status["session_id"] > 0 and path.exists():
                return path
        except ControlError as exc:
            why = str(exc)
        if time.monotonic() - said >= 60.0:
            log.info("waiting for the interface daemon: %s", why)
            said = time.monotonic()
        stop.wait(0.5)
    return None


class LiveSource:
    """The interface daemon as the tick loop's source: its status (session, switches,
    workload epoch, applied values) once per tick; actions go to it over the control
    plane, which checks, records and broadcasts them. The values in effect are the
    daemon's, not the DB's: the previous action may not be committed yet."""

    def __init__(self, client: ControlClient, engine: Engine):
        self.client, self.engine = client, engine
        self.current: list[float] | None = None
        self.epoch = 0
        self.away_since: float | None = None   # the daemon stopped answering (monotonic)

    def names(self) -> list[str]:
        return self.engine.param_names()

    def _away(self, exc: ControlError) -> None:
        """Say once that the daemon is away (the tick loop asks every tick)."""
        if self.away_since is None:
            self.away_since = time.monotonic()
            log.warning("the interface daemon is away (%s); idle until it is back", exc)
        else:
            log.debug("the interface daemon is still away: %s", exc)

    def _back(self) -> None:
        if self.away_since is not None:
            log.info("the interface daemon is back after %.0f s",
                     time.monotonic() - self.away_since)
            self.away_since = None

    def observe(self) -> TickState:
        try:
            status = self.client.status()
        except ControlError as exc:            # daemon away: an idle tick
            self._away(exc)
            return TickState(session=None, tuning=False, training=False,
                             workload_epoch=self.epoch, current=self.current)
        self._back()
        self.epoch = status["workload_epoch"]
        names = self.names()
        if self.current is None and names and all(n in status["parameters"] for n in names):
            self.current = [status["parameters"][n] for n in names]
        return TickState(session=status["session_id"], tuning=status["tuning"],
                         training=status["training"], workload_epoch=self.epoch,
                         current=self.current)

    def apply(self, decision: Decision) -> None:
        names = self.names()
        try:
            reply = self.client.submit_action(decision.tick, decision.action,
                                              dict(zip(names, decision.values)))
        except ControlError as exc:
            if self.away_since is None:
                log.warning("action not submitted: %s", exc)
            return
        if reply["values"]:
            self.current = [reply["values"].get(n, v) for n, v in zip(names, decision.values)]


def _new_engine(db: Path, dqn: DQNConfig, reward: RewardConfig, opts: EngineDaemonOptions,
                deploy: DeploymentConfig | None = None) -> Engine | None:
    """A fresh engine on the live DB; None (after one line in the log) when the DB
    cannot be read. Parameters named ``<node>/<knob>`` (per-node knobs) get the engine's
    per-node mode (node-count independent, ``Engine.for_deployment``), global ones its
    one-row mode."""
    rows = None
    try:
        if deploy is not None:
            rows = rows_of(deploy.param_specs())
        if rows is not None:
            engine = Engine.for_deployment(dqn, reward, db, rows,
                                           getattr(deploy, "cluster_engine", None),
                                           device=opts.device, seed=opts.seed)
        else:
            reader = ReplayReader(db)
    except (ReplayDBError, ValueError) as exc:
        log.error("%s", exc)
        return None
    single_thread_blas()
    torch_threads(opts.cpu_threads)
    if rows is None:
        engine = Engine(dqn, reward, reader, device=opts.device, seed=opts.seed)
    return engine


def _start_engine(db: Path, dqn: DQNConfig, reward: RewardConfig, opts: EngineDaemonOptions,
                  ckpt: Path, deploy: DeploymentConfig | None = None) -> Engine | None:
    """The engine on the live DB (:func:`_new_engine`), resumed from the latest
    checkpoint or started from ``--init-model``. A checkpoint it cannot use (another
    layout or config, damaged, unreadable) is never a crash loop: a fresh engine trains
    afresh, ``restore_error`` says why (the file is then set aside)."""
    engine = _new_engine(db, dqn, reward, opts, deploy)
    if engine is None:
        return None
    if ckpt.exists():
        try:
            engine.load(ckpt)
        except checkpoint.UNUSABLE as exc:
            # validated before use, so a refused file left nothing behind; a fresh engine
            # all the same (one that a part's own load refused may hold some of it)
            engine.close()
            engine = _new_engine(db, dqn, reward, opts, deploy)
            if engine is not None:
                engine.restore_error = checkpoint.why(exc)
        else:
            log.info("resumed from %s (action tick %d, %d training steps)", ckpt,
                     engine.action_ticks, engine.train_steps)
    elif opts.init_model:
        try:
            engine.load(opts.init_model, weights_only=True)
        except checkpoint.UNUSABLE as exc:   # the operator's choice: said, not trained on
            log.error("--init-model %s cannot be used: %s", opts.init_model,
                      checkpoint.why(exc))
            engine.close()
            return None
        log.info("started from the model in %s", opts.init_model)
    if opts.experience is not None and not ckpt.exists():
        if engine.per_node:                 # its rows' memory (drl_engine/row_experience)
            engine.take_experience(opts.experience)
        else:
            engine.prior = opts.experience
            if opts.init_model:             # the network's weights, not a lower ε
                engine.exploration.pretrained = False
            log.info("%s", opts.experience.summary())
    return engine


ENGINE_METRICS = [
    _m("capes_engine_up", "gauge", "1 while the engine runs its tick loop"),
    _m("capes_engine_info", "gauge", "always 1; the labels say how the engine runs",
       "device", "preset", "reward_type"),
    _m("capes_engine_ticks_total", "counter", "ticks of the engine's loop since it started"),
    _m("capes_engine_action_ticks_total", "counter",
       "decisions taken, over the whole model's life (resumed from checkpoints)"),
    _m("capes_engine_train_steps_total", "counter",
       "minibatch updates, over the whole model's life (resumed from checkpoints)"),
    _m("capes_engine_epsilon", "gauge", "exploration rate ε of the next decision"),
    _m("capes_engine_loss", "gauge", "mean loss of the last tick's minibatches"),
    _m("capes_engine_q_max", "gauge", "largest Q-value of the newest observation"),
    _m("capes_engine_q_spread", "gauge",
       "max - min of the Q-values of the newest observation (how much the network "
       "tells the actions apart)"),
    _m("capes_engine_reward", "gauge", "newest reward (of the configured reward type)"),
    _m("capes_engine_objective", "gauge",
       "newest value of the objective (e.g. total throughput) the reward is made of"),
    _m("capes_engine_last_tick", "gauge", "tick of the newest decision"),
    _m("capes_engine_last_tick_timestamp_seconds", "gauge",
       "that tick as unix time (tick x tick_seconds)"),
    _m("capes_engine_decisions_total", "counter",
       "decisions since start, by action (null, <parameter>+, <parameter>-) and kind "
       "(explore, greedy)", "action", "kind"),
    _m("capes_engine_parameter_value", "gauge",
       "value in effect of each parameter, as the daemon accepted it", "parameter"),
    _m("capes_engine_best_value", "gauge",
       "best-known setting of each parameter (the guide's, default preset)", "parameter"),
    _m("capes_engine_workload_epoch", "gauge", "the daemon's workload epoch"),
    _m("capes_engine_tuning", "gauge", "1 while the daemon has tuning on"),
    _m("capes_engine_training", "gauge", "1 while the daemon has training on"),
    _m("capes_engine_checkpoint_timestamp_seconds", "gauge",
       "unix time of the last checkpoint written (or resumed from)"),
    _m("capes_engine_checkpoint_age_seconds", "gauge", "seconds since that checkpoint"),
    _m("capes_engine_tick_duration_seconds", "gauge",
       "wall seconds the last tick's work took (observe, act, train)"),
    _m("capes_engine_ticks_ingested_total", "counter",
       "ticks the engine took in: per-node mode, taken into its ring this session; "
       "one-row mode, decided on"),
    _m("capes_engine_node_ticks_seen_total", "counter",
       "of those ticks, the ones each node had a row in (a node seen in few of them is "
       "one the engine is blind to)", "node"),
]


class EngineView:
    """What the engine is doing, refreshed once per tick (an observer) and read by the
    other observers and by the metrics thread (which only ever sees whole snapshots)."""

    def __init__(self, engine: Engine, source: "LiveSource", dqn: DQNConfig,
                 reward: RewardConfig, tick_seconds: float, ckpt: Path):
        self.engine, self.source, self.tick_seconds, self.ckpt = engine, source, tick_seconds, ckpt
        self.labels = {"device": str(engine.device), "preset": dqn.preset,
                       "reward_type": f"{reward.type} of {reward.objective}"}
        self.ticks = 0
        self.last_decision: Decision | None = None
        self.decisions: dict[tuple[str, str], int] = {}
        self.checkpoint_at: float | None = ckpt.stat().st_mtime if ckpt.exists() else None
        self.q_max = self.q_spread = self.reward = self.objective = None
        self.state = None
        self.tick_started = time.monotonic()
        self.tick_duration: float | None = None
        self.current: dict = {}
        self._decided_seen: list | None = None    # one row: [decisions, per node seen]
        self._lock = threading.Lock()

    def observe(self, rec: TickRecord) -> None:
        now = time.monotonic()
        self.tick_duration = now - self.tick_started
        self.ticks += 1
        self.state = rec.state
        d = rec.decision
        if d is not None:
            self.last_decision = d
            key = (action_name(d.action, self.source.names()),
                   "explore" if d.explored else "greedy")
            self.decisions[key] = self.decisions.get(key, 0) + 1
            self.q_max, self.q_spread = self._q(rec.state.session)
            self._count_seen(rec.state.session, d.tick)
        if rec.state.session is not None:
            self.reward, self.objective = self._reward(rec.state.session)
        snapshot = self._snapshot()
        with self._lock:
            self.current = snapshot

    def _q(self, session: int) -> tuple[float | None, float | None]:
        """Q-values of the newest observation: their max and spread (max - min)."""
        engine = self.engine
        if engine.dqn is None or getattr(engine, "experience", None) is None:
            return None, None
        latest = engine.experience.latest(session)
        if latest is None:
            return None, None
        q = engine.dqn.q_values(latest[1][None])[0]
        return float(q.max()), float(q.max() - q.min())

    def _reward(self, session: int) -> tuple[float | None, float | None]:
        if self.engine.per_node:                                 # per-node: the ring's
            rep = None if self.engine.data is None else self.engine.data.replay
            if rep is None or rep.last is None:
                return None, None
            s = rep.slot(rep.last - 1)
            p, r = float(rep.pobj[rep.slot(rep.last)]), float(rep.r[s])
            return (r if math.isfinite(r) else None, p if math.isfinite(p) else None)
        d = self.engine.experience.derived.get(session)
        if d is None or d.n == 0:
            return None, None
        objective = float(d.p[d.n - 1])
        recent = d.r[max(0, d.n - 5):d.n]
        finite = recent[np.isfinite(recent)]
        return (float(finite[-1]) if len(finite) else None,
                objective if math.isfinite(objective) else None)

    def checkpoint_written(self) -> None:
        self.checkpoint_at = time.time()

    def best(self) -> dict[str, float] | None:
        if self.engine.per_node:
            return self.engine.best_values()
        guide = self.engine.guide
        best = None if guide is None else guide.known.best_idx
        if best is None:
            return None
        return dict(zip(self.source.names(), (float(v) for v in guide.values(best))))

    def _snapshot(self) -> dict:
        e, d, st = self.engine, self.last_decision, self.state
        tick = d.tick if d else None
        return {
            "time": iso(time.time()), "pid": os.getpid(), "tick": tick,
            "tick_time": iso(tick * self.tick_seconds) if tick is not None else None,
            "tick_seconds": self.tick_seconds, "epsilon": e.epsilon, "loss": e.last_loss,
            "train_steps": e.train_steps, "action_ticks": e.action_ticks,
            "ticks": self.ticks,
            "last_action": action_name(d.action, self.source.names()) if d else None,
            "explored": d.explored if d else None,
            "q_max": self.q_max, "q_spread": self.q_spread, "reward": self.reward,
            "objective": self.objective,
            "values": dict(zip(self.source.names(), self.source.current or [])),
            "best": self.best(), "workload_epoch": st.workload_epoch if st else None,
            "tuning": st.tuning if st else None, "training": st.training if st else None,
            "checkpoint": str(self.ckpt), "checkpoint_time": iso(self.checkpoint_at),
            "checkpoint_at": self.checkpoint_at, **self.labels,
            "decisions": {f"{a}/{k}": n for (a, k), n in sorted(self.decisions.items())},
            "tick_duration_s": self.tick_duration,
            # what noticed a workload change: the detector's alarms, the contexts' switches
            "change_alarms": getattr(e, "change_alarms", None),
            "context_switches": (len(e.context.switches)
                                 if getattr(e, "context", None) is not None else None),
            "nodes_seen": self._nodes_seen(),
        }

    def _count_seen(self, session: int | None, tick: int) -> None:
        """One-row mode: the nodes with a row at the tick just decided on."""
        e = self.engine
        data = None if e.per_node or session is None else \
            e.experience.reader.sessions.get(session)
        if data is None or data.first_tick is None or \
                not 0 <= tick - data.first_tick < data.length:
            return
        present = ~np.isnan(data.pis[tick - data.first_tick]).all(axis=1)
        if self._decided_seen is None or len(self._decided_seen[1]) != len(present):
            self._decided_seen = [0, np.zeros(len(present), np.int64)]
        self._decided_seen[0] += 1
        self._decided_seen[1] += present

    def _nodes_seen(self) -> dict | None:
        """Ticks the engine took in and, per node, how many of them it had a row in:
        per node, the ticks ingested into its ring this session; one row, the ticks
        decided on (None before there are any)."""
        e = self.engine
        if not e.per_node:
            if self._decided_seen is None:
                return None
            names = e.experience.layout.node_names
            return {"ticks": self._decided_seen[0], "of": "decided",
                    "nodes": dict(zip(names, self._decided_seen[1].tolist()))}
        if e.data is None or getattr(e, "reader", None) is None:
            return None
        rep = e.data.replay
        return {"ticks": int(rep.ingested), "of": "ingested",
                "nodes": dict(zip(e.reader.layout.node_names, rep.seen.tolist()))}

    def status(self) -> dict:
        with self._lock:
            out = dict(self.current)
        if out.get("checkpoint_at") is not None:
            out["checkpoint_age_s"] = time.time() - out["checkpoint_at"]
        return out

    def tick_begins(self) -> None:
        self.tick_started = time.monotonic()

    def metrics(self) -> dict | None:
        s = self.status()
        if not s:
            return None
        tick = s["tick"]
        return {
            "capes_engine_up": 1, "capes_engine_info": {
                (s["device"], s["preset"], s["reward_type"]): 1},
            "capes_engine_ticks_total": s["ticks"],
            "capes_engine_action_ticks_total": s["action_ticks"],
            "capes_engine_train_steps_total": s["train_steps"],
            "capes_engine_epsilon": s["epsilon"], "capes_engine_loss": s["loss"],
            "capes_engine_q_max": s["q_max"], "capes_engine_q_spread": s["q_spread"],
            "capes_engine_reward": s["reward"], "capes_engine_objective": s["objective"],
            "capes_engine_last_tick": tick,
            "capes_engine_last_tick_timestamp_seconds":
                tick * self.tick_seconds if tick is not None else None,
            "capes_engine_decisions_total": {tuple(k.split("/")): n
                                             for k, n in s["decisions"].items()},
            "capes_engine_parameter_value": s["values"],
            "capes_engine_best_value": s["best"],
            "capes_engine_workload_epoch": s["workload_epoch"],
            "capes_engine_tuning": None if s["tuning"] is None else int(s["tuning"]),
            "capes_engine_training": None if s["training"] is None else int(s["training"]),
            "capes_engine_checkpoint_timestamp_seconds": s["checkpoint_at"],
            "capes_engine_checkpoint_age_seconds": s.get("checkpoint_age_s"),
            "capes_engine_tick_duration_seconds": s["tick_duration_s"],
            "capes_engine_ticks_ingested_total": (s["nodes_seen"] or {}).get("ticks"),
            "capes_engine_node_ticks_seen_total": (s["nodes_seen"] or {}).get("nodes"),
        }


class TensorBoardObserver:
    """Engine scalars per decision: loss, ε, reward, objective (throughput), each
    parameter, Q-value max and spread, best-known setting; x axis = action ticks."""

    def __init__(self, view: EngineView, logdir: str):
        self.view = view
        self.writer = tensorboard_writer(logdir)
        self.logdir = logdir

    def __call__(self, rec: TickRecord) -> None:
        if rec.decision is None and rec.loss is None:
            return
        s = self.view.status()
        step = s["action_ticks"]
        w = self.writer
        for tag, key in (("engine/loss", "loss"), ("engine/epsilon", "epsilon"),
                         ("engine/reward", "reward"), ("engine/objective", "objective"),
                         ("engine/q_max", "q_max"), ("engine/q_spread", "q_spread"),
                         ("engine/train_steps", "train_steps")):
            if s.get(key) is not None:
                w.add_scalar(tag, s[key], step)
        for name, value in s["values"].items():
            w.add_scalar(f"parameters/{name}", value, step)
        for name, value in (s["best"] or {}).items():
            w.add_scalar(f"best/{name}", value, step)

    def close(self) -> None:
        self.writer.close()


def _observers(engine: Engine, source: LiveSource, view: EngineView,
               opts: EngineDaemonOptions, ckpt: Path) -> list:
    """Per-tick observers: the view (first: the others read it), the progress line, the
    status file, periodic checkpoints, and a line when the workload changes."""
    clock = {"log": time.monotonic(), "ckpt": time.monotonic()}
    last = {"epoch": None}

    def progress(rec: TickRecord) -> None:
        if last["epoch"] is not None and rec.state.workload_epoch != last["epoch"]:
            log.info("workload changed (epoch %d): ε raised to %.2f",
                     rec.state.workload_epoch, engine.epsilon)
        last["epoch"] = rec.state.workload_epoch
        now = time.monotonic()
        if now - clock["log"] >= opts.log_every_s:
            clock["log"] = now
            s = view.status()
            if s["tick"] is None:
                log.info("no decision yet (waiting for %d ticks of data; tuning %s); "
                         "training steps %d", engine.cfg.stack,
                         "on" if rec.state.tuning else "off", engine.train_steps)
                return
            values = ", ".join(f"{k}={fmt(v, '.6g')}" for k, v in s["values"].items()) or "-"
            log.info("tick %s ε=%.3f loss=%s steps=%d action=%s values %s reward=%s "
                     "Q spread=%s", tick_text(s["tick"], view.tick_seconds), s["epsilon"],
                     fmt(s["loss"]), s["train_steps"], s["last_action"], values,
                     fmt(s["reward"]), fmt(s["q_spread"]))

    def status_file(rec: TickRecord) -> None:
        try:
            write_json(opts.status_file, view.status(), indent=None)
            last["file_error"] = None
        except OSError as exc:            # a full disk must not stop the tuning
            if last.get("file_error") is None:
                log.warning("status file %s not written: %s", opts.status_file, exc)
            last["file_error"] = exc

    def checkpoint(rec: TickRecord) -> None:
        now = time.monotonic()
        if now - clock["ckpt"] >= opts.checkpoint_every_s:
            engine.save(ckpt)
            view.checkpoint_written()
            clock["ckpt"] = now

    return [view.observe, progress, checkpoint] + ([status_file] if opts.status_file else [])


class _TimedClock:
    """The wall clock, telling the view when a tick's work begins."""

    def __init__(self, clock: WallClock, view: EngineView):
        self.clock, self.view = clock, view

    def stopped(self) -> bool:
        return self.clock.stopped()

    def wait(self) -> None:
        self.clock.wait()
        self.view.tick_begins()


def _clock(engine: Engine, dqn: DQNConfig, deploy: DeploymentConfig, stop) -> WallClock:
    """Every ``tick_seconds``, or (``engine.tick_poll_s``) as soon as a tick is committed:
    the engine's update pulls it, and a row pulled is a tick the loop has not seen."""
    if not dqn.tick_poll_s:
        return WallClock(deploy.tick_seconds, stop)
    return PollingClock(deploy.tick_seconds, stop, dqn.tick_poll_s,
                        lambda: engine.update() > 0)


def checkpoint_dir(opts: EngineDaemonOptions, db: Path) -> Path:
    """``--checkpoint-dir``, or ``capes-checkpoints/`` beside the replay DB."""
    return Path(opts.checkpoint_dir) if opts.checkpoint_dir else db.parent / "capes-checkpoints"


def _keep_incompatible_checkpoint(engine: Engine, ckpt: Path):
    """An observer: when the checkpoint did not fit the DB's layout (the engine then
    starts afresh), say so once and keep the old file beside the new ones."""
    done = {"warned": False}

    def observe(rec) -> None:
        if engine.restore_error and not done["warned"]:
            done["warned"] = True
            kept = ckpt.with_name(ckpt.name + ".incompatible")
            if ckpt.exists():
                os.replace(ckpt, kept)
            log.warning("the checkpoint could not be used (%s); training afresh, the old "
                        "one is kept as %s", engine.restore_error, kept)
    return observe


def run(deploy: DeploymentConfig, dqn: DQNConfig, reward: RewardConfig,
        opts: EngineDaemonOptions, out=sys.stderr) -> int:
    tb = None
    if opts.tensorboard and not tensorboard_available():   # say so before anything starts
        print(f"capes drl-engine: {TENSORBOARD_MISSING}", file=out)
        return 2
    with StopSignal() as stop, ControlClient.from_config(deploy) as client:
        db = _wait_for_db(client, stop)
        if db is None:
            return 0
        ckpt = checkpoint_dir(opts, db) / "engine-latest.pt"
        engine = _start_engine(db, dqn, reward, opts, ckpt, deploy)
        if engine is None:
            return 1
        source = LiveSource(client, engine)
        view = EngineView(engine, source, dqn, reward, deploy.tick_seconds, ckpt)
        server = serve_metrics(registry_for(ENGINE_METRICS, view.metrics), opts.metrics,
                               "drl-engine")
        observers = _observers(engine, source, view, opts, ckpt)
        if opts.tensorboard:
            tb = TensorBoardObserver(view, opts.tensorboard)
            observers.append(tb)
        log.info("device %s, preset %s, db %s, tick %g s, checkpoints %s, metrics %s%s",
                 engine.device, dqn.preset, db, deploy.tick_seconds, ckpt,
                 server.url if server else "off",
                 f", TensorBoard {opts.tensorboard}" if tb else "")
        observers.insert(0, _keep_incompatible_checkpoint(engine, ckpt))
        try:
            run_ticks(engine, source, _TimedClock(_clock(engine, dqn, deploy, stop), view),
                      observers, max_ticks=opts.max_ticks)
        except ValueError as exc:         # e.g. a layout wider than engine.max_inputs
            log.error("stopping: %s", exc)
            return 1
        finally:
            if engine.dqn is not None:
                engine.save(ckpt)
                view.checkpoint_written()
                log.info("checkpoint written to %s", ckpt)
                if opts.status_file:
                    write_json(opts.status_file, view.status(), indent=None)
            if tb is not None:
                tb.close()
            if server is not None:
                server.close()
            engine.close()
    return 0
