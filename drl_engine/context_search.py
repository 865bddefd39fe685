"""Group search: the rows of one new workload context searched together (issue 25, cluster).

Why: per-row probes move one node's knob a few steps, and in a cluster of 64 nodes one
node's step moves the cluster's total by ~0.01 %, far under the per-tick noise of the
total (~1 % at 10 % noise per node). An optimum that needs a whole class of nodes to
move far together (the mix of `configs/recurring-workloads-cluster.toml`: its 16 writers
from window ~24 to 1, so that its 48 readers' windows can rise from 24 to 33; +8 % of
the total) is out of the probes' reach, so recall had nothing to recall there
(``docs/journal.md``, cluster variant). The rows that show the same signature are the
same workload class: moving them as one multiplies the effect by the class's size.

So, when rows enter new contexts (``cluster_engine.context_search = true``), the rows
are grouped by the signature of their current context (:func:`signature_groups`), and
each group holding a new row that moves data is searched by a pattern search on the
cluster objective, with committed moves: every row of the group moves one dynamic knob
by ±s steps (the first s is ``context_search_step`` of the knob's range); after
``settle_ticks`` the objective's mean over ``context_search_ticks`` ticks is compared
with the committed setting's. A gain over ``Z`` standard errors of the difference is
kept (and the same move tried again); a loss over ``EARLY`` of them is undone at once
(after two ticks: a class's far move can cost the cluster most of its throughput), any
other result once measured; then the other direction is tried, straight from the
committed setting. When both directions fail the step halves, the committed setting is
measured again (pooled with its earlier ticks: a kept move's own measurement was its
luckiest) and the next (group, knob) pair has its turn (a class's optimum may move once
another class has moved: the mix's readers gain from wider windows only once its
writers are throttled); a pair is done when a one-step move fails both ways. Every row
holds meanwhile (no probes, no greedy moves, no rollback). At the end the setting found
becomes the best-known setting (trust region, rollback, and what the contexts store for
the next return); a change of contexts ends the search where it stands.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("capes.engine.search")


def signature_groups(sig: np.ndarray, rows: np.ndarray, rel: float = 0.25,
                     floor: float = 0.02) -> list[np.ndarray]:
    """``rows`` grouped by their signatures ``sig`` (N, P, raw scale): a row joins the
    first group whose first row is within ``rel`` of it relative (or ``floor`` × the
    PI's largest value over the rows) on every PI; else it starts a group."""
    if len(rows) == 0:
        return []
    x = sig[rows]
    scale = floor * np.maximum(np.nanmax(np.abs(x), axis=0), 1e-12)
    heads: list[int] = []
    member: list[list[int]] = []
    for j in range(len(rows)):
        for g, h in enumerate(heads):
            tol = rel * np.maximum(np.abs(x[j]), np.abs(x[h])) + scale
            if (np.abs(x[j] - x[h]) <= tol).all():
                member[g].append(int(rows[j]))
                break
        else:
            heads.append(j)
            member.append([int(rows[j])])
    return [np.array(m, np.int64) for m in member]


class GroupSearch:
    """One search over ``groups`` (lists of rows), from grid indices ``idx`` (N, K)."""

    Z = 1.0                  # a move is kept when it gains more than Z standard errors
    EARLY = 4.0              # ... and undone at once when it loses more than EARLY of them

    def __init__(self, groups: list[np.ndarray], idx: np.ndarray, n_steps: np.ndarray,
                 dynamic: np.ndarray, first_step: float, ticks: int, settle: int,
                 tick: int, until: int):
        self.groups, self.n_steps, self.ticks, self.settle = groups, n_steps, ticks, settle
        self.until = until                              # no new trial after this tick
        self.best = idx.copy()                          # the committed setting
        self.knobs = np.flatnonzero(dynamic)
        # (group, knob) pairs to search and each one's step size
        self.todo = [(g, k) for g in range(len(groups)) for k in self.knobs]
        self.step = {p: max(1, int(round(first_step * n_steps[p[1]]))) for p in self.todo}
        self.at = 0                                     # which pair
        self.sign = -1                                  # direction of the move tried
        self.failed = 0                                 # directions failed at this step
        self.trial: np.ndarray | None = None            # the setting being measured
        self.phase, self.t0 = "base", int(tick)         # measuring since t0
        self.base: tuple[float, float] | None = None    # (mean, variance of the mean)
        self.base_p: np.ndarray | None = None           # ... of these ticks
        self.pending: np.ndarray | None = idx.copy()    # a setting to apply
        self.done = False
        self.kept = self.tried = 0

    def _window(self, rep, tick: int) -> np.ndarray | None:
        """The objective over the measuring window as far as it has come (None: not
        begun); NaN in it (a node came or went) ends the search."""
        a = self.t0 + 1 + self.settle
        if tick < a:
            return None
        return rep.comparable(np.arange(a, min(tick, a + self.ticks - 1) + 1), tick)

    def _next_trial(self) -> bool:
        """The next move to measure into ``pending``; False when every pair is done."""
        while self.todo:
            self.at %= len(self.todo)
            g, k = pair = self.todo[self.at]
            rows = self.groups[g]
            s = self.step[pair]
            trial = self.best.copy()
            trial[rows, k] = np.clip(trial[rows, k] + self.sign * s, 0, self.n_steps[k])
            if (trial != self.best).any():
                self.trial = self.pending = trial
                return True
            self._fail(pair)                            # at the bound: nothing to try
        return False

    def _fail(self, pair) -> None:
        self.failed += 1
        self.sign = -self.sign
        if self.failed < 2:
            return
        self.failed = 0
        if self.step[pair] > 1:                         # halved, for the next round: the
            self.step[pair] = max(1, self.step[pair] // 2)   # other pairs' turn first
            self.at += 1
            return
        self.todo.remove(pair)                          # a one-step move fails both ways

    def observe(self, rep, tick: int) -> None:
        """Advance by one ingested tick: compare, keep or undo, start the next trial."""
        if self.done:
            return
        p = self._window(rep, tick)
        if p is None:
            return
        if not np.isfinite(p).all():
            self.finish(tick, "the nodes present changed")
            return
        if len(p) < self.ticks:
            if self.phase == "trial" and len(p) >= 2:   # clearly worse already: stop it
                b, bv = self.base
                if p.mean() < b - self.EARLY * np.sqrt(p.var(ddof=1) / len(p) + bv):
                    self._reject(tick, float(p.mean()), b, bv)
            return
        if self.phase == "trial":
            m, v = self._stats(p)
            b, bv = self.base
            if not m - b > self.Z * np.sqrt(v + bv):
                self._reject(tick, m, b, bv)
                return
            self._log(tick, m, b, bv, "kept")
            self.tried += 1
            self.best, self.kept = self.trial, self.kept + 1
            self.base_p, self.failed = p, 0            # the same move again
        else:                                          # the committed setting, pooled
            self.base_p = p if self.base_p is None else np.concatenate([self.base_p, p])
        self.base = self._stats(self.base_p)
        self._trial(tick)

    @staticmethod
    def _stats(p: np.ndarray) -> tuple[float, float]:
        """Mean and the variance of the mean."""
        return float(p.mean()), float(p.var(ddof=1)) / len(p) if len(p) > 1 else 0.0

    def _trial(self, tick: int) -> None:
        """The next trial from the committed setting, or the end."""
        if tick >= self.until or not self._next_trial():
            self.finish(tick, "done" if tick < self.until else "out of time")
            return
        self.phase, self.t0 = "trial", tick

    def _reject(self, tick: int, m: float, b: float, bv: float) -> None:
        self.tried += 1
        self._log(tick, m, b, bv, "undone")
        self._fail(self.todo[self.at % len(self.todo)])
        self.pending = self.best.copy()
        if self.failed == 0 and self.todo:             # both ways failed: the baseline
            self.phase, self.t0 = "base", tick         # measured again (a kept move's
            return                                     # own was its luckiest)
        self._trial(tick)

    def _log(self, tick, m, b, bv, what) -> None:
        g, k = self.todo[self.at % len(self.todo)]
        log.debug("tick %d: group %d knob %d %+d to index %s: %.1f against %.1f ± %.1f, %s",
                  tick, g, k, self.sign * self.step[(g, k)],
                  np.median(self.trial[self.groups[g], k]), m, b, np.sqrt(bv), what)

    def finish(self, tick: int, why: str) -> None:
        if not self.done:
            self.done = True
            self.pending = self.best.copy() if self.phase == "trial" else None
            log.info("tick %d: group search over %d group(s) ends (%s): %d of %d moves "
                     "kept", tick, len(self.groups), why, self.kept, self.tried)

    def take(self) -> np.ndarray | None:
        """The setting to apply now (grid indices), once."""
        out, self.pending = self.pending, None
        return out


__all__ = ["GroupSearch", "signature_groups"]
