"""``capes evaluate``: a Pilot-style comparison of configurations on a real target.

Pilot (seed 001, chapter 4) in the parts a before/after comparison needs:

* **Randomised, interleaved repetitions** (§4.2.4, Fig. 4.4): every round runs every
  configuration once, in a fresh random order, so drift of the host (caches, other
  tenants, thermal state) spreads over all configurations instead of biasing one.
* **Warm-up removal**: a repetition starts by reopening the target (a readahead change
  only reaches a file opened after it) and with cold caches. The warm-up is found by
  MSER (the Marginal Standard Error Rule, White 1997): the truncation point ``d`` that
  minimises ``var(x[d:]) / (n - d)``, searched over the first half, on the second-by-
  second mean of a configuration's repetitions (Pilot assumes, as we do, that the warm-up
  lasts about as long in every round). The same ``d`` is dropped from each repetition.
  (Pilot uses EDM changepoints; MSER is simpler, needs no extra package, and is the
  standard truncation rule in simulation output analysis.)
* **Autocorrelation and subsession analysis** (§4.2.2): per-second samples are
  autocorrelated; Pilot merges ``n`` adjacent samples into one, increasing ``n`` until the
  lag-1 autocorrelation coefficient lies in [-0.1, 0.1]. We estimate the lag-1
  coefficient pooled over a configuration's repetitions (each centred on its own mean,
  plus the first-order bias correction 1/k for k batches per repetition) and pick the
  smallest such ``n`` leaving at least ``min_batches`` batches per repetition; if none
  does, the unit becomes the repetition mean.
* **Between-repetition variation**: subsession samples of different repetitions are only
  exchangeable if the repetitions agree. A one-way ANOVA over the repetitions' batches
  (scipy.stats.f_oneway) tests that; when it rejects (p < 0.05), the repetition means
  are the samples instead (the classic replication/deletion method), so run-to-run
  variation, which on real storage usually dominates, is in the CI.
* **Confidence intervals**: Student t intervals (scipy.stats.t) for each mean; for the
  relative difference ``mean_b / mean_a - 1`` Fieller's interval for a ratio of
  independent means, with Welch–Satterthwaite degrees of freedom (unbounded when the
  baseline mean is not significantly different from zero); the absolute difference's CI
  and Welch's t-test p-value from scipy.stats.ttest_ind(equal_var=False).
* **Required repetitions** (§4.2.3): the smallest sample count whose t-interval has a
  relative half-width at most ``precision`` given the observed spread, turned into
  repetitions at the samples per repetition observed; likewise for the ratio of a
  configuration's mean to the baseline's (delta method: its CI's half-width relative to
  the ratio, i.e. for a ratio near 1 the relative difference to within ±precision).

The statistics are pure functions of arrays (unit-tested on synthetic series with known
answers); the I/O part (appliers, fio, collectors) is below them.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from scipy import signal as sps_signal
from scipy import stats

from capes.common.stats import MeanCI, mean_ci  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

NAN = float("nan")


# ---------------------------------------------------------------------------------------
# Statistics (pure)
# ---------------------------------------------------------------------------------------

def acf(x, nlags: int = 1) -> np.ndarray:
    """Sample autocorrelation coefficients R(0..nlags) (the biased estimator, as Pilot
    and statsmodels use): sum((x_t - m)(x_{t+k} - m)) / sum((x_t - m)^2). NaN for lags
    the series is too short for; all zero lags > 0 for a constant series."""
    x = np.asarray(x, dtype=float)
    n = x.size
    out = np.full(nlags + 1, NAN)
    if n == 0:
        return out
    d = x - x.mean()
    denom = float(d @ d)
    out[0] = 1.0
    if denom == 0.0:
        out[1:min(nlags, n - 1) + 1] = 0.0
        return out
    full = sps_signal.correlate(d, d, mode="full")[n - 1:]
    k = min(nlags, n - 1)
    out[:k + 1] = full[:k + 1] / denom
    out[0] = 1.0
    return out


def pooled_lag1_acf(groups) -> float:
    """Lag-1 autocorrelation pooled over several series (repetitions), each centred on
    its own mean: sum of lag-1 products over sum of squares. NaN without any pair."""
    num = den = 0.0
    pairs = 0
    for g in groups:
        g = np.asarray(g, dtype=float)
        if g.size < 2:
            continue
        d = g - g.mean()
        num += float(d[:-1] @ d[1:])
        den += float(d @ d)
        pairs += g.size - 1
    if pairs == 0:
        return NAN
    if den == 0.0:
        return 0.0
    return num / den


def detect_warmup(x, max_fraction: float = 0.5, batch: int = 1) -> int:
    """Samples to drop from the start of ``x``: MSER-``batch``. Batch means of ``batch``
    samples y_1..y_k; d* = argmin over d <= max_fraction * k of
    sum_{j > d} (y_j - mean(y[d:]))^2 / (k - d)^2. Returns d* * batch."""
    x = np.asarray(x, dtype=float)
    k = x.size // batch
    if k < 4:
        return 0
    y = x[:k * batch].reshape(k, batch).mean(axis=1)
    d_max = min(int(max_fraction * k), k - 2)
    # suffix sums give every var(y[d:]) in O(k)
    s1 = np.cumsum(y[::-1])[::-1]
    s2 = np.cumsum((y * y)[::-1])[::-1]
    d = np.arange(d_max + 1)
    m = k - d
    sse = s2[d] - s1[d] ** 2 / m
    z = np.maximum(sse, 0.0) / (m * m)
    return int(np.argmin(z)) * batch


def batch_means(x, size: int) -> np.ndarray:
    """Means of consecutive non-overlapping batches of ``size`` samples; a remainder is
    dropped from the start (the end of the warm-up side)."""
    x = np.asarray(x, dtype=float)
    k = x.size // size
    if k == 0:
        return np.zeros(0)
    return x[x.size - k * size:].reshape(k, size).mean(axis=1)


def subsession_size(groups, threshold: float = 0.1, min_batches: int = 5
                    ) -> tuple[int | None, float]:
    """Pilot's subsession analysis over a configuration's repetitions: the smallest
    batch size whose batch means have a pooled lag-1 autocorrelation (bias-corrected by
    +1/k, k = batches per repetition) within [-threshold, threshold], keeping at least
    ``min_batches`` batches per repetition. Returns (size, corrected coefficient), or
    (None, coefficient at the largest size tried) when no size qualifies."""
    groups = [np.asarray(g, dtype=float) for g in groups]
    shortest = min((g.size for g in groups), default=0)
    r = NAN
    for size in range(1, shortest // min_batches + 1):
        batches = [batch_means(g, size) for g in groups]
        k = np.mean([b.size for b in batches])
        r = pooled_lag1_acf(batches) + 1.0 / k
        if abs(r) <= threshold:
            return size, float(r)
    return None, float(r)


@dataclass
class Samples:
    """The (nearly) independent samples of one configuration and how they were made."""
    values: np.ndarray
    unit: str                      # "subsession" or "repetition"
    subsession: int | None         # batch size in seconds (None: repetition means)
    lag1_raw: float                # pooled lag-1 autocorrelation of the per-second data
    lag1: float                    # ... of the samples used (bias-corrected)
    anova_p: float                 # repetitions agree? (NaN when not testable)
    per_rep: float                 # samples per repetition


def independent_samples(groups, threshold: float = 0.1, min_batches: int = 5,
                        alpha: float = 0.05) -> Samples:
    """From per-second series (one per repetition, warm-up already dropped) to samples
    fit for a t-interval: subsession batch means pooled over repetitions, or the
    repetition means when no batch size decorrelates the data or the repetitions
    disagree (one-way ANOVA p < alpha)."""
    groups = [np.asarray(g, dtype=float) for g in groups if np.size(g) > 0]
    if not groups:
        return Samples(np.zeros(0), "repetition", None, NAN, NAN, NAN, 0.0)
    raw = pooled_lag1_acf(groups)
    rep_means = np.array([g.mean() for g in groups])
    size, r = subsession_size(groups, threshold, min_batches)
    if size is None:
        r_rep = acf(rep_means, 1)[1] if rep_means.size > 2 else NAN
        return Samples(rep_means, "repetition", None, raw, float(r_rep), NAN, 1.0)
    batches = [batch_means(g, size) for g in groups]
    p = NAN
    if len(batches) >= 2 and all(b.size >= 2 for b in batches):
        with np.errstate(all="ignore"):
            p = float(stats.f_oneway(*batches).pvalue)
        if not math.isfinite(p):   # all batches identical within repetitions
            p = 1.0 if np.ptp(rep_means) == 0 else 0.0
    if math.isfinite(p) and p < alpha:
        r_rep = acf(rep_means, 1)[1] if rep_means.size > 2 else NAN
        return Samples(rep_means, "repetition", size, raw, float(r_rep), p, 1.0)
    values = np.concatenate(batches)
    return Samples(values, "subsession", size, raw, r, p, values.size / len(groups))


def fieller_ratio_ci(mean_a: float, var_a: float, mean_b: float, var_b: float,
                     t: float) -> tuple[float, float]:
    """Fieller's interval for mean_b / mean_a, independent estimates whose variances
    (of the means) are var_a and var_b, at critical value t. (-inf, inf) when mean_a is
    not significantly different from zero (the set is then unbounded)."""
    a = mean_a * mean_a - t * t * var_a
    b = mean_a * mean_b
    c = mean_b * mean_b - t * t * var_b
    if a <= 0:
        return -math.inf, math.inf
    disc = b * b - a * c
    if disc < 0:                  # cannot happen when a > 0; guard rounding
        disc = 0.0
    root = math.sqrt(disc)
    return (b - root) / a, (b + root) / a


@dataclass
class Comparison:
    rel: float                    # mean_b / mean_a - 1
    rel_low: float
    rel_high: float
    diff: float                   # mean_b - mean_a
    diff_low: float
    diff_high: float
    p_welch: float
    df: float

    @property
    def significant(self) -> bool:
        return math.isfinite(self.rel_low) and (self.rel_low > 0 or self.rel_high < 0)


def relative_difference(a, b, confidence: float = 0.95) -> Comparison:
    """b against a: the relative difference b/a - 1 with Fieller's CI (Welch–
    Satterthwaite df), the difference of means with its Welch CI and Welch's p-value
    (both scipy.stats.ttest_ind(equal_var=False))."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    ma, mb = float(a.mean()), float(b.mean())
    rel = mb / ma - 1 if ma else NAN
    if a.size < 2 or b.size < 2:
        return Comparison(rel, NAN, NAN, mb - ma, NAN, NAN, NAN, NAN)
    va, vb = float(a.var(ddof=1)) / a.size, float(b.var(ddof=1)) / b.size
    if va == 0 and vb == 0:
        p = 0.0 if ma != mb else 1.0
        return Comparison(rel, rel, rel, mb - ma, mb - ma, mb - ma, p, math.inf)
    with np.errstate(all="ignore"):
        res = stats.ttest_ind(b, a, equal_var=False)
        dlo, dhi = res.confidence_interval(confidence)
    r = mb / ma if ma else 1.0
    num = (vb + r * r * va) ** 2
    den = vb * vb / (b.size - 1) + (r ** 4) * va * va / (a.size - 1)
    df = num / den if den > 0 else math.inf
    t = float(stats.t.ppf(0.5 + confidence / 2, df))
    lo, hi = fieller_ratio_ci(ma, va, mb, vb, t)
    return Comparison(rel, lo - 1, hi - 1, mb - ma, float(dlo), float(dhi),
                      float(res.pvalue), float(df))


