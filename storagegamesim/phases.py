"""Workload phases: a schedule of changes in a game's config, and a per-phase scorer.

A schedule is a list of phases, each starting at a tick (``at_tick``) and overriding some
of the game's constants from that tick on; a key a phase leaves out keeps the value in
force before it (phases accumulate). Phase 0 is the game's own config, from tick 0 up to
the first ``at_tick``. In TOML::

    [[game.phases]]               # single-node game: the optimum moves at tick 1,500
    at_tick = 1500
    peak_window = 75.0

    [[cluster.phases]]            # cluster: half the clients go idle at tick 1,200
    at_tick = 1200
    name = "half idle"
    active_fraction = 0.5

    [[cluster.phases]]            # client 7 leaves at tick 2,000 (it sends no PIs)
    at_tick = 2000
    absent = [7]

The change takes effect in the tick numbered ``at_tick``: the throughput the game reports
for that tick is the new workload's (knob changes are delayed, workload changes are not).

:func:`score_phases` turns a per-tick trace of *noise-free* throughput (or objective) into
a per-phase score: time to recover, in-band share, throughput relative to the phase's best
static setting, and a win flag. See its docstring for the exact rules.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np


# --------------------------------------------------------------------------- schedules
@dataclass
class GamePhase:
    """From ``at_tick`` on, the single-node game (:class:`GameConfig`) uses these values."""
    at_tick: int
    name: str = ""
    peak_window: float | None = None
    curve_width: float | None = None
    peak_throughput: float | None = None
    noise: float | None = None
    workload: str | None = None       # a name from ``game.workloads``: its optimum and
                                      # signature (the keys above still override it)

    def validate(self) -> None:
        if self.curve_width is not None and not self.curve_width > 0:
            raise ValueError(f"curve_width: must be > 0 (got {self.curve_width})")
        if self.peak_throughput is not None and not self.peak_throughput > 0:
            raise ValueError(f"peak_throughput: must be > 0 (got {self.peak_throughput})")
        if self.noise is not None and self.noise < 0:
            raise ValueError(f"noise: must be >= 0 (got {self.noise})")

    def overrides(self) -> dict:
        """The game constants this phase sets (the ones it leaves as None are kept)."""
        return {k: v for k, v in asdict(self).items()
                if k not in ("at_tick", "name", "workload") and v is not None}


@dataclass
class Workload:
    """One class of client workload in the cluster simulator.

    ``share`` of the nodes (shares are normalised over the classes) run it; each wants to
    move ``demand`` MB/s (``inf``: as much as it can get), of which ``write_fraction`` are
    writes. ``demand_spread`` is the σ of a per-node log-normal factor on the demand (mean
    1), fixed by the cluster's ``layout_seed``: nodes of one class are not identical."""
    name: str = "bulk"
    share: float = 1.0
    demand: float = field(default=math.inf, metadata={"allow_inf": True})   # config: inf allowed
    write_fraction: float = 0.5
    demand_spread: float = 0.0
    request_kb: float = 1024.0    # signature PIs (``cluster.signature_pis``): mean request
    sequential: float = 0.5       # size and sequential share, as a monitor sees them

    def validate(self) -> None:
        if not self.share > 0 or not math.isfinite(self.share):
            raise ValueError(f"share: must be a finite number > 0 (got {self.share})")
        if not self.demand >= 0:
            raise ValueError(f"demand: must be >= 0 MB/s (got {self.demand})")
        if not 0 <= self.write_fraction <= 1:
            raise ValueError(f"write_fraction: must lie in [0, 1] (got {self.write_fraction})")
        if not self.request_kb > 0:
            raise ValueError(f"request_kb: must be > 0 (got {self.request_kb})")
        if not 0 <= self.sequential <= 1:
            raise ValueError(f"sequential: must lie in [0, 1] (got {self.sequential})")
        if not 0 <= self.demand_spread <= 3:
            raise ValueError(f"demand_spread: must lie in [0, 3] (got {self.demand_spread})")


