"""``capes replay plot``: one stored session over time, as a PNG an operator can read.

Panels, top to bottom, on one time axis (ticks since the session started: seconds on a
real target, simulated seconds on the simulator, as in the demo's plot, whatever the
wall-clock tick length):
the objective the reward is made of (e.g. total throughput), up to four chosen PIs
(summed over the nodes; by default the objective's PIs when it has several), every tuned parameter's value in effect, the reward (of the
config's reward type), and the actions the engine took (one row per action; NULL
included). The session's label, start time and tick length are in the title.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_PI_PANELS = 4


@dataclass
class PlotReport:
    out: str
    session: int
    ticks: int
    actions: int
    pis: list[str]
    note: str = ""


def plot_session(db: str | Path, out: str | Path, session: int | None = None,
                 pis: list[str] | None = None, reward=None) -> PlotReport:
    """Plot ``session`` (default: the newest) of replay DB ``db`` into ``out``.
    ``pis``: PI names to show (default: the reward's PIs); ``reward``: a
    ``drl_engine.config.RewardConfig`` (default: the ``[reward]`` the daemon recorded
    with the session, else total throughput, diff)."""
    from capes.common.replay_db import ReplayDBError, ReplayReader
    from capes.experiments.plots import _pyplot
    from drl_engine.config import RewardConfig
    from drl_engine.rewards import OBJECTIVES, REWARD_TYPES, pi_columns

    reader = ReplayReader(db)
    try:
        if not reader.sessions:
            raise ReplayDBError(f"{db}: no session to plot")
        sid = max(reader.sessions) if session is None else session
        if sid not in reader.sessions:
            raise ReplayDBError(f"{db}: no session {sid} (sessions: "
                                f"{', '.join(map(str, sorted(reader.sessions)))})")
        data = reader.sessions[sid]
        layout = reader.layout
        L = data.length
        if L == 0:
            raise ReplayDBError(f"{db}: session {sid} has no ticks")
        info = data.info
        reward = reward or _recorded_reward(info) or RewardConfig()
        t = np.arange(L)                                       # ticks, as the demo plots
        pi_names = list(layout.pi_names)
        x = data.pis[:L]                                       # (L, nodes, PIs)
        note = ""
        try:
            cols = pi_columns(reward.pis, pi_names)
            objective = OBJECTIVES.build(reward.objective, reward.objective_options)
            p = np.asarray(objective(x[:, :, cols]), float)
            r = np.asarray(REWARD_TYPES.build(reward.type, reward.options)(p), float)
        except ValueError as exc:
            p = r = None
            note = f"no objective/reward panel: {exc}"
        if pis:
            chosen = list(pis)
        elif p is None:
            chosen = pi_names[:MAX_PI_PANELS]
        else:       # the objective's PIs, unless the objective panel is that one PI
            chosen = [n for n in reward.pis if n in pi_names] if len(reward.pis) > 1 else []
        unknown = [n for n in chosen if n not in pi_names]
        if unknown:
            raise ValueError(f"PIs {unknown} are not in the DB (it has: "
                             f"{', '.join(pi_names)})")
        chosen = chosen[:MAX_PI_PANELS]
        values = data.values_in_effect()[:L]
        actions = data.actions[:L]
        params = list(layout.param_names)

        plt = _pyplot()
        panels = ["objective"] * (p is not None) + chosen + ["parameters"] + \
            ["reward"] * (r is not None) + ["actions"]
        fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.1 * len(panels) + 0.8),
                                 sharex=True, squeeze=False)
        axes = axes[:, 0]
        nodes = len(layout.node_names)
        for ax, what in zip(axes, panels):
            if what == "objective":
                ax.plot(t, p, lw=0.8, color="tab:blue")
                of = ("" if reward.pis == [reward.objective] else
                      f" of {', '.join(reward.pis)}")
                ax.set_title(f"objective: {reward.objective}{of}", fontsize=9, loc="left")
                ax.set_ylabel(reward.objective)
            elif what == "parameters":
                for k, name in enumerate(params):
                    ax.step(t, values[:, k], where="post", lw=1.0, label=name)
                ax.set_title("parameter values in effect", fontsize=9, loc="left")
                ax.set_ylabel("value")
                if params:
                    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                              borderaxespad=0)
            elif what == "reward":
                ax.plot(t, r, lw=0.6, color="tab:green")
                ax.axhline(0, color="grey", lw=0.6, ls=":")
                ax.set_title(f"reward ({reward.type} of the objective)", fontsize=9,
                             loc="left")
                ax.set_ylabel("reward")
            elif what == "actions":
                acted = np.flatnonzero(actions >= 0)
                names = ["null"] + [f"{n}{s}" for n in params for s in ("+", "-")]
                ax.scatter(t[acted], actions[acted], s=4, c=actions[acted], cmap="tab10",
                           vmin=0, vmax=9)
                ax.set_yticks(range(len(names)))
                ax.set_yticklabels(names, fontsize=7)
                ax.set_ylim(-0.5, len(names) - 0.5)
                ax.set_title(f"actions ({len(acted)} recorded)", fontsize=9, loc="left")
            else:
                j = pi_names.index(what)
                with np.errstate(all="ignore"):
                    col = x[:, :, j]
                    total = np.where(np.isnan(col).all(axis=1), np.nan, np.nansum(col, axis=1))
                ax.plot(t, total, lw=0.7)
                ax.set_title(f"PI {what}" + (f" (sum of {nodes} nodes)" if nodes > 1 else
                                            f" ({layout.node_names[0]})"),
                             fontsize=9, loc="left")
                ax.set_ylabel(what)
            ax.grid(alpha=0.3)
        axes[-1].set_xlabel(f"tick since the session started (1 tick = {info.tick_seconds:g} s "
                            f"of wall time; the simulator's tick is one simulated second)")
        import time as _time
        start = _time.strftime("%Y-%m-%d %H:%M:%SZ", _time.gmtime(info.started_at))
        fig.suptitle(f"replay session {sid}" + (f" '{info.label}'" if info.label else "")
                     + f" of {Path(db).name}: {L} ticks from {start}, {nodes} node(s)",
                     fontsize=11)
        fig.tight_layout()
        fig.savefig(out, dpi=90)
        plt.close(fig)
        return PlotReport(str(out), sid, L, int((actions >= 0).sum()), chosen, note)
    finally:
        reader.close()


def _recorded_reward(info):
    """The session's ``[reward]`` as the daemon recorded it (None: none, or not one
    this version reads)."""
    from capes.common import config as cfgmod
    from drl_engine.config import RewardConfig
    table = info.provenance.get("reward")
    if not isinstance(table, dict):
        return None
    try:
        return cfgmod.build(RewardConfig, table, "the session's recorded [reward]")
    except (cfgmod.ConfigError, ValueError, TypeError):
        return None