def required_samples(sd: float, mean: float, precision: float,
                     confidence: float = 0.95, cap: int = 10_000_000) -> int:
    """The smallest n >= 2 with t_{n-1} * sd / sqrt(n) <= precision * |mean|."""
    if not (math.isfinite(sd) and math.isfinite(mean)) or mean == 0:
        return cap
    if sd == 0:
        return 2
    q = 0.5 + confidence / 2
    target = precision * abs(mean)
    n = max(2, int((stats.norm.ppf(q) * sd / target) ** 2))
    while n > 2 and stats.t.ppf(q, n - 2) * sd / math.sqrt(n - 1) <= target:
        n -= 1
    while n < cap and stats.t.ppf(q, n - 1) * sd / math.sqrt(n) > target:
        n += 1
    return n


def required_repetitions_for_ratio(a, b, per_rep_a: float, per_rep_b: float,
                                   precision: float, confidence: float = 0.95,
                                   cap: int = 1_000_000) -> int:
    """Repetitions per configuration (the same for both) after which the CI of the
    ratio mean_b / mean_a (delta method, Welch df) has a relative half-width of at most
    ``precision`` (for a ratio near 1: the relative difference known to within
    ±precision), given the spreads observed and the samples each repetition yields."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.size < 2 or b.size < 2 or not a.mean():
        return cap
    ma, mb = a.mean(), b.mean()
    sa2, sb2 = a.var(ddof=1), b.var(ddof=1)
    q = 0.5 + confidence / 2

    def half_width(reps: int) -> float:
        na, nb = max(2.0, reps * per_rep_a), max(2.0, reps * per_rep_b)
        ua, ub = sa2 / (na * ma * ma), (sb2 / (nb * mb * mb) if mb else 0.0)
        if ua + ub == 0:
            return 0.0
        df = (ua + ub) ** 2 / (ua * ua / (na - 1) + ub * ub / (nb - 1))
        return float(stats.t.ppf(q, df)) * math.sqrt(ua + ub)

    lo, hi = 1, 1
    while half_width(hi) > precision:
        hi *= 2
        if hi >= cap:
            return cap
    while lo < hi:
        mid = (lo + hi) // 2
        if half_width(mid) <= precision:
            hi = mid
        else:
            lo = mid + 1
    return lo


def interleaved_order(n_configs: int, repetitions: int, rng: np.random.Generator
                      ) -> list[int]:
    """Rounds of every configuration once, each round in a fresh random order."""
    order: list[int] = []
    for _ in range(repetitions):
        order.extend(int(i) for i in rng.permutation(n_configs))
    return order


def analyse_config(reps, confidence: float = 0.95, precision: float = 0.05,
                   acf_threshold: float = 0.1, min_batches: int = 5,
                   warmup: int | None = None) -> dict:
    """One configuration's repetitions (per-second samples each) -> its statistics.
    ``warmup``: seconds dropped from the start of each repetition; None: MSER's."""
    reps = [np.asarray(r, dtype=float) for r in reps if np.size(r) > 0]
    if not reps:
        return {"n_reps": 0, "n": 0, "mean": NAN, "ci_low": NAN, "ci_high": NAN}
    length = min(r.size for r in reps)
    profile = np.mean([r[:length] for r in reps], axis=0)
    warm = detect_warmup(profile) if warmup is None else min(int(warmup), length - 1)
    kept = [r[warm:] for r in reps]
    s = independent_samples(kept, acf_threshold, min_batches)
    ci = mean_ci(s.values, confidence)
    n_req = required_samples(ci.sd, ci.mean, precision, confidence) if ci.n >= 2 else None
    reps_needed = None if n_req is None else max(len(reps), math.ceil(n_req / s.per_rep))
    return {
        "n_reps": len(reps), "seconds_per_rep": length, "warmup_s": warm,
        "unit": s.unit, "subsession_s": s.subsession, "samples_per_rep": s.per_rep,
        "lag1_acf_raw": s.lag1_raw, "lag1_acf": s.lag1, "anova_p": s.anova_p,
        "n": ci.n, "mean": ci.mean, "sd": ci.sd, "ci_low": ci.low, "ci_high": ci.high,
        "rel_half_width": ci.rel_half_width,
        "reps_needed": reps_needed,
        "more_reps": None if reps_needed is None else reps_needed - len(reps),
        "samples": s.values.tolist(),
    }


