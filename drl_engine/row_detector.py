"""Workload-change detection over rows: one detector stream per node, with a vote.

:class:`~drl_engine.change_detection.SettingResidualDetector`, one stream per node keyed
by its knob values (delayed by ``settle_ticks``; a fixed random sample of
``detect_nodes`` nodes on larger clusters: its per-node tables are a Python loop, ~15 µs
a node and tick, and a change that moves a share of the cluster moves the same share of
a random sample), an alarm when ``detect_vote`` of them (at least 2) vote within 10
ticks. The stream is the node's share of the mean per-node objective
(``detect_signal="share"``; blind to moves every node makes together) or its throughput
(``"throughput"``). The thresholds are the per-node mode's own (``detect_threshold``,
``detect_drift``, ``detect_scale_floor``). The one-row mode's detector is the guide's.
"""
from __future__ import annotations

import math

import numpy as np

from drl_engine.change_detection import ChangeDetectorConfig, SettingResidualDetector


class RowChangeDetector:
    def __init__(self, model, settle_ticks: int, seed: int, nodes: int):
        m, n = model, nodes
        self.signal = m.detect_signal
        self.nodes = (np.sort(np.random.default_rng([seed, 7]).choice(
            n, m.detect_nodes, False)) if m.detect_nodes and n > m.detect_nodes
            else np.arange(n))
        k = len(self.nodes)
        vote = max(2, math.ceil(m.detect_vote * k)) if k >= 2 else 1
        self.detector = SettingResidualDetector(ChangeDetectorConfig(
            delay=settle_ticks, min_streams=vote, threshold=m.detect_threshold,
            drift=m.detect_drift, scale_floor=m.detect_scale_floor), streams=k)

    @property
    def streams(self) -> int:
        return self.detector.streams

    def update(self, pis: np.ndarray, knobs: np.ndarray, obj_cols) -> bool:
        """One tick: every node's PIs (N, P) and knob values (N, K); True on an alarm."""
        x = np.asarray(pis, np.float64)[:, obj_cols].sum(axis=1)
        if self.signal == "share":
            # each node's share of the mean: blind to moves that every node makes
            # together (contention shifts every level, not the shares)
            with np.errstate(invalid="ignore", divide="ignore"):
                x = x / np.nanmean(x)
        d = self.nodes
        keys = list(map(tuple, knobs[d].tolist()))
        return bool(self.detector.update_many(x[d], keys))


__all__ = ["RowChangeDetector"]
