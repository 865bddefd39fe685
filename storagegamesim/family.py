"""A workload family: one continuous parameter, the write fraction x, from readers to
writers (issue 37).

Real systems have no three fixed workloads but a continuum: the share of writes moves, and
the congestion window and rate limit that suit a reader (large sequential requests, a
short queue, a deep window) differ from those that suit a writer (small random requests, a
long queue, a small window). A member of the family at write fraction x in [0, 1] is a
:class:`~storagegamesim.game.GameWorkload` whose every constant moves smoothly with x:

* optimum: ``peak_window`` and ``peak_throughput`` linear in x between the reader's
  (x = 0) and the writer's (x = 1); the rate limit that lets the peak through
  (τ ≥ peak_throughput) moves with it;
* signature (what a monitor sees, :data:`~storagegamesim.game.SIGNATURE_PI_NAMES`):
  ``read_fraction = 1 − x``, ``sequential`` linear, ``request_kb`` and ``queue_depth``
  geometric (log-linear) in x.

Nothing here favours a learner: every member is one game of the usual kind, and the
optimum is a plain interpolation of the two ends, which nearest-neighbour memory, a GP and
a network can all approximate. ``[game.family]`` with ``game.write_fraction`` plays one
member (``configs/workload-family.toml``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def _lin(a: float, b: float, x: float) -> float:
    return a + (b - a) * x


def _geo(a: float, b: float, x: float) -> float:
    return math.exp(_lin(math.log(a), math.log(b), x))


@dataclass
class WorkloadFamily:
    """The two ends of the family (x = 0: readers, x = 1: writers); members interpolate."""
    reader_window: float = 75.0
    writer_window: float = 20.0
    reader_throughput: float = 150.0
    writer_throughput: float = 60.0
    curve_width: float = 12.0
    reader_request_kb: float = 1024.0
    writer_request_kb: float = 8.0
    reader_sequential: float = 0.9
    writer_sequential: float = 0.1
    reader_queue_depth: float = 4.0
    writer_queue_depth: float = 64.0

    def validate(self) -> None:
        for key in ("curve_width", "reader_throughput", "writer_throughput",
                    "reader_request_kb", "writer_request_kb", "reader_queue_depth",
                    "writer_queue_depth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}: must be > 0 (got {getattr(self, key)})")
        for key in ("reader_sequential", "writer_sequential"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key}: must lie in [0, 1] (got {getattr(self, key)})")

    @staticmethod
    def name_of(x: float) -> str:
        return f"write{x:.3f}"

    def workload(self, x: float):
        """The member at write fraction ``x`` (in [0, 1]), a ``GameWorkload``."""
        from storagegamesim.game import GameWorkload     # game.py holds a family
        if not 0 <= x <= 1:
            raise ValueError(f"write_fraction: must lie in [0, 1] (got {x})")
        return GameWorkload(
            name=self.name_of(x),
            peak_window=_lin(self.reader_window, self.writer_window, x),
            curve_width=self.curve_width,
            peak_throughput=_lin(self.reader_throughput, self.writer_throughput, x),
            read_fraction=1.0 - x,
            request_kb=_geo(self.reader_request_kb, self.writer_request_kb, x),
            sequential=_lin(self.reader_sequential, self.writer_sequential, x),
            queue_depth=_geo(self.reader_queue_depth, self.writer_queue_depth, x))


__all__ = ["WorkloadFamily"]