def analyse(names: list[str], reps_by_config: list[list], confidence: float = 0.95,
            precision: float = 0.05, acf_threshold: float = 0.1,
            min_batches: int = 5, warmup: int | None = None) -> dict:
    """Every configuration's statistics, and each against the first (the baseline)."""
    per = [analyse_config(r, confidence, precision, acf_threshold, min_batches, warmup)
           for r in reps_by_config]
    comps = []
    base = per[0]
    for name, cur in zip(names[1:], per[1:]):
        if base["n"] == 0 or cur["n"] == 0:
            comps.append({"config": name, "baseline": names[0]})
            continue
        c = relative_difference(base["samples"], cur["samples"], confidence)
        reps_needed = required_repetitions_for_ratio(
            base["samples"], cur["samples"], base["samples_per_rep"],
            cur["samples_per_rep"], precision, confidence)
        done = min(base["n_reps"], cur["n_reps"])
        comps.append({
            "config": name, "baseline": names[0], "rel_diff": c.rel,
            "rel_ci_low": c.rel_low, "rel_ci_high": c.rel_high,
            "diff": c.diff, "diff_ci_low": c.diff_low, "diff_ci_high": c.diff_high,
            "p_welch": c.p_welch, "df": c.df, "significant": bool(c.significant),
            "reps_needed": max(done, reps_needed),
            "more_reps": max(0, reps_needed - done),
        })
    return {"confidence": confidence, "precision": precision,
            "acf_threshold": acf_threshold,
            "configs": [{"name": n, **p} for n, p in zip(names, per)],
            "comparisons": comps}


