"""Baseline tuners for the converge test: search-then-commit, in CAPES's own tick loop.

A baseline is, as the engine, a :class:`drl_engine.tuner.Tuner` of
:func:`drl_engine.loop.run_ticks`: every tick it reads the same delayed,
noisy PIs from the same replay DB, computes the same objective (``[reward] objective``
over ``[reward] pis``) and returns a :class:`~drl_engine.decision.Decision` whose
``values`` are the full setting it wants in effect now. It knows only what a real tuner
would: the parameter specs and the PIs, never the simulator's config.

The common scheme (:class:`SearchTuner`):

* **dwell**: each setting it evaluates is held for ``dwell`` ticks; its score is the mean
  objective over the last ``dwell − settle`` of them (the first ``settle`` ticks let a
  delayed system show the new setting's effect). Every evaluation costs ``dwell`` ticks,
  as it would on a live system.
* **budget**: after ``budget`` ticks of search it commits to its best setting and holds
  it (``epsilon`` 0, ``explored`` False) until ``workload_changed()`` restarts the search.
  The best setting is, unless the tuner says otherwise, the one with the highest mean
  score over all its evaluations.
* Settings live on each parameter's step grid (``min + k·step``, ``max`` included,
  forbidden values skipped); tuners search over grid indices.

Tuners (``TUNERS``; ``make_tuner(name, specs, reader, reward_cfg, seed, **options)``):

* ``random``: uniform random settings on the grid.
* ``hill``: noise-aware coordinate pattern search (Hooke–Jeeves style) from the current
  setting, with diagonal moves, a per-parameter step that halves when both directions
  fail, confirmation of a better candidate by a second measurement, and the incumbent
  re-measured now and then; optional random restarts.
* ``bo``: Bayesian optimisation, optuna's ``GPSampler`` (Matérn-5/2 GP with a fitted
  noise term, log-EI) through ask/tell, over integer grid indices (``space = "float"``:
  continuous indices rounded to the grid, cheaper); commits to the GP's best posterior mean
  among the settings it measured (``commit = "model"``) or to the best measured one.
* ``tpe``: the same through optuna's ``TPESampler``.
* ``cma``: CMA-ES, optuna's ``CmaEsSampler`` (needs the ``cmaes`` package).

optuna (extra ``tune``) is imported only when an optuna tuner is built.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from capes.common.config import ConfigError, build
from capes.common.params import ParameterSpec
from capes.common.step_grid import StepGrid
from capes.common.registry import PluginError, Registry
from capes.common.replay_db import ReplayReader
from drl_engine.config import RewardConfig
from drl_engine.decision import Decision
from drl_engine.rewards import OBJECTIVES, pi_columns
from drl_engine.tuner import Tuner

TUNERS = Registry("tuner")
tuner = TUNERS.register


# -- options ------------------------------------------------------------------------------

@dataclass
class SearchOptions:
    dwell: int = 5          # ticks each evaluated setting is held
    settle: int = 3         # first ticks of a dwell not scored (the system's delay)
    budget: int = 500       # ticks of search before committing to the best setting

    def validate(self) -> None:
        if self.settle < 0:
            raise ValueError(f"settle: must be >= 0 (got {self.settle})")
        if self.dwell <= self.settle:
            raise ValueError(f"dwell: must exceed settle ({self.dwell} <= {self.settle}); "
                             f"a setting needs at least one scored tick")
        if self.budget < self.dwell:
            raise ValueError(f"budget: must be >= dwell ({self.budget} < {self.dwell})")


# -- the grid -----------------------------------------------------------------------------

class Grid:
    """Each parameter's step grid (``capes.common.step_grid``: index k is
    ``min + k·step``, the last index may be ``max`` itself when max is off the grid);
    forbidden values are never proposed."""

    def __init__(self, specs: list[ParameterSpec]):
        self.specs = list(specs)
        self.steps = StepGrid.of(self.specs)
        self.sizes = [int(n) for n in self.steps.sizes]
        self.allowed = [np.array([not s.is_forbidden(float(v))
                                  for v in self.steps.knob_values(k)])
                        for k, s in enumerate(self.specs)]
        for s, ok in zip(self.specs, self.allowed):
            if not ok.any():
                raise ValueError(f"{s.name}: every value on the grid is forbidden")

    def snap_index(self, k: int, i: float) -> int:
        """The nearest allowed index to (possibly fractional, out-of-range) ``i``."""
        n = self.sizes[k]
        i = int(min(n - 1, max(0, round(i))))
        if self.allowed[k][i]:
            return i
        ok = np.flatnonzero(self.allowed[k])
        return int(ok[np.argmin(np.abs(ok - i))])

    def snap(self, idx) -> tuple[int, ...]:
        return tuple(self.snap_index(k, i) for k, i in enumerate(idx))

    def index_of(self, values) -> tuple[int, ...]:
        """Grid indices of ``values`` (clamped and snapped)."""
        return self.snap(self.steps.index(values))

    def values(self, idx) -> list[float]:
        return [float(v) for v in self.steps.values(np.asarray(idx, np.int64))]

    def random(self, rng: np.random.Generator) -> tuple[int, ...]:
        return tuple(int(rng.choice(np.flatnonzero(ok))) for ok in self.allowed)


# -- the base class -----------------------------------------------------------------------

class SearchTuner(Tuner):
    """Search-then-commit over the step grid, driven one tick at a time by the tick loop
    (a ``drl_engine.tuner.Tuner``, as the engine; it keeps nothing across restarts).

    Subclasses implement ``propose() -> grid indices`` and ``observe(idx, score)``
    (score None: the evaluation failed, no data), and may override ``best()``."""

    Options = SearchOptions
    name = "search"

    def __init__(self, specs: list[ParameterSpec], reader: ReplayReader,
                 reward: RewardConfig, seed: int = 0, options: SearchOptions | None = None):
        self.specs = list(specs)
        self.reader = reader
        self.reward_cfg = reward
        self.seed = int(seed)
        self.opts = options if options is not None else self.Options()
        self.opts.validate()
        self.grid = Grid(self.specs)
        self.objective = OBJECTIVES.build(reward.objective, reward.objective_options)
        self.train_steps = 0                   # the engine's counters, for the harness
        self.action_ticks = 0
        self.evaluations = 0                   # over all searches
        self._cols: list[int] | None = None
        self._session: int | None = None
        self._restart()

    # -- the engine's interface ---------------------------------------------------------
    @property
    def epsilon(self) -> float:
        return 1.0 if self.searching else 0.0

    @property
    def searching(self) -> bool:
        return not self.committed

    def update(self) -> int:
        n = self.reader.refresh()
        if self._cols is None and self.reader.layout is not None:
            self._cols = pi_columns(self.reward_cfg.pis, self.reader.layout.pi_names)
        return n

    def train(self, steps: int | None = None) -> None:
        return None

    def workload_changed(self) -> None:
        """A new workload: forget everything and search again from the current setting."""
        self._restart()

    def act(self, session: int, after_tick: int | None = None,
            current: list[float] | None = None) -> Decision | None:
        data = self.reader.sessions.get(session)
        if data is None or data.length == 0 or self._cols is None:
            return None
        tick = data.first_tick + data.length - 1
        if after_tick is not None and tick <= after_tick:
            return None
        if session != self._session:
            if self._session is not None and self._idx is not None:
                self._restart()
            self._session = session
        if self._idx is None:                                  # a search starts
            now = current if current is not None else data.current_values()
            self.start = self.grid.index_of(now)
            self._search_start = tick
            self._begin(self._next(), tick)
        elif not self.committed and tick >= self._applied_at + self.opts.dwell:
            score = self._score(data, tick)
            if score is not None or tick >= self._applied_at + 2 * self.opts.dwell:
                self._record(self._idx, score)
                if tick - self._search_start + self.opts.dwell > self.opts.budget:
                    self.committed = True
                    self.committed_at = tick
                    self._begin(self.grid.snap(self.best()), tick)
                else:
                    self._begin(self._next(), tick)
        self.action_ticks += 1
        return Decision(tick, 0, self.grid.values(self._idx), self.epsilon,
                        explored=not self.committed, q_max=None)

    # -- for subclasses -----------------------------------------------------------------
    def reset(self) -> None:
        """Start a new search (state of the subclass); ``self.start`` is known by then
        only from the first ``propose`` on."""

    def propose(self) -> tuple[int, ...]:
        raise NotImplementedError

    def observe(self, idx: tuple[int, ...], score: float | None) -> None:
        pass

    def best(self) -> tuple[int, ...]:
        """The setting to commit to: the highest mean score over its evaluations."""
        means = {idx: float(np.mean(s)) for idx, s in self.scores.items() if s}
        if not means:
            return self.start
        return max(means, key=lambda i: (means[i], -len(self.scores[i])))

    def mean_score(self, idx) -> float | None:
        s = self.scores.get(tuple(idx))
        return float(np.mean(s)) if s else None

    # -- internals ----------------------------------------------------------------------
    def _restart(self) -> None:
        self.committed = False
        self.committed_at: int | None = None
        self.scores: dict[tuple[int, ...], list[float]] = {}
        self.history: list[tuple[tuple[int, ...], float | None]] = []
        self._idx: tuple[int, ...] | None = None
        self._applied_at = self._search_start = 0
        self.start: tuple[int, ...] | None = None
        self.rng = np.random.default_rng([self.seed, self.evaluations])
        self.reset()

    def _next(self) -> tuple[int, ...]:
        return self.grid.snap(self.propose())

    def _begin(self, idx: tuple[int, ...], tick: int) -> None:
        self._idx, self._applied_at = tuple(idx), tick

    def _score(self, data, tick: int) -> float | None:
        """Mean objective over the scored ticks of the current dwell (None: no data)."""
        lo = self._applied_at + self.opts.settle + 1 - data.first_tick
        hi = tick + 1 - data.first_tick
        pis = data.pis[max(0, lo):hi][:, :, self._cols]
        if len(pis) == 0:
            return None
        p = np.asarray(self.objective(pis), float)
        p = p[np.isfinite(p)]
        return float(p.mean()) if len(p) else None

    def _record(self, idx: tuple[int, ...], score: float | None) -> None:
        self.evaluations += 1
        self.history.append((idx, score))
        if score is not None:
            self.scores.setdefault(idx, []).append(score)
        self.observe(idx, score)


# -- random search ------------------------------------------------------------------------

@tuner("random")
class RandomTuner(SearchTuner):
    """Uniform random settings on the grid."""

    def propose(self):
        return self.grid.random(self.rng)


# -- hill climbing ------------------------------------------------------------------------

@dataclass
class HillOptions(SearchOptions):
    initial_step: float = 0.25   # first move, as a fraction of each parameter's range
    shrink: float = 0.5          # step × shrink when both directions fail
    expand: float = 1.0          # step × expand after a success (1: keep it)
    diagonal: bool = True        # a sweep also tries diagonal moves (every parameter
                                 # at once): escapes ridges such as min(curve, cap)
    confirm: bool = True         # a candidate that beats the incumbent is measured once
                                 # more and accepted only if the mean of both still does
    remeasure_every: int = 4     # also measure the incumbent again every this many
                                 # evaluations (0: only when converged)
    restarts: bool = False       # converged (all steps at one grid step, a sweep found
                                 # nothing): restart from a random setting

    def validate(self) -> None:
        super().validate()
        if not 0 < self.initial_step <= 1:
            raise ValueError(f"initial_step: must lie in (0, 1] (got {self.initial_step})")
        if not 0 < self.shrink < 1:
            raise ValueError(f"shrink: must lie in (0, 1) (got {self.shrink})")
        if self.expand < 1:
            raise ValueError(f"expand: must be >= 1 (got {self.expand})")
        if self.remeasure_every < 0 or self.remeasure_every == 1:
            raise ValueError(f"remeasure_every: must be 0 or >= 2 "
                             f"(got {self.remeasure_every})")


@tuner("hill")
class HillClimber(SearchTuner):
    """Coordinate pattern search from the current setting, made for noisy scores.

    A sweep tries incumbent ± step for one parameter at a time (random order; after a
    success the successful move first), then (``diagonal``) moves of every parameter at
    once, which get it off ridges such as min(curve(m), τ) where no single parameter
    helps. A candidate is accepted when its mean score beats the incumbent's (with
    ``confirm``: on a second measurement as well). When both directions of a parameter
    fail its step shrinks (never below one grid step). The incumbent's score is the
    mean of all its measurements; it is measured again every ``remeasure_every``
    evaluations and whenever a sweep at the smallest steps finds nothing (converged),
    so a lucky score cannot hold it. With ``restarts`` a converged search starts over
    from a random setting. Commits to the incumbent (with restarts: the local optimum
    with the highest mean score)."""

    Options = HillOptions

    def reset(self):
        self.incumbent: tuple[int, ...] | None = None
        self.optima: list[tuple[int, ...]] = []      # incumbents left by restarts
        self.remeasure = False
        self.restarting = False
        self.confirming: tuple[int, ...] | None = None
        self.move: tuple[int, int] | None = None
        self._fresh_steps()

    def _fresh_steps(self):
        self.steps = [max(1.0, self.opts.initial_step * (n - 1)) for n in self.grid.sizes]
        self.moves: list[tuple[int, int]] = []
        self.failed: set[tuple[int, int]] = set()
        self.sweep_at_min = False

    def _new_sweep(self, first=None):
        """Coordinate moves (k, ±1) in random order, then (with ``diagonal``) as many
        diagonal moves (-1, signs) as there are parameters (all of them when d <= 3)."""
        d = len(self.specs)
        ks = self.rng.permutation(d)
        moves = [(int(k), int(s)) for k in ks for s in self.rng.permutation([1, -1])]
        if self.opts.diagonal and d > 1:
            if d <= 3:
                signs = [tuple(2 * ((i >> j) & 1) - 1 for j in range(d))
                         for i in self.rng.permutation(2 ** d)]
            else:
                signs = [tuple(int(x) for x in self.rng.choice([-1, 1], d))
                         for _ in range(d)]
            moves += [(-1, sg) for sg in signs]
        if first is not None:
            moves = [first] + [m for m in moves if m != first]
        self.moves = moves
        self.sweep_at_min = all(s <= 1 for s in self.steps)

    def _candidate(self, move) -> tuple[int, ...] | None:
        k, d = move
        idx = list(self.incumbent)
        if k < 0:                                       # diagonal: every parameter
            idx = [self.grid.snap_index(j, i + sg * round(self.steps[j]))
                   for j, (i, sg) in enumerate(zip(idx, d))]
        else:
            idx[k] = self.grid.snap_index(k, idx[k] + d * round(self.steps[k]))
        idx = tuple(idx)
        return None if idx == self.incumbent else idx

    def propose(self):
        if self.incumbent is None:
            return self.start
        if self.confirming is not None:
            return self.confirming
        every = self.opts.remeasure_every
        if every and len(self.history) % every == every - 1:
            self.remeasure = True
            return self.incumbent
        while True:
            if not self.moves:
                if self.sweep_at_min:                    # converged
                    self.sweep_at_min = False
                    if self.opts.restarts:
                        self.optima.append(self.incumbent)
                        self._fresh_steps()
                        self.restarting = True
                        return self.grid.random(self.rng)
                    self.remeasure = True
                    return self.incumbent
                self._new_sweep()
            self.move = self.moves.pop(0)
            cand = self._candidate(self.move)
            if cand is not None:
                return cand
            self._failed(self.move)

    def _failed(self, move):
        k, d = move
        if k < 0:                                       # diagonals never shrink a step
            return
        self.failed.add(move)
        if (k, -d) in self.failed:
            self.steps[k] = max(1.0, self.steps[k] * self.opts.shrink)
            self.failed -= {(k, 1), (k, -1)}

    def observe(self, idx, score):
        if self.incumbent is None or self.restarting:
            self.restarting = False
            self.incumbent = idx
            return
        if self.remeasure:
            self.remeasure = False
            return
        inc = self.mean_score(self.incumbent)
        cand = self.mean_score(idx)
        better = cand is not None and (inc is None or cand > inc)
        if better and self.opts.confirm and self.confirming is None:
            self.confirming = idx                     # measure it once more first
            return
        self.confirming = None
        if better:
            k, d = self.move
            self.incumbent = idx
            for j in (range(len(self.steps)) if k < 0 else [k]):
                self.steps[j] = min(self.grid.sizes[j] - 1.0, self.steps[j] * self.opts.expand)
            self.failed.clear()
            self._new_sweep(first=(k, d))
        else:
            self._failed(self.move)

    def best(self):
        if self.incumbent is None:
            return self.start
        cands = self.optima + [self.incumbent]
        means = {i: self.mean_score(i) for i in cands}
        means = {i: m for i, m in means.items() if m is not None}
        return max(means, key=means.get) if means else self.incumbent


# -- optuna samplers ----------------------------------------------------------------------

def _optuna():
    try:
        import optuna
    except ImportError:
        raise ImportError("the bo/tpe/cma tuners need optuna: pip install 'capes[tune]' "
                          "(or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna


@dataclass
class OptunaOptions(SearchOptions):
    startup: int = 10            # random (independent) evaluations before the model

    def validate(self) -> None:
        super().validate()
        if self.startup < 0:
            raise ValueError(f"startup: must be >= 0 (got {self.startup})")


class OptunaTuner(SearchTuner):
    """Ask/tell with an optuna sampler over the grid indices (one IntDistribution per
    parameter); a failed evaluation is told as FAIL."""

    Options = OptunaOptions

    def make_sampler(self, optuna):
        raise NotImplementedError

    def distributions(self, optuna) -> dict:
        """One IntDistribution over the grid indices per parameter."""
        return {f"p{k}": optuna.distributions.IntDistribution(0, n - 1)
                for k, n in enumerate(self.grid.sizes)}

    def reset(self):
        optuna = _optuna()
        self._optuna = optuna
        self.dists = self.distributions(optuna)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.sampler = self.make_sampler(optuna)
            self.study = optuna.create_study(direction="maximize", sampler=self.sampler)
        self.trial = None

    def propose(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", self._optuna.exceptions.ExperimentalWarning)
            self.trial = self.study.ask(self.dists)
        return tuple(round(self.trial.params[f"p{k}"]) for k in range(len(self.specs)))

    def observe(self, idx, score):
        state = self._optuna.trial.TrialState
        if score is None:
            self.study.tell(self.trial, state=state.FAIL)
        else:
            self.study.tell(self.trial, score)
        self.trial = None


@dataclass
class BOOptions(OptunaOptions):
    commit: str = "model"        # "model": best GP posterior mean among measured
                                 # settings; "best": best measured score
    space: str = "int"           # "int": integer grid indices (exact); "float":
                                 # continuous indices rounded to the grid when applied
                                 # (as scikit-optimize treats integers): optuna's
                                 # acquisition search then costs 1.5-3x less
    acq_starts: int = 0          # local searches of the acquisition optimiser
                                 # (0: optuna's default, 10)

    def validate(self) -> None:
        super().validate()
        if self.commit not in ("model", "best"):
            raise ValueError(f"commit: must be 'model' or 'best' (got {self.commit!r})")
        if self.space not in ("int", "float"):
            raise ValueError(f"space: must be 'int' or 'float' (got {self.space!r})")
        if self.acq_starts < 0:
            raise ValueError(f"acq_starts: must be >= 0 (got {self.acq_starts})")


@tuner("bo")
class BayesOpt(OptunaTuner):
    """Gaussian-process BO (optuna GPSampler: Matérn-5/2 kernel, fitted noise, log-EI)."""

    Options = BOOptions

    def make_sampler(self, optuna):
        sampler = optuna.samplers.GPSampler(seed=self.seed,
                                            n_startup_trials=self.opts.startup,
                                            warn_independent_sampling=False)
        if self.opts.acq_starts and hasattr(sampler, "_n_local_search"):
            sampler._n_local_search = self.opts.acq_starts
        return sampler

    def distributions(self, optuna) -> dict:
        if self.opts.space == "int":
            return super().distributions(optuna)
        # continuous grid indices, rounded when applied (as scikit-optimize does)
        return {f"p{k}": optuna.distributions.FloatDistribution(0, n - 1)
                for k, n in enumerate(self.grid.sizes)}

    def best(self):
        if self.opts.commit == "model":
            idx = self._model_best()
            if idx is not None:
                return idx
        return super().best()

    def _model_best(self) -> tuple[int, ...] | None:
        """The measured setting with the highest posterior mean of a GP fitted (with
        optuna's own GP code) to every evaluation; None when that is unavailable."""
        optuna = self._optuna
        trials = self.study.get_trials(deepcopy=False,
                                       states=(optuna.trial.TrialState.COMPLETE,))
        if len(trials) < 2:
            return None
        try:                                   # optuna's GP internals (optuna >= 4.2)
            import torch
            from optuna._gp import gp, prior
            from optuna._gp import search_space as gp_space
            space = gp_space.SearchSpace(self.dists)
            X = space.get_normalized_params(trials)
            y = np.array([t.value for t in trials], float)
            y = (y - y.mean()) / max(y.std(), 1e-12)
            gpr = gp.fit_kernel_params(X=X, Y=y, is_categorical=space.is_categorical,
                                       log_prior=prior.default_log_prior,
                                       minimum_noise=prior.DEFAULT_MINIMUM_NOISE_VAR,
                                       gpr_cache=None, deterministic_objective=False)
            with torch.no_grad():
                mean, _ = gpr.posterior(torch.from_numpy(X))
            t = trials[int(np.argmax(mean.numpy()))]
        except Exception:                      # noqa: BLE001 -- fall back to best measured
            return None
        return tuple(round(t.params[f"p{k}"]) for k in range(len(self.specs)))


@tuner("tpe")
class TPE(OptunaTuner):
    """Tree-structured Parzen estimator (optuna TPESampler)."""

    def make_sampler(self, optuna):
        return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.opts.startup)