@dataclass
class ClusterPhase:
    """From ``at_tick`` on, the cluster simulator (:class:`ClusterConfig`) runs this.

    ``workloads`` replaces the workload mix (the list of classes) when given;
    ``demand_scale`` multiplies every class's demand; ``active_fraction`` is the share of
    clients doing I/O at all (the others are idle: no demand, no RPCs); ``noise`` is the
    measurement noise; ``capacity_scale`` multiplies every server's capacity (a degraded
    or upgraded back end); ``thrash_rpcs`` moves the servers' thrashing point, and with it
    the optimal window (the cluster's "peak"); ``absent`` replaces the list of nodes
    (indices) that are not in the cluster: a node leaves when it is added to it, joins
    when it is taken out (``ClusterConfig.absent``: those absent from tick 0). Idle is
    not absent: an idle node still reports its PIs, an absent one reports none."""
    at_tick: int
    name: str = ""
    workloads: list[Workload] | None = None
    demand_scale: float | None = None
    active_fraction: float | None = None
    noise: float | None = None
    capacity_scale: float | None = None
    thrash_rpcs: float | None = None
    absent: list[int] | None = None

    def validate(self) -> None:
        if self.workloads is not None and not self.workloads:
            raise ValueError("workloads: must name at least one workload class")
        if self.demand_scale is not None and not self.demand_scale >= 0:
            raise ValueError(f"demand_scale: must be >= 0 (got {self.demand_scale})")
        if self.active_fraction is not None and not 0 < self.active_fraction <= 1:
            raise ValueError(f"active_fraction: must lie in (0, 1] (got {self.active_fraction})")
        if self.noise is not None and self.noise < 0:
            raise ValueError(f"noise: must be >= 0 (got {self.noise})")
        if self.capacity_scale is not None and not self.capacity_scale > 0:
            raise ValueError(f"capacity_scale: must be > 0 (got {self.capacity_scale})")
        if self.thrash_rpcs is not None and not self.thrash_rpcs > 0:
            raise ValueError(f"thrash_rpcs: must be > 0 (got {self.thrash_rpcs})")


def validate_schedule(phases: Sequence, time_limit_ticks: int, key: str = "phases") -> None:
    """Phases start strictly in order, after tick 0 and before the time limit."""
    last = 0
    for i, ph in enumerate(phases):
        t = ph.at_tick
        if t <= last:
            what = "must be >= 1" if i == 0 else f"must be > the previous phase's ({last})"
            raise ValueError(f"{key}[{i}].at_tick: {what} (got {t})")
        if t >= time_limit_ticks:
            raise ValueError(f"{key}[{i}].at_tick: must be < time_limit_ticks "
                             f"({time_limit_ticks}) (got {t})")
        last = t


def phase_starts(phases: Sequence) -> list[int]:
    """First tick of every phase, phase 0 (the base config, tick 0) included."""
    return [0] + [int(p.at_tick) for p in phases]


def phase_at(starts: Sequence[int], tick: int) -> int:
    """Index of the phase in force at ``tick``."""
    return int(np.searchsorted(np.asarray(starts), tick, side="right")) - 1


# --------------------------------------------------------------------------- scoring
@dataclass
class PhaseScore:
    phase: int
    name: str
    start: int                      # first tick of the phase
    end: int                        # one past its last tick in the trace
    ticks: int
    ideal: float                    # centre of the band (noise-free)
    best_static: float              # denominator of the relative throughput
    recover_ticks: int | None       # ticks from the start to the first tick of the hold
    in_band_share: float            # share of the phase's ticks inside the band
    mean_relative: float            # mean noise-free throughput / best_static
    median_relative: float
    won: bool                       # recovered within the phase

    def to_dict(self) -> dict:
        return asdict(self)


def in_band(values, ideal, band: float, two_sided: bool = False) -> np.ndarray:
    """``values >= (1 − band)·ideal`` (and ``<= (1 + band)·ideal`` when two-sided).

    One-sided is the default: on the single-node game noise-free throughput never exceeds
    the ideal, so it is the game's own ±band rule; on the cluster a per-node setting may
    beat the best *shared* static setting, and beating it must not count as a miss."""
    values, ideal = np.asarray(values, float), np.asarray(ideal, float)
    low = values >= ideal - band * np.abs(ideal)
    if two_sided:
        return low & (values <= ideal + band * np.abs(ideal))
    return low


