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

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from capes.common.control_client import ControlClient, ControlError
from capes.common.deployment import DeploymentConfig
from capes.common.replay_db import ReplayDBError, ReplayReader
from capes.common.stop_signal import StopSignal
from drl_engine.dqn import DQNConfig
from drl_engine.engine import Engine, action_name
from drl_engine.rewards import RewardConfig

log = logging.getLogger("capes.drl_engine")


@dataclass
class EngineDaemonOptions:
    device: str = "auto"
    checkpoint_dir: str = "capes-checkpoints"
    checkpoint_every_s: float = 60.0
    init_model: str | None = None
    seed: int = 0
    log_every_s: float = 5.0
    max_ticks: int = 0                 # stop after this many action ticks; 0: run forever
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


def _write_status(path: str, status: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(status, fh)
    os.replace(tmp, path)


def run(deploy: DeploymentConfig, dqn: DQNConfig, reward: RewardConfig,
        opts: EngineDaemonOptions, out=sys.stderr) -> int:
    tick_s = deploy.tick_seconds
    ckpt = Path(opts.checkpoint_dir) / "engine-latest.pt"
    with StopSignal() as stop, ControlClient.from_config(deploy) as client:
        db = _wait_for_db(client, stop)
        if db is None:
            return 0
        try:
            reader = ReplayReader(db)
        except ReplayDBError as exc:
            print(f"capes drl-engine: {exc}", file=out)
            return 1
        engine = Engine(dqn, reward, reader, device=opts.device, seed=opts.seed)
        if ckpt.exists():
            engine.load(ckpt)
            print(f"resumed from {ckpt} (action tick {engine.action_ticks}, "
                  f"{engine.train_steps} training steps)", file=out, flush=True)
        elif opts.init_model:
            engine.load(opts.init_model, weights_only=True)
            print(f"started from the model in {opts.init_model}", file=out, flush=True)
        print(f"drl-engine: device {engine.device}, preset {dqn.preset}, db {db}, "
              f"tick {tick_s:g} s", file=out, flush=True)
        epoch = None
        last_tick = None
        current: list[float] | None = None
        acted = 0
        last_log = last_ckpt = time.monotonic()
        next_tick = time.monotonic()
        while not stop.is_set():
            try:
                status = client.status()
            except ControlError as exc:
                log.warning("%s", exc)
                stop.wait(tick_s)
                continue
            if epoch is not None and status["workload_epoch"] != epoch:
                engine.workload_changed()
                print(f"workload changed: ε raised to {engine.epsilon:.2f}", file=out,
                      flush=True)
            epoch = status["workload_epoch"]
            engine.update()
            names = list(engine.experience.layout.param_names) if engine.experience.ready else []
            if current is None and names and all(n in status["parameters"] for n in names):
                current = [status["parameters"][n] for n in names]
            decision = None
            if status["tuning"]:
                decision = engine.act(status["session_id"], after_tick=last_tick,
                                      current=current)
            if decision is not None:
                try:
                    reply = client.submit_action(decision.tick, decision.action,
                                                 dict(zip(names, decision.values)))
                    if reply["values"]:
                        current = [reply["values"].get(n, v)
                                   for n, v in zip(names, decision.values)]
                except ControlError as exc:
                    log.warning("action not submitted: %s", exc)
                last_tick = decision.tick
                acted += 1
            loss = engine.train() if status["training"] else None
            now = time.monotonic()
            if now - last_log >= opts.log_every_s:
                last_log = now
                act = action_name(decision.action, names) if decision else "-"
                loss_s = f"{loss:.4g}" if loss is not None else "-"
                print(f"tick {last_tick} ε={engine.epsilon:.3f} loss={loss_s} "
                      f"steps={engine.train_steps} action={act} values={current}",
                      file=out, flush=True)
            if opts.status_file:
                _write_status(opts.status_file, {
                    "tick": last_tick, "epsilon": engine.epsilon, "loss": engine.last_loss,
                    "train_steps": engine.train_steps, "action_ticks": engine.action_ticks,
                    "values": dict(zip(names, current or [])), "device": str(engine.device)})
            if now - last_ckpt >= opts.checkpoint_every_s:
                engine.save(ckpt)
                last_ckpt = now
            if opts.max_ticks and acted >= opts.max_ticks:
                break
            next_tick += tick_s
            stop.wait(max(0.0, next_tick - time.monotonic()))
            if time.monotonic() - next_tick > 10 * tick_s:   # fell far behind: resync
                next_tick = time.monotonic()
        if engine.dqn is not None:
            engine.save(ckpt)
            print(f"checkpoint written to {ckpt}", file=out, flush=True)
        reader.close()
    return 0