# ---------------------------------------------------------------------------------------
# Configurations and knobs
# ---------------------------------------------------------------------------------------

ORIGINAL = "original"


@dataclass
class ConfigSet:
    """``original`` (the host's values, read before anything changes), fixed values
    ``name=value,name=value`` (a categorical parameter's value by name, e.g.
    ``scheduler=bfq``, or by index), or ``best:PATH``, the best-known setting in an
    engine's status file."""
    label: str
    values: dict[str, float | str] | None = None     # None: the original values

    @classmethod
    def parse(cls, text: str) -> "ConfigSet":
        text = text.strip()
        if text == ORIGINAL:
            return cls(ORIGINAL, None)
        if text.startswith(BEST_PREFIX):
            return cls.from_engine_status(text[len(BEST_PREFIX):])
        values: dict[str, float | str] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, sep, val = item.partition("=")
            if not sep or not name.strip() or not val.strip():
                raise ValueError(f"config set {text!r}: expected 'original' or "
                                 "NAME=VALUE[,NAME=VALUE...]")
            try:
                values[name.strip()] = float(val)
            except ValueError:
                values[name.strip()] = val.strip()
        if not values:
            raise ValueError("empty config set")
        return cls(",".join(f"{k}={_fmt(v)}" for k, v in values.items()), values)


    @classmethod
    def from_engine_status(cls, path: str) -> "ConfigSet":
        """The engine's best-known setting, from the status file it rewrites every
        action tick (``capes drl-engine --status-file PATH``; ``engine.json`` in a
        ``capes demo`` work dir): its ``best`` entry. A checkpoint does not store it
        (only networks, optimiser, counters, ε and normaliser statistics), so this is
        the only place it can be read from after the fact."""
        import json
        path = path.strip()
        if not path:
            raise ValueError(f"config set {BEST_PREFIX!r}: give the engine's status file, "
                             f"{BEST_PREFIX}PATH")
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{BEST_PREFIX}{path}: not a readable engine status file "
                             f"({exc})") from None
        best = doc.get("best") if isinstance(doc, dict) else None
        if not isinstance(best, dict) or not best or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in best.values()):
            raise ValueError(f"{BEST_PREFIX}{path}: the engine reports no best-known "
                             f"setting (best: {best!r}); it has one only with the default "
                             "preset's guide, once some settings were measured")
        values = {str(k): float(v) for k, v in best.items()}
        return cls("best(" + ",".join(f"{k}={_fmt(v)}" for k, v in values.items()) + ")",
                   values)


