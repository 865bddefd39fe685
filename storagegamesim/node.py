"""StorageGameSim as a node: the game in its own process, exposed like sysfs.

The node publishes its state as one small file per value in a directory, so that the
monitoring agent's ``simulator`` collector reads it and the control agent's ``file``
applier sets its knobs exactly as they would on a real node::

    DIR/throughput        measured (noisy) throughput          read-only PIs, replaced
    DIR/true_throughput   noise-free throughput                atomically (temp file +
    DIR/ticks             simulated seconds so far             rename) every tick
    DIR/won               1 once the game is won, else 0
    DIR/window            congestion window m                  knobs: written by the
    DIR/rate_limit        I/O rate limit τ                     control agent, read by
                                                               the node every tick

Knob files are created with the parameters' defaults at start. A knob file caught
empty (being rewritten) leaves the knob as it was; one that does not hold a finite
number is ignored and counted. In-range clamping is the game's, as a real knob's.

Ticks run on wall-clock boundaries shifted by half a tick, ``(k + ½) · tick_seconds``:
agents sample on the boundaries, so they always see a state that is half a tick old
instead of racing the node's update.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from storagegamesim.game import GameConfig, StorageGameSim

log = logging.getLogger("capes.sim_node")

KNOBS = ("window", "rate_limit")
PI_FILES = ("throughput", "true_throughput", "ticks", "won")


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` so that a reader sees the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _number(value: float) -> str:
    return f"{int(value)}\n" if float(value).is_integer() else f"{value!r}\n"


class SimNode:
    """One game published in ``dir``. ``step()`` reads the knobs and plays one tick."""

    def __init__(self, dir: str | Path, config: GameConfig | None = None,
                 seed: int | None = None, keep_running: bool = False):
        self.dir = Path(dir)
        self.game = StorageGameSim(config or GameConfig(), seed)
        self.keep_running = keep_running
        self.bad_knob_values = 0
        self._bad_seen: set[tuple[str, bytes]] = set()
        self.dir.mkdir(parents=True, exist_ok=True)
        for knob in KNOBS:
            write_atomic(self.dir / knob, _number(getattr(self.game, knob)))
        self.publish()

    @property
    def over(self) -> bool:
        """Won (unless it keeps running to show the hold) or out of time."""
        game = self.game
        return game.ticks >= game.config.time_limit_ticks or (game.won and not self.keep_running)

    def read_knobs(self) -> dict[str, float]:
        """The knob values written since the last tick (unreadable ones left out)."""
        out = {}
        for knob in KNOBS:
            try:
                raw = (self.dir / knob).read_bytes()[:64].strip()
            except OSError:
                continue
            if not raw:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                self.bad_knob_values += 1
                if (knob, raw) not in self._bad_seen:
                    self._bad_seen.add((knob, raw))
                    log.warning("ignoring %s = %r: not a finite number", knob, raw)
                continue
            out[knob] = value
        return out

    def step(self) -> None:
        self.game.set_params(**self.read_knobs())
        self.game.tick()
        self.publish()

    def publish(self) -> None:
        game = self.game
        write_atomic(self.dir / "throughput", f"{game.throughput!r}\n")
        write_atomic(self.dir / "true_throughput", f"{game.true_throughput!r}\n")
        write_atomic(self.dir / "ticks", f"{game.ticks}\n")
        write_atomic(self.dir / "won", "1\n" if game.won else "0\n")

    def run(self, tick_seconds: float, stop) -> str:
        """Play one tick per ``tick_seconds`` of wall clock until the game is over or
        ``stop`` (a :class:`capes.common.stop_signal.StopSignal`) is set; return the outcome:
        ``"won"``, ``"time limit"`` or ``"stopped"``."""
        k = math.floor(time.time() / tick_seconds - 0.5) + 1
        won_at = None
        while not self.over:
            due = (k + 0.5) * tick_seconds
            if stop.wait(due - time.time()):
                break
            if time.time() < due:          # woken by another signal: sleep on
                continue
            self.step()
            if self.game.won and won_at is None:
                won_at = self.game.ticks
                log.info("won at tick %d", won_at)
            k = max(k + 1, math.floor(time.time() / tick_seconds - 0.5) + 1)
        if stop.is_set():
            return "stopped"
        return "won" if self.game.won else "time limit"
