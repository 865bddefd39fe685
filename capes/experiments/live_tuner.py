"""A baseline tuner (hill climber, BO, ... from :mod:`capes.experiments.baselines`) run
live in place of the DRL engine: same daemon, same replay DB, same control plane and
action checker, same tick loop as ``capes drl-engine``.

The real-target benches (``capes.experiments.real_readahead``) start it as a process of
the stack so that the hill climber and BO are measured through exactly the path CAPES
takes (PIs from the monitoring agent, actions through the daemon to the control agent):

    python -m capes.experiments.live_tuner --config X.toml --tuner hill:dwell=6 [--set ...]

It knows what a live tuner would: the parameter specs and the PIs in the replay DB.
"""
from __future__ import annotations

import argparse
import logging
import sys

from dataclasses import replace

from capes.common import actions
from capes.common.config import ConfigError
from capes.common.control_client import ControlClient
from capes.common.one_core import use_one_core
from capes.common.replay_db import ReplayDBError, ReplayReader
from capes.common.stop_signal import StopSignal
from capes.experiments.baselines import make_tuner
from capes.settings import load_settings
from drl_engine.daemon import LiveSource, _wait_for_db
from drl_engine.decision import Decision
from drl_engine.loop import WallClock, run_ticks

log = logging.getLogger("capes.live_tuner")


class TunerSource(LiveSource):
    """The daemon as the tick loop's source for a search tuner (it has no experience
    buffer; the parameter names come from the replay DB's layout)."""

    def __init__(self, client, tuner, specs):
        super().__init__(client, tuner)
        self.specs = specs

    def names(self) -> list[str]:
        layout = self.engine.reader.layout
        return list(layout.param_names) if layout is not None else []

    def apply(self, decision: Decision) -> None:
        """A search tuner names the setting it wants; the daemon takes moves (it checks
        that an action's values are the move it names). So each tick makes the move of
        up to ``MAX_STEPS`` steps of one parameter towards the wanted setting, as a
        probe walk of the engine does; the target is reached in a tick or two."""
        names = self.names()
        if self.current is None or len(names) != len(decision.values):
            return
        for k, (want, now) in enumerate(zip(decision.values, self.current)):
            step = self.specs[k].step
            steps = int(round((want - now) / step))
            if steps == 0:
                continue
            steps = max(-actions.MAX_STEPS, min(actions.MAX_STEPS, steps))
            values = list(self.current)
            values[k] = now + steps * step
            super().apply(replace(decision, action=actions.encode(k, steps, len(names)),
                                  values=values))
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--tuner", required=True, help="name[:key=value,...], e.g. "
                    "hill:dwell=6,settle=3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ticks", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = load_settings(args.config, args.overrides)
    except ConfigError as exc:
        print(f"live_tuner: {exc}", file=sys.stderr)
        return 2
    with StopSignal() as stop, ControlClient.from_config(settings) as client:
        db = _wait_for_db(client, stop)
        if db is None:
            return 0
        try:
            reader = ReplayReader(db)
        except ReplayDBError as exc:
            log.error("%s", exc)
            return 1
        specs = [settings.parameters[n] for n in settings.parameters]
        try:
            tuner = make_tuner(args.tuner, specs, reader, settings.reward, seed=args.seed)
        except (ValueError, ImportError) as exc:
            print(f"live_tuner: {exc}", file=sys.stderr)
            return 2
        use_one_core()      # as the engine's daemon (--cpu-threads 1): a baseline's small
                            # GP does not spin idle BLAS threads on the host it tunes
        source = TunerSource(client, tuner, specs)
        log.info("tuner %s on %s, tick %g s", args.tuner, db, settings.tick_seconds)

        def progress(rec) -> None:
            if rec.decision is not None and rec.index % 30 == 0:
                log.info("tick %d: %s (searching %s, %d evaluations)", rec.index,
                         rec.decision.values, tuner.searching, tuner.evaluations)
        try:
            run_ticks(tuner, source, WallClock(settings.tick_seconds, stop), [progress],
                      max_ticks=args.max_ticks)
        finally:
            reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