BEST_PREFIX = "best:"


def _fmt(v: float | str) -> str:
    if isinstance(v, str):
        return v
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Knobs:
    """The parameters a comparison sets, through the appliers of the deployment's
    ``[control.appliers]`` and checked against its ``[parameters]`` ranges. Values are
    numbers, or names for categorical parameters (``values = [...]`` in the spec)."""

    def __init__(self, cfg, names, build=None):
        if build is None:
            from control_agent.appliers import build_applier as build
        self.names = sorted(names)
        self.specs = {}
        self.appliers = {}
        for n in self.names:
            if n not in cfg.parameters:
                raise ValueError(f"{n}: not a parameter of the deployment config "
                                 f"(has: {', '.join(sorted(cfg.parameters)) or 'none'})")
            if n not in cfg.control.appliers:
                raise ValueError(f"{n}: no [control.appliers.{n}] in the deployment config")
            a = cfg.control.appliers[n]
            self.specs[n] = cfg.parameters[n]
            self.appliers[n] = build(a.name, dict(a.options))
        self.original: dict[str, float | str] | None = None

    def _choices(self, n: str) -> list[str]:
        return list(getattr(self.specs[n], "values", None) or [])

    def read(self) -> dict[str, float | str | None]:
        out = {}
        for n in self.names:
            a = self.appliers[n]
            out[n] = a.read_text(n) if self._choices(n) else a.read(n)
        return out

    def remember(self) -> dict[str, float | str]:
        found = self.read()
        missing = [n for n, v in found.items() if v is None]
        if missing:
            raise RuntimeError(f"cannot read the current value of {', '.join(missing)}: "
                               "nothing to restore afterwards, so nothing is changed")
        self.original = {n: (v if isinstance(v, str) else float(v)) for n, v in found.items()}
        return dict(self.original)

    def _normalise(self, n: str, v: float | str) -> float | str:
        """A categorical value as its name (an index is turned into it)."""
        choices = self._choices(n)
        if choices and not isinstance(v, str) and float(v).is_integer() \
                and 0 <= v < len(choices):
            return choices[int(v)]
        return v

    def values_for(self, cs: ConfigSet) -> dict[str, float | str]:
        """Every knob's value under ``cs``: the original where ``cs`` names none."""
        assert self.original is not None
        out = dict(self.original)
        for n, v in (cs.values or {}).items():
            out[n] = self._normalise(n, v)
        return out

    def check(self, cs: ConfigSet) -> None:
        for n, v in (cs.values or {}).items():
            if n not in self.specs:
                raise ValueError(f"{cs.label}: {n} is not being evaluated")
            choices = self._choices(n)
            if isinstance(v, str):
                if v not in choices:
                    raise ValueError(f"{cs.label}: {n}={v}: not a number"
                                     + (f" nor one of {', '.join(choices)}" if choices else ""))
                v = float(choices.index(v))
            why = self.specs[n].check_value(v)
            if why:
                raise ValueError(f"{cs.label}: {n}={_fmt(v)}: {why}")

    def apply(self, values: dict[str, float | str]) -> None:
        for n in self.names:
            self.appliers[n].apply(n, values[n])

    def restore(self) -> list[str]:
        """Put the original values back (whatever the configured range); the errors."""
        errors = []
        for n, v in (self.original or {}).items():
            try:
                self.appliers[n].apply(n, v)
            except Exception as exc:   # keep restoring the others
                errors.append(f"{n}: {exc}")
        return errors

    def close(self) -> None:
        for a in self.appliers.values():
            a.close()