@dataclass
class CMAOptions(OptunaOptions):
    startup: int = 0             # random evaluations before CMA-ES starts
    popsize: int = 0             # 0: CMA-ES's default (4 + 3 ln d)
    with_margin: bool = False    # CMA-ES with margin (for integer parameters)

    def validate(self) -> None:
        super().validate()
        if self.popsize < 0:
            raise ValueError(f"popsize: must be >= 0 (got {self.popsize})")


def have_cmaes() -> bool:
    try:
        import cmaes  # noqa: F401
    except ImportError:
        return False
    return True


@tuner("cma")
class CMAES(OptunaTuner):
    """CMA-ES (optuna CmaEsSampler, which needs the ``cmaes`` package): the search
    distribution starts at the centre of the ranges with σ = 1/6 of the smallest range
    (optuna's defaults; its x0/sigma0 arguments are deprecated)."""

    Options = CMAOptions

    def make_sampler(self, optuna):
        if not have_cmaes():
            raise ImportError("the cma tuner needs the cmaes package: pip install capes[tune]")
        o = self.opts
        return optuna.samplers.CmaEsSampler(
            seed=self.seed, n_startup_trials=o.startup, popsize=o.popsize or None,
            with_margin=o.with_margin, warn_independent_sampling=False)


# -- construction -------------------------------------------------------------------------