def score_phases(true_throughput, starts: Sequence[int], ideal: Sequence[float], *,
                 best_static: Sequence[float] | None = None, band: float = 0.10,
                 hold: int = 21, first_tick: int = 0, names: Sequence[str] | None = None,
                 two_sided: bool = False) -> list[PhaseScore]:
    """Score a run phase by phase.

    ``true_throughput[j]`` is the noise-free throughput (or objective) of tick
    ``first_tick + j``; ``starts`` are the phases' first ticks (:func:`phase_starts`);
    ``ideal[k]`` is the centre of phase k's band, ``best_static[k]`` (default: ``ideal``)
    the denominator of its relative throughput. Per phase, over the ticks of the trace
    that fall in it:

    - in band: ``tp >= (1 − band)·ideal`` (see :func:`in_band`);
    - ``recover_ticks``: the first tick ``i`` of the phase from which the throughput stays
      in band for ``hold`` consecutive ticks, all inside the phase, minus the phase's
      start (None when that never happens). The game's win rule ("in band for *more than*
      ``win_hold_ticks`` ticks") is ``hold = win_hold_ticks + 1``, the default 21;
    - ``won``: recovered within the phase;
    - ``in_band_share``, ``mean_relative``, ``median_relative``: over the phase's ticks.

    A phase with no ticks in the trace (the run ended before it) gets ticks = 0,
    won = False and NaN shares.
    """
    tp = np.asarray(true_throughput, float)
    starts = [int(s) for s in starts]
    ideal = [float(v) for v in ideal]
    best = [float(v) for v in (best_static if best_static is not None else ideal)]
    if not (len(starts) == len(ideal) == len(best)):
        raise ValueError("starts, ideal and best_static must have one entry per phase")
    if hold < 1:
        raise ValueError(f"hold: must be >= 1 (got {hold})")
    last = first_tick + len(tp)
    out = []
    for k, start in enumerate(starts):
        end = min(starts[k + 1] if k + 1 < len(starts) else last, last)
        lo = max(start, first_tick)
        seg = tp[lo - first_tick:end - first_tick] if end > lo else tp[:0]
        name = names[k] if names is not None and k < len(names) else ""
        if len(seg) == 0:
            out.append(PhaseScore(k, name, start, max(end, start), 0, ideal[k], best[k], None,
                                  math.nan, math.nan, math.nan, False))
            continue
        ok = in_band(seg, ideal[k], band, two_sided)
        rec = _first_run(ok, hold)
        recover = None if rec is None else lo + rec - start
        rel = seg / best[k] if best[k] else np.full(len(seg), math.nan)
        out.append(PhaseScore(k, name, start, end, len(seg), ideal[k], best[k], recover,
                              float(ok.mean()), float(rel.mean()), float(np.median(rel)),
                              recover is not None))
    return out


def relative_trace(true_throughput, starts: Sequence[int], best_static: Sequence[float],
                   first_tick: int = 0) -> np.ndarray:
    """Per tick: noise-free throughput / the best static throughput of its phase."""
    tp = np.asarray(true_throughput, float)
    ticks = np.arange(first_tick, first_tick + len(tp))
    k = np.searchsorted(np.asarray(starts), ticks, side="right") - 1
    return tp / np.asarray(best_static, float)[k]


def summarise(scores: Sequence[PhaseScore], true_throughput=None, starts=None,
              best_static=None, first_tick: int = 0) -> dict:
    """One-line summary: every phase won, worst recovery, overall in-band share and (with
    the trace) the median per-tick throughput relative to each phase's best static."""
    played = [s for s in scores if s.ticks]
    total = sum(s.ticks for s in played)
    recov = [s.recover_ticks for s in played if s.recover_ticks is not None]
    out = {"phases": len(scores), "phases_won": sum(s.won for s in scores),
           "all_won": bool(scores) and all(s.won for s in scores),
           "max_recover_ticks": max(recov) if recov else None,
           "in_band_share": (sum(s.in_band_share * s.ticks for s in played) / total
                             if total else math.nan)}
    if true_throughput is not None and starts is not None and best_static is not None:
        rel = relative_trace(true_throughput, starts, best_static, first_tick)
        out["median_relative"] = float(np.median(rel)) if len(rel) else math.nan
        out["mean_relative"] = float(np.mean(rel)) if len(rel) else math.nan
    return out


def _first_run(ok: np.ndarray, hold: int) -> int | None:
    """Index of the first run of ``hold`` consecutive True values in ``ok``."""
    if len(ok) < hold:
        return None
    c = np.concatenate(([0], np.cumsum(ok, dtype=np.int64)))
    full = (c[hold:] - c[:-hold]) == hold          # full[i]: ok[i:i+hold] all True
    idx = np.flatnonzero(full)
    return int(idx[0]) if len(idx) else None


__all__ = ["GamePhase", "ClusterPhase", "Workload", "PhaseScore", "validate_schedule",
           "phase_starts", "phase_at", "in_band", "score_phases", "relative_trace",
           "summarise"]
