"""``capes drl-engine``: the engine as a daemon against a live interface daemon.

It reads the replay DB the interface daemon writes (read-only: the daemon is its only
writer), trains continuously, and once per action tick submits the action for the
newest tick over the gRPC control plane, which checks it, records it and sends it to
the control agents. It follows the daemon's switches: tuning off means no actions,
training off means no training steps; a change of the workload epoch bumps ε.
Checkpoints (model, target, optimiser, counters, ε) are written atomically every
``checkpoint_every_s`` and at exit; a restart resumes from the latest one.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from capes.common.atomic import write_json
from capes.common.control_client import ControlClient, ControlError
from capes.common.deployment import DeploymentConfig
from capes.common.replay_db import ReplayDBError, ReplayReader
from capes.common.stop_signal import StopSignal
from drl_engine.config import DQNConfig
from drl_engine.engine import Decision, Engine, action_name
from drl_engine.loop import TickRecord, TickState, WallClock, run_ticks
from drl_engine.config import RewardConfig

log = logging.getLogger("capes.drl_engine")


@dataclass
class EngineDaemonOptions:
    device: str = "auto"
    checkpoint_dir: str = "capes-checkpoints"
    checkpoint_every_s: float = 60.0
    init_model: str | None = None
    seed: int = 0
    log_every_s: float = 5.0
    max_ticks: int = 0                 # stop after this many ticks; 0: run forever
    status_file: str | None = None     # JSON of tick, ε, loss, ... rewritten every tick


def _wait_for_db(client: ControlClient, stop: StopSignal) -> Path | None:
    """The daemon's replay DB path, once the daemon is up and the DB has a session."""
    while not stop.is_set():
        try:
            status = client.status()
            path = Path(status["db_path"])
            if status["session_id"] > 0 and path.exists():
                return path
        except ControlError as exc:
            log.info("waiting for the interface daemon: %s", exc)
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

    def names(self) -> list[str]:
        exp = self.engine.experience
        return list(exp.layout.param_names) if exp.ready else []

    def observe(self) -> TickState:
        try:
            status = self.client.status()
        except ControlError as exc:            # daemon away: an idle tick
            log.warning("%s", exc)
            return TickState(session=None, tuning=False, training=False,
                             workload_epoch=self.epoch, current=self.current)
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
            log.warning("action not submitted: %s", exc)
            return
        if reply["values"]:
            self.current = [reply["values"].get(n, v) for n, v in zip(names, decision.values)]


def _start_engine(db: Path, dqn: DQNConfig, reward: RewardConfig, opts: EngineDaemonOptions,
                  ckpt: Path, out) -> Engine | None:
    """The engine on the live DB, resumed from the latest checkpoint or started from
    ``--init-model``; None (after one line on ``out``) when the DB cannot be read."""
    try:
        reader = ReplayReader(db)
    except ReplayDBError as exc:
        print(f"capes drl-engine: {exc}", file=out)
        return None
    engine = Engine(dqn, reward, reader, device=opts.device, seed=opts.seed)
    if ckpt.exists():
        engine.load(ckpt)
        print(f"resumed from {ckpt} (action tick {engine.action_ticks}, "
              f"{engine.train_steps} training steps)", file=out, flush=True)
    elif opts.init_model:
        engine.load(opts.init_model, weights_only=True)
        print(f"started from the model in {opts.init_model}", file=out, flush=True)
    return engine


def _observers(engine: Engine, source: LiveSource, opts: EngineDaemonOptions, ckpt: Path,
               out) -> list:
    """Per-tick observers: the progress line, the status file, periodic checkpoints,
    and a line when the workload changes."""
    clock = {"log": time.monotonic(), "ckpt": time.monotonic()}
    last = {"tick": None, "epoch": None}

    def progress(rec: TickRecord) -> None:
        if rec.decision is not None:
            last["tick"] = rec.decision.tick
        if last["epoch"] is not None and rec.state.workload_epoch != last["epoch"]:
            print(f"workload changed: ε raised to {engine.epsilon:.2f}", file=out, flush=True)
        last["epoch"] = rec.state.workload_epoch
        now = time.monotonic()
        if now - clock["log"] >= opts.log_every_s:
            clock["log"] = now
            act = action_name(rec.decision.action, source.names()) if rec.decision else "-"
            loss = f"{rec.loss:.4g}" if rec.loss is not None else "-"
            print(f"tick {last['tick']} ε={engine.epsilon:.3f} loss={loss} "
                  f"steps={engine.train_steps} action={act} values={source.current}",
                  file=out, flush=True)

    def status_file(rec: TickRecord) -> None:
        write_json(opts.status_file, {
            "tick": last["tick"], "epsilon": engine.epsilon, "loss": engine.last_loss,
            "train_steps": engine.train_steps, "action_ticks": engine.action_ticks,
            "values": dict(zip(source.names(), source.current or [])),
            "device": str(engine.device)}, indent=None)

    def checkpoint(rec: TickRecord) -> None:
        now = time.monotonic()
        if now - clock["ckpt"] >= opts.checkpoint_every_s:
            engine.save(ckpt)
            clock["ckpt"] = now

    return [progress, checkpoint] + ([status_file] if opts.status_file else [])


def run(deploy: DeploymentConfig, dqn: DQNConfig, reward: RewardConfig,
        opts: EngineDaemonOptions, out=sys.stderr) -> int:
    ckpt = Path(opts.checkpoint_dir) / "engine-latest.pt"
    with StopSignal() as stop, ControlClient.from_config(deploy) as client:
        db = _wait_for_db(client, stop)
        if db is None:
            return 0
        engine = _start_engine(db, dqn, reward, opts, ckpt, out)
        if engine is None:
            return 1
        print(f"drl-engine: device {engine.device}, preset {dqn.preset}, db {db}, "
              f"tick {deploy.tick_seconds:g} s", file=out, flush=True)
        source = LiveSource(client, engine)
        try:
            run_ticks(engine, source, WallClock(deploy.tick_seconds, stop),
                      _observers(engine, source, opts, ckpt, out), max_ticks=opts.max_ticks)
        finally:
            if engine.dqn is not None:
                engine.save(ckpt)
                print(f"checkpoint written to {ckpt}", file=out, flush=True)
            engine.experience.reader.close()
    return 0