def tuner_names() -> list[str]:
    return TUNERS.names()


def missing_dependency(name: str) -> str | None:
    """Why tuner ``name`` cannot run here (an optional package is missing), in one line;
    None when it can. Asked before a run starts, so that a missing extra is an error
    line, not a traceback from a worker."""
    cls = TUNERS.get_plugin(parse_tuner(name)[0])
    if not issubclass(cls, OptunaTuner):
        return None
    try:
        _optuna()
    except ImportError as exc:
        return str(exc)
    if cls is CMAES and not have_cmaes():
        return "the cma tuner needs the cmaes package: pip install 'capes[tune]'"
    return None


def parse_tuner(spec: str) -> tuple[str, dict[str, Any]]:
    """``"bo:dwell=3,budget=300"`` -> ``("bo", {"dwell": 3, "budget": 300})``: a tuner
    name with options, as one string (for ``--tuner`` and benchmark labels). Values are
    read as int, float, true/false, else kept as strings; the tuner's ``Options`` then
    checks them."""
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"tuner {spec!r}: expected key=value, got {item!r}")
        raw = raw.strip()
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        options[key.strip()] = value
    return name.strip(), options


def make_tuner(name: str, specs: list[ParameterSpec], reader: ReplayReader,
               reward_cfg: RewardConfig, seed: int = 0, **options: Any) -> SearchTuner:
    """The tuner ``name`` (optionally ``name:key=value,...``, see :func:`parse_tuner`)
    with its options checked against its ``Options`` dataclass (unknown keys, types,
    ranges: one ``ValueError`` naming the key); keyword options override those in the
    name."""
    name, parsed = parse_tuner(name)
    options = {**parsed, **options}
    try:
        cls = TUNERS.get_plugin(name)
    except PluginError as exc:
        raise ValueError(f"tuner: {exc.problem}") from None
    try:
        opts = build(cls.Options, options, f"tuner {name}")
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return cls(specs, reader, reward_cfg, seed=seed, options=opts)


__all__ = ["TUNERS", "SearchTuner", "SearchOptions", "HillOptions", "OptunaOptions",
           "BOOptions", "CMAOptions", "RandomTuner", "HillClimber", "BayesOpt", "TPE",
           "CMAES", "Grid", "make_tuner", "parse_tuner", "tuner_names", "have_cmaes"]

