"""Workload contexts: which workload runs, told from its PI signature, and what the
engine learned of each (the ``default`` preset's recall, issue 25).

A storage system's workloads come and go and come back. The guide (``drl_engine/guide``)
finds a workload's best setting by search; without contexts it forgets that setting
when the workload changes and searches again when it returns. Here the engine derives a
*context* from the PIs that describe the workload rather than its performance (read
share, request size, sequentiality, queue depth …: the *signature*), and keeps per
context what the guide knows:

* **Signatures → contexts** (:class:`SignatureClusters`). Online clustering with change
  points: each tick's signature is the per-PI median of the last ``context_window``
  ticks (one outlier never moves it), on a log scale (``log(x + c)``, c = 5 % of the
  first window's value: multiplicative noise has the same spread at every level). A
  context is a running mean and spread per PI; the signature belongs to a context while
  every PI lies within ``context_threshold`` of its spreads (a spread held up by 5
  pseudo-samples at ``context_floor``, so a context's first noisy samples do not split
  it; with ``engine.context_floor_strict`` never below it, so that a context of many
  tight samples does not split on a moderate wobble either). When the
  current context no longer fits for ``context_confirm`` ticks, the engine switches: to
  the nearest context that fits, or (after at least ``NEW_CONFIRM`` ticks) to a new one.
* **Memory per context** (:class:`WorkloadContexts`). On a switch the guide's per-setting
  statistics, its change detector and the engine's exploration clock are stored with the
  context left and those of the context entered are restored: a **return** walks at
  once to that context's best-known setting (its lower-confidence-bound best), moving the
  farthest knob up to ``context_recall_steps`` steps a tick, holds it
  ``context_hold_ticks`` without probes, then explores only as much as that context
  still needs; a **new** context starts the guide afresh (global probes, ε from
  ``epsilon_start`` on its own clock), as a new session would.
* **The Q-network may lead** (``engine.context_lead``, off by default): it sees each
  tick's PIs, the signature included, while the running median needs a second tick to
  confirm a change. On the tick the newest signature leaves the current context
  (:attr:`leaving`), the network's greedy direction makes the first move,
  ``context_recall_steps`` long. Trained online over one hour its direction was as
  often wrong as right (its stack still holds the old workload): a loss, measured in
  ``docs/recall.md``; a network trained on earlier sessions may do better.

* **A new workload's first setting may be inferred** (``engine.context_infer``, off by
  default): once two other workloads are known, the Q-network leads a walk on fresh
  observations (:meth:`WorkloadContexts.infer_action`), or without it
  (``use_q_network = false``) the nearest context's best-known setting is walked to;
  measured on unseen mixes in ``docs/journal.md`` (recall round 3): a small gain, not reliable.

* **The memory may teach the network** (``engine.demo_margin``, off by default): each
  replayed tick is labelled with the move towards its context's best-known setting
  (:meth:`WorkloadContexts.session_contexts`, :meth:`WorkloadContexts.best_of`;
  ``drl_engine/demonstrations.py``), so the walk above points where the memory would.

* **The network may act only in that walk** (``engine.q_scope = "new_contexts"``, off by
  default; ``FlatEngine._q_greedy``): greedy elsewhere holds the best-known setting, so the
  engine plays ``use_q_network = false``'s moves until a new workload's walk, and the
  paired difference carries what the walk adds (``docs/journal.md``, recall round 5).

``engine.use_context = false`` switches contexts off (one best-known setting for all
workloads, forgotten on a change-detector alarm). Contexts are kept in checkpoints
(:meth:`WorkloadContexts.state`): a restarted engine recognises the workloads it has seen.

Hooks (marked ``[context hook]`` in ``drl_engine/flat_engine.py``):
``FlatEngine._guided_action`` calls :meth:`WorkloadContexts.follow` before the guide
credits new ticks, then :meth:`WorkloadContexts.recall_action`,
:meth:`WorkloadContexts.lead` and :meth:`WorkloadContexts.holding` before the probes;
``Engine.epsilon`` reads :attr:`WorkloadContexts.origin` (ε's clock); a switch raises or
restores ε's bump through ``engine.exploration.bump``; ``FlatEngine.state_dict`` keeps
:meth:`WorkloadContexts.state`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from capes.common import actions
from capes.common.step_grid import walk_action
from drl_engine import checkpoint
from drl_engine.change_detection import ChangeDetectorConfig, SettingResidualDetector
from drl_engine.context_memory import ContextMemory
from drl_engine.guide import Guide


@dataclass
class Switch:
    """The signature left one context for another at session index ``index``."""
    index: int
    context: int
    new: bool


SETTINGS = ("window", "threshold", "floor", "confirm", "recent")   # not kept in checkpoints


def log_offset(first: np.ndarray) -> np.ndarray:
    """The c of a signature PI's log(x + c): 5 % of its first value, and at least 0.05 of
    its unit, so that a PI that starts at 0 (an idle node's share of reads, its open files)
    does not put 0 and 0.01 twenty logs apart: an exact zero beside a little noise is one
    workload, not two."""
    return 0.05 * np.maximum(np.abs(first), 1.0)


def running_add(mean: np.ndarray, m2: np.ndarray, n, u: np.ndarray, most: int):
    """One sample ``u`` into a running mean and sum of squared deviations (Welford),
    which become running averages after ``most`` samples; ``n`` a count or one per row
    of ``mean`` (many contexts at once). Returns the new (mean, m2, n)."""
    n = np.minimum(n + 1, most)
    nn = np.asarray(n)[..., None]
    d = u - mean
    mean = mean + d / nn
    step = d * (u - mean)
    m2 = m2 + np.where(nn == most, step - m2 / nn, step)
    return mean, m2, n


class SignatureClusters:
    """Online clustering of signature vectors with change points (see module doc)."""

    PRIOR_SAMPLES = 5      # pseudo-samples of the floor spread in every context's spread
    NEW_CONFIRM = 3        # ticks a signature that fits no context must last to make one:
                           # a real workload stays, a noise excursion of the median rarely
    MOST_SAMPLES = 500     # a context's statistics become running averages after this

    def __init__(self, window: int = 3, threshold: float = 5.0, floor: float = 0.1,
                 confirm: int = 1, strict_floor: bool = False):
        self.window, self.threshold, self.floor, self.confirm = window, threshold, floor, confirm
        self.strict_floor = strict_floor   # the spread never below ``floor`` (False: the
                                           # floor is PRIOR_SAMPLES pseudo-samples, which a
                                           # tight context's many samples outweigh)
        self.recent: list[np.ndarray] = []
        self.offset: np.ndarray | None = None     # c of log(x + c), per PI
        self.mean: list[np.ndarray] = []          # per context, on the log scale
        self.m2: list[np.ndarray] = []
        self.n: list[int] = []
        self.current: int | None = None
        self._pending: tuple[int, int] | None = None   # (candidate, ticks seen; −1: new)
        self.leaving = False      # the newest tick's own signature fits the current context
                                  # no longer, but the running median does (not confirmed)

    @property
    def count(self) -> int:
        return len(self.mean)

    def _point(self, x: np.ndarray) -> np.ndarray | None:
        self.recent.append(np.asarray(x, np.float64))
        del self.recent[:-self.window]
        med = np.nanmedian(np.stack(self.recent), axis=0)
        if not np.isfinite(med).all():
            return None
        if self.offset is None:
            self.offset = log_offset(med)
        return self._log(med)

    def _log(self, x: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(x, 0.0) + self.offset)

    def variance(self, m2: np.ndarray, n) -> np.ndarray:
        """Per-PI variance of a context with ``m2`` and ``n`` samples: ``PRIOR_SAMPLES``
        pseudo-samples at ``floor`` added (``strict_floor``: never below ``floor²``).
        ``n`` a count, or one per row of ``m2`` (``drl_engine/row_context.py``)."""
        n0 = self.PRIOR_SAMPLES
        var = (m2 + n0 * self.floor ** 2) / (np.asarray(n)[..., None] + n0)
        return np.maximum(var, self.floor ** 2) if self.strict_floor else var

    def distance(self, u: np.ndarray, k: int) -> float:
        """The largest per-PI distance of ``u`` from context ``k``, in its spreads."""
        var = self.variance(self.m2[k], self.n[k])
        return float(np.max(np.abs(u - self.mean[k]) / np.sqrt(var)))

    def _add(self, k: int, u: np.ndarray) -> None:
        mean, m2, n = running_add(self.mean[k], self.m2[k], np.int64(self.n[k]), u,
                                  self.MOST_SAMPLES)
        self.mean[k], self.m2[k], self.n[k] = mean, m2, int(n)

    def _new(self, u: np.ndarray) -> int:
        return self.add_known(u, np.zeros_like(u), 1)

    def add_known(self, mean: np.ndarray, m2: np.ndarray, n: int) -> int:
        """A context with statistics already gathered (log mean, log m2, samples; copied
        in): a workload of earlier sessions, or one pooled from rows' contexts. Its
        index."""
        self.mean.append(np.array(mean))
        self.m2.append(np.array(m2))
        self.n.append(int(n))
        return len(self.mean) - 1

    def seed(self, offset: np.ndarray | None, workloads) -> None:
        """Workloads of earlier sessions, ``(log mean, log m2, samples)`` on the log scale
        of ``offset`` (kept as given, not copied), as its only contexts before its first
        tick: the first tick recalls one it fits (:meth:`fold`). Both modes' experience
        seeds through this (``drl_engine.prior_experience``, ``drl_engine.row_context``)."""
        self.offset = offset
        self.mean, self.m2, self.n = [], [], []
        for mean, m2, n in workloads:
            self.add_known(mean, m2, n)

    def update(self, x: np.ndarray) -> tuple[int, bool] | None:
        """Fold one tick's signature in; (context, new) when the current one changed
        (the first tick makes context 0), else None."""
        u = self._point(x)
        self.leaving = False
        if u is None:
            return None
        return self.fold(u, self._log(self.recent[-1]))

    def fold(self, u: np.ndarray, newest: np.ndarray) -> tuple[int, bool] | None:
        """:meth:`update` past the running median: ``u`` the median's point, ``newest``
        the newest tick's own (both on the log scale); per-row callers
        (``drl_engine/row_context.py``) compute them for every row at once."""
        self.leaving = False
        if self.current is None:
            # the first tick: a context known from earlier sessions when it fits one
            # (drl_engine/prior_experience.py seeds them), else context 0 of a new engine
            fits = [(self.distance(u, k), k) for k in range(self.count)]
            fits = [f for f in fits if f[0] <= self.threshold]
            if fits:
                self.current = min(fits)[1]
                self._add(self.current, u)
                return self.current, False
            self.current = self._new(u)
            return self.current, True
        if np.isfinite(newest).all():
            self.leaving = self.distance(newest, self.current) > self.threshold
        if self.distance(u, self.current) <= self.threshold:
            self._pending = None
            self._add(self.current, u)
            return None
        fits = [(self.distance(u, k), k) for k in range(self.count) if k != self.current]
        fits = [f for f in fits if f[0] <= self.threshold]
        candidate = min(fits)[1] if fits else -1
        seen = self._pending[1] + 1 if self._pending and self._pending[0] == candidate else 1
        self._pending = (candidate, seen)
        if seen < (self.confirm if candidate >= 0 else max(self.confirm, self.NEW_CONFIRM)):
            return None
        self._pending = None
        self.leaving = False
        new = candidate < 0
        self.current = self._new(u) if new else candidate
        if not new:
            self._add(candidate, u)
        return self.current, new


@dataclass
class _Memory:
    """What one context keeps while another runs."""
    created_at: int                      # the engine's action tick at its creation
    stats: object = None                 # the guide's per-setting sums (array or dict)
    detector: object = None              # the guide's change detector
    bumped_at: int | None = None         # the engine's exploration bump, this context's
    local_bump: bool = False
    visits: int = 1                      # (its best-known setting: ContextMemory's)


def context_columns(cfg, pi_names, reward_pis, param_names) -> list[int]:
    """Columns of the signature PIs: ``engine.context_pis``, or every PI that is neither
    the objective's nor a parameter's value."""
    names = list(pi_names)
    if cfg.context_pis:
        missing = [p for p in cfg.context_pis if p not in names]
        if missing:
            raise ValueError(f"engine.context_pis: {', '.join(missing)} not among the "
                             f"replay DB's PIs ({', '.join(names)})")
        return [names.index(p) for p in cfg.context_pis]
    skip = set(reward_pis) | set(param_names)
    return [i for i, p in enumerate(names) if p not in skip]


class WorkloadContexts(ContextMemory):
    """The engine's contexts and their memory; one per engine (one session's guide):
    the context memory of one row (``drl_engine.context_memory``), each context's guide
    statistics, change detector and ε clock beside it."""

    INFER_MOVES = 8       # moves of the network's walk at a new context, at most
                          # (``context_infer_known``: the other contexts it needs to have
                          # seen with a best-known setting; from one workload there is no
                          # signature-to-setting mapping to learn)

    def __init__(self, cfg, columns: list[int]):
        super().__init__(cfg, columns, rows=1)
        self.hold_until[:] = -1       # no probes before this action tick (after a walk)
        self.clusters = SignatureClusters(cfg.context_window, cfg.context_threshold,
                                          cfg.context_floor, cfg.context_confirm,
                                          cfg.context_floor_strict)
        self.memory: list[_Memory] = []
        self.switches: list[Switch] = []
        self.target: np.ndarray | None = None       # the recalled setting being walked to
        self.infer = False            # a new context waits for its first setting
        self._net: dict | None = None  # the network's walk at a new context (see infer_action)
        self._left: int | None = None               # the context whose memory the guide holds
        self._seen = 0                              # session indices folded in so far
        self._session_from = 0                      # switches of the current session
        self.prior = None     # experience of earlier sessions (drl_engine/prior_experience)
        self._promise: float | None = None          # the level a recalled start promised
        self._heard: list[float] = []               # ... and the levels heard there

    @classmethod
    def build(cls, cfg, layout, reward_pis) -> "WorkloadContexts | None":
        """None when the replay DB has no signature PIs (the paper game: nothing to tell
        workloads apart by)."""
        cols = context_columns(cfg, layout.pi_names, reward_pis, layout.param_names)
        return cls(cfg, cols) if cols else None

    @property
    def current(self) -> int | None:
        return self.clusters.current

    @property
    def leaving(self) -> bool:
        """The newest tick's signature left the current context, not yet confirmed by
        the running median: the tick where the Q-network, which sees it, leads."""
        return self.clusters.leaving

    def holding(self, now: int, engine=None, guide: Guide | None = None) -> bool:
        """Just arrived at a recalled setting: no probes yet (the context's best-known
        setting is used before it is questioned again). With experience of earlier
        sessions (``prior``), a start that does not deliver what it promised ends the
        hold (:meth:`_promise_broken`)."""
        if not self.held(now)[0]:
            return False
        if guide is not None and self._promise_broken(engine, guide, now):
            return False
        return True

    def _promise_broken(self, engine, guide: Guide, now: int) -> bool:
        """After the settle time at a start recalled from earlier sessions: the median
        level heard below ``1 − prior.margin`` of what its workload reached there. The
        hold ends; a recorded workload's return is searched as a new one (its recorded
        statistics were another system's)."""
        if self._promise is None or guide.last_p is None:
            return False
        if now <= self.hold_until[0] - self.cfg.context_hold_ticks + self.cfg.settle_ticks + 1:
            return False
        self._heard.append(guide.last_p)
        if len(self._heard) < 3 or np.median(self._heard) >= \
                (1.0 - self.prior.margin) * self._promise:
            return False
        self._promise, self._heard, self.hold_until[0] = None, [], now
        c = self.current
        if self.memory[c].created_at < 0:         # a recorded workload: search afresh
            self.memory[c].created_at = now
            _clear_stats(guide)
            guide.known.take(None)
            if engine is not None:
                engine.exploration.bump(now)
        return True

    def new_session(self) -> None:
        """Another session of the replay DB: its ticks are folded in from its start."""
        self._seen = 0
        self.clusters.recent = []
        self._session_from = len(self.switches)

    def session_contexts(self) -> tuple[np.ndarray, np.ndarray]:
        """(session index of each switch, context entered) in the current session:
        which workload ran at each of its ticks (``drl_engine/demonstrations``)."""
        sw = self.switches[self._session_from:]
        return (np.array([s.index for s in sw], np.int64),
                np.array([s.context for s in sw], np.int64))

    def best_of(self, k: int, guide: Guide) -> np.ndarray | None:
        """Context ``k``'s best-known setting (grid indices): the guide's for the
        current one, the stored one for the others."""
        return guide.known.best_idx if k == self.current else self.recalled(0, k)

    # -- per tick -----------------------------------------------------------------------
    def follow(self, engine, pis: np.ndarray, n: int, guide: Guide) -> None:
        """Fold the signature of session indices not seen yet (``pis``: the session's
        (ticks, nodes, PIs) array, ``n`` ticks of it valid) and switch the guide's
        memory on a change of context."""
        for i in range(self._seen, n):
            sig = pis[i][:, self.columns].reshape(-1)
            change = self.clusters.update(sig)
            if change is not None:
                self._switch(engine, guide, Switch(i, *change))
        self._seen = max(self._seen, n)

    def _switch(self, engine, guide: Guide, switch: Switch) -> None:
        self.switches.append(switch)
        now = engine.action_ticks
        if self.memory and self._left is not None:        # store the context left
            left = self.memory[self._left]
            left.stats = copy.deepcopy(guide.grid_stats if guide.dense else guide.sums)
            left.detector = guide.detector
            left.bumped_at, left.local_bump = engine.exploration.bumped_at, engine.exploration.local
            self.remember(0, self._left, guide.known.setting(now))
        self._left = switch.context
        self.target, self.infer, self._net = None, False, None
        self.hold_until[:] = -1
        self._promise, self._heard = None, []
        guide.probe = None
        guide.known.stale()                   # (another context's statistics from here)
        if switch.new:
            if not self.memory:
                # the first workload is the one the engine has explored all along (also
                # after a restart from a checkpoint): it keeps the engine's ε clock
                self.memory.append(_Memory(created_at=0))
                return
            self.memory.append(_Memory(created_at=now))
            self.infer = self.cfg.context_infer or self.prior is not None
            _clear_stats(guide)
            guide.known.take(None)
            guide.detector = _fresh_detector(guide)
            engine.exploration.bump(now)
            return
        mem = self.memory[switch.context]
        mem.visits += 1
        if self.prior is not None and mem.created_at < 0:   # recorded in earlier sessions
            self._promise = self.prior.level_of(switch.context)
        if guide.dense:
            guide.grid_stats[:] = mem.stats
        else:
            guide.sums = copy.deepcopy(mem.stats)
        guide.detector = mem.detector
        engine.exploration.bump(mem.bumped_at, mem.local_bump)
        guide.known.take(self.recalled(0, switch.context))   # until its statistics name one
        best = guide.known.setting(now)
        self.target = best if best is not None else self.recalled(0, switch.context)

    def recall_action(self, current: np.ndarray, guide: Guide, now: int) -> int | None:
        """While a return walks to its context's best-known setting: the next move (None
        once there, or with nothing to recall). Arrived, probes wait
        ``context_hold_ticks``."""
        if self.target is None:
            return None
        target = np.where(guide.frozen, current, self.target)
        action = walk_action(current, target, guide.n_steps, self.cfg.context_recall_steps)
        if action == 0:
            self.target = None
            self.hold(0, now)
            return None
        return action

    @property
    def first_visit(self) -> bool:
        """The current workload is on its first visit and is not the first workload (the
        one explored all along): where its best-known setting is least known
        (``q_scope = "first_visits"``)."""
        c = self.current
        return c is not None and 0 < c < len(self.memory) and self.memory[c].visits == 1

    @property
    def inferring(self) -> bool:
        return self.infer or self._net is not None

    def infer_action(self, engine, session: int, current: np.ndarray,
                     guide: Guide) -> int | None:
        """A new context's first setting (``engine.context_infer``). With the Q-network
        (it sees the signature): a walk led by its greedy action on fresh observations
        (the newest tick, after the last move has shown, over the whole stack: the
        workload seen now, not the one before the switch), ``context_recall_steps`` a
        move, until it wants to stay or turns back (then half a move back), at most
        ``INFER_MOVES`` moves. Without it (``use_q_network = false``): a walk to the
        best-known setting of the nearest context. Either way the setting reached is
        held as a return's recalled one; exploration then starts as for any new
        context. None: nothing (more) to infer, the recall walk takes over."""
        now = engine.action_ticks
        if self.infer:
            self.infer = False
            if self.prior is not None:        # experience of earlier sessions proposes
                self._promise = self.prior.promised(self)
                target = self.prior.propose(engine, session, self, current, guide)
                if target is not None:
                    self.target = np.where(guide.frozen, current, target)
                    return None
                if self.prior.start != "qnet":
                    return None
            known = sum(self.recalled(0, k) is not None for k in range(len(self.memory) - 1))
            if known < self.cfg.context_infer_known:
                return None
            if not self.cfg.use_q_network:
                target = self.nearest_best()
                if target is not None:
                    self.target = np.where(guide.frozen, current, target)
                return None
            wait = 0 if self.cfg.context_infer_fresh else self.cfg.stack
            self._net = {"wait": now + wait, "moves": 0, "last": None}
        net = self._net
        if now < net["wait"]:
            return 0
        move = None
        if engine.dqn is not None and net["moves"] < self.INFER_MOVES:
            if self.cfg.context_infer_fresh:
                q = fresh_q(engine, session, current, guide)
            else:                     # the network's own stack, once it is all the new
                q = engine.dqn.q_values(engine.experience.latest(session)[1][None])[0]
            move = actions.decode(int(q.argmax()), len(current))
        k, sign = (move[0], int(np.sign(move[1]))) if move else (None, 0)
        stuck = move is None or guide.frozen[k] or not 0 <= current[k] + sign <= guide.n_steps[k]
        back = net["last"] is not None and net["last"][0] == k and net["last"][1] == -sign
        if stuck or back:
            self._net = None
            target = np.array(current)
            if back:
                target[k] += sign * (self.cfg.context_recall_steps // 2)
            self.target = guide.step_grid.clip(target)
            if self.cfg.context_infer_local:
                # trust the walk: its end is searched around, not away from by the new
                # context's global probes (issue 25 round 9)
                engine.exploration.bump(engine.exploration.bumped_at, local=True)
            return None
        net.update(wait=now + self.cfg.settle_ticks + 1, moves=net["moves"] + 1,
                   last=(k, sign))
        return actions.encode(k, sign * self.cfg.context_recall_steps, len(current))

    def nearest_best(self) -> np.ndarray | None:
        """The best-known setting of the context whose signature is nearest the current
        one's (None before any other context has one)."""
        c, cl = self.current, self.clusters
        known = [(cl.distance(cl.mean[c], k), k) for k in range(len(self.memory))
                 if k != c and self.recalled(0, k) is not None]
        return self.recalled(0, min(known)[1]) if known else None

    def lead(self, q_action: int, n_params: int) -> int:
        """The Q-network's one-step greedy action as a move of ``context_recall_steps``
        steps: on a tick the signature has just changed, it starts the walk the
        confirmed context would make a tick later."""
        move = actions.decode(q_action, n_params)
        if move is None:
            return 0
        k, steps = move
        return actions.encode(k, int(np.sign(steps)) * self.cfg.context_recall_steps, n_params)

    @property
    def origin(self) -> int | None:
        """The action tick ε's clock starts at in the current context (``Engine.epsilon``:
        a new workload is explored as a new session is, a return no more than its context
        still needs); None before the first context, or with none current (a checkpoint
        saved while the signature is between contexts)."""
        if not self.memory or self.current is None:
            return None
        return self.memory[self.current].created_at

    def counters(self) -> dict:
        return {"contexts": self.clusters.count, "switches": len(self.switches),
                "returns": sum(not s.new for s in self.switches)}

    # -- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict:
        """The contexts and what each keeps (``drl_engine.checkpoint``: loadable with
        ``weights_only``): a restarted engine recognises the workloads it has seen."""
        memory = [{**checkpoint.state_of(m, skip=("detector",)),
                   "best": checkpoint.encode(self.recalled(0, k)),
                   "detector": None if m.detector is None else checkpoint.state_of(m.detector)}
                  for k, m in enumerate(self.memory)]
        return {"clusters": checkpoint.state_of(self.clusters, skip=SETTINGS),
                "memory": memory, "left": self._left,
                "switches": [[s.index, s.context, s.new] for s in self.switches]}

    def load_state(self, state: dict) -> None:
        """Resume from :meth:`state`; ValueError when it was kept for other signature PIs."""
        clusters = {k: checkpoint.decode(v) for k, v in state["clusters"].items()}
        offset = clusters.get("offset")
        if offset is not None and len(offset) != len(self.columns):
            raise ValueError(f"the contexts' state has {len(offset)} signature PIs, "
                             f"this replay DB {len(self.columns)}")
        checkpoint.restore_into(self.clusters, state["clusters"])
        self.memory = []
        self.settings[0].clear()
        for c, m in enumerate(state["memory"]):
            detector = m.get("detector")
            mem = _Memory(created_at=0)
            checkpoint.restore_into(mem, {k: v for k, v in m.items()
                                          if k not in ("detector", "best")})
            self.remember(0, c, checkpoint.decode(m.get("best")))
            if detector is not None:
                mem.detector = SettingResidualDetector(ChangeDetectorConfig())
                checkpoint.restore_into(mem.detector, detector)
            self.memory.append(mem)
        self._left = state.get("left")
        self.switches = [Switch(*s) for s in state.get("switches", [])]
        self._session_from = len(self.switches)    # a session's indices are its own


def fresh_q(engine, session: int, current: np.ndarray, guide: Guide) -> np.ndarray:
    """The Q-network's values on :func:`fresh_observations` at the current setting
    (grid indices ``current``): what it makes of the workload seen now."""
    values = guide.step_grid.values(np.asarray(current)[None])
    return engine.dqn.q_values(fresh_observations(engine.experience, session, values))[0]


def fresh_observations(exp, session: int, settings: np.ndarray) -> np.ndarray:
    """Observations of the newest tick of ``session`` as if it had lasted the whole stack
    (the workload seen now, not the one before the switch), at each row of ``settings``
    (parameter values): a PI named as a parameter shows that setting too."""
    data = exp.reader.sessions[session]
    i = exp.derived[session].n - 1
    row = np.nan_to_num(np.asarray(data.pis[i], np.float64))      # (nodes, PIs)
    names, params = list(exp.layout.pi_names), list(exp.layout.param_names)
    x = np.repeat(row[None, None], len(settings), 0).repeat(exp.stack, 1)  # (B, S, N, P)
    for k, name in enumerate(params):
        if name in names:
            x[:, :, :, names.index(name)] = settings[:, k, None, None]
    if exp.normalise:
        x = exp.normaliser(x)
    v = (settings - exp._param_lo) / exp._param_span
    return np.concatenate([x.reshape(len(settings), -1), v], axis=1).astype(np.float32)


def _clear_stats(guide: Guide) -> None:
    if guide.dense:
        guide.grid_stats = np.zeros_like(guide.grid_stats)
    else:
        guide.sums = {}


def _fresh_detector(guide: Guide):
    if guide.detector is None:
        return None
    return SettingResidualDetector(ChangeDetectorConfig())