# ---------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------

def drop_caches() -> None:
    """sync, then drop the page cache, dentries and inodes (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


class FioMeter:
    """One repetition = one fio run of ``duration`` seconds; the samples are fio's
    per-second bandwidth (bytes/s, ``direction``), or, with ``pi``, that performance
    indicator of the deployment's ``[monitor]`` collectors sampled every second."""

    def __init__(self, workload: str, duration: float, target: str | None = None,
                 directory: str | None = None, size: str | None = None,
                 direction: str = "total", cgroup: str | None = None,
                 pi: str | None = None, collectors=None):
        from capes.experiments import workload_driver as wd
        self.wd = wd
        self.jobfile = wd.resolve_workload(workload)
        self.duration = duration
        self.target, self.directory, self.size = target, directory, size
        self.direction = direction
        self.cgroup = cgroup
        self.pi = pi
        self.collectors = list(collectors or [])
        if pi is not None:
            owners = [c for c in self.collectors if pi in c.names()]
            if not owners:
                raise ValueError(f"metric {pi!r}: no collector of [monitor] provides it")
            self.collector = owners[0]

    @property
    def unit(self) -> str:
        return "bytes/s" if self.pi is None or self.pi.endswith("bytes_s") else ""

    def describe(self) -> str:
        return (f"fio {self.direction} bandwidth" if self.pi is None else self.pi)

    def __call__(self, stop=None) -> np.ndarray:
        env = self.wd.fio_env(self.target, self.directory, self.duration, self.size)
        if self.pi is None:
            res = self.wd.run_fio(self.jobfile, env, self.direction, stop, self.cgroup)
            return res.bandwidth
        import tempfile
        with tempfile.TemporaryDirectory(prefix="capes-fio-") as tmp:
            run = self.wd.FioRun(self.jobfile, env, tmp, self.direction, self.cgroup)
            self.collector.collect()              # prime the rates
            run.start()
            out = []
            t0 = time.monotonic()
            try:
                while run.running() and not (stop is not None and stop.is_set()):
                    t_next = t0 + len(out) + 1
                    while (now := time.monotonic()) < t_next and run.running():
                        time.sleep(min(0.05, t_next - now))
                    if not run.running():
                        break
                    out.append(self.collector.collect().get(self.pi, NAN))
                    if time.monotonic() - t0 > self.duration + 60:
                        break
            finally:
                run.stop()
            run.result()
        x = np.asarray(out, dtype=float)
        return x[np.isfinite(x)]


@dataclass
class Repetition:
    config: int
    round: int
    started: float
    values: dict[str, float]
    samples: list[float] = field(default_factory=list)


