"""What the benches that play arms against a fresh engine share (``bench_experience.py``,
``bench_experience_cluster.py``, ``bench_pretrained_merge.py``): the run options of their
command line, the folder their recorded DBs go to, and an arm's figure paired with fresh's
by seed.

Not a benchmark itself (no ``bench_`` prefix: ``tests/test_benchmarks.py`` runs those).
"""
from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from capes.common.stats import paired_bootstrap_ci


def add_run_options(ap: argparse.ArgumentParser, quick: str, keep: str,
                    report: str = "write the report as JSON") -> None:
    """``--workdir`` (``keep``: what is kept there), ``--json OUT`` and ``--quick``
    (``quick``: what the smoke run plays)."""
    ap.add_argument("--workdir", help=keep)
    ap.add_argument("--json", metavar="OUT", help=report)
    ap.add_argument("--quick", action="store_true", help=quick)


@contextmanager
def work_dir(workdir: str | None, prefix: str) -> Iterator[Path]:
    """``workdir`` (made if missing, kept), else a temporary folder removed on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        yield work


def paired_figure(fresh: list[float], arm: list[float], values: list[float]) -> dict:
    """One figure of an arm: the median of its ``values``, and its difference from fresh
    paired by seed (``fresh[i]`` and ``arm[i]`` the same seed's): the median of the
    differences with its bootstrap 95 % interval, the one difference with a single pair
    (no interval), None with none."""
    ci = paired_bootstrap_ci(fresh, arm)
    one = float(arm[0] - fresh[0]) if len(fresh) == 1 else None
    return {"median": float(np.median(values)),
            "diff_vs_fresh": ci[0] if ci else one,
            "ci95": [ci[1], ci[2]] if ci else None}


__all__ = ["add_run_options", "paired_figure", "work_dir"]
