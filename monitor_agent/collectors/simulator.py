"""The simulator node's PIs, read from its directory as from sysfs.

``capes sim-node --dir DIR`` publishes StorageGameSim's state as one small file per
value (``DIR/throughput``; the knobs ``DIR/window`` and ``DIR/rate_limit``). This
collector reads those files each tick, so a monitoring agent watches the simulator
exactly as it would watch a real node. A missing or unparsable file gives NaN; a file
caught empty while it is being rewritten gives the value it last held.
"""
from __future__ import annotations

import os

from monitor_agent.collectors.base import Collector, register

# storagegamesim.game.PI_NAMES, repeated here so that the monitoring agent does not
# import the game (and NumPy) just to learn three names; tests keep the two equal.
SIM_PI_NAMES = ("throughput", "window", "rate_limit")

NAN = float("nan")


@register("simulator")
class SimulatorCollector(Collector):
    def __init__(self, dir: str, names: list[str] | None = None):
        self._dir = dir
        self._names = list(names) if names is not None else list(SIM_PI_NAMES)
        self._paths = [os.path.join(dir, n) for n in self._names]
        self._last = dict.fromkeys(self._names, NAN)

    def names(self) -> list[str]:
        return list(self._names)

    def collect(self) -> dict[str, float]:
        out = {}
        for name, path in zip(self._names, self._paths):
            try:
                with open(path, "rb") as fh:
                    text = fh.read(64).strip()
            except OSError:
                out[name] = NAN
                continue
            if not text:
                out[name] = self._last[name]
                continue
            try:
                value = float(text)
            except ValueError:
                value = NAN
            out[name] = self._last[name] = value
        return out
