"""Offline training: a model from stored experience, with no target system attached.

The engine is the live one (:class:`~drl_engine.engine.Engine`) over a
:class:`~capes.common.replay_db.ReplayReader` of a (merged) replay DB: the same Algorithm-2
minibatches, loss and target updates, only no actions are taken. The checkpoint it
writes starts a live engine or a converge test (``--init-model``), whose layout of
nodes, PIs and parameters must then match the DB's first session.

Only the ``[engine]`` and ``[reward]`` tables of a config file apply here, so the
config of any target (StorageGameSim, Lustre, …) can be given.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from capes.common import config as cfgmod
from drl_engine.config import DQNConfig
from drl_engine.loop import TickRecord, TickState, run_ticks
from drl_engine.config import RewardConfig
from capes.common.shipped_configs import config_path

DEFAULT_CONFIG = config_path("storagegamesim")


@dataclass
class TrainingConfig:
    engine: DQNConfig = field(default_factory=DQNConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


def load_training_config(path: str | Path | None = None, overrides=(),
                         preset: str | None = None) -> TrainingConfig:
    """The ``[engine]`` and ``[reward]`` of a deployment (or converge-test) file; the
    whole file is validated, with ``--set`` overrides and the engine preset applied."""
    from capes.settings import load_settings
    s = load_settings(path, overrides, preset)
    return TrainingConfig(engine=s.engine, reward=s.reward)


class StoredExperience:
    """Stored experience as the tick loop's source: every tick trains ``chunk``
    minibatches (one point of the loss curve), none acts, until ``steps`` have run."""

    def __init__(self, engine, steps: int, chunk: int):
        self.engine, self.chunk = engine, chunk
        self.until = engine.train_steps + steps

    def observe(self) -> TickState | None:
        left = self.until - self.engine.train_steps
        if left <= 0:
            return None
        return TickState(session=None, tuning=False, train_steps=min(self.chunk, left))

    def apply(self, decision) -> None:
        raise AssertionError("offline training takes no actions")


class NotEnoughExperience(ValueError):
    """The DB holds too few usable transitions for one minibatch."""


class FastPathUnavailable(ValueError):
    """The fast path was asked for (``--fast``) where it cannot run: no CUDA device,
    or a configuration that turns off a part of it."""


def path_name(sampling: str, cuda_graph: bool) -> str:
    """The path a run took, in one word: ``fast`` (minibatches drawn on the device
    inside the step's CUDA graph), ``plain`` (sampled on the host, the step run as
    written: the live engine's way on a CPU), or one part alone, ``device-drawn`` (the
    CPU's faster ablation) or ``graphed`` (CUDA, host sampling)."""
    drawn = sampling == "device"
    return {(True, True): "fast", (False, False): "plain",
            (True, False): "device-drawn", (False, True): "graphed"}[(drawn, bool(cuda_graph))]


def resolve_device(device: str, fast: bool | None, sampling: str) -> str:
    """The torch device a run of ``capes train`` uses, checked before any data is read.
    ``fast`` True forces the fast path (a CUDA device, device sampling, the CUDA graph)
    and is a :class:`FastPathUnavailable` without CUDA; False forces the plain path;
    None lets the device decide. A missing or unknown ``device`` is a
    :class:`~drl_engine.device.DeviceUnavailable`."""
    from drl_engine.device import cuda_absence, device_name
    forced = {True: "device", False: "host"}.get(fast)
    if forced and sampling not in ("auto", forced):
        raise ValueError(f"--{'' if fast else 'no-'}fast draws minibatches "
                         f"{'on the device' if fast else 'on the host'}; --sampling "
                         f"{sampling} contradicts it")
    if fast:
        import torch
        if device != "auto" and not device.startswith("cuda"):
            raise FastPathUnavailable(f"--fast with --device {device}: the fast path runs "
                                      f"on a CUDA device only")
        if not torch.cuda.is_available():
            raise FastPathUnavailable(f"--fast: the fast path runs on a CUDA device and "
                                      f"there is none ({cuda_absence()}); without --fast "
                                      f"the CPU takes the plain path")
    return device_name(device)


@dataclass
class TrainingReport:
    replay: str
    checkpoint: str
    steps: int
    wall_s: float
    steps_per_s: float
    sessions: int
    ticks: int                          # ticks cached from the DB
    candidate_transitions: int          # ticks with a full stack and a next tick
    device: str
    sampling: str                       # "device" (the fast path) or "host"
    cuda_graph: bool                    # the step replayed as a CUDA graph
    path: str                           # path_name(): fast, plain, device-drawn, graphed
    preset: str
    chunk: int                          # steps per curve point
    curve: list[dict]                   # {"step", "loss", "steps_per_s"} per chunk
    config: dict

    def to_json(self) -> dict:
        return {**asdict(self), "final_loss": self.last_loss}

    @property
    def first_loss(self) -> float | None:
        return self.curve[0]["loss"] if self.curve else None

    @property
    def last_loss(self) -> float | None:
        return self.curve[-1]["loss"] if self.curve else None


def train_offline(replay: str | Path, out: str | Path, steps: int,
                  cfg: TrainingConfig | None = None, chunk: int = 100, device: str = "auto",
                  seed: int = 0, init_model: str | Path | None = None,
                  progress: Callable[[dict], None] | None = None,
                  sampling: str = "auto", fast: bool | None = None) -> TrainingReport:
    """Train ``steps`` minibatches on ``replay`` and save the engine to ``out``.

    ``progress`` gets each chunk's {"step", "loss", "steps_per_s"}; ``init_model``
    continues from a checkpoint's networks. ``sampling``: ``auto`` takes the fast path
    on a CUDA device (every valid transition on the device, each minibatch drawn there
    inside the step's CUDA graph: drl_engine/device_transitions.py) and the host's
    numpy sampling elsewhere; ``device`` or ``host`` force one (the ablation).
    ``fast`` True forces the whole fast path (CUDA, device sampling, the CUDA graph; a
    :class:`FastPathUnavailable` where it cannot run), False the plain one (host
    sampling, no CUDA graph), None (the default) decides by the device as above.
    Neither changes the checkpoint: its config is the one given.
    """
    from drl_engine.device_transitions import DeviceTransitions, use_device_sampling
    from capes.common.replay_db import ReplayReader
    from drl_engine.engine import Engine
    if steps < 1 or chunk < 1:
        raise ValueError("steps and chunk must be >= 1")
    cfg = cfg or load_training_config(DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    device = resolve_device(device, fast, sampling)
    if fast and not cfg.engine.cuda_graph:
        raise FastPathUnavailable("--fast replays the step as a CUDA graph; "
                                  "engine.cuda_graph = false turns that off")
    reader = ReplayReader(replay)
    try:
        engine = Engine(cfg.engine, cfg.reward, reader, device=device, seed=seed)
        if engine.dqn is None:
            raise NotEnoughExperience(f"{replay}: no session to train on")
        if init_model:
            engine.load(init_model, weights_only=True)
        learner = engine.dqn.learner
        learner.loss_late = False        # each chunk's own loss (a live tick's comes late)
        if fast is False:
            learner.run_plain()          # the plain path: the step as written
        on_device = fast if fast is not None else use_device_sampling(sampling,
                                                                       learner.device)
        if on_device:
            engine.transitions = DeviceTransitions(engine.experience, learner.device, seed)
            if not engine.transitions.ready:
                raise NotEnoughExperience(f"{replay}: no usable transition (each needs "
                                          f"{cfg.engine.stack} ticks of history, an action "
                                          f"and a reward)")
        sids, counts = engine.experience.candidates()
        ticks = sum(d.length for d in reader.sessions.values())
        curve: list[dict] = []
        source = StoredExperience(engine, steps, chunk)
        timer = {"t": time.perf_counter(), "steps": 0}

        def record(rec: TickRecord) -> None:
            ran = engine.train_steps - timer["steps"]
            if rec.loss is None or ran == 0:
                raise NotEnoughExperience(
                    f"{replay}: too few usable transitions for a minibatch of "
                    f"{cfg.engine.batch_size} (a transition needs {cfg.engine.stack} ticks "
                    f"of history, an action, and at most "
                    f"{cfg.engine.missing_tolerance:.0%} missing entries)")
            now = time.perf_counter()
            point = {"step": engine.train_steps, "loss": rec.loss,
                     "steps_per_s": ran / max(now - timer["t"], 1e-9)}
            timer.update(t=now, steps=engine.train_steps)
            if not math.isfinite(rec.loss):
                raise FloatingPointError(f"loss became {rec.loss} at step {engine.train_steps};"
                                         f" lower engine.learning_rate or use the default preset")
            curve.append(point)
            if progress is not None:
                progress(point)

        start = time.perf_counter()
        run_ticks(engine, source, observers=[record])
        done = engine.train_steps
        wall = time.perf_counter() - start
        engine.save(out)
    finally:
        reader.close()
    return TrainingReport(
        replay=str(replay), checkpoint=str(out), steps=done, wall_s=wall,
        steps_per_s=done / max(wall, 1e-9), sessions=len(sids), ticks=ticks,
        candidate_transitions=int(counts.sum()), device=str(engine.device),
        sampling="device" if on_device else "host",
        cuda_graph=learner.graphed,
        path=path_name("device" if on_device else "host", learner.graphed),
        preset=cfg.engine.preset, chunk=chunk,
        curve=curve, config=cfgmod.to_table(cfg))


def plot_loss(report: TrainingReport, path: str | Path) -> None:
    """PNG of the training loss per chunk against minibatch steps (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [p["step"] for p in report.curve]
    losses = [p["loss"] for p in report.curve]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, losses, lw=1.2)
    if losses and min(losses) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("minibatch steps")
    ax.set_ylabel(f"loss (mean of {report.chunk} steps)")
    ax.set_title(f"offline training on {Path(report.replay).name}: {report.sessions} "
                 f"session(s), {report.candidate_transitions:,} transitions, "
                 f"preset {report.preset}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_point(point: dict) -> str:
    """A chunk's loss and speed, as the progress bar and lines show them."""
    return f"loss {point['loss']:.5g}  {point['steps_per_s']:.0f} steps/s"


def describe_path(report: TrainingReport) -> str:
    """Which path the steps took, for the summary line."""
    parts = [report.device]
    if report.cuda_graph:
        parts.append("CUDA graph")
    parts.append("minibatches drawn on the device" if report.sampling == "device"
                 else "minibatches sampled on the host")
    return f"the {report.path} path ({', '.join(parts)})"