def run_repetitions(knobs: Knobs, configs: list[ConfigSet], measure: Callable,
                    repetitions: int, seed: int | None = None, stop=None,
                    prepare: Callable[[], None] | None = None, settle_s: float = 0.0,
                    on_rep: Callable[[Repetition, int, int], None] | None = None
                    ) -> list[Repetition]:
    """Set each configuration in a randomised, interleaved order, and measure. Knobs
    must have remembered the original values; restoring them is the caller's job."""
    order = interleaved_order(len(configs), repetitions, np.random.default_rng(seed))
    done: list[Repetition] = []
    for i, ci in enumerate(order):
        if stop is not None and stop.is_set():
            break
        values = knobs.values_for(configs[ci])
        knobs.apply(values)
        if prepare is not None:
            prepare()
        if settle_s > 0:
            if stop is not None:
                stop.wait(settle_s)
            else:
                time.sleep(settle_s)
        rep = Repetition(ci, i // len(configs), time.time(), values)
        samples = measure(stop)
        if stop is not None and stop.is_set():
            break                       # an interrupted repetition is not a sample
        rep.samples = [float(v) for v in samples]
        done.append(rep)
        if on_rep is not None:
            on_rep(rep, i + 1, len(order))
    return done


def check_settings(repetitions: int = 1, duration: float = 2.0, confidence: float = 0.95,
                   precision: float = 0.05, acf_threshold: float = 0.1,
                   settle_s: float = 0.0, warmup: int | None = None,
                   min_batches: int = 5) -> None:
    """A ValueError (``"<option>: <problem>"``, named as on the command line) for the
    first setting that would fail the analysis: checked before anything is measured,
    so no repetition runs only to be lost."""
    def bad(name, value, want):
        raise ValueError(f"{name}: {want} (got {value!r})")
    if isinstance(repetitions, bool) or not isinstance(repetitions, int) or \
            not 1 <= repetitions <= 100_000:
        bad("repetitions", repetitions, "must be a whole number in [1, 100000]")
    if not 2 <= duration <= 7 * 86400:                 # also refuses NaN
        bad("duration", duration, "must be a number of seconds in [2, 604800]")
    if not 0 < confidence < 1:
        bad("confidence", confidence, "must lie strictly between 0 and 1, e.g. 0.95")
    if not 0 < precision < 1e6:
        bad("precision", precision, "must be a relative half-width > 0, e.g. 0.05")
    if not 0 < acf_threshold <= 1:
        bad("acf-threshold", acf_threshold, "must lie in (0, 1], e.g. 0.1")
    if not 0 <= settle_s <= 86400:
        bad("settle", settle_s, "must be a number of seconds in [0, 86400]")
    if warmup is not None and not 0 <= warmup <= 7 * 86400:
        bad("warmup", warmup, "must be 'auto' or a number of seconds >= 0")
    if isinstance(min_batches, bool) or not isinstance(min_batches, int) or min_batches < 2:
        bad("min_batches", min_batches, "must be a whole number >= 2")


def evaluate(knobs: Knobs, configs: list[ConfigSet], measure: Callable,
             repetitions: int, seed: int | None = None, stop=None,
             prepare: Callable[[], None] | None = None, settle_s: float = 0.0,
             confidence: float = 0.95, precision: float = 0.05,
             acf_threshold: float = 0.1, min_batches: int = 5,
             warmup: int | None = None, on_rep=None) -> dict:
    """Remember the original values, run the repetitions, restore the original values
    (always: also on an error or a stop), and analyse. Returns the report."""
    check_settings(repetitions, 2.0, confidence, precision, acf_threshold, settle_s, warmup,
                   min_batches)
    if len(configs) < 2:
        raise ValueError("compare at least two configurations")
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"configurations given twice: {labels}")
    for c in configs:
        knobs.check(c)
    original = knobs.remember()
    log.info("original values: %s (restored at the end)",
             ", ".join(f"{k}={_fmt(v)}" for k, v in original.items()))
    reps: list[Repetition] = []
    t0 = time.time()
    try:
        reps = run_repetitions(knobs, configs, measure, repetitions, seed, stop,
                               prepare, settle_s, on_rep)
    finally:
        errors = knobs.restore()
        if errors:
            log.error("could not restore: %s", "; ".join(errors))
        after = knobs.read()
    by_config = [[r.samples for r in reps if r.config == i] for i in range(len(configs))]
    report = analyse(labels, by_config, confidence, precision, acf_threshold, min_batches,
                     warmup)
    for c, cs in zip(report["configs"], configs):
        c["values"] = knobs.values_for(cs)
    report.update({
        "original": original,
        "restored": not errors and all(after[n] == v for n, v in original.items()),
        "after": after,
        "repetitions": repetitions,
        "interrupted": stop is not None and stop.is_set(),
        "seed": seed,
        "wall_s": time.time() - t0,
        "runs": [{"config": labels[r.config], "round": r.round, "started": r.started,
                  "values": r.values, "samples": r.samples} for r in reps],
    })
    return report


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------

