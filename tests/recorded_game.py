"""Recorded StorageGameSim experience for the training tests: seeded converge runs of the
default game, each its own replay DB, merged as ``capes replay merge`` does."""
from __future__ import annotations

from pathlib import Path

import torch


def record_and_merge(d: Path, ticks: int, seeds=(0, 1)) -> Path:
    """``run<seed>.db`` per seed (at most ``ticks`` ticks) and ``merged.db`` in ``d``."""
    from capes.experiments.converge_test import load_config, run_one
    from capes.experiments.offline_training import DEFAULT_CONFIG
    from capes.experiments.replay_merge import merge
    torch.set_num_threads(1)
    cfg = load_config(DEFAULT_CONFIG, [f"game.time_limit_ticks={ticks}"])
    for seed in seeds:
        run_one(cfg, seed, db_path=d / f"run{seed}.db")
    merge([d / f"run{seed}.db" for seed in seeds], d / "merged.db")
    return d / "merged.db"