def jsonable(obj):
    """The report as strict JSON values: NaN and ±inf (no CI, an unbounded one) become
    None; numpy scalars become Python numbers."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def _scale(unit: str) -> tuple[float, str]:
    return (1e6, "MB/s") if unit == "bytes/s" else (1.0, unit or "")


def format_report(report: dict) -> str:
    div, unit = _scale(report.get("unit", ""))
    conf = report["confidence"] * 100
    head = report.get("title")
    lines = [head] if head else []
    lines.append(f"{'configuration':<34} {'mean ' + unit:>11} {f'{conf:g}% CI':>21} "
                 f"{'n':>4} {'unit':>10} {'warm-up':>8} {'acf1':>6} {'more reps':>9}")
    for c in report["configs"]:
        if c["n"] == 0:
            lines.append(f"{c['name']:<34} {'(no data)':>11}")
            continue
        ci = (f"[{c['ci_low'] / div:.1f}, {c['ci_high'] / div:.1f}]"
              if math.isfinite(c["ci_low"]) else "-")
        unit_s = (f"{c['subsession_s']}s-batch" if c["unit"] == "subsession"
                  else f"{c['n_reps']} reps")
        more = "-" if c["more_reps"] is None else str(c["more_reps"])
        name = c["name"]
        if name == ORIGINAL:
            name += " (" + ",".join(f"{k}={_fmt(v)}" for k, v in c["values"].items()) + ")"
        lines.append(f"{name:<34} {c['mean'] / div:>11.1f} {ci:>21} {c['n']:>4} "
                     f"{unit_s:>10} {c['warmup_s']:>7}s {c['lag1_acf']:>6.2f} {more:>9}")
    for cmp in report["comparisons"]:
        if "rel_diff" not in cmp:
            lines.append(f"{cmp['config']} vs {cmp['baseline']}: no data")
            continue
        lo, hi = cmp["rel_ci_low"], cmp["rel_ci_high"]
        ci = (f"[{lo * 100:+.1f}%, {hi * 100:+.1f}%]" if math.isfinite(lo)
              else "[unbounded]")
        verdict = "differs" if cmp["significant"] else "no significant difference"
        lines.append(f"{cmp['config']} vs {cmp['baseline']}: {cmp['rel_diff'] * 100:+.1f}% "
                     f"{ci}, Welch p={cmp['p_welch']:.2g}: {verdict}; "
                     f"±{report['precision'] * 100:g}% needs {cmp['reps_needed']} reps "
                     f"each ({cmp['more_reps']} more)")
    if report.get("interrupted"):
        lines.append("interrupted: partial results")
    restored = ", ".join(f"{k}={_fmt(v)}" for k, v in report["original"].items())
    lines.append(f"original values {'restored' if report['restored'] else 'NOT restored'}: "
                 f"{restored}")
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """Left: every repetition's per-second samples (warm-up faded); right: each
    configuration's samples used and its mean with the CI."""
    from capes.experiments.plots import _pyplot
    plt = _pyplot()
    div, unit = _scale(report.get("unit", ""))
    names = [c["name"] for c in report["configs"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(13, 5),
                                     gridspec_kw={"width_ratios": [3, 2]})
    seen = set()
    for run in report["runs"]:
        i = names.index(run["config"])
        warm = report["configs"][i].get("warmup_s", 0) or 0
        y = np.asarray(run["samples"]) / div
        x = np.arange(1, y.size + 1)
        col = colors[i % len(colors)]
        ax_t.plot(x[:warm + 1], y[:warm + 1], color=col, alpha=0.3, lw=1)
        ax_t.plot(x[warm:], y[warm:], color=col, lw=1,
                  label=None if i in seen else run["config"])
        seen.add(i)
    ax_t.set_xlabel("second of the repetition")
    ax_t.set_ylabel(f"{report.get('metric', 'throughput')} ({unit})")
    ax_t.set_title("per-second samples of every repetition (warm-up faded)")
    ax_t.legend(fontsize=8, loc="best")
    rng = np.random.default_rng(0)
    for i, c in enumerate(report["configs"]):
        if not c["n"]:
            continue
        s = np.asarray(c["samples"]) / div
        ax_c.scatter(i + rng.uniform(-0.15, 0.15, s.size), s, s=10, alpha=0.5,
                     color=colors[i % len(colors)],
                     label="samples used (subsession or repetition means)" if i == 0 else None)
        if math.isfinite(c["ci_low"]):
            ax_c.errorbar(i + 0.3, c["mean"] / div,
                          yerr=[[(c["mean"] - c["ci_low"]) / div],
                                [(c["ci_high"] - c["mean"]) / div]],
                          fmt="o", color="black", capsize=5,
                          label=f"mean, {report['confidence'] * 100:g}% CI" if i == 0 else None)
    ax_c.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax_c.set_ylabel(f"mean {report.get('metric', 'throughput')} ({unit})")
    ax_c.set_title("configurations: samples, mean and CI")
    ax_c.legend(fontsize=8, loc="best")
    fig.suptitle(report.get("title", "capes evaluate"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
